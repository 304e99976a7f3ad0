"""Tokenizer, chat template, and incremental text with stop strings (no transformers at run time)."""
from __future__ import annotations

import json
from pathlib import Path

from specrt.errors import ConfigError, PairError


class TextCodec:
    def __init__(self, pair_dir: Path):
        from tokenizers import Tokenizer

        path = pair_dir / "tokenizer.json"
        try:
            self.tokenizer = Tokenizer.from_file(str(path))
        except Exception as e:
            raise PairError(f"cannot load the tokenizer {path}: {str(e).splitlines()[0] if str(e) else e}") from None
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
        return self.tokenizer.encode(text, add_special_tokens=False).ids

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def apply_chat_template(self, messages: list[dict]) -> str:
        """Render the tokenizer's chat template the way transformers does (jinja2, generation prompt on)."""
        if not self.chat_template:
            raise ConfigError("this pair's tokenizer has no chat template; generate without --chat")
        import jinja2
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        def raise_exception(msg):
            raise jinja2.TemplateError(msg)

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
        env.globals["raise_exception"] = raise_exception
        env.filters["tojson"] = lambda x, indent=None, **kw: json.dumps(x, ensure_ascii=False, indent=indent)
        try:
            return env.from_string(self.chat_template).render(messages=messages, add_generation_prompt=True,
                                                              **{k: v for k, v in self.special.items() if v})
        except jinja2.TemplateError as e:
            raise ConfigError(f"chat template failed: {e}") from None


def _token_text(tok) -> str | None:
    if isinstance(tok, dict):
        return tok.get("content")
    return tok


class TextStream:
    """Incremental decoding with stop strings: feed accepted tokens, read text that is safe to show.

    Text that could still turn out to be the start of a stop string is held back. When a stop string
    appears, `stopped` becomes True, the text ends before it, and `n_tokens` is the number of tokens
    up to the one that completed it.
    """

    def __init__(self, codec: TextCodec, stop: tuple[str, ...] = ()):
        from tokenizers.decoders import DecodeStream

        self.codec, self.stop = codec, stop
        self._decoder = DecodeStream(skip_special_tokens=True)  # buffers split UTF-8 sequences itself
        self._longest_stop = max((len(s) for s in stop), default=0)
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
            start = max(0, len(self.text) - self._longest_stop)  # a stop string can only end in the new chunk
            self.text += chunk
            hits = [i for s in self.stop if (i := self.text.find(s, start)) >= 0]
            if hits:
                self.text, self.stopped = self.text[: min(hits)], True
        return self._flush()

    def finish(self) -> str:
        if not self.stopped:  # the stream holds back an incomplete UTF-8 tail; a full decode shows it
            full = self.codec.decode(self.tokens)
            if full.startswith(self.text):
                self.text = full
        return self._flush(final=True)

    def _flush(self, final: bool = False) -> str:
        safe = len(self.text)
        if not final and not self.stopped:
            for s in self.stop:  # hold back a tail that may begin a stop string
                for j in range(min(len(s) - 1, len(self.text)), 0, -1):
                    if self.text.endswith(s[:j]):
                        safe = min(safe, len(self.text) - j)
                        break
        chunk = self.text[self._shown:safe]
        self._shown = max(self._shown, safe)
        return chunk
