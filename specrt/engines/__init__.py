"""Backends behind one small protocol (see base.Engine); the decode loop never asks which one it has."""
