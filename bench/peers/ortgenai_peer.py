"""Peer benchmark: onnxruntime-genai (og.Generator), int4 CPU models from its own builder, greedy.

Settings: `target` (target model alone) and `spec-kK` for each K in --k (its draft-model speculative
decoding, `model.type: "speculative"`, max_draft_tokens K).

Preparation (cached under --workdir, default ~/.cache/specrt/peers; reruns skip what exists):
  1. each GGUF is loaded with transformers (dequantized to fp32) and written with save_pretrained
     (+ tokenizer) to WORKDIR/hf/NAME         (one child process per model, so memory is returned)
  2. `python -m onnxruntime_genai.models.builder -i WORKDIR/hf/NAME -o WORKDIR/ortgenai/NAME-int4
     -p int4 -e cpu -c WORKDIR/builder-cache --extra_options hf_token=false`  (1.5B: ~17 GB RSS peak)
  3. run folders (hard links, no copies): WORKDIR/ortgenai/run-target (target, session options set)
     and WORKDIR/ortgenai/run-spec (target + draft/ subfolder, genai_config with model.type
     "speculative", model.draft = the draft's decoder block, speculative.max_draft_tokens).
Session options: intra_op_num_threads=--threads, inter_op 1; worker threads spin within a run and stop
after it (allow_spinning + force_spinning_stop, as specrt's sessions do), or never with --no-spinning.

    python bench/peers/ortgenai_peer.py --prepare-only          # heavy: run alone
    python bench/peers/ortgenai_peer.py --repeats 3 --k 3,4 --json /tmp/peers/ortgenai.json
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common as C  # noqa: E402

DEFAULT_WORKDIR = Path.home() / ".cache" / "specrt" / "peers"


def save_hf(name: str, out: Path):
    """Child process: GGUF -> transformers fp32 -> save_pretrained folder."""
    import torch
    import transformers

    from specrt.export.fetch import fetch_model
    path = Path(fetch_model(name, progress=False))
    t = time.perf_counter()
    model = transformers.AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                                              dtype=torch.float32)
    tok = transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    # The weights are already dequantized to fp32; drop the GGUF quantizer so save_pretrained accepts the model
    # (transformers refuses to serialize a model still marked as gguf-quantized).
    model.hf_quantizer = None
    for obj in (model.config, getattr(model, "generation_config", None)):
        if obj is not None and hasattr(obj, "quantization_config"):
            delattr(obj, "quantization_config")
    tmp = out.with_name(out.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp)
    tok.save_pretrained(tmp)
    tmp.rename(out)
    print(f"saved {name} -> {out} in {time.perf_counter() - t:.1f} s", file=sys.stderr, flush=True)


def prepare_model(name: str, workdir: Path, precision: str, accuracy_level: int | None, timeout: int,
                  block_size: int | None = None) -> Path:
    hf = workdir / "hf" / name
    if not (hf / "config.json").exists():
        hf.parent.mkdir(parents=True, exist_ok=True)
        r = subprocess.run([sys.executable, __file__, "--_save-hf", name, str(hf)], timeout=timeout)
        if r.returncode or not (hf / "config.json").exists():
            C.die(f"saving {name} as a Hugging Face folder failed (exit {r.returncode})")
    tag = precision + (f"-acc{accuracy_level}" if accuracy_level is not None else "") + (f"-b{block_size}" if block_size else "")
    out = workdir / "ortgenai" / f"{name}-{tag}"
    if not (out / ".complete").exists():
        shutil.rmtree(out, ignore_errors=True)
        extra = ["hf_token=false"] + ([f"accuracy_level={accuracy_level}"] if accuracy_level is not None else [])
        extra += [f"block_size={block_size}"] if block_size else []
        cmd = [sys.executable, "-m", "onnxruntime_genai.models.builder", "-i", str(hf), "-o", str(out),
               "-p", precision, "-e", "cpu", "-c", str(workdir / "builder-cache"), "--extra_options", *extra]
        print("+ " + " ".join(cmd), file=sys.stderr, flush=True)
        t = time.perf_counter()
        r = subprocess.run(cmd, timeout=timeout)
        if r.returncode or not (out / "genai_config.json").exists():
            C.die(f"onnxruntime-genai builder failed for {name} (exit {r.returncode})")
        (out / ".complete").write_text(f"{time.perf_counter() - t:.1f} s\n")
        print(f"built {out} in {time.perf_counter() - t:.1f} s", file=sys.stderr, flush=True)
    return out


def link_tree(src: Path, dst: Path):
    dst.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        if f.is_file() and f.name not in ("genai_config.json", ".complete"):
            d = dst / f.name
            if d.exists():
                d.unlink()
            try:
                os.link(f, d)
            except OSError:
                shutil.copy2(f, d)


def session_options(threads: int, spinning: bool = True) -> dict:
    spin = {"session.intra_op.allow_spinning": "1", "session.force_spinning_stop": "1"} if spinning else \
        {"session.intra_op.allow_spinning": "0"}
    return {"intra_op_num_threads": threads, "inter_op_num_threads": 1, "session.inter_op.allow_spinning": "0", **spin}


def make_run_dirs(target: Path, draft: Path, workdir: Path, threads: int, max_k: int, tag: str,
                  spinning: bool = True) -> tuple[Path, Path]:
    tcfg = json.loads((target / "genai_config.json").read_text())
    dcfg = json.loads((draft / "genai_config.json").read_text())
    run_t = workdir / "ortgenai" / f"run-target-{tag}"
    link_tree(target, run_t)
    cfg = json.loads(json.dumps(tcfg))
    cfg["model"]["decoder"].setdefault("session_options", {}).update(session_options(threads, spinning))
    (run_t / "genai_config.json").write_text(json.dumps(cfg, indent=2))

    run_s = workdir / "ortgenai" / f"run-spec-{tag}"
    link_tree(target, run_s)
    link_tree(draft, run_s / "draft")
    cfg = json.loads(json.dumps(tcfg))
    cfg["model"]["decoder"].setdefault("session_options", {}).update(session_options(threads, spinning))
    dec = json.loads(json.dumps(dcfg["model"]["decoder"]))
    dec["filename"] = "draft/" + dec["filename"]
    dec.setdefault("session_options", {}).update(session_options(threads, spinning))
    cfg["model"]["type"] = "speculative"
    cfg["model"]["draft"] = dec
    cfg["speculative"] = {"max_draft_tokens": max_k}
    (run_s / "genai_config.json").write_text(json.dumps(cfg, indent=2))
    return run_t, run_s


def main():
    if len(sys.argv) == 4 and sys.argv[1] == "--_save-hf":
        return save_hf(sys.argv[2], Path(sys.argv[3]))
    p = C.base_parser(__doc__.splitlines()[0])
    p.add_argument("--k", default="3,4", help="draft lengths (max_draft_tokens) to measure, comma separated")
    p.add_argument("--no-target", action="store_true", help="skip the target-only setting")
    p.add_argument("--workdir", type=Path, default=DEFAULT_WORKDIR)
    p.add_argument("--precision", default="int4", choices=["int4", "int8", "fp32"])
    p.add_argument("--accuracy-level", type=int, default=None,
                   help="builder accuracy_level (default: builder's own, 4 = int8 activations on CPU)")
    p.add_argument("--block-size", type=int, default=None,
                   help="builder block_size for MatMulNBits (default: the builder's own, 32)")
    p.add_argument("--no-spinning", dest="spinning", action="store_false",
                   help="worker threads never spin (the setting of specrt's second and third sittings)")
    p.add_argument("--prepare-only", action="store_true", help="build the models and run folders, measure nothing")
    p.add_argument("--build-timeout", type=int, default=3600)
    p.add_argument("--target", default=C.TARGET)
    p.add_argument("--draft", default=C.DRAFT)
    args = p.parse_args()
    try:
        ks = [int(k) for k in args.k.split(",") if k.strip()]
    except ValueError:
        C.die(f"--k must be comma separated integers, got {args.k!r}")
    if any(not 1 <= k <= 16 for k in ks):
        C.die("--k values must be between 1 and 16")
    og = C.require("onnxruntime_genai", "pip install onnxruntime-genai==0.18.0")
    prompts = C.read_prompts(args.prompts, args.limit)

    t0 = time.perf_counter()
    tdir = prepare_model(args.target, args.workdir, args.precision, args.accuracy_level, args.build_timeout, args.block_size)
    ddir = (prepare_model(args.draft, args.workdir, args.precision, args.accuracy_level, args.build_timeout, args.block_size)
            if ks else None)
    tag = (f"{args.precision}{'' if args.accuracy_level is None else f'-acc{args.accuracy_level}'}"
           f"{f'-b{args.block_size}' if args.block_size else ''}-t{args.threads}{'' if args.spinning else '-nospin'}")
    run_t, run_s = make_run_dirs(tdir, ddir or tdir, args.workdir, args.threads, max(ks or [1]), tag, args.spinning)
    print(f"prepared in {time.perf_counter() - t0:.1f} s: {run_t} {run_s}", file=sys.stderr, flush=True)
    if args.prepare_only:
        return

    def load(folder):
        t = time.perf_counter()
        cfg = og.Config(str(folder))
        cfg.clear_providers()
        m = og.Model(cfg)
        print(f"loaded {folder.name} in {time.perf_counter() - t:.1f} s", file=sys.stderr, flush=True)
        return m

    models = {}
    if not args.no_target:
        models["target"] = load(run_t)
    if ks:
        try:
            models["spec"] = load(run_s)
        except Exception as e:  # noqa: BLE001 - report the runtime's own message on one line
            C.die(f"onnxruntime-genai rejected the speculative config {run_s / 'genai_config.json'}: "
                  f"{' '.join(str(e).split())}")
    any_model = next(iter(models.values()))
    tok = og.Tokenizer(any_model)
    eos_cfg = json.loads((run_t / "genai_config.json").read_text())["model"]["eos_token_id"]
    eos_ids = set(eos_cfg if isinstance(eos_cfg, list) else [eos_cfg])
    prompt_ids = []
    for pr in prompts:
        text = tok.apply_chat_template(json.dumps([{"role": "user", "content": pr["prompt"]}]),
                                       add_generation_prompt=True)
        prompt_ids.append(tok.encode(text).astype("int32"))

    spec_totals: dict[str, dict] = {}

    def make(model, k):
        def run(i):
            ids = prompt_ids[i]
            t = time.perf_counter()
            params = og.GeneratorParams(model)
            params.set_search_options(do_sample=False, max_length=len(ids) + args.max_new_tokens)
            if k:
                params.set_speculative_options(max_draft_tokens=k)
            gen = og.Generator(model, params)
            gen.append_tokens(ids)
            while not gen.is_done():
                gen.generate_next_token()
            seq = gen.get_sequence(0)
            wall = time.perf_counter() - t
            new, reason = C.cut_at_eos(list(seq[len(ids):]), eos_ids)
            new = new[: args.max_new_tokens]
            res = {"tokens": new, "wall_s": wall, "finish": reason}
            if k:
                st = gen.get_speculative_stats()
                acc = spec_totals.setdefault(f"spec-k{k}", {})
                for key, v in st.items():  # counts only (ratios and averages do not add up)
                    if (isinstance(v, (int, float)) and not isinstance(v, bool) and key != "effective_k"
                            and not key.startswith(("avg_", "mean_", "expected_", "acceptance_"))):
                        acc[key] = acc.get(key, 0) + v
                # "proposed" = drafted tokens the target verified (draft_tokens_evaluated), as specrt counts
                # them; draft_tokens_proposed also holds drafts dropped unverified at the length limit.
                res["proposed"] = int(st.get("draft_tokens_evaluated", st.get("draft_tokens_proposed", 0)))
                res["accepted"] = int(st.get("draft_tokens_accepted", 0))
                if "target_forward_passes" in st:
                    res["target_passes"] = int(st["target_forward_passes"])
                res["stats"] = st
            return res
        return run

    settings = {}
    if "target" in models:
        settings["target"] = make(models["target"], 0)
    for k in ks:
        settings[f"spec-k{k}"] = make(models["spec"], k)
    # Show the runtime's stats keys once, so the acceptance fields can be checked.
    if ks:
        probe = settings[f"spec-k{ks[0]}"](0)
        print(f"speculative stats keys: {json.dumps(probe['stats'], default=str)[:600]}", file=sys.stderr, flush=True)
    result = C.run_protocol(settings, prompts, args.repeats,
                            before_measure=spec_totals.clear)  # the sums cover measured runs only
    for row in result["rows"]:
        if row["setting"] in spec_totals:
            row["speculative_stats_sum"] = spec_totals[row["setting"]]
    C.finish(args, {"peer": "onnxruntime-genai", "onnxruntime_genai": og.__version__, "precision": args.precision,
                    "accuracy_level": args.accuracy_level if args.accuracy_level is not None else "builder default (4 on CPU)",
                    "block_size": args.block_size or "builder default (32)",
                    "target_dir": str(run_t), "spec_dir": str(run_s) if ks else None,
                    "prompt_tokens": [int(len(x)) for x in prompt_ids],
                    "notes": "acceptance = draft_tokens_accepted / draft_tokens_evaluated from get_speculative_stats(); "
                             "tokens exclude EOS"}, result, prompts)


if __name__ == "__main__":
    main()
