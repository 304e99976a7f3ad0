"""The Python API: load a pair folder once, generate (or stream) many times.

    with specrt.load("PAIR_DIR") as pair:                       # load once: seconds
        res = pair.generate("def fib(n):", max_new_tokens=64)   # then generate many times
        with pair.stream("def fib(n):", cancel=stop_event) as s:
            for chunk in s:                                      # text as it is produced
                show(chunk)
        s.result                                                 # the Result, once the stream ended

Threads: a Pair holds one KV cache per model, so it runs one generation at a time. Use one Pair
per thread, or your own lock; a second thread that calls generate while one runs gets a
ConfigError at once (never a wait, never corrupted caches).
"""
from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path

import numpy as np

from specrt.api import memory, requests
from specrt.api.text import TextCodec, TextStream
from specrt.config import HISTORY_CAP, GenerationConfig
from specrt.api.grammars import Grammars
from specrt.api.runner import Runner
from specrt.decoding.constraint import Constraint
from specrt.decoding.decode import Request, Result
from specrt.decoding.policy import CostModel, PolicyConfig, PolicyState
from specrt.decoding.prefix import PromptCache
from specrt.decoding.proposers import DraftMemory, History
from specrt.engines import select
from specrt.errors import ConfigError, PairError
from specrt.manifest import read_manifest, verify_files



def _cancel_fn(cancel) -> Callable[[], bool] | None:
    """`cancel=` accepts a threading.Event (cancelled once set) or a callable returning True to cancel."""
    if cancel is None:
        return None
    is_set = getattr(cancel, "is_set", None)
    if callable(is_set):
        return is_set
    if callable(cancel):
        return cancel
    raise ConfigError(f"cancel must be a threading.Event or a callable returning True to cancel, got {type(cancel).__name__}")


def _output_ids(pair_dir: Path, entry, vocab: int):
    """The token ids of a restricted draft's logits rows (None: row i is id i), checked."""
    if not entry.output_ids:
        return None
    path = pair_dir / entry.output_ids
    if entry.output_ids not in entry.files:
        raise PairError(f"{path} is not among the draft's hashed files in the manifest; re-export the pair")
    try:
        ids = np.load(path, allow_pickle=False)
    except (OSError, ValueError) as e:
        raise PairError(f"cannot read {path}: {e}") from None
    if (ids.ndim != 1 or ids.dtype.kind not in "iu" or len(ids) != entry.logits_width or not len(ids)
            or ids[0] < 0 or ids[-1] >= vocab or (np.diff(ids) <= 0).any()):
        raise PairError(f"{path} must list {entry.logits_width} sorted, distinct token ids below {vocab}; re-export the pair")
    return ids.astype(np.int64)


class Pair:
    """A loaded draft/target pair. Create with `specrt.load(pair_dir)`.

    One Pair holds one KV cache per model, so it runs one generation at a time: use one Pair per
    thread, or your own lock. A call that finds the Pair busy (another thread is generating, an
    unfinished `stream` is still open, or an `on_text` callback calls back into the Pair) raises
    ConfigError at once instead of waiting.

    `close()` (or a `with` block) releases the onnxruntime sessions and caches; afterwards
    `generate` and `stream` raise PairError. Closing from another thread while a generation runs
    cancels it at its next round and waits for it to end.

    `check_memory`: before loading, estimate what the pair needs (weights, KV caches at max_len,
    logits, workspace; see `specrt.api.memory`) and refuse with a PairError, which names a
    max_len that would fit, when the machine does not have it available. The estimate is kept in
    `self.memory`.

    `draft_model=False`: the draft model is neither checked, loaded nor counted (its weights are a
    fifth of an int4 pair's memory); requests draft with prompt lookup (drafter ngram or suffix), as
    on a target-only pair; `self.draft` is None and `self.draft_left_out` True.
    """

    def __init__(self, pair_dir, threads: int | None = None, verify: bool = True, use_tuned: bool = True,
                 check_memory: bool = True, device: str = "auto", history: bool = True,
                 history_cap: int = HISTORY_CAP, share_prefix: bool = True, draft_model: bool = True):
        if threads is not None and (isinstance(threads, bool) or not isinstance(threads, int) or threads < 0):
            raise ConfigError(f"threads must be an integer >= 1 (or 0/None: onnxruntime's default), got {threads!r}")
        self._lock = threading.Lock()  # held while a generation runs
        self._owner: int | None = None  # thread id of the caller holding it
        self._closed = False
        self._closing = threading.Event()  # set by close(): cancels a generation in flight
        self.target = self.draft = None
        self.last_result: Result | None = None  # the Result of the latest finished generate/stream
        self.dir = Path(pair_dir)
        self.manifest = m = read_manifest(self.dir)
        draft = m.draft if draft_model else None  # the draft model's entry, when it is to be loaded
        self.draft_left_out = m.draft is not None and draft is None
        # "cpu", "cuda" or "tensorrt"; device_note says why auto did not take a GPU when the pair is made for one
        self.device, self.device_note = select.resolve_device(device, m, self.dir)
        # Before hashing or loading anything: a pair that cannot fit is refused in milliseconds.
        on = "cpu" if self.device == "cpu" else "cuda"
        self.memory = (memory.check_memory(self.dir, m, device=on, draft=draft_model) if check_memory
                       else memory.estimate(self.dir, m, draft=draft_model))
        if verify:
            for entry in (m.target, draft):
                if entry is not None:
                    verify_files(self.dir, entry)
        self.codec = TextCodec(self.dir)
        vocab = self.codec.tokenizer.get_vocab(with_added_tokens=True)
        top = max(vocab.values(), default=-1) + 1
        if top != m.vocab_size:
            raise PairError(f"{self.dir / 'tokenizer.json'} does not match the manifest: its ids go up to {top - 1}, "
                            f"the pair's vocabulary has {m.vocab_size} ids (replaced tokenizer?); re-export the pair")
        try:
            self.target = select.open_engine(self.dir, m, "target", m.max_draft_len + 1, threads, self.device)
            self.draft = select.open_engine(self.dir, m, "draft", 1, threads, self.device) if draft else None
        except PairError as e:
            if not (device == "auto" and self.device == "tensorrt" and m.for_gpu):
                raise
            self._release()  # auto on a pair whose engines do not load here: its graphs run on CUDA
            self.target = self.draft = None
            self.device, self.device_note = "cuda", f"TensorRT engines not used: {e}; running on onnxruntime's CUDA provider"
            self.target = select.open_engine(self.dir, m, "target", m.max_draft_len + 1, threads, self.device)
            self.draft = select.open_engine(self.dir, m, "draft", 1, threads, self.device) if draft else None
        self.draft_ids = _output_ids(self.dir, m.draft, m.vocab_size) if draft else None
        # structured output: llguidance's view of the tokenizer, built at the first constrained request
        self.grammars = Grammars(self.dir / "tokenizer.json", m.vocab_size, m.eos_token_ids)
        self.draft_memory = DraftMemory()  # the draft cache's prefix is reused by the next request
        self.prompt_cache = PromptCache()  # and the target's, where that is exact (decoding/prefix.py)
        self.share_prefix = share_prefix
        self.tuned = (m.tuned or {}) if use_tuned else {}
        self.policy_config = PolicyConfig()  # the draft-length policy's settings (decoding/policy.py)
        # what requests learn (pass costs, acceptance, calibration), carried between them
        self.state = PolicyState(history=History(history_cap) if history else None)
        if self.tuned.get("acceptance"):
            kind = "ngram" if self.tuned.get("drafter") == "ngram" else "model"
            self.state.acceptance[kind] = list(self.tuned["acceptance"])
        if self.tuned:
            if self.tuned.get("graphs") != m.graph_hashes():
                raise PairError(f"the tuned settings in {self.dir}/manifest.json were measured on other graphs "
                                "(re-exported?); rerun `specrt tune` or delete the manifest's \"tuned\" entry")
            c = self.tuned.get("costs", {})
            self.state.costs = CostModel(draft_s=c.get("draft_s"), target_s={int(w): s for w, s in c.get("target_s", {}).items()},
                                         draft_read_s=c.get("draft_read_s"))

    def generate(self, prompt: str | list[int], settings: Mapping | None = None, *, chat: bool = False,
                 on_text: Callable[[str], None] | None = None, cancel=None, **fields) -> Result:
        """Generate a continuation of `prompt` (text, or a list of token ids).

        The request's settings are `settings` (a mapping of them, e.g. a JSON record's) with `fields` given
        as keywords over it, by the names of api/requests.TABLE (`help(specrt.api.requests)` lists them
        all): max_new_tokens (128), min_tokens (0: no end of text before that many), temperature (0: greedy),
        top_k, top_p, seed (0), stop (a string or a list), draft_len (0: the target alone; "auto": each
        round's length from measured acceptance and costs; default: what `specrt tune` chose, else auto),
        drafter ("model", "ngram", "suffix" or "hybrid"; default: tuned, else hybrid with a draft model,
        else ngram), draft_window, confidence_stop, ngram_max, sampling ("coupled", the default with a
        seed: the seed gives the target-only sample whatever drafts it; "rejection" without), and at most
        one constraint: json_schema, regex, grammar (Lark) or response_format (OpenAI's object), which the
        output then matches, sampled or greedy exactly as the target alone would under it
        (`result.stats["grammar_complete"]`: whether it ended as a complete match). A setting left None
        takes its default; an unknown name raises ConfigError.
        `chat=True` wraps a text prompt in the tokenizer's chat template as a user message.
        `on_text` receives the text as it is produced (stop strings never reach it), in this thread.
        `cancel`: a threading.Event, or a callable returning True, checked once per round (one target
        pass); when it fires, generation ends with finish_reason "cancelled" and the tokens so far.
        """
        return self.run(self.encode(prompt, chat), self.settings({**(settings or {}), **fields}), on_text, cancel)

    def stream(self, prompt: str | list[int], settings: Mapping | None = None, *, chat: bool = False, cancel=None,
               **fields) -> Stream:
        """Like `generate` (the same settings), but return an iterator of text chunks as they are produced.

            with pair.stream("def fib(n):", max_new_tokens=64) as s:
                for chunk in s:
                    print(chunk, end="", flush=True)
            s.result  # the Result (also pair.last_result, and StopIteration.value)

        Bad settings raise here, at once. Decoding runs in a helper thread while you consume the
        chunks (it does not wait for you: the chunks queue up). Closing the stream early (`close()`,
        leaving the `with` block, `break` out of a `for` over an unnamed stream) cancels the
        generation at its next round and waits for it; `result` then has finish_reason "cancelled".
        The Pair is busy until the stream is exhausted or closed.
        """
        cfg = self.settings({**(settings or {}), **fields})
        ids = self.encode(prompt, chat)
        fn = _cancel_fn(cancel)
        self._check_open()
        self.check(ids, cfg)
        return Stream(self, ids, cfg, fn)

    @property
    def notes(self) -> list[str]:
        """What a user should know about how this pair runs here: why auto kept a GPU pair off the GPU or off
        TensorRT, why CUDA graphs are off. The CLI prints them on stderr."""
        found = [self.device_note] + [getattr(e, "note", None) for e in (self.target, self.draft)]
        return list(dict.fromkeys(n for n in found if n))

    @property
    def default_drafter(self) -> str:
        """The drafter a request gets unless told (api/requests.defaults)."""
        return requests.defaults(self.manifest, self.tuned, self.draft is not None)[0]

    def config(self, *, batched: bool = False, prompt: list[int] | None = None, **kw) -> GenerationConfig:
        """A request's GenerationConfig on this pair (api/requests.resolve: unset drafting choices from
        `specrt tune` or the defaults; `batched`: as a row of a batch; with `prompt`, checked against the pair)."""
        return requests.resolve(self.manifest, self.tuned, self.draft is not None, batched=batched, prompt=prompt, **kw)

    def settings(self, fields: Mapping, *defaults: requests.Layer, batched: bool = False,
                 prompt: list[int] | None = None) -> GenerationConfig:
        """A request's GenerationConfig from its raw settings by name (api/requests.TABLE, e.g. a JSON
        record's; None or absent: the default; another name: ConfigError) over a front end's `defaults`
        layers, then what `specrt tune` chose, then the built-in defaults (api/requests.settings, the one
        resolver); with `prompt`, checked against this pair."""
        requests.check_names(fields)
        return requests.settings(self.manifest, self.tuned, self.draft is not None, fields, *defaults,
                                 batched=batched, prompt=prompt)

    def check(self, prompt: list[int], cfg: GenerationConfig, batched: bool = False, grammar: bool = True) -> None:
        """Raise ConfigError for a request this pair cannot run (api/requests.check; `grammar`: its constraint
        too, which api/grammars.py checks once per distinct grammar)."""
        requests.check(self.manifest, prompt, cfg, draft_left_out=self.draft_left_out, batched=batched)
        if grammar and cfg.grammar is not None:
            self.grammars.check(cfg.grammar)

    def batch_engine(self, role: str, batch: int, cache_len: int, max_logits: int):
        """A ragged engine of `batch` rows with caches of `cache_len` slots over this pair's loaded session of
        model `role` (the batched decoder's). The target's first refuses a batch whose caches, the draft's
        included when it is loaded, do not fit in the memory available now."""
        if role == "target":
            memory.check_batch(self.manifest, batch, cache_len, getattr(self.target, "device", "cpu"),
                               self.draft is not None)
        return select.batch_engine(self.dir, getattr(self, role), cache_len, max_logits, batch)

    def text_stream(self, stop: tuple[str, ...]) -> TextStream:
        """The text of a request's tokens as they come, cut at its first stop string."""
        return TextStream(self.codec, stop)

    def encode(self, prompt: str | list[int], chat: bool = False) -> list[int]:
        """A prompt as token ids (api/requests.prompt_ids: the one rule of every front end)."""
        return requests.prompt_ids(self.codec, self.manifest.vocab_size, prompt=prompt, chat=chat)

    def run(self, prompt: list[int], cfg: GenerationConfig, on_text: Callable[[str], None] | None = None,
            cancel=None) -> Result:
        """Generate after the token ids `prompt` with a ready GenerationConfig (see `generate`)."""
        fn = _cancel_fn(cancel)
        self._begin()
        try:
            return self._run(prompt, cfg, on_text, fn)
        finally:
            self._end()

    # ------------------------------------------------------------------ one generation at a time

    @contextmanager
    def exclusive(self):
        """Hold the Pair like a generation does, for code that drives `self.target`/`self.draft`
        directly (checks, batch runners): a generate or stream meanwhile raises ConfigError, and
        entering while one runs raises ConfigError."""
        self._begin()
        self.forget_caches()  # the caller may overwrite the caches
        try:
            yield self
        finally:
            self._end()

    def forget_caches(self) -> None:
        """The next request reads its prompt whole, into both models (for code that wrote their caches)."""
        self.draft_memory.forget()
        self.prompt_cache.forget()

    def _check_open(self) -> None:
        if self._closed:
            raise PairError(f"this Pair ({self.dir}) is closed; load the pair again")

    def _begin(self) -> None:
        self._check_open()
        if not self._lock.acquire(blocking=False):
            raise ConfigError("this Pair is already generating (in another thread, an unfinished stream, or a callback "
                              "of its own); a Pair runs one generation at a time: use one Pair per thread, or your own lock")
        if self._closed:  # closed between the check and the lock
            self._lock.release()
            self._check_open()
        self._owner = threading.get_ident()

    def _end(self) -> None:
        self._owner = None
        self._lock.release()
        if self._closed:
            self._release()

    def _run(self, prompt: list[int], cfg: GenerationConfig, on_text: Callable[[str], None] | None,
             cancel: Callable[[], bool] | None) -> Result:
        """One generation; the caller holds the lock. A batch of one over the pair's batch-1 engines."""
        req = Request(None, prompt, cfg, on_text, lambda: self._closing.is_set() or (cancel is not None and bool(cancel())))
        (_, res), = Runner(self).decode([req])
        if isinstance(res, ConfigError):
            raise res
        self.last_result = res
        return res

    def runner(self, batch_size: int | None = None) -> Runner:
        """The one door into the round (api/runner.py): None, requests alone on this pair's engines; an
        integer, a batch of that many rows (its KV caches allocated now). `runner.run(requests)` holds the pair."""
        return Runner(self, batch_size)

    def policy(self, cfg: GenerationConfig, state: PolicyState | None = None, constraint: Constraint | None = None):
        """The draft-length policy and proposers a request alone gets (decoding/policy.build), learning into
        `state` (default: the Pair's); `constraint`: its grammar's state (structured output)."""
        return Runner(self).policy(0, cfg, constraint, state)

    def close(self) -> None:
        """Release the sessions and caches. Idempotent.

        From another thread while a generation runs: cancels it at its next round and waits for it.
        From inside the running generation (an `on_text` callback, a stream's consumer loop): the
        generation is cancelled and the Pair is released when it returns.
        """
        self._closed = True
        self._closing.set()
        if self._owner == threading.get_ident():
            return  # our own generation is on the stack: _end() releases
        with self._lock:
            self._release()

    def _release(self) -> None:
        if getattr(self, "grammars", None) is not None:  # its checker process (absent: a load that failed early)
            self.grammars.close()
        for e in (self.target, self.draft):
            if e is not None:
                e.close()

    @property
    def closed(self) -> bool:
        return self._closed

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


class _Done:
    def __init__(self, result=None, error: BaseException | None = None):
        self.result, self.error = result, error


def _stream_chunks(pair: Pair, ids: list[int], cfg: GenerationConfig, cancel, box: dict) -> Iterator[str]:
    """The generator behind Stream. It must not reference the Stream (no cycle: dropping the Stream
    closes this generator at once, which cancels the decode and frees the Pair)."""
    pair._begin()
    stop = threading.Event()
    chunks: queue.SimpleQueue = queue.SimpleQueue()

    def work():
        try:
            res = pair._run(ids, cfg, chunks.put, lambda: stop.is_set() or (cancel is not None and bool(cancel())))
            chunks.put(_Done(result=res))
        except BaseException as e:  # noqa: BLE001 - handed to the consumer, raised there
            chunks.put(_Done(error=e))

    worker = threading.Thread(target=work, name="specrt-stream")
    try:
        worker.start()
        while True:
            item = chunks.get()
            if isinstance(item, _Done):
                if item.error is not None:
                    raise item.error
                box["result"] = item.result
                return item.result
            yield item
    finally:
        stop.set()  # consumer gone early (close, break, exception): cancel at the next round
        if worker.ident is not None:
            worker.join()
        while "result" not in box and not chunks.empty():  # closed early: keep the cancelled Result
            item = chunks.get()
            if isinstance(item, _Done) and item.error is None:
                box["result"] = item.result
        pair._end()


class Stream:
    """Text chunks of one generation, as an iterator; see `Pair.stream`.

    `result` is the Result once the iterator is exhausted or closed (None before); iteration
    ends with StopIteration(value=Result) like a generator's return. `close()` cancels a
    generation still running; a `with` block closes on exit.
    """

    def __init__(self, pair: Pair, ids: list[int], cfg: GenerationConfig, cancel):
        self._box: dict = {}
        self._gen = _stream_chunks(pair, ids, cfg, cancel, self._box)

    @property
    def result(self) -> Result | None:
        return self._box.get("result")

    def __iter__(self) -> Stream:
        return self

    def __next__(self) -> str:
        return next(self._gen)

    def close(self) -> None:
        """Stop early: the generation is cancelled at its next round (and waited for). Never started:
        nothing runs, `result` stays None."""
        self._gen.close()

    def __enter__(self) -> Stream:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def text(self) -> str:
        """Consume the rest of the stream; return all its text."""
        return "".join(self)


def generate_batch(pair, prompts: list, batch_size: int = 4, settings: Mapping | None = None, *, chat: bool = False,
                   totals: dict | None = None, **fields) -> list:
    """`pair.generate` for many prompts at once; returns one Result per prompt, in order.

    Settings as `pair.generate`'s, but for `draft_len`: a batch's rows draft a fixed length (default: what
    `specrt tune` chose, else min(4, the pair's max_draft_len)). `seed` is one seed for every prompt (each
    then gets what `pair.generate(prompt, seed=seed)` gets) or a list with one per prompt. `totals`, if
    given, receives the batch totals (decoding.decode.Totals.as_dict).
    """
    fields = {**(settings or {}), **fields}
    seed = fields.pop("seed", None)
    seeds = list(seed) if isinstance(seed, (list, tuple)) else [seed] * len(prompts)
    if len(seeds) != len(prompts):
        raise ConfigError(f"{len(seeds)} seeds for {len(prompts)} prompts")
    reqs = []
    with pair.runner(batch_size) as dec:
        for i, (p, s) in enumerate(zip(prompts, seeds)):
            ids = pair.encode(p, chat)
            reqs.append(Request(i, ids, pair.settings({**fields, "seed": s}, batched=True, prompt=ids)))
        out = dict(dec.run(reqs))
        if refused := next((v for v in out.values() if isinstance(v, ConfigError)), None):
            raise refused
        if totals is not None:
            totals.update(dec.totals.as_dict())
    return [out[i] for i in range(len(prompts))]


def load(pair_dir, threads: int | None = None, verify: bool = True, use_tuned: bool = True,
         check_memory: bool = True, device: str = "auto", history: bool = True, history_cap: int = HISTORY_CAP,
         share_prefix: bool = True, draft_model: bool = True) -> Pair:
    """Load a pair folder made by `specrt export` (with the settings `specrt tune` stored, if any).

    `check_memory=False` skips the memory estimate check (see `Pair`).
    `device`: "auto" (default: TensorRT engines, else CUDA for an fp16 pair, else the CPU; `pair.device`
    says which, `pair.device_note` why a GPU pair stayed on the CPU), "cpu", "cuda" or "tensorrt".
    `history`: keep the outputs of this Pair's requests (at most `history_cap` tokens, 4 bytes each, the
    oldest requests dropped first) for the suffix drafter and hybrid to draft from; False: every request
    drafts only from itself (isolation between users).
    `share_prefix`: a request keeps, in both models' caches, what its prompt shares with the previous
    request's (the target's where that is exact, so the answer is a fresh read's, decoding/prefix.py);
    False: every request reads its prompt whole (isolation: its timing then says nothing of the others').
    `draft_model`: False leaves the pair's draft model out (not loaded, not counted; drafters ngram and
    suffix only): the footprint of the target alone.
    """
    return Pair(pair_dir, threads=threads, verify=verify, use_tuned=use_tuned, check_memory=check_memory,
                device=device, history=history, history_cap=history_cap, share_prefix=share_prefix,
                draft_model=draft_model)
