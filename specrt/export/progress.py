"""What an export shows while it works: a line per long step with its duration, a bar where the step has
a count (bytes hashed, nodes quantized).

Quiet unless given a stream, so library callers and tests see nothing they did not ask for; `specrt
export` gives it stderr when that is a terminal and `--quiet` is not set.
"""
from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import IO, Callable, Iterator

from specrt.manifest import sha256_file


def _ignore(n: int = 1) -> None:
    pass


@dataclass(frozen=True)
class Progress:
    stream: IO[str] | None = None  # where steps are reported; None: nowhere
    prefix: str = ""  # whose steps these are, e.g. "target: "

    @property
    def on(self) -> bool:
        return self.stream is not None

    def of(self, name: str) -> Progress:
        """The same reporting, each step named `name: step`."""
        return replace(self, prefix=f"{self.prefix}{name}: ")

    @contextlib.contextmanager
    def step(self, name: str, total: int | None = None, unit: str = "it") -> Iterator[Callable[[int], object]]:
        """Report the step `name` while the block runs. With a `total`, a bar the block advances by calling
        the function it is given with each amount done (unit "B": bytes); without, one line and its time."""
        if self.stream is None:
            yield _ignore
            return
        label = self.prefix + name
        if total is not None:
            from tqdm import tqdm  # lazy, as in export/fetch.py

            with tqdm(total=total, unit=unit, unit_scale=unit == "B", unit_divisor=1024, desc=label,
                      file=self.stream, dynamic_ncols=True, leave=True) as bar:
                yield bar.update
            return
        self.stream.write(f"{label} ...")
        self.stream.flush()
        t0 = time.perf_counter()
        try:
            yield _ignore
        except BaseException:
            self.stream.write("\n")  # the error's message starts a line of its own
            raise
        # "\r" and the whole line: right also where a library's own output broke into it
        self.stream.write(f"\r{label} ... {time.perf_counter() - t0:.1f} s\n")
        self.stream.flush()


QUIET = Progress()


def hash_files(paths: list[Path], progress: Progress = QUIET) -> list[str]:
    """The sha256 of each file, under one "hashing" bar over their bytes."""
    with progress.step("hashing", total=sum(p.stat().st_size for p in paths), unit="B") as advance:
        return [sha256_file(p, on_read=advance) for p in paths]
