"""Exception types of the public API.

Every error a user can cause (bad input, missing or corrupt files, unsupported settings) is raised as a
subclass of :class:`SpecrtError` with a one-line message; the CLI prints that line and exits non-zero.
"""
import math


class SpecrtError(Exception):
    """Base class of all errors that specrt raises on bad input or bad files."""


class PairError(SpecrtError):
    """The pair folder is missing, corrupt, or does not match its manifest."""


class ConfigError(SpecrtError):
    """A setting is out of range or inconsistent with the pair; `param` names the request field at fault,
    when one is (what a server's error object reports)."""

    def __init__(self, message: str = "", param: str | None = None):
        super().__init__(message)
        self.param = param


class ExportError(SpecrtError):
    """A checkpoint cannot be loaded or exported."""


class FetchError(SpecrtError):
    """A named model cannot be fetched, or a fetched part is missing or corrupt."""


def first_line(e: BaseException, last: bool = False, limit: int | None = None) -> str:
    """The first (`last`: the last) line of `e`'s message, for a one-line error; its type's name when the
    message is empty; at most `limit` characters when given."""
    s = str(e).strip()
    line = s.splitlines()[-1 if last else 0] if s else type(e).__name__
    return line if limit is None else line[:limit]


def show(v) -> str:
    """repr(v) for an error message; an integer too long to print sensibly (JSON integers have no limit,
    and past 4,300 digits Python refuses to convert one) as its size."""
    if isinstance(v, int) and not isinstance(v, bool) and v.bit_length() > 128:
        return f"{'a negative' if v < 0 else 'an'} integer of about {int(v.bit_length() * math.log10(2)) + 1} digits"
    return repr(v)
