"""Peer benchmark: llama.cpp through llama-cpp-python, the target GGUF as shipped (q4_k_m), greedy.

Settings: `target` (plain decoding) and `pld-nN` for each N in --pld (prompt-lookup decoding,
`draft_model=LlamaPromptLookupDecoding(num_pred_tokens=N)`, max_ngram_size --ngram).
Sampling: temperature 0, top_k 1 (greedy), repeat penalty off. The KV cache is reset before
every request (llama-cpp-python would otherwise reuse the cached prompt of the previous run).
Chat template: the GGUF's own (tokenizer.chat_template), rendered by llama-cpp-python's
Jinja2ChatFormatter (transformers-compatible Jinja settings), tokenized with special tokens.
Acceptance (pld): proposed = tokens returned by the draft model, accepted = leading generated
tokens of each round equal to that round's proposal.

    python bench/peers/llamacpp_peer.py --repeats 3 --pld 2,10 --json /tmp/peers/llamacpp.json
"""
from __future__ import annotations

import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common as C  # noqa: E402


def main():
    p = C.base_parser(__doc__.splitlines()[0])
    p.add_argument("--pld", default="2,10", help="num_pred_tokens values for prompt-lookup decoding ('' = none)")
    p.add_argument("--ngram", type=int, default=2, help="max_ngram_size of prompt lookup")
    p.add_argument("--n-ctx", type=int, default=2048)
    p.add_argument("--model", default=C.TARGET, help="known model name or a .gguf path")
    args = p.parse_args()
    try:
        plds = [int(x) for x in args.pld.split(",") if x.strip()]
    except ValueError:
        C.die(f"--pld must be comma separated integers, got {args.pld!r}")
    llama_cpp = C.require("llama_cpp", "CMAKE_BUILD_PARALLEL_LEVEL=2 pip install llama-cpp-python (source build, ~4 min)")
    from llama_cpp.llama_chat_format import Jinja2ChatFormatter
    from llama_cpp.llama_speculative import LlamaPromptLookupDecoding
    prompts = C.read_prompts(args.prompts, args.limit)

    if args.model.endswith(".gguf"):
        path = Path(args.model)
    else:
        from specrt.export.fetch import fetch_model
        path = Path(fetch_model(args.model, progress=False))

    def load(with_draft: bool):
        t = time.perf_counter()
        llm = llama_cpp.Llama(model_path=str(path), n_ctx=args.n_ctx, n_threads=args.threads,
                              n_threads_batch=args.threads, verbose=False, seed=0,
                              draft_model=LlamaPromptLookupDecoding(max_ngram_size=args.ngram) if with_draft else None)
        print(f"loaded {path.name} (draft model: {with_draft}) in {time.perf_counter() - t:.1f} s",
              file=sys.stderr, flush=True)
        return llm

    plain = load(False)
    spec = load(True) if plds else None

    template = plain.metadata.get("tokenizer.chat_template")
    if not template:
        C.die(f"{path.name} has no tokenizer.chat_template")
    eos_id, bos_id = plain.token_eos(), plain.token_bos()
    text_of = plain._model.token_get_text
    fmt = Jinja2ChatFormatter(template, eos_token=text_of(eos_id) if eos_id != -1 else "",
                              bos_token=text_of(bos_id) if bos_id != -1 else "", add_generation_prompt=True)
    vocab = plain._model.vocab

    def is_eog(t: int) -> bool:
        return bool(llama_cpp.llama_vocab_is_eog(vocab, t))

    prompt_ids = [plain.tokenize(fmt(messages=[{"role": "user", "content": pr["prompt"]}]).prompt.encode("utf-8"),
                                 add_bos=False, special=True) for pr in prompts]

    class CountingPLD(LlamaPromptLookupDecoding):
        def __init__(self, n):
            super().__init__(max_ngram_size=args.ngram, num_pred_tokens=n)
            self.reset()

        def reset(self):
            self.proposed = self.accepted = self.rounds = 0
            self.draft, self.pos, self.matching = [], 0, False

        def __call__(self, input_ids, /, **kw):
            d = super().__call__(input_ids, **kw)
            self.proposed += len(d)
            self.rounds += 1
            self.draft, self.pos, self.matching = [int(x) for x in d], 0, True
            return d

        def see(self, t: int):  # a generated token, in order
            if self.matching and self.pos < len(self.draft) and t == self.draft[self.pos]:
                self.accepted += 1
                self.pos += 1
            else:
                self.matching = False

    def make(llm, n):
        pld = CountingPLD(n) if n else None

        def run(i):
            ids = prompt_ids[i]
            if pld is not None:
                llm.draft_model = pld
                pld.reset()
            new, reason = [], "length"
            t = time.perf_counter()
            llm.reset()  # no prompt-cache reuse between requests
            for tok in llm.generate(ids, top_k=1, top_p=1.0, min_p=0.0, temp=0.0, repeat_penalty=1.0, reset=True):
                if pld is not None:
                    pld.see(tok)
                if is_eog(tok):
                    reason = "eos"
                    break
                new.append(int(tok))
                if len(new) >= args.max_new_tokens:
                    break
            wall = time.perf_counter() - t
            res = {"tokens": new, "wall_s": wall, "finish": reason}
            if pld is not None:
                # a round = one target eval after the prefill; + 1 for the prefill itself
                res.update(proposed=pld.proposed, accepted=pld.accepted, target_passes=pld.rounds + 1)
            return res
        return run

    settings = {"target": make(plain, 0)}
    for n in plds:
        settings[f"pld-n{n}"] = make(spec, n)
    result = C.run_protocol(settings, prompts, args.repeats)
    C.finish(args, {"peer": "llama.cpp", "llama_cpp_python": llama_cpp.__version__, "model": path.name,
                    "n_ctx": args.n_ctx, "max_ngram_size": args.ngram, "prompt_tokens": [len(x) for x in prompt_ids],
                    "notes": "GGUF q4_k_m as shipped; greedy temp 0 top_k 1; tokens exclude EOS; pld acceptance = "
                             "leading matches per round / proposed tokens"}, result, prompts)


if __name__ == "__main__":
    main()
