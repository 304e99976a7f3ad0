import json, statistics
b = json.load(open('/tmp/ab/before.json')); a = json.load(open('/tmp/ab/after.json'))
same_tok = same_hist = total = 0
wall = {}
for v in b:
    for pid in b[v]:
        for rb, ra in zip(b[v][pid], a[v][pid]):
            total += 1
            same_tok += rb[6] == ra[6]
            same_hist += rb[3] == ra[3]
            wall.setdefault(v, []).append(ra[1] / rb[1])
print(f"requests {total}: identical tokens {same_tok}, identical draft-length histograms {same_hist}")
for v, r in wall.items():
    print(f"{v}: wall after/before per request, median {statistics.median(r):.3f}, quartiles "
          f"{statistics.quantiles(r, n=4)[0]:.3f}..{statistics.quantiles(r, n=4)[2]:.3f}")
tb = sum(x[1] for v in b for p in b[v] for x in b[v][p]); ta = sum(x[1] for v in a for p in a[v] for x in a[v][p])
pb = sum(x[4] for v in b for p in b[v] for x in b[v][p]); pa = sum(x[4] for v in a for p in a[v] for x in a[v][p])
print(f"total wall before {tb:.1f} s, after {ta:.1f} s ({ta/tb:.3f}); priced before {pb:.2f} s, after {pa:.2f} s")
