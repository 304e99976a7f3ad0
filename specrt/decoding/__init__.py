"""The speculative decoding algorithm: sampling, the round, proposers, the draft-length policy, prefix reuse and
batched decoding. Imports numpy, the configs, the errors and the engine protocols only (tests/test_layout.py)."""
