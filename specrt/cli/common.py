"""What the commands share: bad input as one `Error:` line and exit code 2, --device, loading a pair,
the draft-length parsers."""
from __future__ import annotations

import functools
import os
import stat
import sys
from pathlib import Path

import click

from specrt.api import requests
from specrt.config import DRAFTERS, SAMPLERS, TREES
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


_CLICK_TYPES = {"int": int, "num": float, "str": str}
_CHOICES = {"drafter": DRAFTERS, "sampling": SAMPLERS, "tree": TREES}


def setting_options(front: str):
    """The request settings `front` ("cli", "job") exposes (api/requests.TABLE) as options, each None unless
    given (the default then is the request's: api/requests.resolve); the command receives them by their
    names. Constraints are constraint_options' (files)."""
    def decorate(fn):
        for name in reversed(requests.fields_of(front)):
            f = requests.TABLE[name]
            if name in requests.CONSTRAINTS:
                continue
            kw = dict(default=None, help=f.help)
            if f.kind == "stops":
                kw.update(multiple=True, default=())
            elif f.kind == "draft_len":
                kw.update(callback=draft_len_value)
            elif name in _CHOICES:
                kw.update(type=click.Choice(_CHOICES[name]))
            else:
                kw.update(type=_CLICK_TYPES[f.kind])
            fn = click.option(f"--{name.replace('_', '-')}", name, **kw)(fn)
        return fn
    return decorate


def settings_given(values: dict, front: str) -> dict:
    """The settings among a command's option values (setting_options), unset ones left out."""
    return {n: (list(v) if isinstance(v, tuple) else v) for n in requests.fields_of(front)
            if (v := values.get(n)) is not None and v != ()}


def constraint_options(fn):
    """Structured output: --json-schema FILE, --json-object, --regex RE, --grammar FILE (at most one)."""
    opts = [
        click.option("--json-schema", "json_schema", type=click.Path(dir_okay=False, path_type=Path), default=None,
                     help="A JSON schema file: the output is one JSON value that it validates (on one line)."),
        click.option("--json-object", is_flag=True, help="The output is a JSON object, of any shape."),
        click.option("--regex", default=None, help="The output matches this regular expression (Rust regex syntax)."),
        click.option("--grammar", type=click.Path(dir_okay=False, path_type=Path), default=None,
                     help="A grammar file (Lark, llguidance's dialect; GBNF is read too): the output matches it."),
    ]
    for o in reversed(opts):
        fn = o(fn)
    return fn


GRAMMAR_FILE_MAX = 8 << 20  # bytes: eight times what the server takes in a body by default


def _grammar_file(path: Path, option: str) -> str:
    """A schema or grammar file's text: a regular file (a device or a FIFO could be endless or never end) of
    at most GRAMMAR_FILE_MAX bytes, in UTF-8."""
    try:
        with os.fdopen(os.open(path, os.O_RDONLY | os.O_NONBLOCK), "rb") as f:  # a FIFO's open waits otherwise
            st = os.fstat(f.fileno())
            if not stat.S_ISREG(st.st_mode):
                raise click.BadParameter(f"{path} is not a regular file", param_hint=option)
            data = f.read(GRAMMAR_FILE_MAX + 1)
        if len(data) > GRAMMAR_FILE_MAX:
            raise click.BadParameter(f"{path} is larger than {GRAMMAR_FILE_MAX >> 20} MB", param_hint=option)
        return data.decode("utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise click.BadParameter(f"cannot read {path}: {getattr(e, 'strerror', None) or e}",
                                 param_hint=option) from None


def constraint_fields(json_schema, json_object, regex, grammar) -> dict:
    """The request fields (api/requests.FIELDS) of constraint_options' values; files read here."""
    given = [n for n, v in (("--json-schema", json_schema), ("--json-object", json_object), ("--regex", regex),
                            ("--grammar", grammar)) if v]
    if len(given) > 1:
        raise click.UsageError(f"give one of --json-schema, --json-object, --regex, --grammar, not {' and '.join(given)}")
    out = {}
    if json_object:
        out["response_format"] = {"type": "json_object"}
    for name, path in (("json_schema", json_schema), ("grammar", grammar)):
        if path is not None:
            out[name] = _grammar_file(Path(path), f"--{name.replace('_', '-')}")
    if regex is not None:
        out["regex"] = regex
    return out
