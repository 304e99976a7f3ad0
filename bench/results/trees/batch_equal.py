"""Batch rows with trees against target-only alone on the real pair: greedy and coupled, the 33 check prompts."""
import json, sys
import specrt
from specrt.api.pair import generate_batch

pair_dir, prompts_file = sys.argv[1], sys.argv[2]
recs = [json.loads(l) for l in open(prompts_file)]
with specrt.load(pair_dir) as pair:
    texts = [pair.encode(r["prompt"], r.get("chat", True)) for r in recs]
    for label, kw in (("greedy", {}), ("coupled", dict(temperature=0.8, top_p=0.95))):
        seeds = list(range(len(texts))) if kw else None
        rows = generate_batch(pair, texts, batch_size=3, max_new_tokens=64, draft_len="auto", tree="auto",
                              **kw, **({"seed": seeds} if seeds else {}))
        same = trees = branch = 0
        for i, (t, row) in enumerate(zip(texts, rows)):
            alone = pair.generate(t, max_new_tokens=64, draft_len=0, **kw, **({"seed": i} if seeds else {}))
            same += row.tokens == alone.tokens
            trees += row.stats["tree_rounds"]
            branch += sum(row.stats["accepted_by_branch"].values())
        print(f"{label}: batch 3 rows with trees == target-only alone: {same} of {len(texts)}; "
              f"rounds that verified trees {trees}, tokens from branches {branch}", flush=True)
