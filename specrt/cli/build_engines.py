"""`specrt build-engines`: TensorRT engines for a pair folder, on this machine's GPU (engines/trt.py)."""
from __future__ import annotations

from pathlib import Path

import click

from specrt.cli.common import errors, log


@click.command("build-engines")
@click.argument("pair_dir", type=click.Path(path_type=Path))
@click.option("--prefill-chunk", type=int, default=256, show_default=True,
              help="Widest prefill chunk of the engines' profile; longer prompts are run in chunks.")
@errors
def build_engines(pair_dir, prefill_chunk):
    """Build TensorRT engines for an fp16 pair on this machine's GPU (again after a TensorRT or GPU change)."""
    from specrt.manifest import read_manifest, write_manifest
    from specrt.export.trt_build import build_pair_engines
    from specrt.errors import ConfigError

    if prefill_chunk < 1:
        raise ConfigError(f"--prefill-chunk must be >= 1, got {prefill_chunk}")
    m = read_manifest(pair_dir)
    m = build_pair_engines(pair_dir, m, min(prefill_chunk, m.max_len), log=log)
    write_manifest(pair_dir, m)
    click.echo(f"built TensorRT {m.engines['tensorrt_version']} engines for compute capability "
               f"{m.engines['compute_capability']} in {pair_dir}", err=True)
