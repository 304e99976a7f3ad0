"""GPU speed on the real pair's shapes: specrt (onnxruntime CUDA, fp16) vs transformers assisted generation.

Random weights with Qwen2.5-Coder-0.5B/1.5B-Instruct's exact shapes are made on the GPU machine
(real weights cannot travel there). Random models agree on nothing, so each speculative round emits
one token; what this measures is the *time of a round* at draft length k (k draft passes, one verify
pass of k+1 tokens, the loop), side by side with target-only decoding, in one run, medians over
repeats. The speedup at the real pair's acceptance is then

    tokens/s(k) = tokens per round on the real pair (measured on the CPU, fp32 pair, code prompts:
                  bench/results/specrt_fp32_code.json, greedy, so the same tokens as on any device)
                  / measured GPU round time(k)

and the same for transformers' assisted generation (fixed k, no confidence stop), so both engines are
credited with the same acceptance. Writes speed.json to --out.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
VOCAB = 151936
SHAPES = {  # config.json of Qwen2.5-Coder-0.5B-Instruct / -1.5B-Instruct
    "draft": dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                  num_key_value_heads=2),
    "target": dict(hidden_size=1536, intermediate_size=8960, num_hidden_layers=28, num_attention_heads=12,
                   num_key_value_heads=2),
}
# The real models tie their output matrix to the embeddings. Random tied models agree on nearly every
# token (the residual stream stays close to the input's embedding, so both predict a repeat of it);
# untied random output matrices make them disagree, so a round emits one token and its time is
# measured cleanly. A step reads the same bytes either way (tying saves storage, not per-step work).
UNTIED = dict(tie_word_embeddings=False)


ACCEPTANCE_SOURCES = {  # tokens per target pass of the real pair, measured on the CPU (greedy), per draft length
    "fp32 pair, code prompts": "bench/results/specrt_fp32_code.json",
    "int4 pair, all 9 prompts": "bench/results/specrt_int4_classes.json",
}


def cpu_tokens_per_round() -> dict[str, dict[int, float]]:
    out = {}
    for name, path in ACCEPTANCE_SOURCES.items():
        d = json.loads((ROOT / path).read_text())
        out[name] = {r["draft_len"]: r["tokens_per_target_pass"] for r in d["rows"]
                     if r["drafter"] == "model" and isinstance(r["draft_len"], int) and r["draft_len"] > 0}
    return out


def probe_cuda_graph(pair_dir: Path, role: str, n: int = 50) -> dict:
    """An experiment, not the product path: one-token steps of `role` with onnxruntime's CUDA graph capture,
    which needs fixed shapes and fixed device addresses. The whole cache is bound as the past every step
    (a mask marks the valid slots) and the new K/V go to a fixed staging buffer, so nothing moves between
    steps; the runtime would then copy the staging buffer into the cache (not timed here). Reports the
    median step (inputs updated in place, logits copied to the host) or why onnxruntime refused."""
    import onnxruntime as ort

    from specrt.config import read_manifest
    from specrt.engines.ort import session_options

    m = read_manifest(pair_dir)
    e = getattr(m, role)
    try:
        sess = ort.InferenceSession(str(pair_dir / e.path), session_options(),
                                    providers=[("CUDAExecutionProvider", {"device_id": 0, "enable_cuda_graph": "1"})])
        past_len = m.max_len - 1
        dt = np.dtype(e.dtype)
        cuda = lambda shape, t=np.int64: ort.OrtValue.ortvalue_from_shape_and_type(list(shape), t, "cuda", 0)  # noqa: E731
        ids, pos, mask, lp = cuda((1, 1)), cuda((1, 1)), cuda((1, past_len + 1)), cuda((1,))
        logits = cuda((1, 1, e.logits_width), np.float32)
        io = sess.io_binding()
        for name, ov in (("input_ids", ids), ("position_ids", pos), ("attention_mask", mask), ("logit_positions", lp)):
            io.bind_ortvalue_input(name, ov)
        keep = []
        for i in range(e.num_layers):
            for past, new in zip(e.kv_names(i)[:2], e.kv_names(i)[2:]):
                cache, stage = cuda((past_len, 1, e.num_kv_heads, e.head_dim), dt), cuda((1, 1, e.num_kv_heads, e.head_dim), dt)
                keep += [cache, stage]
                io.bind_ortvalue_input(past, cache)
                io.bind_ortvalue_output(new, stage)
        io.bind_ortvalue_output("logits", logits)
        host_mask = np.zeros((1, past_len + 1), np.int64)
        lp.update_inplace(np.zeros(1, np.int64))
        times = []
        for step in range(n + 3):
            t = time.perf_counter()
            ids.update_inplace(np.array([[step + 3]], np.int64))
            pos.update_inplace(np.array([[200 + step]], np.int64))
            host_mask[0, : 200 + step] = 1
            host_mask[0, -1] = 1
            mask.update_inplace(host_mask)
            sess.run_with_iobinding(io)
            logits.numpy()
            times.append(time.perf_counter() - t)
        return {"ok": True, "step_ms": 1e3 * statistics.median(times[3:]), "first_ms": 1e3 * times[0]}
    except Exception as ex:  # the point is to learn whether and why it fails
        return {"ok": False, "error": str(ex).splitlines()[0][:400] if str(ex) else type(ex).__name__}


def make_models(work: Path, shapes: dict, device: str) -> dict:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from specrt.export.tiny import _save_tokenizer, make_word_tokenizer

    tok = make_word_tokenizer([f"w{i}" for i in range(VOCAB - 3)])  # 3 specials + words = VOCAB ids
    models = {}
    for seed, (role, shape) in enumerate(shapes.items()):
        folder = work / f"hf-{role}"
        cfg = AutoConfig.for_model("qwen2", vocab_size=VOCAB, max_position_embeddings=32768, rope_theta=1e6,
                                   rms_norm_eps=1e-6, eos_token_id=2, bos_token_id=None, pad_token_id=0, **shape, **UNTIED)
        torch.manual_seed(seed)
        with torch.device(device):
            model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float16).eval()
        model.save_pretrained(folder)
        _save_tokenizer(tok, folder)
        models[role] = model
    return models


def median_ms(fn, n: int) -> float:
    times = []
    for _ in range(n):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return 1e3 * statistics.median(times)


def pass_costs(pair, prompt: np.ndarray, widths=(1, 2, 3, 4, 5), n: int = 30) -> dict:
    """Median ms of one engine call at each width after a past of len(prompt)."""
    out = {}
    for role, eng, ws in (("target", pair.target, widths), ("draft", pair.draft, (1, 2))):
        eng.truncate(0)
        eng.forward(prompt[None], np.array([len(prompt) - 1]))
        for w in ws:
            ids = prompt[None, :w]

            def call():
                eng.forward(ids, np.arange(w) if role == "target" else np.array([w - 1]))
                eng.truncate(len(prompt))
            call()
            out[f"{role}_{w}"] = median_ms(call, n)
    return out


def specrt_runs(pair, prompt: list[int], ks, new_tokens: int, repeats: int) -> dict:
    """Median decode-phase round time (ms) and tokens/s per setting, settings interleaved per repeat.
    "auto" shows the guard on this GPU: with a draft that is always wrong it should plan no drafting."""
    cfgs = {0: pair.config(max_new_tokens=new_tokens, draft_len=0)}
    cfgs |= {k: pair.config(max_new_tokens=new_tokens, draft_len=k, drafter="model", confidence_stop=0.0)
             for k in [*ks, "auto"]}
    rows = {k: [] for k in cfgs}
    for cfg in cfgs.values():
        pair.run(prompt, cfg)  # warm-up
    for _ in range(repeats):
        for k, cfg in cfgs.items():
            s = pair.run(prompt, cfg).stats
            decode_s = s["wall_s"] - s["ttft_s"]
            rows[k].append(dict(round_ms=1e3 * decode_s / max(s["rounds"], 1), tokens_per_s=s["tokens_per_s"],
                                tokens_per_round=s["new_tokens"] / max(s["target_passes"], 1), ttft_ms=1e3 * s["ttft_s"],
                                new_tokens=s["new_tokens"]))
    return {k: {f: statistics.median(r[f] for r in v) for f in v[0]} for k, v in rows.items()}


def hf_runs(models, prompt: list[int], ks, new_tokens: int, repeats: int, device: str) -> dict:
    """transformers generate (greedy, fp16, same GPU): target-only and assisted with a fixed k."""
    import torch

    target, draft = models["target"], models["draft"]
    ids = torch.tensor([prompt], device=device)
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    draft.generation_config.num_assistant_tokens_schedule = "constant"
    draft.generation_config.assistant_confidence_threshold = 0.0

    def run(k):
        kw = dict(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False, pad_token_id=0)
        if k:
            draft.generation_config.num_assistant_tokens = k
            kw["assistant_model"] = draft
        sync()
        t = time.perf_counter()
        out = target.generate(ids, **kw)
        sync()
        return out.shape[1] - ids.shape[1], time.perf_counter() - t

    settings = [0, *ks]
    for k in settings:
        run(k)
    rows = {k: [] for k in settings}
    with torch.no_grad():
        for _ in range(repeats):
            for k in settings:
                n, wall = run(k)
                rows[k].append(dict(tokens_per_s=n / wall, ms_per_token=1e3 * wall / n))
    return {k: {f: statistics.median(r[f] for r in v) for f in v[0]} for k, v in rows.items()}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--work", type=Path, default=Path("/tmp/specrt-gpu-speed"))
    ap.add_argument("--ks", default="2,3,4")
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--prompt-len", type=int, default=200)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--skip-hf", action="store_true")
    ap.add_argument("--hf-new-tokens", type=int, default=64, help="transformers' runs (slower rounds): fewer tokens")
    ap.add_argument("--device", default="cuda", help="cpu: a dry run of this script (with --small)")
    ap.add_argument("--small", action="store_true", help="2-layer models of 1/8 the width (a dry run)")
    a = ap.parse_args()
    import specrt
    from specrt.export.pair import ExportConfig, export_pair

    ks = [int(k) for k in a.ks.split(",")]
    a.work.mkdir(parents=True, exist_ok=True)
    a.out.mkdir(parents=True, exist_ok=True)
    shapes = SHAPES
    if a.small:
        shapes = {r: dict(s, hidden_size=s["hidden_size"] // 8, intermediate_size=s["intermediate_size"] // 8,
                          num_hidden_layers=2) for r, s in SHAPES.items()}
    result = {"shapes": shapes, "vocab": VOCAB, "ks": ks, "new_tokens": a.new_tokens, "prompt_len": a.prompt_len,
              "repeats": a.repeats}
    t0 = time.time()
    models = make_models(a.work, shapes, a.device)
    log = lambda s: print(s, file=sys.stderr, flush=True)  # noqa: E731
    log(f"random models made in {time.time() - t0:.0f}s")
    pair_dir = a.work / "pair-fp16"
    t0 = time.time()
    export_pair(ExportConfig(target=str(a.work / "hf-target"), draft=str(a.work / "hf-draft"), out=pair_dir,
                             precision="fp16", max_len=1024, max_draft_len=8, overwrite=True), log=log)
    result["export_s"] = time.time() - t0
    log(f"exported in {result['export_s']:.0f}s")
    prompt = np.random.default_rng(0).integers(3, VOCAB, size=a.prompt_len).astype(np.int64)
    with specrt.load(pair_dir, device=a.device) as pair:
        result["device"] = pair.device
        result["pass_ms"] = pass_costs(pair, prompt)
        log(f"pass costs (ms): {json.dumps({k: round(v, 3) for k, v in result['pass_ms'].items()})}")
        result["specrt"] = specrt_runs(pair, prompt.tolist(), ks, a.new_tokens, a.repeats)
    log(f"specrt: {json.dumps(result['specrt'])}")
    if not a.skip_hf:
        result["transformers"] = hf_runs(models, prompt.tolist(), ks, a.hf_new_tokens, max(2, a.repeats - 1), a.device)
        log(f"transformers: {json.dumps(result['transformers'])}")
    if a.device == "cuda":
        result["cuda_graph_probe"] = {r: probe_cuda_graph(pair_dir, r) for r in ("draft", "target")}
        log(f"cuda graph probe: {json.dumps(result['cuda_graph_probe'])}")
    result["cpu_tokens_per_round"] = sources = cpu_tokens_per_round()
    sp, base = result["specrt"], result["specrt"][0]["tokens_per_s"]
    lines = [f"target-only: specrt {base:.1f} tok/s" + (f", transformers {result['transformers'][0]['tokens_per_s']:.1f} tok/s"
                                                         if "transformers" in result else ""),
             f"auto with an always-wrong draft: {sp['auto']['tokens_per_s'] / base:.2f}x target-only"]
    proj = {}
    for source, tpr in sources.items():
        for k in ks:
            if k not in tpr:
                continue
            s_tok = tpr[k] / (sp[k]["round_ms"] / 1e3)
            row = {"tokens_per_round_cpu": tpr[k], "specrt_round_ms": sp[k]["round_ms"], "specrt_tokens_per_s": s_tok,
                   "specrt_speedup_vs_target_only": s_tok / base}
            text = f"{source}, k={k}: {tpr[k]:.2f} tokens/round -> specrt {s_tok:.1f} tok/s ({s_tok / base:.2f}x target-only)"
            if "transformers" in result:
                h_tok = tpr[k] / (result["transformers"][k]["ms_per_token"] / 1e3)  # one token per round measured
                row |= {"hf_round_ms": result["transformers"][k]["ms_per_token"], "hf_tokens_per_s": h_tok,
                        "specrt_over_hf": s_tok / h_tok}
                text += f"; transformers assisted {h_tok:.1f} tok/s (specrt {s_tok / h_tok:.2f}x)"
            proj[f"{source}, k={k}"] = row
            lines.append(text)
    result["projected"] = proj
    (a.out / "speed.json").write_text(json.dumps(result, indent=2))
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
