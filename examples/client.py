"""A client of `specrt serve`: the official openai package, nothing specrt-specific but the extra fields.

    specrt serve PAIR_DIR &                      # http://127.0.0.1:8000/v1
    python examples/client.py [--base-url http://127.0.0.1:8000/v1] [--prompt TEXT] [--max-tokens 128]

Streams one chat answer, then prints what the server says about the speculative rounds (the `specrt`
object of the last chunk). The API key comes from SPECRT_API_KEY when the server was started with one.
"""
from __future__ import annotations

import argparse
import os
import sys

import openai


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--base-url", default="http://127.0.0.1:8000/v1")
    ap.add_argument("--prompt", default="Write a Python function that checks whether a string is a palindrome.")
    ap.add_argument("--max-tokens", type=int, default=128)
    a = ap.parse_args()
    client = openai.OpenAI(base_url=a.base_url, api_key=os.environ.get("SPECRT_API_KEY", "none"), max_retries=0)
    try:
        model = client.models.list().data[0].id  # a specrt server serves one pair
        stats = {}
        for chunk in client.chat.completions.create(
                model=model, messages=[{"role": "user", "content": a.prompt}], max_tokens=a.max_tokens,
                temperature=0.2, stream=True,
                extra_body={"draft_len": "auto"}):  # specrt's own fields ride in extra_body
            if chunk.choices:
                sys.stdout.write(chunk.choices[0].delta.content or "")
                sys.stdout.flush()
            stats = (chunk.model_extra or {}).get("specrt") or stats
    except openai.APIConnectionError:
        print(f"error: no server at {a.base_url} (start one with `specrt serve PAIR_DIR`)", file=sys.stderr)
        return 1
    except openai.APIStatusError as e:  # the server's OpenAI-shaped error object
        print(f"error: HTTP {e.status_code}: {e.message}", file=sys.stderr)
        return 1
    print(f"\n[{stats.get('new_tokens')} tokens, {stats.get('tokens_per_s', 0):.1f} tok/s in the server, "
          f"acceptance {stats.get('acceptance_rate', 0):.0%}, {stats.get('tokens_per_target_pass', 0):.2f} tokens/target pass]",
          file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
