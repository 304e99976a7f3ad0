import json, sys
a = json.load(open(sys.argv[1])); b = json.load(open(sys.argv[2]))
diff = same = 0
for v in a:
    for pid in a[v]:
        for ra, rb in zip(a[v][pid], b[v][pid]):
            ka = (ra[0], ra[2], ra[3], round(ra[4], 9), ra[5]); kb = (rb[0], rb[2], rb[3], round(rb[4], 9), rb[5])
            if ka == kb: same += 1
            else:
                diff += 1; print("DIFF", v, pid, ka, kb)
print(f"{same} identical requests (tokens, skipped rounds, draft lengths, priced seconds, rounds by drafter), {diff} different")
