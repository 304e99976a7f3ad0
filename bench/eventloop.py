"""Whether big prompts stall the server: latency of a small request and of /health, idle and while clients
send 1 MB chat prompts in a loop.

    python bench/eventloop.py PAIR_DIR [--clients 6] [--prompt-bytes 1000000] [--probes 40] [--interval 0.1]
        [-- SERVE_FLAGS...]

Starts `specrt serve PAIR_DIR --port 0`, then probes it `--probes` times (a 4-token greedy completion and
GET /health in turn, `--interval` s apart) with no other load, then again while `--clients` clients each
send chat requests of `--prompt-bytes` of text, one after the other. Such a prompt is longer than any
pair's context, so the server tokenizes it and refuses it (400, context_length_exceeded): what is measured
is what parsing, templating and tokenizing big prompts costs everyone else. Prints one table: median and
max seconds of each probe, idle and under load, and the big requests answered meanwhile.
"""
import argparse
import statistics
import threading
import time

import httpx

from serve import start_server  # bench/serve.py: `specrt serve --port 0`, its URL from the log


def probe(client: httpx.Client, n: int, interval: float) -> dict[str, list[float]]:
    """Seconds of each small request and /health, n of each, in turn."""
    out = {"small request": [], "/health": []}
    for _ in range(n):
        for name in out:
            t0 = time.perf_counter()
            if name == "/health":
                r = client.get("/health")
            else:
                r = client.post("/v1/completions", json={"prompt": "x = 1 +", "max_tokens": 4, "temperature": 0})
            out[name].append(time.perf_counter() - t0)
            r.raise_for_status()
            time.sleep(interval)
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("pair")
    ap.add_argument("--clients", type=int, default=6)
    ap.add_argument("--prompt-bytes", type=int, default=1_000_000)
    ap.add_argument("--probes", type=int, default=40, help="of each kind, idle and under load")
    ap.add_argument("--interval", type=float, default=0.1, help="seconds between probes")
    ap.add_argument("serve_flags", nargs="*")
    a = ap.parse_args()
    proc, base = start_server(a.pair, a.serve_flags)
    base = base.removesuffix("/v1")
    big = {"messages": [{"role": "user", "content": ("word " * (a.prompt_bytes // 5 + 1))[: a.prompt_bytes]}],
           "max_tokens": 4}
    stop, answered, lock = threading.Event(), {}, threading.Lock()

    def flood():
        with httpx.Client(base_url=base, timeout=600) as c:
            while not stop.is_set():
                status = c.post("/v1/chat/completions", json=big).status_code
                with lock:
                    answered[status] = answered.get(status, 0) + 1

    try:
        with httpx.Client(base_url=base, timeout=600) as c:
            probe(c, 2, 0)  # warm-up
            idle = probe(c, a.probes, a.interval)
            clients = [threading.Thread(target=flood, daemon=True) for _ in range(a.clients)]
            for t in clients:
                t.start()
            time.sleep(2)  # every client has a big prompt in flight
            loaded = probe(c, a.probes, a.interval)
            stop.set()
            for t in clients:
                t.join()
    finally:
        proc.terminate()
        proc.wait(60)
    load = f"{a.clients} clients x {a.prompt_bytes / 1e6:g} MB prompts"
    print(f"{'':16} {'idle':>19}   {load:>30}")
    print(f"{'probe (seconds)':16} {'median':>9} {'max':>9}   {'median':>19} {'max':>10}")
    for name in idle:
        print(f"{name:16} {statistics.median(idle[name]):9.3f} {max(idle[name]):9.3f}   "
              f"{statistics.median(loaded[name]):19.3f} {max(loaded[name]):10.3f}")
    print(f"big requests answered under load, by status: {dict(sorted(answered.items()))}; "
          f"{a.probes} probes of each kind, {a.interval:g} s apart")


if __name__ == "__main__":
    main()
