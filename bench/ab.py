"""The in-process A/B harness of the bench/ab_*.py scripts.

Every prompt of bench/prompts/prompts.jsonl runs under every variant back to back (order rotated
per prompt), each variant with its own learned acceptance, probe schedule and cost model (as a
deployment running only that setting would have) and a cleared draft cache; a warm-up request per
variant first. Prints per class the median over (prompt, repeat) of
each variant's tokens/s ratio to the "none" variant of the same prompt and repeat, and the median
and mean over all requests.

Wall time on this 2-core machine spreads +-10-20% per request with identical work, which hides the
few-percent differences the A/Bs look for. So each request is also *priced*: every engine pass is
logged (model, tokens read) and charged what that pass costs in a table measured once at the start
(median of 15 at each width, widths interleaved; a cache of 256 tokens for widths <= 16, an empty one above,
linear in between). Each pass is timed as a drafting round meets it: a target pass right after two draft
steps, a draft pass right after a target pass (tables before the tenth sitting timed each pass repeated
alone and have no "pattern" entry; the two ways agree within the machine's run-to-run spread, so the
3-10% that bench/live_costs.py saw drafting rounds' passes cost above the table is not the alternation). A priced ratio depends only on the passes a variant chose, not on the machine's
mood while it ran them; it leaves out the loop's own Python time (bench/loop_overhead.py: well
under 1 ms a round) and how attention grows with the context.
With --frozen the variants also *plan* with that table (a cost model that ignores what it sees), so
their choices no longer follow the timing noise either: greedy runs are then deterministic, and a
priced difference is the policy's alone, for this one table of costs.

A variant is (draft_len, drafter, setup[, config]): `setup()` puts that variant's code in place (the
scripts monkeypatch one piece of specrt) right before each of its requests; `config`: more
GenerationConfig fields (a dict).
"""
import copy
import json
import statistics
import subprocess
import sys
import time
import types
from pathlib import Path

import numpy as np

import specrt
from specrt.runtime.adaptive import Calibration, CostModel
from specrt.runtime.bench import read_prompts


def at_commit(commit: str, *names: str) -> dict:
    """specrt.runtime modules (by name: "adaptive", "decode", ...) as they were at `commit`, loaded
    under other names; a module imports the ones named before it from that commit too (decode, after
    adaptive, then plans with that commit's AutoDraftLen)."""
    mods = {}
    for name in names:
        src = subprocess.run(["git", "show", f"{commit}:specrt/runtime/{name}.py"], capture_output=True, text=True,
                             check=True, cwd=Path(__file__).parent).stdout
        for prev in mods:
            src = src.replace(f"from specrt.runtime.{prev} import", f"from {prev}_{commit} import")
        mod = sys.modules[f"{name}_{commit}"] = types.ModuleType(f"{name}_{commit}")
        exec(compile(src, f"{name}_{commit}.py", "exec"), mod.__dict__)
        mods[name] = mod
    return mods


def setting(obj, attr: str, value):
    """A variant's setup: put `value` in place as `obj.attr` before each of its requests."""
    def setup():
        setattr(obj, attr, value)
    return setup


class FrozenCosts(CostModel):
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
                engine.forward = self._wrap(engine.forward, name)
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
        def logged(tokens, logit_positions, *a, **kw):
            self.log.append((name, tokens.shape[1]))
            return forward(tokens, logit_positions, *a, **kw)
        return logged

    def price(self, name: str, width: int) -> float:
        return float(np.interp(width, self.WIDTHS, self.table[name]))

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


def priced_run(pair, meter: Meter, state: tuple, ids: list[int], cfg) -> dict:
    """One request in a variant's own carried state (acceptance, probes, costs, calibration) with a cleared
    draft cache; its stats, with "priced_s" the priced seconds of its passes."""
    pair.acceptance, pair.probes, pair.costs, pair.calibration = state
    pair.draft_memory.forget()
    meter.take()
    stats = pair.run(ids, cfg).stats
    stats["priced_s"] = meter.take()
    return stats


def main(variants: dict, usage: str, max_new_tokens: int = 128) -> dict:
    """Run the A/B from the command line: PAIR_DIR REPEATS [VARIANT,...] [--json=OUT] [--limit=N]
    [--prompts=FILE,FILE] (default bench/prompts/prompts.jsonl) [--frozen] [--table=FILE] (prices: read from
    FILE, or measured and written there; with --frozen a replay of one variant then repeats its runs exactly)."""
    args = [a for a in sys.argv[1:] if not a.startswith("--")]
    frozen = "--frozen" in sys.argv[1:]
    opts = dict(a[2:].split("=", 1) for a in sys.argv[1:] if a.startswith("--") and "=" in a)
    if len(args) < 2:
        sys.exit(usage)
    if len(args) > 2:
        variants = {v: variants[v] for v in ["none"] + args[2].split(",")}
    pair = specrt.load(args[0])
    files = opts.get("prompts", "bench/prompts/prompts.jsonl").split(",")
    plist = read_prompts([Path(f) for f in files], pair, int(opts["limit"]) if "limit" in opts else None)
    meter = Meter(pair, Path(opts["table"]) if "table" in opts else None)
    print("priced pass times (ms) by width", {n: dict(zip(Meter.WIDTHS, (round(x * 1e3, 2) for x in t)))
                                               for n, t in meter.table.items() if n != "pattern"},
          "measured", meter.table.get("pattern", "alone"), flush=True)
    state = {v: ({}, {}, meter.costs() if frozen else copy.deepcopy(pair.costs), Calibration()) for v in variants}
    res = {v: {} for v in variants}

    def run(v, p, n):
        k, drafter, setup, *kw = variants[v]
        setup()
        return priced_run(pair, meter, state[v], p.ids,
                          pair.config(max_new_tokens=n, draft_len=k, drafter=drafter, **(kw[0] if kw else {})))

    for v in variants:
        run(v, plist[0], max_new_tokens // 2)
    names = list(variants)
    for r in range(int(args[1])):
        for i, p in enumerate(plist):
            shift = (r * len(plist) + i) % len(names)
            for v in names[shift:] + names[:shift]:
                s = run(v, p, max_new_tokens)
                res[v].setdefault(p.id, []).append((s["new_tokens"], s["wall_s"], s["rounds_skipped"], s["draft_len_hist"],
                                                    s["priced_s"], s["rounds_by_drafter"]))
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
    print("-- priced, per prompt (mean over repeats)")
    for pid in cls:
        print(pid, {v: round(statistics.mean(ratios(v, [pid], 4)), 3) for v in variants})
    print("requests with >= 100 plain rounds", {v: sum(x[2] >= 100 for runs in res[v].values() for x in runs) for v in variants})
    if "json" in opts:
        Path(opts["json"]).write_text(json.dumps(res))
    return res
