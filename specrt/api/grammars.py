"""A pair's grammar compiler for structured output (decoding/constraint.py): llguidance's view of the pair's
tokenizer, and a request's Grammar checked and made into the matcher its Constraint drives."""
from __future__ import annotations

import threading
from collections.abc import Sequence
from pathlib import Path

from specrt.config import Grammar
from specrt.decoding.constraint import Constraint
from specrt.errors import ConfigError, PairError, first_line

# JSON on one line with the separators models write (", " and ": "): every key, quote and separator of a
# schema's output is then forced, and drafts for free (llguidance's default allows any whitespace there).
JSON_STYLE = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


def compiled(g: Grammar) -> str:
    """The grammar in llguidance's form."""
    import llguidance

    if g.kind == "json_schema":
        try:
            return llguidance.LLMatcher.grammar_from_json_schema(g.source, defaults=JSON_STYLE)
        except ValueError as e:
            raise ConfigError(f"invalid JSON schema: {first_line(e)}", param=g.param) from None
    if g.kind == "regex":
        return llguidance.LLMatcher.grammar_from_regex(g.source)
    return llguidance.grammar_from("grammar", g.source)


def _one_line(err: str) -> str:
    """llguidance's error (a message, then the source with a caret, then the cause) on one line."""
    lines = [x.strip() for x in err.splitlines() if x.strip()]
    cause = next((x for x in lines[1:] if x.lower().startswith("error:")), "")
    return (lines[0].rstrip(":") + (f" ({cause})" if cause else ""))[:300] if lines else "rejected"


class Grammars:
    """A pair's compiler of request grammars: llguidance's view of the pair's tokenizer, built once on first
    use (about a second for a 150k vocabulary) and shared by every request."""

    def __init__(self, tokenizer_json: Path, vocab: int, eos_ids: Sequence[int]):
        self.path, self.vocab, self.eos = Path(tokenizer_json), vocab, list(eos_ids)
        self._tok, self._lock = None, threading.Lock()
        self._compiled: dict[Grammar, str] = {}  # the latest grammars checked (a job's records share one)
        self._cache = threading.Lock()

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

    def check(self, g: Grammar) -> str:
        """The grammar compiled, or ConfigError naming what is wrong with it (before any decoding)."""
        import llguidance

        with self._cache:
            if g in self._compiled:
                return self._compiled[g]
        tok = self.tokenizer
        try:
            text = compiled(g)
            err = llguidance.LLMatcher.validate_grammar(text, tok)
        except ConfigError:
            raise
        except Exception as e:  # the library's own errors for what it cannot read
            raise ConfigError(f"invalid {g.what}: {first_line(e)[:300]}", param=g.param) from None
        if err:
            raise ConfigError(f"invalid {g.what}: {_one_line(err)}", param=g.param)
        with self._cache:  # the server checks requests in its threads while its worker starts them
            if len(self._compiled) >= 64:
                self._compiled.pop(next(iter(self._compiled)))
            self._compiled[g] = text
        return text

    def start(self, g: Grammar) -> Constraint:
        """A request's matcher, at the start of its output."""
        import llguidance

        m = llguidance.LLMatcher(self.tokenizer, self.check(g), log_level=0)
        if m.is_error():
            raise ConfigError(f"invalid {g.what}: {first_line(m.get_error())}", param=g.param)
        return Constraint(m, self.tokenizer, self.vocab)
