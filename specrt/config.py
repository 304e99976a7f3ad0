"""A request's settings: frozen dataclasses, made once at the edge (api/requests.resolve) and passed down as
they are. The pair folder's schema is manifest.py."""
from __future__ import annotations

import math
import numbers
from dataclasses import dataclass, field

from specrt.errors import ConfigError, show

DRAFTERS = ("model", "ngram", "suffix", "hybrid")
# Stop strings a request may give, and their length: enough for any use seen, and a bound on what a round
# of matching costs (OpenAI's API takes at most 4).
MAX_STOPS, MAX_STOP_CHARS = 16, 256
MAX_NEW_TOKENS = 128  # a request's default length, wherever it is not given
HISTORY_CAP = 262144  # tokens of earlier outputs a pair keeps for the suffix drafter by default (1 MB)


def needs_draft_model(drafter: str | None, draft_len: int | str | None = None) -> bool:
    """Whether a request drafting with `drafter` at `draft_len` runs the draft model (None for either: the
    pair's default, which may)."""
    return draft_len != 0 and drafter in (None, "model", "hybrid")


def _is_int(v) -> bool:
    return isinstance(v, numbers.Integral) and not isinstance(v, bool)


SAMPLERS = ("rejection", "coupled")
TREES = ("auto", "off")  # auto: a round may verify a tree where the target takes one (decoding/tree.py)


@dataclass(frozen=True)
class SamplingConfig:
    """How tokens are chosen. temperature 0 means greedy; top_k 0 and top_p 1.0 mean off. `method`: how a
    sampled request verifies drafts (decoding/sampling.py): "rejection" (a seed reproduces for the same
    drafts) or "coupled" (a seed gives the target-only sample whatever drafts it). A request that gives a
    seed and no method gets "coupled" (api/requests.parse); this default is for those without a seed."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    method: str = "rejection"

    def __post_init__(self):
        if not _is_int(self.top_k):
            raise ConfigError(f"top_k must be an integer, got {show(self.top_k)}", param="top_k")
        if not 0.0 <= self.temperature < math.inf:  # NaN fails every comparison
            raise ConfigError(f"temperature must be >= 0 and finite, got {self.temperature}", param="temperature")
        if self.top_k < 0:
            raise ConfigError(f"top_k must be >= 0 (0 = off), got {show(self.top_k)}", param="top_k")
        if not (0.0 < self.top_p <= 1.0):
            raise ConfigError(f"top_p must be in (0, 1], got {self.top_p}", param="top_p")
        if self.method not in SAMPLERS:
            raise ConfigError(f"sampling must be one of {', '.join(SAMPLERS)}, got {self.method!r}", param="sampling")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


GRAMMARS = {"json_schema": "json_schema", "regex": "regex", "lark": "grammar"}  # kind: the request field naming it


@dataclass(frozen=True)
class Grammar:
    """What a request's output must match (decoding/constraint.py): `kind` "json_schema" (`source`: the schema
    as JSON text), "regex" or "lark" (a Lark grammar in llguidance's dialect; GBNF is read too)."""

    kind: str
    source: str

    def __post_init__(self):
        if self.kind not in GRAMMARS:
            raise ConfigError(f"unknown grammar kind {self.kind!r}; choose one of {', '.join(GRAMMARS)}", param="grammar")
        if not isinstance(self.source, str) or not self.source.strip():
            raise ConfigError(f"the {self.what} is empty", param=self.param)
        try:
            self.source.encode("utf-8")
        except UnicodeEncodeError as e:
            raise ConfigError(f"the {self.what} is not valid text: character {e.start} is a lone surrogate",
                              param=self.param) from None

    @property
    def param(self) -> str:
        return GRAMMARS[self.kind]

    @property
    def what(self) -> str:
        return {"json_schema": "JSON schema", "regex": "regular expression", "lark": "grammar"}[self.kind]


@dataclass(frozen=True)
class GenerationConfig:
    """One request: how many tokens, when to stop, how many draft tokens per round."""

    max_new_tokens: int = MAX_NEW_TOKENS
    draft_len: int | str = 4  # "auto": chosen per round from measured acceptance and costs
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    seed: int = 0
    stop: tuple[str, ...] = ()
    drafter: str = "model"  # model | ngram (prompt lookup) | suffix (lookup + earlier outputs) | hybrid
    ngram_max: int = 16  # longest suffix the prompt-lookup drafter matches (longer matches rank as equal)
    confidence_stop: float = 0.0  # a model draft stops early once its top probability falls below this
    # The most tokens a draft model's catch-up pass reads; further behind, it starts over from the last
    # ones (0: no limit; None: the device's default, decoding.proposers.default_window).
    draft_window: int | None = None
    grammar: Grammar | None = None  # the output must match it (structured output); None: free text
    min_tokens: int = 0  # no end of text (EOS) before this many new tokens; a stop string still ends it
    tree: str = "auto"  # TREES

    def __post_init__(self):
        if self.tree not in TREES:
            raise ConfigError(f"tree must be one of {', '.join(TREES)}, got {show(self.tree)}", param="tree")
        if self.drafter not in DRAFTERS:
            raise ConfigError(f"unknown drafter {self.drafter!r}; choose one of {', '.join(DRAFTERS)}", param="drafter")
        if not 1 <= self.ngram_max <= 16:
            raise ConfigError(f"ngram_max must be in 1..16, got {show(self.ngram_max)}", param="ngram_max")
        if self.max_new_tokens < 1:
            raise ConfigError(f"max_new_tokens must be >= 1, got {show(self.max_new_tokens)}", param="max_new_tokens")
        if not _is_int(self.max_new_tokens):
            raise ConfigError(f"max_new_tokens must be an integer, got {show(self.max_new_tokens)}", param="max_new_tokens")
        if not _is_int(self.min_tokens) or not 0 <= self.min_tokens <= self.max_new_tokens:
            raise ConfigError(f"min_tokens must be an integer in 0..max_new_tokens ({show(self.max_new_tokens)}), "
                              f"got {show(self.min_tokens)}", param="min_tokens")
        if not _is_int(self.seed) or self.seed < 0:
            raise ConfigError(f"seed must be an integer >= 0, got {show(self.seed)}", param="seed")
        if self.draft_len != "auto" and (not _is_int(self.draft_len) or self.draft_len < 0):
            raise ConfigError(f"draft_len must be an integer >= 0 (0 = target only) or 'auto', got {show(self.draft_len)}",
                              param="draft_len")
        if self.draft_window is not None and (not _is_int(self.draft_window) or self.draft_window < 0):
            raise ConfigError(f"draft_window must be an integer >= 0 (0 = no limit), got {show(self.draft_window)}",
                              param="draft_window")
        if not 0.0 <= self.confidence_stop < 1.0:
            raise ConfigError(f"confidence_stop must be in [0, 1), got {self.confidence_stop}",
                              param="confidence_stop")
        if not isinstance(self.stop, tuple) or not all(isinstance(s, str) for s in self.stop):
            raise ConfigError("stop must be a tuple of strings", param="stop")
        if any(not s for s in self.stop):
            raise ConfigError("stop strings must not be empty", param="stop")
        for s in self.stop:
            try:
                s.encode("utf-8")
            except UnicodeEncodeError:
                raise ConfigError(f"stop string {s[:20]!r} is not valid text (a lone surrogate)",
                                  param="stop") from None
        if len(self.stop) > MAX_STOPS or any(len(s) > MAX_STOP_CHARS for s in self.stop):
            raise ConfigError(f"at most {MAX_STOPS} stop strings of at most {MAX_STOP_CHARS} characters each, got "
                              f"{len(self.stop)} (longest {max(map(len, self.stop))})", param="stop")
