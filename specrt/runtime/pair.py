"""The Python API: load a pair folder once, generate many times."""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from specrt.config import GenerationConfig, SamplingConfig, read_manifest, verify_files
from specrt.runtime.adaptive import CostModel
from specrt.errors import ConfigError, PairError


@dataclass(frozen=True)
class Result:
    tokens: list[int]  # generated ids, prompt and EOS excluded
    text: str  # decoded generated text (ends before a stop string)
    finish_reason: str  # "eos" | "length" | "stop"
    stats: dict  # see runtime.decode.Stats.as_dict


class Pair:
    """A loaded draft/target pair. Create with `specrt.load(pair_dir)`.

    One Pair holds one KV cache per model, so use it from one thread at a time (or one Pair per
    thread). `close()` (or a `with` block) releases the onnxruntime sessions and caches.
    """

    def __init__(self, pair_dir, threads: int | None = None, verify: bool = True, use_tuned: bool = True):
        from specrt.engines.ort import OrtEngine
        from specrt.runtime.text import TextCodec

        self.dir = Path(pair_dir)
        self.manifest = m = read_manifest(self.dir)
        if verify:
            for entry in (m.target, m.draft):
                if entry is not None:
                    verify_files(self.dir, entry)
        self.codec = TextCodec(self.dir)
        self.target = OrtEngine(self.dir, m.target, m.max_len, m.max_draft_len + 1, threads=threads)
        self.draft = OrtEngine(self.dir, m.draft, m.max_len, 1, threads=threads) if m.draft else None
        self.costs = CostModel()  # measured pass times on this machine, shared by all requests
        self.tuned = (m.tuned or {}) if use_tuned else {}
        if self.tuned:
            if self.tuned.get("graphs") != m.graph_hashes():
                raise PairError(f"the tuned settings in {self.dir}/manifest.json were measured on other graphs "
                                "(re-exported?); rerun `specrt tune` or delete the manifest's \"tuned\" entry")
            c = self.tuned.get("costs", {})
            self.costs = CostModel(draft_s=c.get("draft_s"), target_s={int(w): s for w, s in c.get("target_s", {}).items()})

    def generate(self, prompt: str | list[int], max_new_tokens: int = 128, temperature: float = 0.0,
                 top_k: int = 0, top_p: float = 1.0, seed: int = 0, draft_len: int | str | None = None,
                 stop: tuple[str, ...] | list[str] = (), chat: bool = False, drafter: str | None = None,
                 on_text: Callable[[str], None] | None = None) -> Result:
        """Generate a continuation of `prompt` (text, or a list of token ids).

        temperature 0 is greedy; draft_len 0 is plain target-only decoding through the same engine,
        "auto" picks each round's length from measured acceptance and costs; default: what
        `specrt tune` chose for this pair, else "auto".
        `drafter`: "model" (the pair's draft model), "ngram" (prompt lookup, no draft model needed)
        or "hybrid" (the n-gram proposal when there is one, else the draft model); default: "model" if
        the pair has a draft model, else "ngram".
        `chat=True` wraps a text prompt in the tokenizer's chat template as a user message.
        `on_text` receives the text as it is produced (stop strings never reach it).
        """
        cfg = self.config(max_new_tokens=max_new_tokens, draft_len=draft_len, seed=seed, stop=tuple(stop),
                          drafter=drafter, sampling=SamplingConfig(temperature=temperature, top_k=top_k, top_p=top_p))
        return self.run(self.encode(prompt, chat), cfg, on_text)

    @property
    def default_drafter(self) -> str:
        return self.tuned.get("drafter") or ("model" if self.draft is not None else "ngram")

    def config(self, draft_len=None, drafter=None, confidence_stop=None, **kw) -> GenerationConfig:
        """A GenerationConfig whose unset drafting choices come from `specrt tune` (or the defaults)."""
        return GenerationConfig(
            draft_len=self.tuned.get("draft_len", "auto") if draft_len is None else draft_len,
            drafter=drafter or self.default_drafter,
            confidence_stop=self.tuned.get("confidence_stop", 0.0) if confidence_stop is None else confidence_stop,
            **kw)

    def encode(self, prompt: str | list[int], chat: bool = False) -> list[int]:
        if isinstance(prompt, str):
            if chat:
                prompt = self.codec.apply_chat_template([{"role": "user", "content": prompt}])
            ids = self.codec.encode(prompt)
        else:
            ids = list(prompt)
            if any(isinstance(i, bool) or not isinstance(i, (int, np.integer)) for i in ids):
                raise ConfigError("a prompt given as a list must hold integer token ids")
            ids = [int(i) for i in ids]
            if any(not 0 <= i < self.manifest.vocab_size for i in ids):
                raise ConfigError(f"prompt token ids must be in 0..{self.manifest.vocab_size - 1}")
        if not ids:
            raise ConfigError("the prompt is empty")
        return ids

    def run(self, prompt: list[int], cfg: GenerationConfig, on_text: Callable[[str], None] | None = None) -> Result:
        from specrt.runtime.decode import decode
        from specrt.runtime.text import TextStream

        m = self.manifest
        k = m.max_draft_len if cfg.draft_len == "auto" else cfg.draft_len
        if k > m.max_draft_len:
            raise ConfigError(f"draft_len {cfg.draft_len} is above this pair's max_draft_len {m.max_draft_len} "
                              "(set at export with --max-draft-len)")
        if k and cfg.drafter != "ngram" and self.draft is None:
            raise ConfigError(f"this pair has no draft model, which drafter {cfg.drafter!r} needs; "
                              "use drafter 'ngram' or draft_len 0")
        need = len(prompt) + cfg.max_new_tokens + k + 1
        if len(prompt) >= m.max_len:
            raise ConfigError(f"the prompt has {len(prompt)} tokens; this pair's max_len is {m.max_len}")
        if need > m.max_len:
            room = m.max_len - len(prompt) - k - 1
            fix = f"use max_new_tokens <= {room}" if room >= 1 else "use a shorter prompt or export with a larger --max-len"
            raise ConfigError(f"prompt ({len(prompt)} tokens) + max_new_tokens ({cfg.max_new_tokens}) + draft_len+1 "
                              f"exceeds max_len {m.max_len}; {fix}")
        stream = TextStream(self.codec, cfg.stop)

        def on_tokens(new: list[int]) -> bool:
            chunk = stream.feed(new)
            if chunk and on_text is not None:
                on_text(chunk)
            return stream.stopped

        tokens, reason, stats = decode(self.target, self._drafter(cfg), prompt, cfg, m.vocab_size,
                                       frozenset(m.eos_token_ids), on_tokens, self.costs, m.max_draft_len,
                                       self.tuned.get("acceptance"))
        tail = stream.finish()
        if tail and on_text is not None:
            on_text(tail)
        if stream.stopped:
            tokens = tokens[: stream.n_tokens]
            stats.new_tokens = len(tokens)  # tokens accepted past the stop string are not output
        return Result(tokens=tokens, text=stream.text, finish_reason=reason, stats=stats.as_dict())

    def _drafter(self, cfg: GenerationConfig):
        from specrt.runtime.drafters import HybridDrafter, ModelDrafter, NgramDrafter

        if cfg.draft_len == 0:
            return None
        if cfg.drafter == "ngram":
            return NgramDrafter(cfg.ngram_max)
        model = ModelDrafter(self.draft, self.manifest.vocab_size)
        return model if cfg.drafter == "model" else HybridDrafter(model, NgramDrafter(cfg.ngram_max))

    def close(self) -> None:
        for e in (self.target, self.draft):
            if e is not None:
                e.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def load(pair_dir, threads: int | None = None, verify: bool = True, use_tuned: bool = True) -> Pair:
    """Load a pair folder made by `specrt export` (with the settings `specrt tune` stored, if any)."""
    return Pair(pair_dir, threads=threads, verify=verify, use_tuned=use_tuned)
