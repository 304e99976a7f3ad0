"""Export memory at 7B scale (not a test): a checkpoint shaped as Qwen2.5-7B (its config, random bfloat16 weights
in safetensors shards, ~15 GB) is made, exported to int4 by `specrt export` under `/usr/bin/time -v`, generated
from with `specrt generate --draft-len 0`, and deleted.

    python bench/export_memory.py [--work DIR] [--keep] [--trace]

Prints the export's peak resident memory and wall time, and the generated text (random weights: noise). The
work folder needs ~21 GB of disk (the checkpoint and the int4 pair); both are removed at the end unless --keep.
"""
from __future__ import annotations

import argparse
import json
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

# Qwen2.5-7B's config (its config.json on the hub), as the shapes to export
CONFIG = {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_size": 3584,
          "intermediate_size": 18944, "num_hidden_layers": 28, "num_attention_heads": 28, "num_key_value_heads": 4,
          "vocab_size": 152064, "max_position_embeddings": 32768, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0,
          "hidden_act": "silu", "tie_word_embeddings": False, "torch_dtype": "bfloat16", "use_sliding_window": False,
          "bos_token_id": None, "eos_token_id": 2}


def _bf16(rng, shape, scale=0.02):
    """Random normal values as bfloat16 (ml_dtypes, which onnx brings), made in float32 a row block at a time."""
    import ml_dtypes

    out = np.empty(shape, ml_dtypes.bfloat16)
    flat = out.reshape(shape[0], -1)
    for lo in range(0, shape[0], 1024):
        flat[lo:lo + 1024] = (rng.standard_normal(flat[lo:lo + 1024].shape, np.float32) * scale).astype(ml_dtypes.bfloat16)
    return out


def make_checkpoint(folder: Path) -> None:
    """One safetensors shard per layer (and one for the embeddings and the output matrix) plus their index."""
    from safetensors.numpy import save_file

    from specrt.export.tiny import _save_tokenizer, make_tokenizer

    folder.mkdir(parents=True)
    c, rng = CONFIG, np.random.default_rng(0)
    H, I, kv = c["hidden_size"], c["intermediate_size"], c["num_key_value_heads"] * c["hidden_size"] // c["num_attention_heads"]
    shards = {"model-embed.safetensors": {"model.embed_tokens.weight": _bf16(rng, (c["vocab_size"], H)),
                                          "lm_head.weight": _bf16(rng, (c["vocab_size"], H)),
                                          "model.norm.weight": _bf16(rng, (H,), 0.1) + 1}}
    weight_map = {}
    for name, tensors in shards.items():
        save_file(tensors, folder / name)
        weight_map.update(dict.fromkeys(tensors, name))
    del shards
    for i in range(c["num_hidden_layers"]):
        p = f"model.layers.{i}"
        layer = {f"{p}.self_attn.q_proj.weight": _bf16(rng, (H, H)), f"{p}.self_attn.q_proj.bias": _bf16(rng, (H,)),
                 f"{p}.self_attn.k_proj.weight": _bf16(rng, (kv, H)), f"{p}.self_attn.k_proj.bias": _bf16(rng, (kv,)),
                 f"{p}.self_attn.v_proj.weight": _bf16(rng, (kv, H)), f"{p}.self_attn.v_proj.bias": _bf16(rng, (kv,)),
                 f"{p}.self_attn.o_proj.weight": _bf16(rng, (H, H)),
                 f"{p}.mlp.gate_proj.weight": _bf16(rng, (I, H)), f"{p}.mlp.up_proj.weight": _bf16(rng, (I, H)),
                 f"{p}.mlp.down_proj.weight": _bf16(rng, (H, I)),
                 f"{p}.input_layernorm.weight": _bf16(rng, (H,), 0.1) + 1,
                 f"{p}.post_attention_layernorm.weight": _bf16(rng, (H,), 0.1) + 1}
        name = f"model-{i:05d}.safetensors"
        save_file(layer, folder / name)
        weight_map.update(dict.fromkeys(layer, name))
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    (folder / "config.json").write_text(json.dumps(CONFIG, indent=1))
    _save_tokenizer(make_tokenizer(), folder)


def timed(cmd: list[str]) -> tuple[float, float, str]:
    """(peak RSS in GB, wall seconds, output) of `cmd` run under /usr/bin/time -v."""
    r = subprocess.run(["/usr/bin/time", "-v", *cmd], capture_output=True, text=True)
    if r.returncode:
        sys.exit(f"{' '.join(cmd)} failed:\n{r.stderr[-2000:]}")
    rss = int(re.search(r"Maximum resident set size \(kbytes\): (\d+)", r.stderr).group(1)) * 1024 / 1e9
    wall = re.search(r"Elapsed \(wall clock\) time \(h:mm:ss or m:ss\): ([\d:.]+)", r.stderr).group(1)
    seconds = sum(float(x) * 60 ** i for i, x in enumerate(reversed(wall.split(":"))))
    return rss, seconds, r.stdout


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--work", type=Path, default=Path("bench-export-7b"))
    ap.add_argument("--keep", action="store_true", help="keep the checkpoint and the pair")
    ap.add_argument("--trace", action="store_true", help="export through torch instead (needs ~4x 30 GB)")
    args = ap.parse_args()
    src, pair = args.work / "qwen2.5-7b-shaped", args.work / "pair-int4"
    try:
        if not (src / "config.json").is_file():
            t0 = time.perf_counter()
            make_checkpoint(src)
            size = sum(p.stat().st_size for p in src.iterdir()) / 1e9
            print(f"checkpoint: {size:.1f} GB of bfloat16 safetensors in {time.perf_counter() - t0:.0f} s", flush=True)
        cmd = ["specrt", "export", "--target", str(src), "--out", str(pair), "--precision", "int4", "--overwrite"]
        print(subprocess.run([*cmd, "--dry-run"], capture_output=True, text=True, check=True).stdout.strip())
        rss, wall, _ = timed(cmd + (["--trace"] if args.trace else []))
        pair_gb = sum(p.stat().st_size for p in (pair / "target").iterdir()) / 1e9
        print(f"export to int4: peak RSS {rss:.2f} GB, wall {wall:.0f} s, pair {pair_gb:.1f} GB", flush=True)
        rss, wall, text = timed(["specrt", "generate", str(pair), "--prompt", "def quicksort(xs):",
                                 "--max-new-tokens", "8", "--draft-len", "0"])
        print(f"generate 8 tokens (--draft-len 0): peak RSS {rss:.2f} GB, wall {wall:.0f} s; text {text.strip()!r}")
    finally:
        if not args.keep:
            shutil.rmtree(args.work, ignore_errors=True)


if __name__ == "__main__":
    main()
