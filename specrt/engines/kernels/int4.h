// The int4 x int8 matmul behind the CPU engine's wide passes (docs/kernel.md).
//
// It computes what onnxruntime's MatMulNBits (bits 4, accuracy level 4) computes, Y = A W^T with W in
// 4-bit blocks along K, but with one arithmetic per output element that no caller can change:
//   1. each row of A is quantized to int8 per block of `bs` values: amax = max |a|, scale = amax / 127,
//      q = round-half-even(a * (127 / amax)), and the block's sum of q is kept;
//   2. for each block, the exact integer dot(q, w) - zp * sum(q) is taken (no rounding: an int32);
//   3. acc = fma(float(dot), scale_a * scale_w, acc), blocks in order from the first; y = acc (+ bias).
// Every path (the scalar reference, AVX2, AVX-VNNI, AVX-512, AMX, NEON) gives the same bits, and a row's bits
// never depend on how many rows a call has or where the row sits in it: the integer part is exact and
// the float part is the same operations in the same order for every row.
#pragma once

#include <cstddef>
#include <cstdint>

namespace specrt {

constexpr int kPanel = 16;     // output columns a packed panel holds
constexpr int kRowChunk = 64;  // rows whose float accumulators one pass over the weights keeps
constexpr int kQPad = 16;      // bytes an activation buffer (Acts::q) has past its end

// One MatMulNBits weight packed for the kernels. Panel p holds columns [16p, 16p+16) (zero columns pad
// the last); for each block, bs/8 steps of 64 bytes, then 16 float scales, then 16 float zero points.
// Byte 4c+i of a step holds column c's weights k0+i (low nibble) and k0+4+i (high nibble), k0 = 8 * step:
// one load gives, per column, the 4 consecutive weights a 32-bit lane of a dot-product instruction takes.
struct Packed {
  int K = 0, N = 0, bs = 0, nblk = 0, npanel = 0;
  size_t block_bytes = 0;  // bs * 8 + 128
  uint8_t* data = nullptr;  // npanel * nblk * block_bytes bytes, 64-byte aligned
  float* bias = nullptr;    // [N], or null
  void* chunk = nullptr;    // the memory data lies in (int4.cc)
  // A gated MLP's two matmuls in one (N even, N / 2 a multiple of kPanel, no bias): the output has N / 2
  // columns, column j = silu(column j) * column N / 2 + j of the matmul (silu_mul, attention.h). Panels
  // 2i and 2i + 1 hold columns [16i, 16i + 16) and [N / 2 + 16i, ...), so a kernel's panel range must
  // start and end at even panels.
  bool glu = false;
  int out_cols() const { return glu ? N / 2 : N; }
};

// The activations of one call, quantized (step 1 above). The int8 values are stored by 8 (one step of a
// block) and then by row, so that a vector tile reaches all its rows' bytes of a step from one address; or,
// for the AMX path (`rows_major`), row by row, so that a tile row is 64 consecutive values of one row. q has
// room for kRowPad more rows and kQPad more bytes (acts_bytes): a path may read a few rows past the last.
struct Acts {
  int M = 0, Kp = 0, nblk = 0;  // Kp = nblk * bs: rows are zero-padded to whole blocks
  int8_t* q = nullptr;      // [Kp / 8][M][8], or [M][Kp] when rows_major
  float* scale = nullptr;   // [M][nblk]
  float* sum = nullptr;     // [M][nblk], exact integers
  bool rows_major = false;
  int8_t* at(int r, int k) const {  // value k of row r
    return rows_major ? q + (size_t)r * Kp + k : q + ((size_t)(k >> 3) * M + r) * 8 + (k & 7);
  }
};
constexpr int kRowPad = 15;
inline size_t acts_bytes(int M, int Kp) { return (size_t)(M + kRowPad) * Kp + kQPad; }

// Computes rows [r0, r0 + nr) (nr <= kRowChunk) of panels [p0, p1) into y (row stride ldy floats; with
// w.glu, the gated columns of panel pairs [p0, p1), both even).
using Kernel = void (*)(const Packed& w, const Acts& a, int r0, int nr, int p0, int p1, float* y, size_t ldy);
// Step 1 for rows [row0, row0 + rows) of A (row stride lda floats) into out, whose rows it fills.
using Quantizer = void (*)(const float* A, size_t lda, int row0, int rows, int K, int bs, const Acts& out);

// A path: its kernel, the quantizer it runs with (every quantizer gives the same bytes) and the layout of
// the activations its kernel reads. Where `narrow` is set, it runs instead for calls of at most
// `narrow_rows` rows (a path that loses on few rows) and for weights whose block size `takes` refuses: the
// bits are the same.
struct Impl {
  Kernel kernel = nullptr;
  Quantizer quantize = nullptr;
  bool rows_major = false;
  const Impl* narrow = nullptr;
  int narrow_rows = 0;
  bool (*takes)(int bs) = nullptr;  // null: every block size
  const Impl& for_block(int bs) const { return narrow && takes && !takes(bs) ? *narrow : *this; }
  const Impl& for_rows(int M) const { return narrow && M <= narrow_rows ? *narrow : *this; }
};

// Kernel paths, in order of preference.
enum Path { kAvx512Amx, kAvx512Vnni, kAvx512, kAvxVnni, kAvx2, kNeonI8mm, kNeonDot, kScalar, kPaths };
extern const char* const kPathNames[kPaths];

Impl impl_for(Path path);  // nulls where this build has no such path
bool cpu_has(Path path);    // the CPU (and OS) run it
// Path `name` ("auto": the best this CPU runs that passed its self-check; never the scalar path, which
// exists to define and test the arithmetic). Null when that path cannot run here.
const Impl* choose(const char* name, Path* chosen);

// Packs B [N][nblk][bs/2] (MatMulNBits' layout), scales [N][nblk], zero points [N][ceil(nblk/2)] (4-bit,
// low nibble first; null: 8) and bias [N] (may be null); `glu`: as a gated MLP's two matmuls in one
// (Packed::glu). Returns false when out of memory, or for `glu` with a bias or an N it does not take.
bool pack(const uint8_t* B, const float* scales, const uint8_t* zp, const float* bias, int K, int N, int bs,
          Packed* out, bool glu = false);
void release(Packed* w);

// A root-mean-square norm in front of a matmul (an onnxruntime SkipSimplifiedLayerNormalization or
// SimplifiedLayerNormalization folded into it, engines/int4.py), one row of K values: s = a + skip (a alone
// when skip is null), written to `sum` unless it is null; y = s * (1 / sqrt(mean(s * s) + eps)) * gamma, each
// product rounded in that order. The squares are summed in 8 partial sums (value i into sum i % 8, in
// order), added as ((0 + 1) + (2 + 3)) + ((4 + 5) + (6 + 7)): plain float operations in one order, so the
// same bits on every path and in any pass.
void rms_norm(const float* a, const float* skip, const float* gamma, float eps, int K, float* sum, float* y);

// Path kernels and quantizers; defined in the per-ISA files (null where a build lacks them).
void kernel_scalar(const Packed& w, const Acts& a, int r0, int nr, int p0, int p1, float* y, size_t ldy);
void quantize_scalar(const float* A, size_t lda, int row0, int rows, int K, int bs, const Acts& out);
extern const Kernel kAvx2Kernel, kAvxVnniKernel, kAvx512Kernel, kAvx512VnniKernel, kAvx512AmxKernel, kNeonDotKernel,
    kNeonI8mmKernel;
// The AVX-512 VNNI path with Intel's memory-side traits (prefetch), chosen for it on a GenuineIntel CPU (int4.cc)
extern const Kernel kAvx512VnniIntelKernel;
extern const Quantizer kAvx2Quantize;  // every x86 path runs with it
bool amx_takes(int bs);  // the block sizes the AMX kernel takes

}  // namespace specrt





