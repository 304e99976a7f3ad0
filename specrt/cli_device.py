"""`--device` for the commands that load a pair (generate, bench, tune, check)."""
from __future__ import annotations

import click


def device_option(fn):
    return click.option("--device", type=click.Choice(["auto", "cpu", "cuda", "tensorrt"]), default="auto",
                        show_default=True,
                        help="auto: TensorRT engines if the pair has them, else CUDA for a pair with fp16 activations on "
                             "a machine with a GPU, else the CPU.")(fn)


def load_pair(pair_dir, device: str, **kw):
    """specrt.load, saying on stderr what the user should know about where it runs (Pair.notes)."""
    from specrt.runtime.pair import load

    pair = load(pair_dir, device=device, **kw)
    for note in pair.notes:
        click.echo(f"note: {note}", err=True)
    return pair
