"""What an edge app (a Jetson kiosk, a robot's voice box, an offline assistant) copies from specrt.

    python examples/edge_app.py PAIR_DIR [--prompt TEXT] [--timeout 10] [--max-new-tokens 128]

- load the pair once, at start-up (seconds; checks the files and that the pair fits in memory);
- stream each answer to the display as it is produced;
- cancel on a button press or a timeout (checked once per decoding round, a few ms);
- close the pair on exit, whatever happens;
- tell specrt's own errors (bad pair folder, request too long for the cache...) apart from bugs.

Without --prompt it reads one prompt per line from stdin. Ctrl-C plays the cancel button: it stops
the answer being generated, not the app (Ctrl-D ends it).
"""
from __future__ import annotations

import argparse
import signal
import sys
import threading
import time

import specrt


class Display:
    """Stand-in for the real output: an LCD, a TTS engine, a websocket..."""

    def show(self, text: str) -> None:
        sys.stdout.write(text)
        sys.stdout.flush()

    def status(self, line: str) -> None:
        print(f"\n[{line}]", file=sys.stderr, flush=True)


def answer(pair: specrt.Pair, prompt: str, display: Display, button: threading.Event, timeout_s: float,
           max_new_tokens: int) -> specrt.Result:
    """Stream one answer; stop early on the button or after timeout_s seconds."""
    deadline = time.monotonic() + timeout_s
    button.clear()
    with pair.stream(prompt, max_new_tokens=max_new_tokens, chat=pair.codec.chat_template is not None,
                     cancel=lambda: button.is_set() or time.monotonic() > deadline) as stream:
        for chunk in stream:
            display.show(chunk)
    return stream.result


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("pair_dir")
    ap.add_argument("--prompt", help="answer this one prompt and exit (default: read prompts from stdin)")
    ap.add_argument("--timeout", type=float, default=10.0, help="seconds per answer before it is cut off")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    args = ap.parse_args(argv)

    button = threading.Event()  # a GPIO/touch callback would call button.set(), from any thread
    signal.signal(signal.SIGINT, lambda *_: button.set())
    display = Display()
    try:
        pair = specrt.load(args.pair_dir)  # once: sessions, KV caches, tokenizer
    except specrt.SpecrtError as e:  # missing/corrupt pair, not enough memory...: one line, no traceback
        print(f"cannot start: {e}", file=sys.stderr)
        return 2
    try:
        prompts = [args.prompt] if args.prompt is not None else (line.rstrip("\n") for line in sys.stdin)
        for prompt in prompts:
            if not prompt.strip():
                continue
            try:
                res = answer(pair, prompt, display, button, args.timeout, args.max_new_tokens)
            except specrt.ConfigError as e:  # this request is bad (too long...): say so, keep serving
                display.status(f"rejected: {e}")
                continue
            display.status(f"{res.finish_reason}: {len(res.tokens)} tokens, {res.stats['tokens_per_s']:.1f} tok/s")
    finally:
        pair.close()  # also stops a generation still running in another thread
    return 0


if __name__ == "__main__":
    sys.exit(main())
