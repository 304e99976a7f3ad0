"""Weight-only quantization as onnxruntime's operators read it: MatMulNBits weights (int4 blocks along K) and
GatherBlockQuantized embedding tables (4 or 8 bits in blocks along the hidden axis).

Both are computed per output row (a MatMulNBits column, an embedding row), so a matrix quantized in chunks of
rows gives the same bytes as the whole matrix at once: the graph builder quantizes a chunk at a time.
"""
from __future__ import annotations

import numpy as np

# onnxruntime reads a MatMulNBits weight from the mapped file while it prepacks it, so loading holds a weight
# twice for a moment: the output matrix (151936 x 1536 in int4, 117 MB) raised a target-only process's peak
# by 110 MB above what it holds after loading. Slices of at most this many output rows bound that to ~25 MB;
# each output column is the same dot product, so the logits are unchanged bit for bit (tests/test_export.py),
# as long as slices start on the kernels' column tiles (a width of 133 changed them at accuracy level 0).
SLICE_ROWS = 32768


def matmul_4bits(rows: np.ndarray, block_size: int, symmetric: bool):
    """Rows [n, K] of a weight (output rows, the float type of the graph) as MatMulNBits's (B [n, K/block,
    block/2] uint8, scales [n, K/block], zero points [n, ceil(K/block / 2)] uint8), by onnxruntime's own
    quantizer (the function its MatMulNBitsQuantizer calls), so the bytes are the ones that quantizer writes."""
    from onnxruntime.capi._pybind_state import quantize_matmul_4bits

    n, K = rows.shape
    k_blocks = -(-K // block_size)
    weight = np.ascontiguousarray(rows.T)  # [K, n], as the MatMul's B input
    if k_blocks * block_size > K:  # the quantizer pads K with zeros to whole blocks
        weight = np.pad(weight, ((0, k_blocks * block_size - K), (0, 0)))
    packed = np.zeros((n, k_blocks, block_size // 2), np.uint8)
    zero_points = np.zeros((n, (k_blocks + 1) // 2), np.uint8)
    scales = np.zeros((n, k_blocks), weight.dtype)
    quantize_matmul_4bits(packed, weight, scales, zero_points, block_size, n, K, symmetric)
    return packed, scales, zero_points


def quantize_blocks(table, bits: int, block_size: int):
    """Asymmetric weight-only quantization of a [V, H] table along H in blocks: (data, scales, zero_points)
    as com.microsoft GatherBlockQuantized (and MatMulNBits) read them, two 4-bit values a byte low nibble
    first. Scales keep the table's float type."""
    V, H = table.shape
    top = (1 << bits) - 1
    blocks = table.astype(np.float32).reshape(V, H // block_size, block_size)
    lo, hi = np.minimum(blocks.min(-1), 0), np.maximum(blocks.max(-1), 0)  # 0 stays exact
    scale = np.maximum((hi - lo) / top, np.finfo(np.float32).tiny)
    zero = np.clip(np.round(-lo / scale), 0, top).astype(np.uint8)
    q = np.clip(np.round(blocks / scale[..., None]) + zero[..., None], 0, top).astype(np.uint8).reshape(V, H)
    if bits == 4:
        q = q[:, 0::2] | (q[:, 1::2] << 4)
        packed = np.zeros((V, (zero.shape[1] + 1) // 2), np.uint8)
        packed[:] = zero[:, 0::2]
        packed[:, : zero.shape[1] // 2] |= zero[:, 1::2] << 4
        zero = packed
    return q, scale.astype(table.dtype), zero
