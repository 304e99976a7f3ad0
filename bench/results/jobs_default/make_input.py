"""input96.jsonl: bench/prompts/batch.jsonl three times (ids -0/-1/-2; the second and third with a suffix)."""
import json
import sys

recs = [json.loads(line) for line in open(sys.argv[1])]
with open(sys.argv[2], "w") as f:
    for rep in range(3):
        for r in recs:
            suffix = "" if rep == 0 else f" (variant {rep})"
            f.write(json.dumps({"id": f"{r['id']}-{rep}", "prompt": r["prompt"] + suffix}) + "\n")
