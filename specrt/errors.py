"""Exception types of the public API.

Every error a user can cause (bad input, missing or corrupt files, unsupported settings) is raised as a
subclass of :class:`SpecrtError` with a one-line message; the CLI prints that line and exits non-zero.
"""


class SpecrtError(Exception):
    """Base class of all errors that specrt raises on bad input or bad files."""


class PairError(SpecrtError):
    """The pair folder is missing, corrupt, or does not match its manifest."""


class ConfigError(SpecrtError):
    """A setting is out of range or inconsistent with the pair."""


class ExportError(SpecrtError):
    """A checkpoint cannot be loaded or exported."""


class FetchError(SpecrtError):
    """A named model cannot be fetched, or a fetched part is missing or corrupt."""
