"""What the commands share: bad input as one `Error:` line and exit code 2, --device, loading a pair,
the draft-length parsers."""
from __future__ import annotations

import functools
import sys

import click

from specrt.errors import SpecrtError


class BadInput(click.ClickException):
    """A SpecrtError as the command line shows it: `Error: <the message>` on stderr, exit code 2, like a
    usage error click itself reports (`specrt check` keeps 1 for a check that ran and failed)."""

    exit_code = 2


def errors(fn):
    """Bad input becomes one line on stderr and exit code 2, never a traceback; Ctrl-C exits 130."""

    @functools.wraps(fn)
    def wrapper(*a, **kw):
        try:
            return fn(*a, **kw)
        except SpecrtError as e:
            raise BadInput(str(e)) from None
        except KeyboardInterrupt:
            click.echo("interrupted", err=True)
            sys.exit(130)

    return wrapper


def command_line() -> list[str]:
    """The command as typed (kept by the `specrt` group), for files that say how they were made."""
    return click.get_current_context().meta.get("specrt.argv", ["specrt"])


def device_option(fn):
    """`--device` for the commands that load a pair (generate, bench, tune, check)."""
    return click.option("--device", type=click.Choice(["auto", "cpu", "cuda", "tensorrt"]), default="auto",
                        show_default=True,
                        help="auto: TensorRT engines if the pair has them, else CUDA for a pair with fp16 activations on "
                             "a machine with a GPU, else the CPU.")(fn)


def load_pair(pair_dir, device: str, **kw):
    """specrt.load, saying on stderr what the user should know about where it runs (Pair.notes)."""
    from specrt.api.pair import load

    pair = load(pair_dir, device=device, **kw)
    for note in pair.notes:
        click.echo(f"note: {note}", err=True)
    return pair


def parse_draft_len(value: str):
    """A draft length: an integer >= 0 or 'auto'."""
    v = value.strip().lower()
    if v == "auto":
        return "auto"
    try:
        k = int(v)
    except ValueError:
        k = -1
    if k < 0:
        raise click.BadParameter(f"expected an integer >= 0 or 'auto', got {value!r}")
    return k


def draft_len_value(ctx, param, value):
    """--draft-len of generate (default None: the tuned setting, else auto)."""
    return None if value is None else parse_draft_len(value)


def draft_len_list(ctx, param, value):
    """--draft-lens of bench and tune: comma-separated draft lengths."""
    vals = [parse_draft_len(v) for v in value.split(",") if v.strip()]
    if not vals:
        raise click.BadParameter("expected comma-separated draft lengths")
    return vals


def batch_size_value(ctx, param, value):
    """--batch-size of batch and serve: an integer >= 1 or 'auto'."""
    v = str(value).strip().lower()
    if v == "auto":
        return "auto"
    try:
        b = int(v)
    except ValueError:
        b = 0
    if b < 1:
        raise click.BadParameter(f"expected an integer >= 1 or 'auto', got {value!r}")
    return b


def batch_size_list(ctx, param, value):
    """--batch-sizes of bench: comma-separated integers >= 1."""
    if value is None:
        return None
    try:
        vals = [int(v) for v in value.split(",") if v.strip()]
    except ValueError:
        vals = []
    if not vals or min(vals) < 1:
        raise click.BadParameter(f"expected comma-separated integers >= 1, got {value!r}")
    return vals


def log(s: str) -> None:
    """Progress lines of the library (export, engine builds) go to stderr."""
    click.echo(s, err=True)
