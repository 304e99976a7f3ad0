"""The grammar checker: a child process that compiles a request's grammar and starts its matcher, so that
what would crash or exhaust a process does it here (api/grammars.py runs it and reads its answers).

llguidance recurses over chains of named rules and `$ref`s without a bound, and a deep enough chain
overflows the stack of the thread that compiles it (SIGSEGV); some grammars panic only when their matcher is
built; some take seconds or hundreds of MB. A grammar passes here only if, on a thread with a stack 16 times
smaller than the one the server builds matchers on, with `CHECK_MB` of memory over the checker's own, it
compiles, its matcher starts and computes its first mask, and some text matches it. The parent bounds the
time; this process bounds its memory (RLIMIT_AS), and dies of what it cannot survive.

It runs as a script (`python grammar_check.py`), importing only llguidance. Protocol, one JSON line each way: the parent sends {"kind", "source"}; the child answers {"text": the
compiled grammar, "mb": memory the matcher took} or {"error": one line}. The child starts with the path of
the pair's tokenizer.json, its vocabulary size, its EOS ids and its memory bound in MB, and says {"ready": true} once it is loaded.
"""
from __future__ import annotations

import json
import os
import resource
import sys
import threading

CHECK_STACK_MB = 4  # llguidance's recursion: ~250 KB-deep chains of rules per MB (1,000 rules, 500 $refs here)
CHECK_MB = 512  # memory a grammar's check may take over the checker's own (a regex's lexer can take 300)
# JSON on one line with the separators models write (", " and ": "): every key, quote and separator of a
# schema's output is then forced, and drafts for free (llguidance's default allows any whitespace there).
JSON_STYLE = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


def first_line(e: BaseException) -> str:  # this file runs on its own: it imports nothing of specrt's
    s = str(e).strip()
    return s.splitlines()[0] if s else type(e).__name__


class Refused(Exception):
    """What is wrong with a grammar, in one line."""


def compiled(kind: str, source: str) -> str:
    """The grammar in llguidance's form; Refused when it cannot be read."""
    import llguidance

    try:
        if kind == "json_schema":
            schema = source.strip()
            if schema == "false":
                raise Refused("the JSON schema false allows no value")
            if schema == "true":  # any JSON value, as the schema {} says
                schema = "{}"
            return llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=JSON_STYLE)
        if kind == "regex":
            return llguidance.LLMatcher.grammar_from_regex(source)
        return llguidance.grammar_from("grammar", source)
    except (ValueError, TypeError, RuntimeError) as e:  # the library's errors for what it cannot read
        raise Refused(first_line(e)[:300]) from None


def one_line(err: str) -> str:
    """llguidance's error (a message, then the source with a caret, then the cause) on one line."""
    lines = [x.strip() for x in err.splitlines() if x.strip()]
    cause = next((x for x in lines[1:] if x.lower().startswith("error:")), "")
    return (lines[0].rstrip(":") + (f" ({cause})" if cause else ""))[:300] if lines else "rejected"


def _rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize() / 2**20


def check(tok, kind: str, source: str, mb: int = CHECK_MB) -> dict:
    """{"text", "mb"} of a grammar that starts, or {"error"}."""
    import llguidance

    try:
        text = compiled(kind, source)
        err = llguidance.LLMatcher.validate_grammar(text, tok)
        if err:
            raise Refused(one_line(err))
        before = _rss_mb()
        m = llguidance.LLMatcher(tok, text, log_level=0)
        first = m.compute_bitmask() if not m.is_error() else b""
        if m.is_error():
            why = first_line(m.get_error())
            raise Refused("no text matches it" if why == "NoExtensionBias" else why[:300])  # no token can begin
        eos = set(tok.eos_tokens)
        if not m.is_accepting() and not any(b >> i & 1 and 8 * j + i not in eos
                                            for j, b in enumerate(first) for i in range(8) if b):
            raise Refused("no text matches it")
        return {"text": text, "mb": max(0.0, _rss_mb() - before)}
    except Refused as e:
        return {"error": str(e)}
    except MemoryError:
        return {"error": f"checking it needs more than {mb} MB"}


def main() -> None:
    import llguidance

    path, vocab, eos, mb = sys.argv[1], int(sys.argv[2]), [int(x) for x in sys.argv[3].split(",") if x], int(sys.argv[4])
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))  # a crash here is an answer, not a core dump to write
    os.nice(10)  # below the decoding it shares the cores with
    with open(path, encoding="utf-8") as f:
        tok = llguidance.LLTokenizer(f.read(), n_vocab=vocab, eos_token=eos)
    out, box = sys.stdout, {}

    def work(kind, source):
        box["answer"] = check(tok, kind, source, mb)

    threading.stack_size(CHECK_STACK_MB << 20)
    # what a check may allocate: the address space now (tokenizer, libraries) and mb more
    with open("/proc/self/statm") as f:
        now = int(f.read().split()[0]) * resource.getpagesize()
    limit = now + (mb + 2 * CHECK_STACK_MB) * 2**20
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    out.write('{"ready": true}\n')
    out.flush()
    for line in sys.stdin:
        q = json.loads(line)
        t = threading.Thread(target=work, args=(q["kind"], q["source"]))  # the small stack set above
        t.start()
        t.join()
        out.write(json.dumps(box.pop("answer", {"error": "the checker failed"})) + "\n")
        out.flush()


if __name__ == "__main__":
    main()
