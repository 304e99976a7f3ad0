"""Peer benchmark: Hugging Face transformers `generate`, torch CPU fp32, greedy.

Settings (--settings, comma separated, first one is the baseline of the 'vs first' column):
  target        target model alone
  assisted      assisted generation (`assistant_model=draft`) with transformers' defaults
                (up to 20 draft tokens per round, draft stops early below confidence 0.4)
  assisted-kN   assisted generation with exactly N draft tokens per round ("constant" schedule,
                confidence threshold off): the same policy as specrt --draft-len N

Weights: the cached GGUFs (q4_k_m) loaded and dequantized to fp32 by transformers.
Acceptance: counted exactly by wrapping transformers' AssistedCandidateGenerator
(proposed = candidate tokens per round, accepted = matches per round).

    python bench/peers/transformers_peer.py --repeats 3 --json /tmp/peers/transformers.json
"""
from __future__ import annotations

import re
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common as C  # noqa: E402


def main():
    p = C.base_parser(__doc__.splitlines()[0])
    p.add_argument("--settings", default="target,assisted,assisted-k4")
    p.add_argument("--target", default=C.TARGET)
    p.add_argument("--draft", default=C.DRAFT)
    args = p.parse_args()
    names = [s.strip() for s in args.settings.split(",") if s.strip()]
    for s in names:
        if s not in ("target", "assisted") and not re.fullmatch(r"assisted-k[1-9]\d*", s):
            C.die(f"unknown setting {s!r} (target, assisted, assisted-kN)")
    prompts = C.read_prompts(args.prompts, args.limit)

    torch = C.require("torch", "pip install torch")
    transformers = C.require("transformers", "pip install 'transformers>=4.45' gguf")
    C.require("gguf", "pip install gguf")
    from transformers.generation import candidate_generator as cg

    from specrt.export.fetch import fetch_model

    torch.set_num_threads(args.threads)
    need_draft = any(s != "target" for s in names)

    def load(name):
        path = Path(fetch_model(name, progress=False))
        t = time.perf_counter()
        model = transformers.AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                                                  dtype=torch.float32)
        model.eval()
        print(f"loaded {path.name} in {time.perf_counter() - t:.1f} s", file=sys.stderr, flush=True)
        return path, model

    tpath, target = load(args.target)
    tok = transformers.AutoTokenizer.from_pretrained(str(tpath.parent), gguf_file=tpath.name)
    draft = load(args.draft)[1] if need_draft else None
    if tok.chat_template is None:
        C.die(f"the tokenizer of {tpath.name} has no chat template")

    eos = target.generation_config.eos_token_id
    eos_ids = set(eos if isinstance(eos, list) else [eos]) | {tok.eos_token_id}
    eos_ids.discard(None)
    pad = tok.pad_token_id if tok.pad_token_id is not None else min(eos_ids)
    prompt_ids = []
    for pr in prompts:
        text = tok.apply_chat_template([{"role": "user", "content": pr["prompt"]}], add_generation_prompt=True,
                                       tokenize=False)
        prompt_ids.append(torch.tensor([tok(text, add_special_tokens=False).input_ids]))

    # Exact acceptance counts: wrap the assisted candidate generator (one instance per generate call).
    counts = {"proposed": 0, "accepted": 0, "rounds": 0}
    orig_get, orig_update = cg.AssistedCandidateGenerator.get_candidates, cg.AssistedCandidateGenerator.update_candidate_strategy

    def get_candidates(self, input_ids, *a, **kw):
        ids, logits = orig_get(self, input_ids, *a, **kw)
        counts["proposed"] += ids.shape[1] - input_ids.shape[1]
        return ids, logits

    def update_candidate_strategy(self, input_ids, scores, num_matches):
        counts["accepted"] += int(num_matches)
        counts["rounds"] += 1
        return orig_update(self, input_ids, scores, num_matches)

    cg.AssistedCandidateGenerator.get_candidates = get_candidates
    cg.AssistedCandidateGenerator.update_candidate_strategy = update_candidate_strategy

    if draft is not None:
        base_gc = draft.generation_config
    gen_kw = dict(max_new_tokens=args.max_new_tokens, do_sample=False, temperature=None, top_p=None, top_k=None,
                  pad_token_id=pad)

    def make(setting):
        def run(i):
            ids = prompt_ids[i]
            kw = dict(gen_kw)
            if setting != "target":
                gc = draft.generation_config = base_gc.__class__.from_dict(base_gc.to_dict())
                if setting.startswith("assisted-k"):
                    gc.num_assistant_tokens = int(setting[len("assisted-k"):])
                    gc.num_assistant_tokens_schedule = "constant"
                    gc.assistant_confidence_threshold = 0.0
                kw["assistant_model"] = draft
            counts.update(proposed=0, accepted=0, rounds=0)
            t = time.perf_counter()
            with torch.inference_mode():
                out = target.generate(ids, attention_mask=torch.ones_like(ids), **kw)
            wall = time.perf_counter() - t
            new, reason = C.cut_at_eos(out[0, ids.shape[1]:].tolist(), eos_ids)
            res = {"tokens": new, "wall_s": wall, "finish": reason}
            if setting != "target":
                res.update(proposed=counts["proposed"], accepted=counts["accepted"], target_passes=counts["rounds"])
            return res
        return run

    result = C.run_protocol({s: make(s) for s in names}, prompts, args.repeats)
    C.finish(args, {"peer": "transformers", "transformers": transformers.__version__, "torch": torch.__version__,
                    "target": tpath.name, "draft": args.draft if need_draft else None, "dtype": "float32",
                    "prompt_tokens": [int(x.shape[1]) for x in prompt_ids],
                    "notes": "GGUF q4_k_m weights dequantized to fp32; tokens exclude EOS; acceptance = "
                             "matches / candidate tokens over all rounds"}, result, prompts)


if __name__ == "__main__":
    main()
