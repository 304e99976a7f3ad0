"""Python overhead of the round: many short generations on the tiny pair (its passes take microseconds)."""
import sys, time
import specrt
with specrt.load(sys.argv[1]) as pair:
    prompts = [[40 + i, 41, 42, 43, 44, 45] * 3 for i in range(12)]
    for p in prompts[:2]:
        pair.generate(p, max_new_tokens=8)
    t0 = time.perf_counter()
    n = 0
    for rep in range(3):
        for p in prompts:
            for kw in (dict(draft_len="auto", drafter="hybrid"), dict(draft_len=3, drafter="model"), dict(draft_len=0)):
                res = pair.generate(p, max_new_tokens=48, **kw); n += len(res.tokens); rounds = globals().get("rounds", 0) + res.stats["rounds"]; globals()["rounds"] = rounds
    print(f"{n / (time.perf_counter() - t0):.1f} tok/s rounds {rounds} tokens {n}", file=sys.stderr)
