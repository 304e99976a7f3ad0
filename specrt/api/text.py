"""Tokenizer, chat template, and incremental text with stop strings (no transformers at run time)."""
from __future__ import annotations

import json
import os
from pathlib import Path

from specrt.errors import ConfigError, PairError, first_line

# encode_batch (below) would otherwise run on tokenizers' thread pool, after which every fork (a subprocess)
# prints a warning on stderr; one text gains nothing from it
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


class TextCodec:
    def __init__(self, pair_dir: Path):
        from tokenizers import Tokenizer

        path = pair_dir / "tokenizer.json"
        try:
            self.tokenizer = Tokenizer.from_file(str(path))
        except Exception as e:
            raise PairError(f"cannot load the tokenizer {path}: {first_line(e)}") from None
        self.chat_template, self.special = None, {}
        cfg_path = pair_dir / "tokenizer_config.json"
        if cfg_path.is_file():
            try:
                cfg = json.loads(cfg_path.read_text(encoding="utf-8"))
            except (UnicodeDecodeError, json.JSONDecodeError) as e:
                raise PairError(f"corrupt {cfg_path}: {e}") from None
            self.chat_template = cfg.get("chat_template")
            self.special = {k: _token_text(cfg.get(k)) for k in ("bos_token", "eos_token")}
        jinja = pair_dir / "chat_template.jinja"
        if self.chat_template is None and jinja.is_file():
            self.chat_template = jinja.read_text(encoding="utf-8")

    def encode(self, text: str) -> list[int]:
        check_text(text, "the prompt")
        # encode_batch lets go of Python's lock while it works (encode holds it): a server thread tokenizing
        # a long prompt then does not stall the event loop
        return self.tokenizer.encode_batch([text], add_special_tokens=False)[0].ids

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    @property
    def renders_tools(self) -> bool:
        """The chat template shows the model a list of tools (OpenAI's `tools`)."""
        return bool(self.chat_template) and "tools" in self.chat_template

    def apply_chat_template(self, messages: list[dict], tools: list[dict] | None = None) -> str:
        """Render the tokenizer's chat template the way transformers does (jinja2, generation prompt on);
        `tools`: OpenAI's tool objects, for a template that renders them."""
        if not self.chat_template:
            raise ConfigError("this pair's tokenizer has no chat template; generate without --chat")
        import jinja2
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        def raise_exception(msg):
            raise jinja2.TemplateError(msg)

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
        env.globals["raise_exception"] = raise_exception
        env.filters["tojson"] = lambda x, indent=None, **kw: (
            x.text if isinstance(x, JSONText) and indent is None else json.dumps(x, ensure_ascii=False, indent=indent))
        try:
            extra = {"tools": tools} if tools else {}
            return env.from_string(self.chat_template).render(messages=messages, add_generation_prompt=True, **extra,
                                                              **{k: v for k, v in self.special.items() if v})
        except jinja2.TemplateError as e:
            raise ConfigError(f"chat template failed: {e}") from None


class JSONText(dict):
    """A JSON object read from `text` (an earlier tool call's arguments, as OpenAI's messages give them),
    which a chat template's `tojson` writes as that text rather than encoding the object again."""

    def __init__(self, value: dict, text: str):
        super().__init__(value)
        self.text = text


def check_text(text: str, what: str) -> None:
    """ConfigError unless `text` is text that UTF-8 can hold: a lone surrogate (from a JSON escape such as
    \\ud800, or bytes that were not UTF-8 on a command line) is not."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ConfigError(f"{what} is not valid text: character {e.start} is {text[e.start]!r}, a lone surrogate "
                          "(invalid UTF-8 in the input?)") from None


def _token_text(tok) -> str | None:
    if isinstance(tok, dict):
        return tok.get("content")
    return tok


def _prefix_function(s: str) -> list[int]:
    """pi[i]: the length of the longest proper prefix of s[:i + 1] that is also a suffix of it."""
    pi = [0] * len(s)
    for i in range(1, len(s)):
        k = pi[i - 1]
        while k and s[i] != s[k]:
            k = pi[k - 1]
        pi[i] = k + 1 if s[i] == s[k] else k
    return pi


class _StopMatcher:
    """Where stop strings occur in a text fed piece by piece. Per stop string, the state of a
    Knuth-Morris-Pratt automaton (how long a prefix of it the text ends with) advances one character at a
    time: a piece costs O(its characters x stop strings), whatever the length of the text before it."""

    def __init__(self, stops: tuple[str, ...]):
        self.stops = stops
        self.fail = [_prefix_function(s) for s in stops]
        self.state = [0] * len(stops)

    def feed(self, piece: str, at: int) -> int | None:
        """Advance over `piece`, which starts at index `at` of the text; the index where the earliest
        stop string completed in it begins, or None."""
        first = None
        for k, s in enumerate(self.stops):
            st, fail = self.state[k], self.fail[k]
            for i, ch in enumerate(piece):
                while st and s[st] != ch:
                    st = fail[st - 1]
                if s[st] == ch:
                    st += 1
                if st == len(s):  # later matches of this string begin later
                    start = at + i - len(s) + 1
                    first = start if first is None else min(first, start)
                    st = fail[st - 1]
                    break
            self.state[k] = st
        return first

    def pending(self) -> int:
        """Characters at the end of the text that may begin a stop string."""
        return max(self.state, default=0)


class TextStream:
    """Incremental decoding with stop strings: feed accepted tokens, read text that is safe to show.

    Text that could still turn out to be the start of a stop string is held back. When a stop string
    appears, `stopped` becomes True, the text ends before it, and `n_tokens` is the number of tokens
    up to the one that completed it. Looking for the stop strings costs each round O(its new text).
    """

    def __init__(self, codec: TextCodec, stop: tuple[str, ...] = ()):
        from tokenizers.decoders import DecodeStream

        self.codec, self.stop = codec, stop
        self._decoder = DecodeStream(skip_special_tokens=True)  # buffers split UTF-8 sequences itself
        self._stops = _StopMatcher(stop)
        self.text = ""  # text so far (ends before a stop string once stopped)
        self.tokens: list[int] = []
        self._shown = 0
        self.stopped = False
        self.n_tokens = 0

    def feed(self, new: list[int]) -> str:
        """Add tokens one by one; return the newly safe text."""
        for t in new:
            if self.stopped:
                break
            self.n_tokens += 1
            self.tokens.append(t)
            chunk = self._decoder.step(self.codec.tokenizer, t)
            if not chunk:
                continue
            hit = self._stops.feed(chunk, len(self.text))
            self.text += chunk
            if hit is not None:
                self.text, self.stopped = self.text[:hit], True
        return self._flush()

    def finish(self) -> str:
        if not self.stopped:  # the stream holds back an incomplete UTF-8 tail; a full decode shows it
            full = self.codec.decode(self.tokens)
            if full.startswith(self.text):
                self.text = full
        return self._flush(final=True)

    def _flush(self, final: bool = False) -> str:
        safe = len(self.text)
        if not final and not self.stopped:  # hold back a tail that may begin a stop string
            safe -= min(self._stops.pending(), len(self.text))
        chunk = self.text[self._shown:safe]
        self._shown = max(self._shown, safe)
        return chunk
