"""A pair's grammars for structured output (decoding/constraint.py): each distinct grammar checked once in a
child process (api/grammar_check.py) with a time and memory bound, its matcher then built here on a thread
with a large stack, kept, and copied for every request that names it.

Why a child: llguidance can crash the process on a grammar (a deep chain of rules or `$ref`s overflows the
stack), panic only when a matcher is built, or take seconds and hundreds of MB. Whatever the child survives
on a stack 16 times smaller than BUILD_STACK_MB, this process survives too; whatever kills or outlasts it is
that request's one-line error. Checks run one at a time (one child), off the decoding thread: the server
asks from its own thread, and a batch job as it reads its records.
"""
from __future__ import annotations

import collections
import json
import os
import selectors
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from specrt.api import grammar_check
from specrt.config import Grammar
from specrt.decoding.constraint import Constraint
from specrt.errors import ConfigError, PairError, first_line

CHECK_S = 10.0  # a grammar whose check (compile, start, first mask) takes longer is refused
BUILD_STACK_MB = 16 * grammar_check.CHECK_STACK_MB  # the stack of the threads that build matchers here
KEEP, KEEP_MB = 64, 1024  # matchers kept (the latest grammars), and the memory they took to start
_STACK = threading.Lock()  # threading.stack_size is process-wide


@dataclass
class _Known:
    error: str = ""  # why the grammar is refused ("": it starts)
    mb: float = 0.0  # what its matcher took to start, in the checker
    matcher: object = None  # at the start of the output: each request runs a copy


def on_big_stack(fn, *args):
    """fn(*args) on a thread with a BUILD_STACK_MB stack, waited for."""
    box = {}

    def run():
        try:
            box["value"] = fn(*args)
        except BaseException as e:  # noqa: BLE001 - raised again in the caller's thread
            box["error"] = e

    with _STACK:
        old = threading.stack_size(BUILD_STACK_MB << 20)
        try:
            t = threading.Thread(target=run, name="specrt-grammar", daemon=True)
            t.start()
        finally:
            threading.stack_size(old)
    t.join()
    if "error" in box:
        raise box["error"]
    return box["value"]


class Grammars:
    """A pair's compiler of request grammars: llguidance's view of the pair's tokenizer (built on first use,
    about a second for a 150k vocabulary), the checker process, and the matchers of the latest grammars."""

    def __init__(self, tokenizer_json: Path, vocab: int, eos_ids: Sequence[int], check_s: float = CHECK_S,
                 check_mb: int = grammar_check.CHECK_MB):
        self.path, self.vocab, self.eos, self.check_s = Path(tokenizer_json), vocab, list(eos_ids), check_s
        self.check_mb = check_mb
        self._tok, self._lock = None, threading.Lock()
        self._known: collections.OrderedDict[Grammar, _Known] = collections.OrderedDict()
        self._cache = threading.Lock()
        self._checking = threading.Lock()  # one child, one check at a time
        self._child: subprocess.Popen | None = None

    @property
    def tokenizer(self):
        with self._lock:
            if self._tok is None:
                try:
                    import llguidance
                except ImportError:
                    raise ConfigError("structured output needs the llguidance package: pip install llguidance") from None
                try:
                    self._tok = llguidance.LLTokenizer(self.path.read_text(encoding="utf-8"), n_vocab=self.vocab,
                                                       eos_token=self.eos)
                except Exception as e:  # the library's own error types
                    raise PairError(f"llguidance cannot read {self.path}: {first_line(e)}") from None
            return self._tok

    def warm(self) -> None:
        """Build the tokenizer's view and start the checker now rather than at the first grammar."""
        self.tokenizer
        with self._checking:
            self._process()

    def known(self, g: Grammar) -> bool:
        """Whether `g` was checked lately (check() answers at once)."""
        with self._cache:
            return g in self._known

    def check(self, g: Grammar) -> None:
        """Return if `g` starts; ConfigError naming what is wrong with it otherwise (before any decoding)."""
        self._entry(g)

    def start(self, g: Grammar) -> Constraint:
        """A request's matcher, at the start of its output."""
        k = self._entry(g)
        return Constraint(k.matcher.deep_copy(), self.tokenizer, self.vocab, start=k.matcher)

    def close(self) -> None:
        with self._checking:
            if self._child is not None:
                self._child.kill()
                self._child.wait()
                self._child = None

    # ------------------------------------------------------------------ checking

    def _entry(self, g: Grammar) -> _Known:
        with self._cache:
            k = self._known.get(g)
            if k is not None:
                self._known.move_to_end(g)
        if k is None:
            with self._checking:
                with self._cache:
                    k = self._known.get(g)
                if k is None:
                    k = self._check(g)
                    self._keep(g, k)
        if k.error:
            raise ConfigError(f"invalid {g.what}: {k.error}", param=g.param)
        return k

    def _keep(self, g: Grammar, k: _Known) -> None:
        with self._cache:
            self._known[g] = k
            while len(self._known) > KEEP or (len(self._known) > 1 and
                                              sum(x.mb for x in self._known.values()) > KEEP_MB):
                self._known.popitem(last=False)

    def _check(self, g: Grammar) -> _Known:
        answer = self._ask(g)
        if "error" in answer:
            return _Known(error=answer["error"])
        k = _Known(mb=answer["mb"])
        try:
            k.matcher = on_big_stack(self._build, g, answer["text"])
        except ConfigError as e:
            k.error = str(e).removeprefix(f"invalid {g.what}: ")
        return k

    def _build(self, g: Grammar, text: str):
        import llguidance

        m = llguidance.LLMatcher(self.tokenizer, text, log_level=0)
        if m.is_error():
            raise ConfigError(f"invalid {g.what}: {first_line(m.get_error())[:300]}", param=g.param)
        return m

    def _process(self) -> subprocess.Popen:
        if self._child is not None and self._child.poll() is None:
            return self._child
        env = dict(os.environ, MALLOC_ARENA_MAX="1")  # one heap: the checker's address-space bound holds
        child = subprocess.Popen(
            [sys.executable, "-I", grammar_check.__file__, str(self.path), str(self.vocab), ",".join(map(str, self.eos)),
             str(self.check_mb)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, env=env, bufsize=0)
        ready = _read_line(child, 120.0)
        if not ready or not json.loads(ready).get("ready"):
            child.kill()
            child.wait()
            raise ConfigError(f"the grammar checker did not start ({sys.executable} {grammar_check.__file__})")
        self._child = child
        return child

    def _ask(self, g: Grammar) -> dict:
        self.tokenizer  # llguidance present, and the tokenizer readable: say so before starting a checker
        child = self._process()
        try:
            child.stdin.write((json.dumps({"kind": g.kind, "source": g.source}) + "\n").encode())
            line = _read_line(child, self.check_s)
        except (BrokenPipeError, ConnectionResetError):
            line = b""
        if line:
            return json.loads(line)
        self._child = None
        try:
            child.wait(timeout=None if line == b"" else 0)  # its output ended: it is exiting
        except subprocess.TimeoutExpired:
            child.kill()
            child.wait()
            return {"error": f"checking it takes more than {self.check_s:g} s"}
        if -child.returncode in (signal.SIGSEGV, signal.SIGBUS):
            return {"error": "its rules or $refs nest too deeply to compile safely (a chain of about 1,000 named "
                             "rules or 500 $refs at most)"}
        return {"error": f"checking it needs more than {self.check_mb} MB"}


def _read_line(child: subprocess.Popen, timeout: float) -> bytes | None:
    """The child's next line; b"" when its output ends (it died), None when `timeout` seconds pass first."""
    buf, end = b"", time.monotonic() + timeout
    with selectors.DefaultSelector() as sel:
        sel.register(child.stdout, selectors.EVENT_READ)
        while not buf.endswith(b"\n"):
            left = end - time.monotonic()
            if left <= 0 or not sel.select(left):
                return None
            chunk = os.read(child.stdout.fileno(), 1 << 20)
            if not chunk:
                return b""
            buf += chunk
    return buf
