"""GPU speed of the lean graph on two real shapes: ms per pass, c, and the speculative tokens/s they give.

Random fp16 weights with the exact shapes of Qwen2.5-Coder-0.5B-Instruct (draft), -1.5B-Instruct and
-7B-Instruct (targets) are made here and exported with `specrt export --precision fp16` (real weights
cannot travel to the GPU machine). Per model and pass width 1..5 (after a 512-token prompt) it times the
engine call the decode loop makes, logits copy to the host included, with CUDA graphs (captured once per
shape, then replayed) and without, medians over `--calls`. The draft is timed with its full output
vocabulary (the demo pair keeps 49152 rows: its real steps are cheaper). Then, per shape pair:

    c                  = draft ms (width 1) / target ms (width 1)
    model drafter      tokens/s(k) = T_model(k) / (k * draft_ms(1) + a_k * (draft_ms(2) - draft_ms(1)) + target_ms(k+1))
    n-gram drafter     tokens/s(k) = T_ngram(k) / target_ms(k+1)
    target only        tokens/s    = 1 / target_ms(1)

with T(k) the tokens per target pass and a_k the last position's acceptance that the real int4 pair
reached on the CPU (bench/results/cpu_tokens_per_round.json: greedy, so the same tokens on any device;
a round whose k drafts were all accepted makes the draft read two tokens next round, hence a_k).
A 7B target of 28 layers and 15 GB would take minutes to export on the GPU machine; `--target-layers`
times it at two depths and extrapolates linearly to 28 (a captured pass is a sum of per-layer kernels).
Making and exporting a model is most of the time (on the H200 machine: the 0.5B ~100 s, the 1.5B ~175 s).
The models are made in a temporary folder; every model's times go to OUT/timings.json as soon as they are
measured (a run stopped by its time limit keeps them), then OUT/summary.json {"device", "date", "shapes":
{"0.5b-1.5b": {...}, "0.5b-7b": {...}}}.

    python bench/gpu/speed.py --out OUT                       # on the GPU machine (bench/gpu/check.sh)
    python bench/gpu/speed.py --out OUT --device cpu --tiny   # a smoke run of this script on any machine
"""
from __future__ import annotations

import argparse
import atexit
import datetime
import json
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
TOKENS_PER_ROUND = ROOT / "bench/results/cpu_tokens_per_round.json"
MODELS = {  # config.json of Qwen2.5-Coder-0.5B/1.5B/7B-Instruct
    "0.5b": dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                 num_key_value_heads=2, vocab_size=151936),
    "1.5b": dict(hidden_size=1536, intermediate_size=8960, num_hidden_layers=28, num_attention_heads=12,
                 num_key_value_heads=2, vocab_size=151936),
    "7b": dict(hidden_size=3584, intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28,
               num_key_value_heads=4, vocab_size=152064),
}
TINY = {  # --tiny: the same script on shapes any CPU runs in seconds
    "0.5b": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=512),
    "1.5b": dict(hidden_size=128, intermediate_size=256, num_hidden_layers=4, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=512),
    "7b": dict(hidden_size=128, intermediate_size=384, num_hidden_layers=6, num_attention_heads=8,
               num_key_value_heads=2, vocab_size=520),
}
PAIRS = {"0.5b-7b": ("0.5b", "7b"), "0.5b-1.5b": ("0.5b", "1.5b")}  # the 7B first: the one a GPU wants
WIDTHS = (1, 2, 3, 4, 5)


def make_model(folder: Path, shape: dict, layers: int, vocab: int, seed: int) -> Path:
    """A random-weight fp16 Qwen2 checkpoint of `shape` with `layers` layers and a `vocab`-word tokenizer."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from specrt.export.tiny import _save_tokenizer, make_word_tokenizer

    cfg = AutoConfig.for_model("qwen2", **{**shape, "num_hidden_layers": layers}, max_position_embeddings=32768,
                               rope_theta=1e6, rms_norm_eps=1e-6, eos_token_id=2, bos_token_id=None, pad_token_id=0,
                               tie_word_embeddings=False)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float16).eval()
    model.save_pretrained(folder)
    _save_tokenizer(make_word_tokenizer([f"w{i}" for i in range(vocab - 3)]), folder)  # 3 specials + words
    return folder


def export(work: Path, name: str, target: Path, draft: Path | None, max_len: int) -> Path:
    from specrt.export.pair import ExportConfig, export_pair

    out = work / name
    export_pair(ExportConfig(target=str(target), draft=None if draft is None else str(draft), out=out,
                             precision="fp16", max_len=max_len, max_draft_len=8, overwrite=True), log=lambda s: None)
    return out


def pass_ms(pair_dir: Path, as_draft: bool, device: str, cuda_graph: bool, prompt: int, calls: int) -> dict:
    """Median ms of one engine call per width after a `prompt`-token past: logits for every fed position
    (a verify pass), or `as_draft` for the last one only (a draft step, a catch-up)."""
    from specrt.manifest import read_manifest
    from specrt.engines.ort import ort_engine

    m = read_manifest(pair_dir)
    eng = ort_engine(pair_dir, m.target, m.max_len, max(WIDTHS), device=device, cuda_graph=cuda_graph)
    ids = np.random.default_rng(0).integers(3, m.vocab_size, size=prompt + max(WIDTHS))[None]
    eng.forward(ids[:, :prompt], np.array([prompt - 1]))
    out = {}
    for w in WIDTHS:
        pos = np.array([w - 1]) if as_draft else np.arange(w)
        times = []
        for i in range(calls + 3):  # the first calls capture the graph of this shape
            t = time.perf_counter()
            eng.forward(ids[:, prompt:prompt + w], pos)
            times.append(time.perf_counter() - t)
            eng.truncate(prompt)
        out[w] = 1e3 * statistics.median(times[3:])
    note, captured = eng.note, sorted(eng._graphs.ids) if getattr(eng, "_graphs", None) else []
    eng.close()
    return {"ms": out, "note": note, "captured_shapes": [list(k) for k in captured]}


def extrapolate(a: dict, b: dict, la: int, lb: int, layers: int) -> dict:
    """Per width: the time at `layers` layers from times at la and lb layers (linear in the layer count)."""
    return {w: a[w] + (layers - la) * (b[w] - a[w]) / (lb - la) for w in a}


def projection(draft_ms: dict, target_ms: dict, rounds: dict) -> dict:
    """Projected tokens/s per drafter and k from pass times and CPU-measured tokens per round."""
    target_tps = 1e3 / target_ms[1]
    out = {"target_only_tok_s": target_tps, "model": {}, "ngram": {}}
    for k_s, r in rounds.get("model", {}).items():
        k = int(k_s)
        if k + 1 in target_ms:
            cost = k * draft_ms[1] + r["last_acceptance"] * (draft_ms[2] - draft_ms[1]) + target_ms[k + 1]
            out["model"][k] = 1e3 * r["tokens_per_round"] / cost
    for k_s, r in rounds.get("ngram", {}).items():
        k = int(k_s)
        if k + 1 in target_ms:
            out["ngram"][k] = 1e3 * r["tokens_per_round"] / target_ms[k + 1]
    best = max(((tps, d, k) for d in ("model", "ngram") for k, tps in out[d].items()), default=(target_tps, "none", 0))
    out["best"] = {"drafter": best[1], "draft_len": best[2], "tok_s": best[0], "over_target": best[0] / target_tps}
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--tiny", action="store_true", help="tiny shapes: a smoke run of the script itself")
    ap.add_argument("--shapes", default=",".join(PAIRS), help="comma-separated: " + ", ".join(PAIRS))
    ap.add_argument("--target-layers", default="7b:1,3", help="MODEL:A,B times MODEL at A and B layers and "
                                                               "extrapolates to its real depth")
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--calls", type=int, default=30)
    ap.add_argument("--max-len", type=int, default=2048)
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    shapes = TINY if args.tiny else MODELS
    prompt = min(args.prompt, 64) if args.tiny else args.prompt
    cut = {}
    for spec in filter(None, args.target_layers.split(";")):
        name, depths = spec.split(":")
        cut[name] = tuple(int(x) for x in depths.split(","))
    rounds = json.loads(TOKENS_PER_ROUND.read_text())["drafters"] if TOKENS_PER_ROUND.is_file() else {}
    work = Path(tempfile.mkdtemp(prefix="specrt-speed-"))
    atexit.register(shutil.rmtree, work, True)  # gigabytes of models
    vocab = min(s["vocab_size"] for s in shapes.values())  # one tokenizer: the narrowest output matrix
    timings: dict[str, dict] = {}
    t0 = time.time()
    for pair_name in args.shapes.split(","):
        d_name, t_name = PAIRS[pair_name]
        if d_name not in timings:
            d_src = make_model(work / f"hf-{d_name}", shapes[d_name], shapes[d_name]["num_hidden_layers"], vocab, 1)
            pd = export(work, f"pair-{d_name}", d_src, None, args.max_len)
            timings[d_name] = {g: pass_ms(pd, True, args.device, g, prompt, args.calls) for g in (True, False)}
            _report(args.out, d_name, timings[d_name], t0)
        if t_name not in timings:
            full = shapes[t_name]["num_hidden_layers"]
            depths = cut.get(t_name, (full,))
            per = []
            for L in depths:
                src = make_model(work / f"hf-{t_name}-{L}", shapes[t_name], L, vocab, 2)
                pt = export(work, f"pair-{t_name}-{L}", src, None, args.max_len)
                per.append({g: pass_ms(pt, False, args.device, g, prompt, args.calls) for g in (True, False)})
                _report(args.out, f"{t_name}-{L}", per[-1], t0)
            if len(depths) == 2:
                timings[t_name] = {g: {"ms": extrapolate(per[0][g]["ms"], per[1][g]["ms"], *depths, full),
                                       "note": per[0][g]["note"], "measured_layers": list(depths),
                                       "captured_shapes": per[0][g]["captured_shapes"]} for g in (True, False)}
            else:
                timings[t_name] = per[0]
    summary = {"device": _device_name(args.device), "date": datetime.datetime.now(datetime.timezone.utc).isoformat(),
               "onnxruntime": __import__("onnxruntime").__version__, "tiny": args.tiny, "prompt_tokens": prompt,
               "tokens_per_round_source": str(TOKENS_PER_ROUND.relative_to(ROOT)) if rounds else None, "shapes": {}}
    for pair_name in args.shapes.split(","):
        d_name, t_name = PAIRS[pair_name]
        d, t = timings[d_name], timings[t_name]
        draft_ms, target_ms = d[True]["ms"], t[True]["ms"]
        proj = projection(draft_ms, target_ms, rounds)
        summary["shapes"][pair_name] = {
            "target_ms": target_ms, "draft_ms": draft_ms, "c": draft_ms[1] / target_ms[1],
            "uncaptured": {"target_ms": t[False]["ms"], "draft_ms": d[False]["ms"]},
            "cuda_graph_notes": [n for n in (t[True]["note"], d[True]["note"]) if n],
            "target_measured_layers": t[True].get("measured_layers"),
            "target_tok_s": proj["target_only_tok_s"], "speculative_over_target": proj["best"]["over_target"],
            "best": proj["best"], "projected_tok_s": {"model": proj["model"], "ngram": proj["ngram"]},
        }
    (args.out / "summary.json").write_text(json.dumps(summary, indent=2))
    for name, s in summary["shapes"].items():
        print(f"{name}: target {s['target_ms'][1]:.2f} ms/token (uncaptured {s['uncaptured']['target_ms'][1]:.2f}), "
              f"draft {s['draft_ms'][1]:.2f} ms, c = {s['c']:.2f}, best {s['best']['drafter']} k={s['best']['draft_len']}: "
              f"{s['speculative_over_target']:.2f}x target-only ({s['target_tok_s']:.0f} tok/s)")
    return 0


def _report(out: Path, name: str, times: dict, t0: float) -> None:
    """Print a model's pass times, captured and not, and add them to OUT/timings.json at once."""
    path = out / "timings.json"
    done = json.loads(path.read_text()) if path.is_file() else {}
    done[name] = {"captured": times[True], "uncaptured": times[False]}
    path.write_text(json.dumps(done, indent=1))
    fmt = lambda ms: " ".join(f"{w}:{v:.3f}" for w, v in ms.items())  # noqa: E731
    print(f"{name}: ms per pass by width, captured {fmt(times[True]['ms'])} | uncaptured {fmt(times[False]['ms'])}"
          f" ({time.time() - t0:.0f} s)", flush=True)


def _device_name(device: str) -> str:
    if device == "cpu":
        import platform

        return f"cpu ({platform.processor() or platform.machine()})"
    import subprocess

    r = subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total", "--format=csv,noheader"], capture_output=True,
                       text=True)
    return r.stdout.strip().splitlines()[0] if r.returncode == 0 and r.stdout.strip() else "cuda"


if __name__ == "__main__":
    sys.exit(main())
