"""What keeping the prompt prefix across requests buys a job, and that it changes no output.

    python bench/policy/prefix.py PAIR_DIR [--prompts FILE] [--limit N] [--max-new-tokens 128]
        [--settings 0:model,auto:suffix] [--json OUT]

The prompts run in order, as a job runs them, under each setting (draft length:drafter) once per mode,
back to back in rotating order: "kept" with the target's cache holding what the previous prompt left in
it (decoding/prefix.py: what they share, in whole chunks unless the engine's rows are exact), "read" with
it emptied first, and on an exact engine "chunks": only the whole chunks they share kept (the rule for
onnxruntime's kernels), to price what keeping all of it adds. Each (setting, mode) drafts from its own
history of outputs, as a job running only it would. Prints, per setting: job tokens/s in each mode, kept
against read, the median time to first token, prompt tokens kept, and how many greedy outputs differ
between kept and read (a fixed length, or exact rows: must be 0; auto's draft lengths follow measured
timings, and with onnxruntime's int4 kernel a verify pass of another width can round a near-tie the
other way, so there a few may).
"""
import argparse
import json
import os
import statistics
import sys

import specrt
from specrt.apps.bench import read_prompts
from specrt.config import GenerationConfig
from specrt.decoding.proposers import History


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("pair")
    ap.add_argument("--prompts", default="bench/prompts/repetitive.jsonl")
    ap.add_argument("--limit", type=int)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--settings", default="0:model,auto:suffix")
    ap.add_argument("--json")
    a = ap.parse_args()
    pair = specrt.load(a.pair)
    prompts = read_prompts(a.prompts, pair, a.limit)
    settings = []
    for item in a.settings.split(","):
        k, _, drafter = item.partition(":")
        settings.append((k if k == "auto" else int(k), drafter or "model"))
    cfgs = {s: GenerationConfig(max_new_tokens=a.max_new_tokens, draft_len=s[0], drafter=s[1]) for s in settings}
    modes = ("kept", "chunks", "read") if pair.target.row_exact else ("kept", "read")
    C = pair.target.prefill_chunk
    hist = {(s, m): History(pair.state.history.cap) for s in settings for m in modes}
    runs = {(s, m): [] for s in settings for m in modes}
    for cfg in cfgs.values():
        pair.run(prompts[0].ids, cfg)  # warm-up
    for i, p in enumerate(prompts):
        shared = len(os.path.commonprefix([prompts[i - 1].ids, p.ids])) if i else 0
        for j, (s, cfg) in enumerate(cfgs.items()):
            turn = (i + j) % len(modes)
            for m in modes[turn:] + modes[:turn]:
                pair.draft_memory.keep(shared)
                pair.prompt_cache.keep({"kept": shared, "chunks": shared // C * C, "read": 0}[m])
                pair.state.history = hist[s, m]
                res = pair.run(p.ids, cfg)
                runs[s, m].append((res.tokens, res.stats))
        print(f"\r{i + 1}/{len(prompts)}", end="", file=sys.stderr, flush=True)
    print(file=sys.stderr)
    out = []
    for s in settings:
        row = {"draft_len": s[0], "drafter": s[1]}
        for m in modes:
            st = [r[1] for r in runs[s, m]]
            row[m] = {"tokens_per_s": sum(x["new_tokens"] for x in st) / sum(x["wall_s"] for x in st),
                      "ttft_s": statistics.median(x["ttft_s"] for x in st),
                      "wall_s": sum(x["wall_s"] for x in st),
                      "prompt_cached": sum(x["prompt_cached"] for x in st),
                      "prompt_tokens": sum(x["prompt_tokens"] for x in st)}
        row["speedup"] = row["kept"]["tokens_per_s"] / row["read"]["tokens_per_s"]
        if "chunks" in row:
            row["speedup_over_chunks"] = row["kept"]["tokens_per_s"] / row["chunks"]["tokens_per_s"]
        row["outputs_differing"] = sum(x[0] != y[0] for x, y in zip(runs[s, "kept"], runs[s, "read"]))
        out.append(row)
        print(f"draft_len {s[0]} {s[1]:>6}: kept {row['kept']['tokens_per_s']:.2f} tok/s (ttft {row['kept']['ttft_s']:.3f} s, "
              f"{row['kept']['prompt_cached']}/{row['kept']['prompt_tokens']} prompt tokens kept) vs read "
              f"{row['read']['tokens_per_s']:.2f} (ttft {row['read']['ttft_s']:.3f} s): {row['speedup']:.3f}x; "
              f"outputs differing: {row['outputs_differing']}/{len(prompts)}")
        if "chunks" in row:
            ch = row["chunks"]
            print(f"    whole chunks only: {ch['tokens_per_s']:.2f} tok/s (ttft {ch['ttft_s']:.3f} s, {ch['prompt_cached']} "
                  f"prompt tokens kept): kept all {row['speedup_over_chunks']:.3f}x")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"prompts": a.prompts, "max_new_tokens": a.max_new_tokens, "rows": out}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
