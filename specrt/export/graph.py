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


# Each of these computes its result in torch (for tracing and reference) and exports as one node, where
# plain tracing would emit a chain of shape arithmetic or a dozen elementwise ops. On a 2-core CPU a
# one-token step is dominated by per-node dispatch once the weights are int4, so node count is speed.

class _Reshape(torch.autograd.Function):
    """Reshape to a constant target where 0 keeps the input's dimension (ONNX semantics)."""

    @staticmethod
    def forward(ctx, x, shape):
        return x.reshape([x.shape[i] if d == 0 else d for i, d in enumerate(shape)])

    @staticmethod
    def symbolic(g, x, shape):
        return g.op("Reshape", x, g.op("Constant", value_t=torch.tensor(shape, dtype=torch.int64)))


class _Rotary(torch.autograd.Function):
    """Rotary embedding (half rotation) of x [B, S, N*D] at positions [B, S]: onnxruntime's
    com.microsoft RotaryEmbedding over precomputed cos/sin tables [max_len, D/2]. A contrib op:
    the portable (GPU) graph uses _rotary_portable instead (standard ops, same math)."""

    @staticmethod
    def forward(ctx, x, positions, cos_table, sin_table, num_heads):
        B, S, _ = x.shape
        xs = x.reshape(B, S, num_heads, -1)
        cos = cos_table[positions][:, :, None]  # [B, S, 1, D/2]
        sin = sin_table[positions][:, :, None]
        cos, sin = torch.cat((cos, cos), -1), torch.cat((sin, sin), -1)
        return (xs * cos + _rotate_half(xs) * sin).reshape(B, S, -1)

    @staticmethod
    def symbolic(g, x, positions, cos_table, sin_table, num_heads):
        out = g.op("com.microsoft::RotaryEmbedding", x, positions, cos_table, sin_table, interleaved_i=0,
                   num_heads_i=num_heads)
        out.setType(x.type())
        return out


class _CacheMatMul(torch.autograd.Function):
    """a [B, Hkv, M, K'] times a sequence-major cache slice c [T, B, Hkv, D], read in place:
    transpose_cache=True gives a @ c^T per head ([B, Hkv, M, T], scaled by alpha: attention scores),
    False gives a @ c ([B, Hkv, M, D], with K' = T: the weighted values). Exported as one
    com.microsoft FusedMatMul with transBatchB, which moves the cache's sequence axis behind its
    batch axes by strides: no Transpose or Concat of the past per step, whose cost grew with the past
    (the 0.5B int4 draft step: 11.5 ms at a past of 20, 22.5 ms at 600 with the transposing graph).
    A contrib op, like RotaryEmbedding: the portable (GPU) graph traces `forward` instead."""

    @staticmethod
    def forward(ctx, a, c, transpose_cache, alpha):
        c = c.permute(1, 2, 0, 3)  # [B, Hkv, T, D]
        return torch.matmul(a, c.transpose(-1, -2) if transpose_cache else c) * alpha

    @staticmethod
    def symbolic(g, a, c, transpose_cache, alpha):
        out = g.op("com.microsoft::FusedMatMul", a, c, alpha_f=alpha, transA_i=0, transB_i=int(transpose_cache),
                   transBatchA_i=0, transBatchB_i=1)
        a_sizes, c_sizes = a.type().varyingSizes(), c.type().varyingSizes()
        out.setType(a.type().with_sizes(a_sizes[:-1] + [c_sizes[0] if transpose_cache else c_sizes[3]]))
        return out


class _SplitLast(torch.autograd.Function):
    """x split along its last axis into two parts of `sizes` (an int64 [2] tensor computed once per
    graph): one Split node, where slicing by a traced length costs ~5 nodes of shape arithmetic per layer."""

    @staticmethod
    def forward(ctx, x, sizes):
        return tuple(x.split(sizes.tolist(), -1))

    @staticmethod
    def symbolic(g, x, sizes):
        parts = g.op("Split", x, sizes, axis_i=-1, outputs=2)
        for p in parts:
            p.setType(x.type().with_sizes(x.type().varyingSizes()[:-1] + [None]))
        return parts


def _rotary_portable(x, cos, sin, num_heads, head_dim):
    """_Rotary in standard ops, with cos/sin [B, S, 1, D] gathered once per graph (not per layer):
    a Reshape, a constant Split, Neg, Concat, two Muls and an Add per call."""
    xs = _Reshape.apply(x, (0, -1, num_heads, head_dim))  # [B, S, N, D]
    x1, x2 = xs.split(head_dim // 2, -1)
    return _Reshape.apply(xs * cos + torch.cat((-x2, x1), -1) * sin, (0, -1, num_heads * head_dim))


def _f32(x):
    """x in float32 (attention math runs in fp32 for fp16 models); no Cast node when it already is."""
    return x if x.dtype == torch.float32 else x.float()


def _fused_linear(mods: list[nn.Linear]) -> nn.Linear:
    """One Linear computing the concatenation of `mods`' outputs: one weight matmul instead of several.
    Consumes the originals (their weights are freed as they are copied, so export memory does not grow)."""
    out = sum(m.out_features for m in mods)
    has_bias = any(m.bias is not None for m in mods)
    fused = nn.Linear(mods[0].in_features, out, bias=has_bias, dtype=mods[0].weight.dtype, device="meta")
    fused.weight = nn.Parameter(torch.cat([m.weight.detach() for m in mods]), requires_grad=False)
    if has_bias:
        fused.bias = nn.Parameter(torch.cat([m.bias.detach() if m.bias is not None else
                                             torch.zeros(m.out_features, dtype=m.weight.dtype) for m in mods]),
                                  requires_grad=False)
    for m in mods:
        m.weight = m.bias = None
    return fused


class DeltaKVDecoder(nn.Module):
    """`hf_model` rewritten for export; it consumes the model (projections are fused in place).

    `portable`: standard ONNX ops only (no com.microsoft RotaryEmbedding/FusedMatMul), for
    onnxruntime's CUDA provider and TensorRT; the default graph is the fastest on onnxruntime's CPU."""

    def __init__(self, hf_model, max_len: int = 4096, output_ids=None, portable: bool = False):
        super().__init__()
        self.portable = portable
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
        if output_ids is not None:  # a restricted output vocabulary: keep only these rows
            head = hf_model.lm_head
            rows = torch.as_tensor(output_ids, dtype=torch.int64)
            self.lm_head = nn.Linear(head.in_features, len(rows), bias=head.bias is not None, device="meta")
            self.lm_head.weight = nn.Parameter(head.weight.detach()[rows].clone(), requires_grad=False)
            if head.bias is not None:
                self.lm_head.bias = nn.Parameter(head.bias.detach()[rows].clone(), requires_grad=False)
        self.num_layers = cfg.num_hidden_layers
        self.num_heads = cfg.num_attention_heads
        self.num_kv_heads = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        rotary = self.model.rotary_emb
        scaling = float(getattr(rotary, "attention_scaling", 1.0))
        freqs = torch.arange(max_len, dtype=torch.float32)[:, None] * rotary.inv_freq.detach().float()  # [max_len, D/2]
        self.register_buffer("cos_table", freqs.cos() * scaling, persistent=False)
        self.register_buffer("sin_table", freqs.sin() * scaling, persistent=False)
        self.qkv = nn.ModuleList()
        self.gate_up = nn.ModuleList()
        for layer in self.model.layers:
            a, mlp = layer.self_attn, layer.mlp
            self.qkv.append(_fused_linear([a.q_proj, a.k_proj, a.v_proj]))
            self.gate_up.append(_fused_linear([mlp.gate_proj, mlp.up_proj]))

    def forward(self, input_ids, position_ids, attention_mask, logit_positions, *past):
        B, S = input_ids.shape
        H, Hkv, D = self.num_heads, self.num_kv_heads, self.head_dim
        rep = H // Hkv
        h = self.model.embed_tokens(input_ids)  # [B, S, hidden]
        cos = self.cos_table.to(h.dtype)
        sin = self.sin_table.to(h.dtype)
        if self.portable:  # [B, S, 1, D] at the input positions, shared by every layer
            cos, sin = (torch.cat((g, g), -1)[:, :, None] for g in (cos[position_ids], sin[position_ids]))

        # Mask by cache slot, built without shape arithmetic: slot index = cumsum(ones) - 1.
        kv_slot = torch.cumsum(torch.ones_like(attention_mask), -1) - 1  # [B, T]
        total = kv_slot[:, -1:] + 1  # [B, 1]  T = P + S
        # S counted from data, not from the shape: a Shape->Gather here was the one node onnxruntime's CUDA
        # provider left on the CPU (measured on an H200), which also rules out CUDA graph capture.
        ones = torch.ones_like(input_ids)
        q_slot = total - ones.sum(-1, keepdim=True) + torch.cumsum(ones, -1) - 1  # [B, S]
        allowed = (kv_slot[:, None, :] <= q_slot[:, :, None]) & (attention_mask[:, None, :] > 0)  # [B, S, T]
        bias = torch.where(allowed, 0.0, torch.finfo(torch.float32).min)[:, None]  # [B, 1, S, T]
        bias = bias.repeat(1, 1, rep, 1)  # [B, 1, rep*S, T]: the row order of the grouped queries below

        # [P, S]: the past and new parts of each attention row, for _SplitLast (shape ops once, not per layer)
        past_new = None if self.portable else torch.cat((torch._shape_as_tensor(past[0])[:1],
                                                          torch._shape_as_tensor(input_ids)[1:]))

        new_kv = []
        for i, layer in enumerate(self.model.layers):
            attn, mlp = layer.self_attn, layer.mlp
            x = layer.input_layernorm(h)
            q, k, v = self.qkv[i](x).split([H * D, Hkv * D, Hkv * D], -1)  # [B, S, H*D], [B, S, Hkv*D] x2
            if hasattr(attn, "q_norm"):  # qwen3: per-head RMSNorm before rotary
                q = _Reshape.apply(attn.q_norm(_Reshape.apply(q, (0, -1, H, D))), (0, -1, H * D))
                k = _Reshape.apply(attn.k_norm(_Reshape.apply(k, (0, -1, Hkv, D))), (0, -1, Hkv * D))
            if self.portable:
                q, k = _rotary_portable(q, cos, sin, H, D), _rotary_portable(k, cos, sin, Hkv, D)
            else:
                q, k = _Rotary.apply(q, position_ids, cos, sin, H), _Rotary.apply(k, position_ids, cos, sin, Hkv)
            k_new = _Reshape.apply(k, (0, -1, Hkv, D)).transpose(0, 1)  # [S, B, Hkv, D]
            v_new = _Reshape.apply(v, (0, -1, Hkv, D)).transpose(0, 1)  # [S, B, Hkv, D]
            new_kv += [k_new, v_new]

            # Grouped-query attention over [past | new] without concatenating or transposing the past:
            # scores and weighted values in two parts each, read from the caches in place.
            qg = _Reshape.apply(_f32(_Reshape.apply(q, (0, -1, Hkv, rep, D)).permute(0, 2, 3, 1, 4)),
                                (0, Hkv, -1, D))  # [B, Hkv, rep*S, D]
            if self.portable:  # standard ops only: concatenate past and new (cheap on a GPU)
                keys = _f32(torch.cat((past[2 * i], k_new)))  # [T, B, Hkv, D]
                values = _f32(torch.cat((past[2 * i + 1], v_new)))
                probs = torch.softmax(_CacheMatMul.forward(None, qg, keys, True, attn.scaling) + bias, dim=-1)
                out = _CacheMatMul.forward(None, probs, values, False, 1.0).to(h.dtype)  # [B, Hkv, rep*S, D]
            else:
                scores = torch.cat((_CacheMatMul.apply(qg, _f32(past[2 * i]), True, attn.scaling),
                                    _CacheMatMul.apply(qg, _f32(k_new), True, attn.scaling)), -1)  # [B, Hkv, rep*S, T]
                p_past, p_new = _SplitLast.apply(torch.softmax(scores + bias, dim=-1), past_new)
                out = (_CacheMatMul.apply(p_past, _f32(past[2 * i + 1]), False, 1.0)
                       + _CacheMatMul.apply(p_new, _f32(v_new), False, 1.0)).to(h.dtype)  # [B, Hkv, rep*S, D]
            out = _Reshape.apply(_Reshape.apply(out, (0, Hkv, rep, -1, D)).permute(0, 3, 1, 2, 4), (0, -1, H * D))  # [B, S, H*D]
            h = h + attn.o_proj(out)
            gate_up = self.gate_up[i]
            gate, up = gate_up(layer.post_attention_layernorm(h)).split(gate_up.out_features // 2, -1)  # one Split
            h = h + mlp.down_proj(mlp.act_fn(gate) * up)

        h = self.model.norm(h)
        h = torch.index_select(h, 1, logit_positions)  # [B, N, hidden]: no logits for unused positions
        logits = self.lm_head(h).float()  # [B, N, V]
        return (logits, *new_kv)


def io_names(num_layers: int) -> tuple[list[str], list[str]]:
    past = [n for i in range(num_layers) for n in (f"past_key.{i}", f"past_value.{i}")]
    new = [n for i in range(num_layers) for n in (f"new_key.{i}", f"new_value.{i}")]
    return ["input_ids", "position_ids", "attention_mask", "logit_positions", *past], ["logits", *new]


def export_onnx(hf_model, out_path, max_len: int = 4096, output_ids=None, opset: int = 18,
                portable: bool = False) -> DeltaKVDecoder:
    """Trace the delta-KV decoder of `hf_model` to `out_path` (external data for large models).
    Positions must stay below `max_len` (the size of the rotary tables). Consumes `hf_model`.
    `output_ids`: logits only for these token ids (a restricted draft vocabulary).
    `portable`: standard ops only (GPU: onnxruntime CUDA, TensorRT); see DeltaKVDecoder."""
    wrapper = DeltaKVDecoder(hf_model, max_len, output_ids, portable).eval()
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
