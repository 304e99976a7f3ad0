"""The A/B tool: variants of the drafting settings, priced, over the shipped prompts, in one process.

    python bench/ab.py PAIR_DIR [--repeats N] [--frozen] [--table FILE] [--json OUT] [--limit N]
        [--prompts FILE,FILE] [--max-new-tokens 128] [--threads N] [--sampling OVERRIDES] [--structured on|off]
        VARIANT=OVERRIDES ...

A variant is a name and comma-separated overrides of GenerationConfig fields (draft_len, drafter,
draft_window, confidence_stop, ngram_max, ...), SamplingConfig fields (temperature, top_k, top_p, method)
and decoding.policy.PolicyConfig fields (calibration, widen_every, ...), e.g.
`model_auto=draft_len=auto,drafter=model`, `no_widen=draft_len=auto,drafter=model,widen_every=0`,
`coupled=draft_len=3,drafter=model,method=coupled`. A variant "none" (target-only) is always run.
`--sampling temperature=0.7,top_p=0.95`: SamplingConfig fields every variant starts from ("none" too).

Every prompt runs under every variant back to back (order rotated per prompt), each variant with its
own PolicyState (costs, acceptance, probe schedules, calibration), as a deployment running only that
setting would have, and cleared caches (`--keep-prefix`: the prefix it shares with the previous prompt
kept, as in a job); a warm-up request per variant first. Prints per class
the median over (prompt, repeat) of each variant's tokens/s ratio to "none" of the same prompt and
repeat, by wall time and by priced time.

Wall time on this 2-core machine spreads +-10-20% per request with identical work, which hides the
few-percent differences an A/B looks for. So each request is also *priced*: every engine pass is
logged (model, tokens read) and charged what that pass costs in a table measured once (median of 15
at each width, widths interleaved, each pass right after the passes a drafting round puts before it;
a cache of 256 tokens for widths <= 16, an empty one above, linear in between). A priced ratio
depends only on the passes a variant chose. It leaves out the loop's own Python time (well under 1 ms
a round) and how attention grows with the context. With --frozen the variants also *plan* with that
table (a cost model that ignores what it sees), so their choices no longer follow the timing noise:
greedy runs are then deterministic, and a priced difference is the policy's alone, for this table.
"""
import argparse
import ast
import copy
import dataclasses
import json
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np

import specrt
from specrt.apps.bench import read_prompts
from specrt.config import GenerationConfig, SamplingConfig
from specrt.decoding.policy import PolicyConfig, CostModel, PolicyState
from specrt.decoding.proposers import History


class FrozenCosts(CostModel):
    """Costs that ignore what they see: a variant plans with the price table."""

    def observe_draft(self, seconds, passes):
        pass

    def observe_catchup(self, seconds, tokens):
        pass

    def observe_target(self, width, seconds):
        pass


class Meter:
    """Logs each pass of the pair's engines and prices it from a table of measured pass times."""

    WIDTHS = [1, 2, 3, 4, 5, 6, 7, 8, 9, 12, 16, 32, 64, 128, 256, 512]
    REPEATS = 15  # 5 in tables without a "pattern" entry

    def __init__(self, pair, table: Path | None = None):
        """`table`: a JSON file with the prices to use (written there when it does not exist yet)."""
        self.log = []
        self.table = json.loads(table.read_text()) if table and table.exists() else {}
        other = {"target": pair.draft, "draft": pair.target}
        for name in ("target", "draft"):
            engine = getattr(pair, name)
            if engine is not None:
                if name not in self.table:
                    # a verify follows two draft steps; a draft step follows a verify of k = 2
                    self.table[name] = self._measure(engine, other[name], [1, 1] if name == "target" else [3])
                    self.table["pattern"] = "drafting"
                # every pass goes through forward_ragged (forward calls it; a tree's verify calls it directly)
                engine.forward_ragged = self._wrap(engine.forward_ragged, name)
        if table and not table.exists():
            table.write_text(json.dumps(self.table))

    @classmethod
    def _measure(cls, engine, other, before: list[int]) -> list[float]:
        """Pass times of `engine` by width, each right after passes of `other` (None: alone) of the
        widths in `before`."""
        runs = {w: [] for w in cls.WIDTHS}
        for e in (engine, other) if other is not None else (engine,):
            e.truncate(0)
            e.forward(np.zeros((1, 256), np.int64), np.array([255]))  # the context of the steps
        for _ in range(cls.REPEATS):  # widths interleaved, so a drift of the machine's speed moves them all alike
            for w in cls.WIDTHS:
                engine.truncate(256 if w <= 16 else 0)
                if other is not None:
                    other.truncate(256)
                    for b in before:
                        other.forward(np.zeros((1, b), np.int64), np.arange(b))
                t0 = time.perf_counter()
                engine.forward(np.zeros((1, w), np.int64), np.array([w - 1]))
                runs[w].append(time.perf_counter() - t0)
        for e in (engine, other):
            if e is not None:
                e.truncate(0)
        return [statistics.median(runs[w]) for w in cls.WIDTHS]

    def _wrap(self, forward, name):
        depth = [0]

        def logged(tokens, *a, **kw):
            # a pass wider than the engine's prefill chunk calls forward_ragged again for each chunk: it is
            # one pass of its whole width (the table's wide prices were timed the same way), priced once
            if not depth[0]:
                self.log.append((name, tokens.shape[1]))
            depth[0] += 1
            try:
                return forward(tokens, *a, **kw)
            finally:
                depth[0] -= 1
        return logged

    def price(self, name: str, width: int) -> float:
        """Interpolated in the table; past its widest pass, linearly from its two widest."""
        t, w = self.table[name], self.WIDTHS
        if width > w[-1]:
            return t[-1] + (t[-1] - t[-2]) / (w[-1] - w[-2]) * (width - w[-1])
        return float(np.interp(width, w, t))

    def costs(self) -> CostModel:
        """A cost model fixed at the table's prices (draft catch-up: per token from widths 16..64)."""
        d = self.table.get("draft")
        frozen = FrozenCosts(draft_s=d[0] if d else None, target_s={w: self.price("target", w) for w in range(1, 17)},
                             draft_read_s=(self.price("draft", 64) - self.price("draft", 16)) / 48 if d else None)
        return frozen

    def take(self) -> float:
        """Priced seconds of the passes logged since the last call."""
        total = sum(self.price(n, w) for n, w in self.log)
        self.log.clear()
        return total


def priced_run(pair, meter: Meter, state: PolicyState, config: PolicyConfig, ids: list[int], cfg,
               shared: int = 0) -> dict:
    """One request in a variant's own state and settings, its caches holding only the first `shared` tokens
    of its prompt (0: its prompt read whole); its stats, with "priced_s" the priced seconds of its passes."""
    pair.state, pair.policy_config = state, config
    pair.draft_memory.keep(shared)
    pair.prompt_cache.keep(shared)
    meter.take()
    res = pair.run(ids, cfg)
    stats = dict(res.stats, priced_s=meter.take(), tokens=res.tokens)
    return stats


def structured_prompts(paths: list[Path], pair, constrained: bool):
    """Structured-output records ({"id", "class", "messages", and "json_schema" | "regex" | "grammar" |
    "response_format", or "tools" and "tool_choice"}): (prompts, {id: its Grammar, when `constrained`}), each
    prompt rendered with its tools as the server renders them."""
    from specrt.api import requests
    from specrt.apps.bench import Prompt
    from specrt.apps.serve.tools import tools_of

    plist, grammars = [], {}
    for path in paths:
        for line in path.read_text().splitlines():
            rec = json.loads(line)
            tools = tools_of(rec, pair.codec)
            ids = requests.prompt_ids(pair.codec, pair.manifest.vocab_size, messages=rec["messages"],
                                      tools=tools.render if tools else None)
            plist.append(Prompt(str(rec["id"]), ids, str(rec.get("class", "default"))))
            g = tools.grammar if tools else requests.parse(rec).get("grammar")
            if constrained and g is not None:
                pair.grammars.check(g)
                grammars[plist[-1].id] = g
    return plist, grammars


def parse_variant(text: str, sampling: dict | None = None) -> tuple[str, dict, PolicyConfig]:
    """"name=field=value,field=value" -> (name, GenerationConfig overrides, PolicyConfig). `sampling`: the
    SamplingConfig fields a variant's own override."""
    name, _, rest = text.partition("=")
    gen_fields = {f.name for f in dataclasses.fields(GenerationConfig)}
    auto_fields = {f.name for f in dataclasses.fields(PolicyConfig)}
    sampling_fields = {f.name for f in dataclasses.fields(SamplingConfig)}
    gen, auto, samp = {}, {}, dict(sampling or {})
    for item in filter(None, rest.split(",")):
        key, _, raw = item.partition("=")
        try:
            value = ast.literal_eval(raw)
        except (ValueError, SyntaxError):
            value = raw  # a bare word: "auto", "hybrid"
        if key in sampling_fields:
            samp[key] = value
        elif key in gen_fields:
            gen[key] = value
        elif key in auto_fields:
            auto[key] = value
        else:
            sys.exit(f"variant {name}: {key!r} is not a GenerationConfig, SamplingConfig or PolicyConfig field")
    if samp:
        gen["sampling"] = SamplingConfig(**samp)
    return name, gen, dataclasses.replace(PolicyConfig(), **auto)


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("pair_dir")
    ap.add_argument("variants", nargs="+", help="NAME=FIELD=VALUE,FIELD=VALUE")
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--frozen", action="store_true", help="plan with the price table too (deterministic greedy runs)")
    ap.add_argument("--keep-prefix", action="store_true",
                    help="each prompt keeps in the caches what it shares with the previous prompt, as in a job "
                         "(default: every prompt read whole)")
    ap.add_argument("--table", type=Path, help="prices: read from FILE, or measured and written there")
    ap.add_argument("--json", type=Path)
    ap.add_argument("--limit", type=int)
    ap.add_argument("--prompts", default="bench/prompts/prompts.jsonl", help="FILE[,FILE...]")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, help="onnxruntime threads (priced times do not depend on them)")
    ap.add_argument("--sampling", default="", help="SamplingConfig fields of every variant: temperature=0.7,top_p=0.95")
    ap.add_argument("--structured", choices=["on", "off"],
                    help="the prompts are structured-output records (bench/prompts/structured.jsonl): every request "
                         "constrained by its record's json_schema, regex, grammar or tools (on), or the same prompts "
                         "unconstrained (off)")
    a = ap.parse_args(argv)
    sampling = parse_variant("sampling=" + a.sampling)[1].get("sampling")
    base = dataclasses.asdict(sampling) if sampling else {}
    variants = {"none": parse_variant("none=draft_len=0", base)[1:]}
    for text in a.variants:
        name, gen, auto = parse_variant(text, base)
        variants[name] = (gen, auto)
    pair = specrt.load(a.pair_dir, threads=a.threads)
    if a.structured:
        plist, grammars = structured_prompts([Path(f) for f in a.prompts.split(",")], pair, a.structured == "on")
        plist = plist[:a.limit]
    else:
        plist, grammars = read_prompts([Path(f) for f in a.prompts.split(",")], pair, a.limit), {}
    meter = Meter(pair, a.table)
    print("priced pass times (ms) by width", {n: dict(zip(Meter.WIDTHS, (round(x * 1e3, 2) for x in t)))
                                               for n, t in meter.table.items() if n != "pattern"}, flush=True)
    # each variant learns from nothing but its own requests (the pair's tuned acceptance is not used),
    # and keeps its own history of outputs (the suffix proposer's), from the first prompt on
    state = {v: PolicyState(costs=meter.costs() if a.frozen else copy.deepcopy(pair.state.costs), history=History())
             for v in variants}
    res = {v: {} for v in variants}

    def run(v, p, n, shared=0):
        gen, auto = variants[v]
        cfg = pair.config(max_new_tokens=n, grammar=grammars.get(p.id), **gen)
        return priced_run(pair, meter, state[v], auto, p.ids, cfg, shared)

    for v in variants:
        run(v, plist[0], a.max_new_tokens // 2)
        state[v].history.clear()  # the warm-up's output must not draft the first prompt's
    names = list(variants)
    for r in range(a.repeats):
        for v in names:  # a repeat must not draft a prompt from its own earlier output
            state[v].history.clear()
        for i, p in enumerate(plist):
            shift = (r * len(plist) + i) % len(names)
            # --keep-prefix: what the caches would hold had this prompt followed the previous one in a job
            shared = len(os.path.commonprefix([plist[i - 1].ids, p.ids])) if a.keep_prefix and i else 0
            for v in names[shift:] + names[:shift]:
                s = run(v, p, a.max_new_tokens, shared)
                res[v].setdefault(p.id, []).append((s["new_tokens"], s["wall_s"], s["rounds_skipped"], s["draft_len_hist"],
                                                    s["priced_s"], s["rounds_by_drafter"], s["tokens"],
                                                    s["accepted"], s["proposed"]))
        print("repeat", r, flush=True)
    cls = {p.id: p.kind for p in plist}

    def ratios(v, ids, col=1):  # col 1: wall time, 4: priced time
        return [(x[0] / x[col]) / (res["none"][pid][r][0] / res["none"][pid][r][col])
                for pid in ids for r, x in enumerate(res[v][pid])]

    for col, what in ((1, "wall"), (4, "priced")):
        print(f"-- tokens/s vs none, {what} time")
        for c in sorted(set(cls.values())):
            ids = [pid for pid in cls if cls[pid] == c]
            print(c, {v: round(statistics.median(ratios(v, ids, col)), 3) for v in variants})
        print("all (median / mean)", {v: (round(statistics.median(ratios(v, cls, col)), 3),
                                          round(statistics.mean(ratios(v, cls, col)), 3)) for v in variants})
    rows = {v: [x for pid in cls for x in res[v][pid]] for v in variants}
    print("acceptance (accepted / proposed drafts)",
          {v: round(sum(x[7] for x in r) / max(sum(x[8] for x in r), 1), 3) for v, r in rows.items()})
    if a.json:
        a.json.write_text(json.dumps(res))
    return res


if __name__ == "__main__":
    main()
