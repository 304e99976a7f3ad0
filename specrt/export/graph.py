"""The exported decoder graph: the KV contract of DESIGN §3 written as a torch module.

The module reuses the Hugging Face model's own submodules (embeddings, projections, norms, MLPs)
and replaces only the attention bookkeeping, so the graph has exactly the interface the runtime
binds:

inputs
  input_ids        int64 [B, S]        the S new tokens
  position_ids     int64 [B, S]        their positions (explicit, so ragged batches work)
  attention_mask   int64 [B, P+S]      1 = cache slot valid for that row (masks stale slots)
  logit_positions  int64 [N]           which of the S positions get logits (prefill: only the last)
  past_key.i / past_value.i  [P, B, Hkv, D]   the valid prefix of the cache, sequence-major
outputs
  logits           float32 [B, N, V]
  new_key.i / new_value.i    [S, B, Hkv, D]   only the new entries; the runtime binds them to
                                              the cache at offset P, so the graph writes in place

Attention is causal by cache slot: query i sits in slot P+i and sees slots j <= P+i that the mask
marks valid.
"""
from __future__ import annotations

import torch
from torch import nn

from specrt.errors import ExportError

SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "mistral", "qwen3")


def _rotate_half(x):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class DeltaKVDecoder(nn.Module):
    def __init__(self, hf_model):
        super().__init__()
        cfg = hf_model.config
        if cfg.model_type not in SUPPORTED_MODEL_TYPES:
            raise ExportError(
                f"model type {cfg.model_type!r} is not supported; supported: {', '.join(SUPPORTED_MODEL_TYPES)}"
            )
        rope = getattr(cfg, "rope_parameters", None) or getattr(cfg, "rope_scaling", None) or {}
        rope_type = rope.get("rope_type", rope.get("type", "default")) if isinstance(rope, dict) else "default"
        if rope_type in ("dynamic", "longrope"):
            raise ExportError(f"rope type {rope_type!r} depends on the sequence length and is not supported")
        self.model = hf_model.model
        self.lm_head = hf_model.lm_head
        self.num_layers = cfg.num_hidden_layers
        self.num_heads = cfg.num_attention_heads
        self.num_kv_heads = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        rotary = self.model.rotary_emb
        self.register_buffer("inv_freq", rotary.inv_freq.detach().float().clone(), persistent=False)
        self.attention_scaling = float(getattr(rotary, "attention_scaling", 1.0))

    def forward(self, input_ids, position_ids, attention_mask, logit_positions, *past):
        B, S = input_ids.shape
        Hkv, D = self.num_kv_heads, self.head_dim
        rep = self.num_heads // Hkv
        h = self.model.embed_tokens(input_ids)  # [B, S, hidden]

        # Rotary tables for the explicit positions.
        freqs = position_ids.float()[..., None] * self.inv_freq  # [B, S, D/2]
        emb = torch.cat((freqs, freqs), dim=-1)
        cos = (emb.cos() * self.attention_scaling)[:, None].to(h.dtype)  # [B, 1, S, D]
        sin = (emb.sin() * self.attention_scaling)[:, None].to(h.dtype)

        # Mask by cache slot, built without shape arithmetic: slot index = cumsum(ones) - 1.
        kv_slot = torch.cumsum(torch.ones_like(attention_mask), -1) - 1  # [B, T]
        total = kv_slot[:, -1:] + 1  # [B, 1]  T = P + S
        q_slot = total - S + torch.cumsum(torch.ones_like(input_ids), -1) - 1  # [B, S]
        allowed = (kv_slot[:, None, :] <= q_slot[:, :, None]) & (attention_mask[:, None, :] > 0)  # [B, S, T]
        bias = torch.where(allowed, 0.0, torch.finfo(torch.float32).min)[:, None, None]  # [B, 1, 1, S, T]

        new_kv = []
        for i, layer in enumerate(self.model.layers):
            attn = layer.self_attn
            x = layer.input_layernorm(h)
            q = attn.q_proj(x).view(B, S, -1, D)  # [B, S, H, D]
            k = attn.k_proj(x).view(B, S, Hkv, D)
            v = attn.v_proj(x).view(B, S, Hkv, D)
            if hasattr(attn, "q_norm"):  # qwen3: per-head RMSNorm before rotary
                q, k = attn.q_norm(q), attn.k_norm(k)
            q, k = q.transpose(1, 2), k.transpose(1, 2)  # [B, H, S, D]
            q = q * cos + _rotate_half(q) * sin
            k = k * cos + _rotate_half(k) * sin
            k_new = k.permute(2, 0, 1, 3)  # [S, B, Hkv, D]
            v_new = v.transpose(0, 1)  # [S, B, Hkv, D]
            new_kv += [k_new, v_new]

            keys = torch.cat((past[2 * i], k_new), 0).permute(1, 2, 0, 3)  # [B, Hkv, T, D]
            values = torch.cat((past[2 * i + 1], v_new), 0).permute(1, 2, 0, 3)
            # Grouped-query attention by broadcasting: no repeated copy of K/V.
            qg = q.reshape(B, Hkv, rep, S, D).float()  # [B, Hkv, rep, S, D]
            scores = torch.matmul(qg, keys.float()[:, :, None].transpose(-1, -2)) * attn.scaling  # [B, Hkv, rep, S, T]
            probs = torch.softmax(scores + bias, dim=-1)
            out = torch.matmul(probs, values.float()[:, :, None]).to(h.dtype)  # [B, Hkv, rep, S, D]
            out = out.permute(0, 3, 1, 2, 4).reshape(B, S, -1)  # [B, S, H*D]
            h = h + attn.o_proj(out)
            h = h + layer.mlp(layer.post_attention_layernorm(h))

        h = self.model.norm(h)
        h = torch.index_select(h, 1, logit_positions)  # [B, N, hidden]: no logits for unused positions
        logits = self.lm_head(h).float()  # [B, N, V]
        return (logits, *new_kv)


def io_names(num_layers: int) -> tuple[list[str], list[str]]:
    past = [n for i in range(num_layers) for n in (f"past_key.{i}", f"past_value.{i}")]
    new = [n for i in range(num_layers) for n in (f"new_key.{i}", f"new_value.{i}")]
    return ["input_ids", "position_ids", "attention_mask", "logit_positions", *past], ["logits", *new]


def export_onnx(hf_model, out_path, opset: int = 18) -> DeltaKVDecoder:
    """Trace the delta-KV decoder of `hf_model` to `out_path` (external data for large models)."""
    wrapper = DeltaKVDecoder(hf_model).eval()
    dtype = next(hf_model.parameters()).dtype
    L, Hkv, D = wrapper.num_layers, wrapper.num_kv_heads, wrapper.head_dim
    B, S, P = 1, 3, 2
    ids = torch.zeros((B, S), dtype=torch.int64)
    pos = torch.arange(P, P + S, dtype=torch.int64)[None]
    mask = torch.ones((B, P + S), dtype=torch.int64)
    logit_pos = torch.tensor([S - 1], dtype=torch.int64)
    past = [torch.zeros((P, B, Hkv, D), dtype=dtype) for _ in range(2 * L)]
    inputs, outputs = io_names(L)
    axes = {
        "input_ids": {0: "batch", 1: "seq"},
        "position_ids": {0: "batch", 1: "seq"},
        "attention_mask": {0: "batch", 1: "total"},
        "logit_positions": {0: "n_logits"},
        "logits": {0: "batch", 1: "n_logits"},
    }
    for n in inputs[4:]:
        axes[n] = {0: "past", 1: "batch"}
    for n in outputs[1:]:
        axes[n] = {0: "seq", 1: "batch"}
    import warnings

    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(
            wrapper,
            (ids, pos, mask, logit_pos, *past),
            str(out_path),
            input_names=inputs,
            output_names=outputs,
            dynamic_axes=axes,
            opset_version=opset,
            do_constant_folding=True,
            dynamo=False,
        )
    return wrapper
