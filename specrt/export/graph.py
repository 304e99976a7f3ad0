"""The exported decoder graphs, written as torch modules over the Hugging Face model's own submodules.

Both reuse the model's embeddings, projections, norms and MLPs and replace only the attention
bookkeeping, so each graph has exactly the interface the runtime binds (docs/design.md, "The KV-cache
contract").

The lean graph (`LeanDecoder`, onnxruntime on the CPU and CUDA): a handful of fused onnxruntime ops
per layer over per-row caches that attention reads and writes in place.

inputs
  input_ids      int64 [B, S]       the new tokens of each row, right-padded
  seqlens_k      int32 [B]          per row: tokens in its cache after this call, minus one
  total_sequence_length  int32 [1]  C, the slots per row: an upper bound of every row's length (an input,
                                    not a Shape of the cache, so no node runs on the CPU: CUDA graphs)
  logit_index    int64 [N]          which of the B*S positions get logits (flat: row * S + position)
  query_seqlens  int32 [B]          per row: how many of its S tokens are real (0: the row sits out);
                                    onnxruntime >= 1.32 only, see `gqa_has_query_seqlens`
  past_key.i / past_value.i  [B, Hkv, C, D]   the whole cache, C slots per row
outputs
  logits         float32 [N, V]
  present_key.i / present_value.i  [B, Hkv, C, D]   bound to the same buffers as the past

Row b's new tokens sit at positions seqlens_k[b] + 1 - query_seqlens[b] onwards, so each row has its
own length and a rollback is a shorter length in the next call; rotary runs inside the attention op.

The portable graph (`PortableDecoder`, standard ONNX ops only: what TensorRT builds engines from), the
delta contract over one shared length:

inputs
  input_ids        int64 [B, S]        the S new tokens
  position_ids     int64 [B, S]        their positions
  attention_mask   int64 [B, P+S]      1 = cache slot valid for that row
  logit_positions  int64 [N]           which of the S positions get logits (prefill: only the last)
  past_key.i / past_value.i  [P, B, Hkv, D]   the valid prefix of the cache, sequence-major
outputs
  logits           float32 [B, N, V]
  new_key.i / new_value.i    [S, B, Hkv, D]   only the new entries; the runtime binds them to
                                              the cache at offset P, so the graph writes in place

Attention there is causal by cache slot: query i sits in slot P+i and sees slots j <= P+i that the mask
marks valid. Its index math runs in float32: TensorRT's ONNX parser takes CumSum and ReduceSum in
float types only (engines/trt.py checks a graph against its operator table).
"""
from __future__ import annotations

import warnings

import torch
from torch import nn

from specrt.engines.ort import gqa_has_query_seqlens  # noqa: F401 - the exporter's question, asked of onnxruntime
from specrt.errors import ExportError

SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "mistral", "qwen3")


def _rotate_half(x):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


# One node each where plain tracing would emit a chain of shape arithmetic or elementwise ops: on
# a 2-core CPU a one-token int4 step is dominated by per-node dispatch, so node count is speed.

class _Reshape(torch.autograd.Function):
    """Reshape to a constant target where 0 keeps the input's dimension (ONNX semantics)."""

    @staticmethod
    def forward(ctx, x, shape):
        return x.reshape([x.shape[i] if d == 0 else d for i, d in enumerate(shape)])

    @staticmethod
    def symbolic(g, x, shape):
        return g.op("Reshape", x, g.op("Constant", value_t=torch.tensor(shape, dtype=torch.int64)))


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


def _common_init(mod: nn.Module, hf_model, max_positions: int, output_ids) -> None:
    """What both graphs take from `hf_model`: its submodules, shapes and rotary tables [max_positions, D/2];
    the output matrix cut to `output_ids` (a restricted draft vocabulary) when given."""
    cfg = hf_model.config
    if cfg.model_type not in SUPPORTED_MODEL_TYPES:
        raise ExportError(
            f"model type {cfg.model_type!r} is not supported; supported: {', '.join(SUPPORTED_MODEL_TYPES)}"
        )
    rope = getattr(cfg, "rope_parameters", None) or getattr(cfg, "rope_scaling", None) or {}
    rope_type = rope.get("rope_type", rope.get("type", "default")) if isinstance(rope, dict) else "default"
    if rope_type in ("dynamic", "longrope"):
        raise ExportError(f"rope type {rope_type!r} depends on the sequence length and is not supported")
    mod.model = hf_model.model
    mod.lm_head = hf_model.lm_head
    if output_ids is not None:  # a restricted output vocabulary: keep only these rows
        head = hf_model.lm_head
        rows = torch.as_tensor(output_ids, dtype=torch.int64)
        mod.lm_head = nn.Linear(head.in_features, len(rows), bias=head.bias is not None, device="meta")
        mod.lm_head.weight = nn.Parameter(head.weight.detach()[rows].clone(), requires_grad=False)
        if head.bias is not None:
            mod.lm_head.bias = nn.Parameter(head.bias.detach()[rows].clone(), requires_grad=False)
    mod.num_layers = cfg.num_hidden_layers
    mod.hidden = cfg.hidden_size
    mod.num_heads = cfg.num_attention_heads
    mod.num_kv_heads = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
    mod.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    rotary = mod.model.rotary_emb
    scaling = float(getattr(rotary, "attention_scaling", 1.0))
    freqs = torch.arange(max_positions, dtype=torch.float32)[:, None] * rotary.inv_freq.detach().float()  # [max, D/2]
    mod.register_buffer("cos_table", freqs.cos() * scaling, persistent=False)
    mod.register_buffer("sin_table", freqs.sin() * scaling, persistent=False)


def _rotary(x, cos, sin, num_heads, head_dim):
    """Rotary embedding (half rotation) of x [B, S, N*D] with cos/sin [B, S, 1, D] gathered once per graph:
    a Reshape, a constant Split, Neg, Concat, two Muls and an Add per call."""
    xs = _Reshape.apply(x, (0, -1, num_heads, head_dim))  # [B, S, N, D]
    x1, x2 = xs.split(head_dim // 2, -1)
    return _Reshape.apply(xs * cos + torch.cat((-x2, x1), -1) * sin, (0, -1, num_heads * head_dim))


class PortableDecoder(nn.Module):
    """`hf_model` rewritten as the portable graph (see above); it consumes the model (projections are fused)."""

    def __init__(self, hf_model, max_len: int = 4096, output_ids=None):
        super().__init__()
        _common_init(self, hf_model, max_len, output_ids)
        self.qkv, self.gate_up = nn.ModuleList(), nn.ModuleList()
        for layer in self.model.layers:
            a, mlp = layer.self_attn, layer.mlp
            self.qkv.append(_fused_linear([a.q_proj, a.k_proj, a.v_proj]))
            self.gate_up.append(_fused_linear([mlp.gate_proj, mlp.up_proj]))

    def forward(self, input_ids, position_ids, attention_mask, logit_positions, *past):
        H, Hkv, D = self.num_heads, self.num_kv_heads, self.head_dim
        rep = H // Hkv
        h = self.model.embed_tokens(input_ids)  # [B, S, hidden]
        cos, sin = self.cos_table.to(h.dtype), self.sin_table.to(h.dtype)
        cos, sin = (torch.cat((g, g), -1)[:, :, None] for g in (cos[position_ids], sin[position_ids]))  # [B, S, 1, D]

        # Mask by cache slot, built without shape arithmetic: slot index = cumsum(ones) - 1, in float32.
        valid = attention_mask.float()  # [B, T]
        kv_slot = torch.cumsum(torch.ones_like(valid), -1) - 1  # [B, T]
        total = kv_slot[:, -1:] + 1  # [B, 1]  T = P + S
        ones = torch.ones_like(input_ids, dtype=torch.float32)
        q_slot = total - ones.sum(-1, keepdim=True) + torch.cumsum(ones, -1) - 1  # [B, S]
        allowed = (kv_slot[:, None, :] <= q_slot[:, :, None]) & (valid[:, None, :] > 0)  # [B, S, T]
        bias = torch.where(allowed, 0.0, torch.finfo(torch.float32).min)[:, None]  # [B, 1, S, T]
        bias = torch.cat([bias] * rep, 2)  # [B, 1, rep*S, T]: the row order of the grouped queries below (a
        # Concat: `repeat` traces to an int64 ConstantOfShape, which TensorRT's parser does not take)

        new_kv = []
        for i, layer in enumerate(self.model.layers):
            attn, mlp = layer.self_attn, layer.mlp
            x = layer.input_layernorm(h)
            q, k, v = self.qkv[i](x).split([H * D, Hkv * D, Hkv * D], -1)  # [B, S, H*D], [B, S, Hkv*D] x2
            if hasattr(attn, "q_norm"):  # qwen3: per-head RMSNorm before rotary
                q = _Reshape.apply(attn.q_norm(_Reshape.apply(q, (0, -1, H, D))), (0, -1, H * D))
                k = _Reshape.apply(attn.k_norm(_Reshape.apply(k, (0, -1, Hkv, D))), (0, -1, Hkv * D))
            q, k = _rotary(q, cos, sin, H, D), _rotary(k, cos, sin, Hkv, D)
            k_new = _Reshape.apply(k, (0, -1, Hkv, D)).transpose(0, 1)  # [S, B, Hkv, D]
            v_new = _Reshape.apply(v, (0, -1, Hkv, D)).transpose(0, 1)  # [S, B, Hkv, D]
            new_kv += [k_new, v_new]
            qg = _Reshape.apply(_f32(_Reshape.apply(q, (0, -1, Hkv, rep, D)).permute(0, 2, 3, 1, 4)),
                                (0, Hkv, -1, D))  # [B, Hkv, rep*S, D]
            keys = _f32(torch.cat((past[2 * i], k_new))).permute(1, 2, 0, 3)  # [B, Hkv, T, D]
            values = _f32(torch.cat((past[2 * i + 1], v_new))).permute(1, 2, 0, 3)
            probs = torch.softmax(qg @ keys.transpose(-1, -2) * attn.scaling + bias, dim=-1)  # [B, Hkv, rep*S, T]
            out = (probs @ values).to(h.dtype)  # [B, Hkv, rep*S, D]
            out = _Reshape.apply(_Reshape.apply(out, (0, Hkv, rep, -1, D)).permute(0, 3, 1, 2, 4), (0, -1, H * D))  # [B, S, H*D]
            h = h + attn.o_proj(out)
            gate_up = self.gate_up[i]
            gate, up = gate_up(layer.post_attention_layernorm(h)).split(gate_up.out_features // 2, -1)  # one Split
            h = h + mlp.down_proj(mlp.act_fn(gate) * up)

        h = self.model.norm(h)
        h = torch.index_select(h, 1, logit_positions)  # [B, N, hidden]: no logits for unused positions
        logits = self.lm_head(h).float()  # [B, N, V]
        return (logits, *new_kv)


def portable_io_names(num_layers: int) -> tuple[list[str], list[str]]:
    past = [n for i in range(num_layers) for n in (f"past_key.{i}", f"past_value.{i}")]
    new = [n for i in range(num_layers) for n in (f"new_key.{i}", f"new_value.{i}")]
    return ["input_ids", "position_ids", "attention_mask", "logit_positions", *past], ["logits", *new]


def export_portable(hf_model, out_path, max_len: int = 4096, output_ids=None, opset: int = 18) -> PortableDecoder:
    """Trace the portable graph of `hf_model` to `out_path` (external data for large models).
    Positions must stay below `max_len` (the size of the rotary tables). Consumes `hf_model`.
    `output_ids`: logits only for these token ids (a restricted draft vocabulary)."""
    wrapper = PortableDecoder(hf_model, max_len, output_ids).eval()
    dtype = next(hf_model.parameters()).dtype
    L, Hkv, D = wrapper.num_layers, wrapper.num_kv_heads, wrapper.head_dim
    B, S, P = 1, 3, 2
    ids = torch.zeros((B, S), dtype=torch.int64)
    pos = torch.arange(P, P + S, dtype=torch.int64)[None]
    mask = torch.ones((B, P + S), dtype=torch.int64)
    logit_pos = torch.tensor([S - 1], dtype=torch.int64)
    past = [torch.zeros((P, B, Hkv, D), dtype=dtype) for _ in range(2 * L)]
    inputs, outputs = portable_io_names(L)
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
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(wrapper, (ids, pos, mask, logit_pos, *past), str(out_path), input_names=inputs,
                          output_names=outputs, dynamic_axes=axes, opset_version=opset, do_constant_folding=True,
                          dynamo=False)
    return wrapper


# --- the lean graph -------------------------------------------------------------------------------------------
#
# Its fused ops are traced under placeholder names (domain "specrt") and given their onnxruntime form by
# `finish_lean`, where their optional inputs and outputs can be spelled out.

def _rms(x, weight, eps):
    x32 = x.float()
    return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype) * weight


class _RmsNorm(torch.autograd.Function):
    """RMSNorm as onnxruntime's SimplifiedLayerNormalization (fp32 statistics for fp16 inputs)."""

    @staticmethod
    def forward(ctx, x, weight, eps):
        return _rms(x, weight, eps)

    @staticmethod
    def symbolic(g, x, weight, eps):
        out = g.op("specrt::RmsNorm", x, weight, epsilon_f=eps)
        out.setType(x.type())
        return out


class _SkipRmsNorm(torch.autograd.Function):
    """(RMSNorm(x + skip), x + skip): the residual add and the next norm in one
    com.microsoft SkipSimplifiedLayerNormalization."""

    @staticmethod
    def forward(ctx, x, skip, weight, eps):
        s = x + skip
        return _rms(s, weight, eps), s

    @staticmethod
    def symbolic(g, x, skip, weight, eps):
        out, total = g.op("specrt::SkipRmsNorm", x, skip, weight, epsilon_f=eps, outputs=2)
        out.setType(x.type())
        total.setType(x.type())
        return out, total


class _Gqa(torch.autograd.Function):
    """com.microsoft GroupQueryAttention with rotary inside, over caches [B, Hkv, C, D] it reads and
    writes in place. `q` packs q, k and v along its last axis when `k` and `v` are None. `forward` is the
    reference semantics (what the op computes)."""

    @staticmethod
    def forward(ctx, q, k, v, past_k, past_v, seqlens_k, total, query_lens, cos, sin, num_heads, scale):
        B, S, _ = q.shape
        Hkv, D = past_k.shape[1], past_k.shape[3]
        if k is None:
            q, k, v = q.split([num_heads * D, Hkv * D, Hkv * D], -1)
        q, k, v = (t.reshape(B, S, -1, D).transpose(1, 2) for t in (q, k, v))  # [B, heads, S, D]
        out = torch.zeros(B, num_heads, S, D, dtype=q.dtype)
        pk, pv = past_k.clone(), past_v.clone()
        for b in range(B):
            n = S if query_lens is None else int(query_lens[b])
            start = int(seqlens_k[b]) + 1 - n
            pos = torch.arange(start, start + n)
            c, s_ = torch.cat((cos[pos], cos[pos]), -1), torch.cat((sin[pos], sin[pos]), -1)  # [n, D]
            qb = q[b, :, :n] * c + _rotate_half(q[b, :, :n]) * s_
            pk[b, :, start:start + n] = k[b, :, :n] * c + _rotate_half(k[b, :, :n]) * s_
            pv[b, :, start:start + n] = v[b, :, :n]
            keys = pk[b, :, :start + n].repeat_interleave(num_heads // Hkv, 0).float()  # [H, T, D]
            vals = pv[b, :, :start + n].repeat_interleave(num_heads // Hkv, 0).float()
            scores = qb.float() @ keys.transpose(1, 2) * scale  # [H, n, T]
            causal = torch.arange(start + n)[None] <= pos[:, None]  # [n, T]
            out[b, :, :n] = (torch.softmax(scores.masked_fill(~causal, float("-inf")), -1) @ vals).to(q.dtype)
        return out.transpose(1, 2).reshape(B, S, num_heads * D), pk, pv

    @staticmethod
    def symbolic(g, q, k, v, past_k, past_v, seqlens_k, total, query_lens, cos, sin, num_heads, scale):
        packed = k is None
        args = [q, *([] if packed else [k, v]), past_k, past_v, seqlens_k, total, cos, sin,
                *([] if query_lens is None else [query_lens])]
        out, pk, pv = g.op("specrt::Gqa", *args, num_heads_i=num_heads, scale_f=scale, packed_i=int(packed),
                           outputs=3)
        out.setType(q.type().with_sizes(q.type().varyingSizes()[:2] + [None]))
        pk.setType(past_k.type())
        pv.setType(past_v.type())
        return out, pk, pv


class LeanDecoder(nn.Module):
    """`hf_model` rewritten as the lean graph (see above); it consumes the model (projections are fused).

    Per decoder layer: one matmul for q/k/v (+ its bias), GroupQueryAttention, the output matmul, a fused
    residual + RMSNorm, one matmul for gate/up, a Split, SiLU and the product, the down matmul and the next
    fused residual + RMSNorm (qwen3 adds a Split and the per-head norms of q and k). `max_positions`: the
    rotary tables' length, at least the largest cache.
    `query_seqlens`: emit that GroupQueryAttention input (several multi-token rows per call)."""

    def __init__(self, hf_model, max_positions: int, output_ids=None, query_seqlens: bool = True):
        super().__init__()
        _common_init(self, hf_model, max_positions, output_ids)
        self.query_seqlens = query_seqlens
        self.qkv, self.gate_up = nn.ModuleList(), nn.ModuleList()
        for layer in self.model.layers:
            a, mlp = layer.self_attn, layer.mlp
            self.qkv.append(_fused_linear([a.q_proj, a.k_proj, a.v_proj]))
            self.gate_up.append(_fused_linear([mlp.gate_proj, mlp.up_proj]))

    def forward(self, input_ids, seqlens_k, total, logit_index, *rest):
        q_lens, past = (rest[0], rest[1:]) if self.query_seqlens else (None, rest)
        h = self.model.embed_tokens(input_ids)  # [B, S, hidden]
        cos, sin = self.cos_table.to(h.dtype), self.sin_table.to(h.dtype)
        layers = self.model.layers
        x = _RmsNorm.apply(h, layers[0].input_layernorm.weight, layers[0].input_layernorm.variance_epsilon)
        presents = []
        for i, layer in enumerate(layers):
            attn, mlp = layer.self_attn, layer.mlp
            q, k, v = self.qkv[i](x), None, None  # q/k/v packed: [B, S, (H + 2 Hkv) * D]
            if hasattr(attn, "q_norm"):  # qwen3: per-head RMSNorm of q and k before rotary
                H, Hkv, D = self.num_heads, self.num_kv_heads, self.head_dim
                q, k, v = q.split([H * D, Hkv * D, Hkv * D], -1)
                q = _Reshape.apply(_RmsNorm.apply(_Reshape.apply(q, (0, -1, H, D)), attn.q_norm.weight,
                                                  attn.q_norm.variance_epsilon), (0, -1, H * D))
                k = _Reshape.apply(_RmsNorm.apply(_Reshape.apply(k, (0, -1, Hkv, D)), attn.k_norm.weight,
                                                  attn.k_norm.variance_epsilon), (0, -1, Hkv * D))
            out, pk, pv = _Gqa.apply(q, k, v, past[2 * i], past[2 * i + 1], seqlens_k, total, q_lens,
                                     cos, sin, self.num_heads, attn.scaling)  # [B, S, H*D]
            presents += [pk, pv]
            post = layer.post_attention_layernorm
            x, h = _SkipRmsNorm.apply(attn.o_proj(out), h, post.weight, post.variance_epsilon)
            gate_up = self.gate_up[i]
            gate, up = gate_up(x).split(gate_up.out_features // 2, -1)
            norm = layers[i + 1].input_layernorm if i + 1 < len(layers) else self.model.norm
            x, h = _SkipRmsNorm.apply(mlp.down_proj(mlp.act_fn(gate) * up), h, norm.weight, norm.variance_epsilon)
        x = torch.index_select(_Reshape.apply(x, (-1, self.hidden)), 0, logit_index)  # [N, hidden]
        return (self.lm_head(x).float(), *presents)  # [N, V]


def lean_io_names(num_layers: int, query_seqlens: bool = True) -> tuple[list[str], list[str]]:
    past = [n for i in range(num_layers) for n in (f"past_key.{i}", f"past_value.{i}")]
    present = [n for i in range(num_layers) for n in (f"present_key.{i}", f"present_value.{i}")]
    return ["input_ids", "seqlens_k", "total_sequence_length", "logit_index",
            *(["query_seqlens"] if query_seqlens else []), *past], ["logits", *present]


def export_lean(hf_model, out_path, max_positions: int, output_ids=None, query_seqlens: bool = True,
                opset: int = 18) -> LeanDecoder:
    """Trace the lean graph of `hf_model` to `out_path` (external data for large models). Consumes `hf_model`."""
    import onnx

    wrapper = LeanDecoder(hf_model, max_positions, output_ids, query_seqlens).eval()
    dtype = next(hf_model.parameters()).dtype
    L, Hkv, D = wrapper.num_layers, wrapper.num_kv_heads, wrapper.head_dim
    B, S, P, C = 1, 3, 2, 8
    ids = torch.zeros((B, S), dtype=torch.int64)
    seqlens = torch.tensor([P + S - 1], dtype=torch.int32)
    total = torch.tensor([C], dtype=torch.int32)
    logit_index = torch.tensor([S - 1], dtype=torch.int64)
    past = [torch.zeros((B, Hkv, C, D), dtype=dtype) for _ in range(2 * L)]
    extra = [torch.tensor([S], dtype=torch.int32)] if query_seqlens else []
    inputs, outputs = lean_io_names(L, query_seqlens)
    axes = {"input_ids": {0: "batch", 1: "seq"}, "seqlens_k": {0: "batch"}, "query_seqlens": {0: "batch"},
            "logit_index": {0: "n_logits"}, "logits": {0: "n_logits"}}
    for n in inputs[4 + query_seqlens:] + outputs[1:]:
        axes[n] = {0: "batch", 2: "capacity"}
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(wrapper, (ids, seqlens, total, logit_index, *extra, *past), str(out_path), input_names=inputs,
                          output_names=outputs, dynamic_axes={k: v for k, v in axes.items() if k in inputs + outputs},
                          opset_version=opset, do_constant_folding=True, dynamo=False)
    proto = onnx.load(str(out_path), load_external_data=False)
    finish_lean(proto, Hkv)
    onnx.save_model(proto, str(out_path))
    return wrapper


def finish_lean(proto, kv_heads: int) -> None:
    """Give the placeholder ops of a traced lean graph their onnxruntime form, in place."""
    from onnx import helper

    # The tracer leaves an Identity per initializer it found equal to another (tiny test models' norms are
    # all ones) and Constant nodes for split sizes and slice bounds: read them as the tensors they are.
    inits = {t.name for t in proto.graph.initializer}
    alias = {n.output[0]: n.input[0] for n in proto.graph.node if n.op_type == "Identity" and n.input[0] in inits}
    for n in proto.graph.node:
        n.input[:] = [alias.get(i, i) for i in n.input]
    for o in proto.graph.output:
        if o.name in alias:
            raise ExportError(f"graph output {o.name} is a copy of a weight")
    for n in proto.graph.node:
        if n.op_type == "Constant":
            t = helper.get_attribute_value(n.attribute[0])
            t.name = n.output[0]
            proto.graph.initializer.append(t)
    used = {i for n in proto.graph.node for i in n.input} | {o.name for o in proto.graph.output}
    nodes = []
    for n in proto.graph.node:
        if n.op_type == "Constant" or n.output[0] in alias:
            continue
        if n.domain != "specrt":
            nodes.append(n)
            continue
        attrs = {a.name: helper.get_attribute_value(a) for a in n.attribute}
        if n.op_type == "RmsNorm":
            new = helper.make_node("SimplifiedLayerNormalization", list(n.input), list(n.output), name=n.name,
                                   axis=-1, epsilon=attrs["epsilon"], stash_type=1)
        elif n.op_type == "SkipRmsNorm":  # outputs: normed, (mean), (inv_std_var), input + skip
            new = helper.make_node("SkipSimplifiedLayerNormalization", list(n.input),
                                   [n.output[0], "", "", n.output[1] if n.output[1] in used else ""],
                                   name=n.name, domain="com.microsoft", epsilon=attrs["epsilon"])
        elif n.op_type == "Gqa":
            ins = list(n.input)
            qkv = ins[:1] + ["", ""] if attrs["packed"] else ins[:3]
            pk, pv, seqlens, total, cos, sin, *q_lens = ins[1 if attrs["packed"] else 3:]
            inputs = [*qkv, pk, pv, seqlens, total, cos, sin]
            if q_lens:  # GroupQueryAttention's input 16
                inputs += [""] * 7 + q_lens
            new = helper.make_node("GroupQueryAttention", inputs, list(n.output), name=n.name, domain="com.microsoft",
                                   num_heads=attrs["num_heads"], kv_num_heads=kv_heads, scale=attrs["scale"],
                                   do_rotary=1, rotary_interleaved=0)
        else:
            raise ExportError(f"unknown placeholder op {n.op_type}")
        nodes.append(new)
    del proto.graph.node[:]
    proto.graph.node.extend(nodes)
    for imp in proto.opset_import:
        if imp.domain == "specrt":
            proto.opset_import.remove(imp)
            break
    if not any(i.domain == "com.microsoft" for i in proto.opset_import):
        proto.opset_import.append(helper.make_opsetid("com.microsoft", 1))
