"""What serving costs and what concurrency buys, on one pair, through the openai client.

    python bench/serve.py PAIR_DIR [--prompts FILE] [--limit N] [--repeats R] [--max-new-tokens 128]
        [--clients 4] [--json OUT] [-- SERVE_FLAGS...]

1. Overhead: for each prompt and repeat, a streamed greedy chat request through `specrt serve` and the
   same request run in this process the way `specrt generate` runs it (`Pair.run`, pair loaded once),
   back to back in alternating order. tokens/s through the server = completion tokens over the time from
   sending the request to its last chunk; in process = new tokens over Pair.run's wall time. Prints the
   median of the per-request ratios.
2. Concurrency: the prompts `--rounds` times by one client in turn, then by `--clients` clients at once;
   aggregate tokens/s = all completion tokens over the wall time of the phase.

Both the server (`--no-history`) and the pair in process keep nothing of one request for another (no
history of outputs, no prompt prefix), so a repeat or a phase does the same work as the first (with a
history, a prompt asked again drafts its whole earlier answer).
"""
import argparse
import json
import re
import statistics
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import openai

import specrt


def start_server(pair_dir, flags):
    proc = subprocess.Popen([sys.executable, "-m", "specrt.cli", "serve", str(pair_dir), "--port", "0", *flags],
                            stderr=subprocess.PIPE, text=True)
    for line in proc.stderr:
        sys.stderr.write(line)
        if m := re.search(r" on (http://\S+/v1) ", line):
            threading.Thread(target=lambda: [sys.stderr.write(x) for x in proc.stderr], daemon=True).start()
            return proc, m.group(1)
    raise SystemExit(f"the server did not start (exit {proc.wait()})")


def streamed(client, model, messages, n):
    t0, parts, usage = time.perf_counter(), [], None
    for ch in client.chat.completions.create(model=model, messages=messages, max_tokens=n,
                                             temperature=0, stream=True, stream_options={"include_usage": True}):
        if ch.choices:
            parts.append(ch.choices[0].delta.content or "")
        if ch.usage:
            usage = ch.usage
    return "".join(parts), usage.completion_tokens, time.perf_counter() - t0


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("pair")
    ap.add_argument("--prompts", default="bench/prompts/prompts.jsonl")
    ap.add_argument("--limit", type=int, default=9)
    ap.add_argument("--repeats", type=int, default=2, help="of the overhead phase (0: skip it)")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--clients", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--json")
    ap.add_argument("serve_flags", nargs="*")
    a = ap.parse_args()
    recs = [json.loads(line) for line in Path(a.prompts).read_text().splitlines() if line.strip()][: a.limit]
    prompts = [r.get("messages") or [{"role": "user", "content": r["prompt"]}] for r in recs]  # all as chat
    proc, base = start_server(a.pair, ["--no-history", *a.serve_flags])
    model = Path(a.pair).resolve().name
    client = openai.OpenAI(base_url=base, api_key="none", max_retries=0, timeout=600)
    out = {"command": " ".join(sys.argv), "overhead": [], "concurrency": {}}
    try:
        streamed(client, model, prompts[0], 8)  # warm-up
        with specrt.load(a.pair, history=False, share_prefix=False) as pair:
            pair.run(pair.encode(pair.codec.apply_chat_template(prompts[0])), pair.config(max_new_tokens=8))
            for rep in range(a.repeats):
                for i, p in enumerate(prompts):
                    ids = pair.encode(pair.codec.apply_chat_template(p))
                    cfg = pair.config(max_new_tokens=a.max_new_tokens)
                    row = {"prompt": i, "repeat": rep}
                    for which in (("server", "local") if (i + rep) % 2 == 0 else ("local", "server")):
                        if which == "server":
                            text, n, wall = streamed(client, model, p, a.max_new_tokens)
                            row["server_tok_s"], row["server_text"] = n / wall, text
                        else:
                            res = pair.run(ids, cfg)
                            row["local_tok_s"], row["local_text"] = res.stats["tokens_per_s"], res.text
                    row["ratio"] = row["server_tok_s"] / row["local_tok_s"]
                    row["same_text"] = row.pop("server_text") == row.pop("local_text")
                    out["overhead"].append(row)
                    print(f"prompt {i} repeat {rep}: server {row['server_tok_s']:.1f} tok/s, local {row['local_tok_s']:.1f}, "
                          f"ratio {row['ratio']:.3f}, same text {row['same_text']}", flush=True)
        ratios = [r["ratio"] for r in out["overhead"]]
        out["overhead_median_ratio"] = statistics.median(ratios) if ratios else None
        for clients in (1, a.clients):
            t0 = time.perf_counter()
            with ThreadPoolExecutor(clients) as ex:
                got = list(ex.map(lambda p: streamed(client, model, p, a.max_new_tokens), prompts * a.rounds))
            wall = time.perf_counter() - t0
            tokens = sum(n for _, n, _ in got)
            out["concurrency"][clients] = {"tokens": tokens, "wall_s": wall, "tokens_per_s": tokens / wall}
            print(f"{clients} client(s): {tokens} tokens in {wall:.1f} s = {tokens / wall:.1f} tok/s", flush=True)
        c = out["concurrency"]
        out["concurrency_gain"] = c[a.clients]["tokens_per_s"] / c[1]["tokens_per_s"]
        if ratios:
            print(f"overhead: median server/local tokens/s {out['overhead_median_ratio']:.3f} over {len(ratios)} requests")
        print(f"{a.clients} clients / 1 client aggregate tokens/s {out['concurrency_gain']:.2f}x")
    finally:
        proc.terminate()
        proc.wait(60)
    if a.json:
        Path(a.json).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
