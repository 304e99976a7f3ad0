"""How much of the wall time is the Python/numpy loop rather than onnxruntime?

    python bench/loop_overhead.py PAIR_DIR [--draft-len 3] [--drafter model] [--max-new-tokens 128] [--repeats 3]

Times every `session.run_with_iobinding` call (the graphs) during greedy generations of the bench
prompts and reports the rest of the wall time (binding, sampling, bookkeeping, text) as a share.
"""
import argparse
import statistics
import time
from pathlib import Path

import specrt
from specrt.runtime.bench import read_prompts


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("pair")
    ap.add_argument("--prompts", default=str(Path(__file__).parent / "prompts" / "prompts.jsonl"))
    ap.add_argument("--limit", type=int, default=3)
    ap.add_argument("--draft-len", default="3")
    ap.add_argument("--drafter", default="model")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    a = ap.parse_args()
    k = a.draft_len if a.draft_len == "auto" else int(a.draft_len)
    with specrt.load(a.pair) as pair:
        in_graph = [0.0]
        for eng in (pair.target, pair.draft):
            run = eng.session.run_with_iobinding

            def timed(io, *args, _run=run):
                t = time.perf_counter()
                _run(io, *args)
                in_graph[0] += time.perf_counter() - t

            eng.session.run_with_iobinding = timed
        prompts = read_prompts(Path(a.prompts), pair, a.limit)
        pair.generate(prompts[0].ids, max_new_tokens=8, draft_len=k, drafter=a.drafter)  # warm-up
        shares, per_round = [], []
        for _ in range(a.repeats):
            in_graph[0] = 0.0
            wall, rounds = 0.0, 0
            for p in prompts:
                t = time.perf_counter()
                rounds += pair.generate(p.ids, max_new_tokens=a.max_new_tokens, draft_len=k, drafter=a.drafter).stats["rounds"]
                wall += time.perf_counter() - t
            shares.append(1 - in_graph[0] / wall)
            per_round.append((wall - in_graph[0]) / rounds * 1e3)
        print(f"draft_len {k}, drafter {a.drafter}: Python/numpy outside the graphs = {statistics.median(shares):.1%} of "
              f"wall time, {statistics.median(per_round):.2f} ms a round (median of {a.repeats}; per repeat "
              f"{', '.join(f'{s:.1%}' for s in shares)})")


if __name__ == "__main__":
    main()
