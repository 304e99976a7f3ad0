"""Render bench/results/*.json (from bench/compare.sh) as markdown tables for bench/RESULTS.md."""
import json
import sys
from pathlib import Path


def specrt_table(name, res):
    lines = [f"**{name}** ({res['prompts']} prompts x {res['repeats']} repeats, {res['max_new_tokens']} new tokens, "
             f"temperature {res['temperature']}, peak RSS {res['peak_rss_mb']:.0f} MB)", "",
             "| drafter | draft_len | tok/s | vs target-only | acceptance | tokens/target pass | TTFT ms | ITL ms | per-position acceptance | by class (speedup) |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in res["rows"]:
        pos = " ".join(f"{a:.2f}" for a in r["accepted_per_position"])
        cls = ", ".join(f"{c} {v:.2f}x" for c, v in (r.get("speedup_by_class") or {}).items())
        lines.append(f"| {r['drafter']} | {r['draft_len']} | {r['tokens_per_s']:.2f} | {r['speedup']:.2f}x | "
                     f"{r['acceptance_rate']:.0%} | {r['tokens_per_target_pass']:.2f} | {r['ttft_ms']:.0f} | "
                     f"{r['itl_ms']:.1f} | {pos} | {cls} |")
    return "\n".join(lines)


def batch_table(name, res):
    lines = [f"**{name}** ({res['prompts']} requests x {res['repeats']} repeats, {res['max_new_tokens']} new tokens, "
             f"temperature {res['temperature']}, drafter {res['drafter']}, peak RSS {res['peak_rss_mb']:.0f} MB)", "",
             "| draft_len | batch | aggregate tok/s | vs batch 1 target-only | speculation gain at this batch | "
             "acceptance | tokens/target pass | occupancy | mean latency s |", "|---|---|---|---|---|---|---|---|---|"]
    for r in res["rows"]:
        gain = "" if r["speculation_gain"] is None else f"{r['speculation_gain']:.2f}x"
        lines.append(f"| {r['draft_len']} | {r['batch_size']} | {r['tokens_per_s']:.1f} | {r['speedup']:.2f}x | {gain} | "
                     f"{r['acceptance_rate']:.0%} | {r['tokens_per_target_pass']:.2f} | {r['occupancy']:.0%} | "
                     f"{r['mean_latency_s']:.2f} |")
    return "\n".join(lines)


def peer_table(name, res):
    rows = res["rows"]
    base = rows[0]["tokens_per_s"]
    lines = [f"**{name}** ({res.get('prompts')} prompts x {res.get('repeats')} repeats, {res.get('max_new_tokens')} new tokens)",
             "", "| setting | tok/s | vs its first setting | acceptance | same tokens as its target-only |", "|---|---|---|---|---|"]
    for r in rows:
        acc = r.get("acceptance_rate")
        lines.append(f"| {r['setting']} | {r['tokens_per_s']:.2f} | {r['tokens_per_s'] / base:.2f}x | "
                     f"{'' if acc is None else f'{acc:.0%}'} | {r.get('same_tokens_as_baseline', '')} |")
    return "\n".join(lines)


def main(folder):
    folder = Path(folder)
    out = []
    if (folder / "when.txt").exists():
        out.append(f"Measured {(folder / 'when.txt').read_text().strip()}.\n")
    for f in sorted(folder.glob("specrt_*.json")):
        res = json.loads(f.read_text())
        out += [(batch_table if res.get("mode") == "batch" else specrt_table)(f.stem, res), ""]
    for f in sorted(folder.glob("peer_*.json")):
        out += [peer_table(f.stem, json.loads(f.read_text())), ""]
    print("\n".join(out))


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "bench/results")
