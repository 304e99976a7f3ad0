// The Arm paths: NEON with the dot-product instructions (Armv8.2 dotprod: Cortex-A76/A78, Jetson Orin,
// Graviton 2+; the shared tile, 4 columns a vector) and with the int8 matrix multiply (i8mm: Neoverse V1/V2
// and N2, Graviton 3+, Cortex-A710+; a tile of its own, two rows at a time). int4.cc checks the CPU.
#include "int4.h"

#if defined(__aarch64__)
#include <arm_neon.h>

#include <cstring>

namespace specrt {

// The traits both paths use: 4 columns a vector, sums in 32-bit lanes.
#define SPECRT_NEON_TRAITS                                                                              \
  static constexpr int L = 4, R = 4;                                                                  \
  static constexpr bool kWide = true;                                                                 \
  using V = int32x4_t;                                                                                \
  using F = float32x4_t;                                                                              \
  static V zero() { return vdupq_n_s32(0); }                                                          \
  static V load(const uint8_t* p) { return vreinterpretq_s32_u8(vld1q_u8(p)); }                      \
  static V lo(V v) { return vreinterpretq_s32_u8(vandq_u8(vreinterpretq_u8_s32(v), vdupq_n_u8(15))); } \
  static V hi(V v) { return vreinterpretq_s32_u8(vshrq_n_u8(vreinterpretq_u8_s32(v), 4)); }          \
  static V bcast(const int8_t* p) { return vld1q_dup_s32((const int32_t*)(const void*)p); }          \
  static V fold(V s32, V acc) { return vaddq_s32(s32, acc); }                                         \
  static F cvt(V v) { return vcvtq_f32_s32(v); }                                                      \
  static F loadf(const float* p) { return vld1q_f32(p); }                                             \
  static void storef(float* p, F v) { vst1q_f32(p, v); }                                              \
  static F set1(float x) { return vdupq_n_f32(x); }                                                   \
  static F fnmadd(F a, F b, F c) { return vfmsq_f32(c, a, b); } /* c - a*b, fused */                 \
  static F mul(F a, F b) { return vmulq_f32(a, b); }                                                  \
  static F fmadd(F a, F b, F c) { return vfmaq_f32(c, a, b); } /* a*b + c, fused */

#pragma GCC push_options
#pragma GCC target("arch=armv8.2-a+dotprod")
namespace arm_dot {
struct T {
  SPECRT_NEON_TRAITS
  // signed x signed bytes: the weights' nibbles (0..15) are valid signed bytes
  static V dot(V acc, V w, V a) { return vdotq_s32(acc, vreinterpretq_s8_s32(w), vreinterpretq_s8_s32(a)); }
  static V dotp(V acc, V w, const int8_t* p) { return dot(acc, w, bcast(p)); }
};
#include "int4_tile.inc"
#include "int4_kernel.inc"
}  // namespace arm_dot
#pragma GCC pop_options

#pragma GCC push_options
#pragma GCC target("arch=armv8.2-a+dotprod+i8mm")
namespace arm_i8mm {
struct T {
  SPECRT_NEON_TRAITS
};

// Rows [r, r + n) of one block of one panel. smmla multiplies a 2 x 8 block of activations (two rows' bytes
// of a step, side by side in Acts) by an 8 x 2 block of weights (two columns' 8 weights, which zipping the
// low and high nibbles of a packed step gives) into 2 x 2 int32 sums: twice the products of an sdot. An
// odd last row is paired with the 8 bytes after it, whose sums are dropped: the row's own are exact.
template <int n>
static inline void tile(const Packed& w, const Acts& a, const uint8_t* blk, int b, int r, float* acc) {
  constexpr int P = (n + 1) / 2;
  const float* sc = (const float*)(blk + (size_t)w.bs * 8);
  const float* zf = sc + kPanel;
  const int steps = w.bs / 8;
  const int8_t* q = a.at(r, b * w.bs);
  const size_t stride = (size_t)a.M * 8;
  int32x4_t c[P][8];  // [row pair][column pair]: sums of (row 0, col 0), (0, 1), (1, 0), (1, 1)
  for (int p = 0; p < P; ++p)
    for (int k = 0; k < 8; ++k) c[p][k] = vdupq_n_s32(0);
  for (int j = 0; j < steps; ++j) {
    int8x16_t rows[P];
    for (int p = 0; p < P; ++p) rows[p] = vld1q_s8(q + j * stride + p * 16);
    for (int g = 0; g < 4; ++g) {  // 4 columns at a time
      const uint8x16_t x = vld1q_u8(blk + (size_t)j * 64 + g * 16);
      const uint32x4_t lo = vreinterpretq_u32_u8(vandq_u8(x, vdupq_n_u8(15)));
      const uint32x4_t hi = vreinterpretq_u32_u8(vshrq_n_u8(x, 4));
      const int8x16_t b0 = vreinterpretq_s8_u32(vzip1q_u32(lo, hi)), b1 = vreinterpretq_s8_u32(vzip2q_u32(lo, hi));
      for (int p = 0; p < P; ++p) {
        c[p][2 * g] = vmmlaq_s32(c[p][2 * g], rows[p], b0);
        c[p][2 * g + 1] = vmmlaq_s32(c[p][2 * g + 1], rows[p], b1);
      }
    }
  }
  for (int v = 0; v < 4; ++v) {  // the float step as the shared tile does it, 4 columns a vector
    const T::F z = T::loadf(zf + v * 4), s = T::loadf(sc + v * 4);
    for (int p = 0; p < P; ++p) {
      const uint64x2_t c0 = vreinterpretq_u64_s32(c[p][2 * v]), c1 = vreinterpretq_u64_s32(c[p][2 * v + 1]);
      const int32x4_t sums[2] = {vreinterpretq_s32_u64(vzip1q_u64(c0, c1)), vreinterpretq_s32_u64(vzip2q_u64(c0, c1))};
      for (int h = 0; h < 2 && 2 * p + h < n; ++h) {
        const int i = 2 * p + h;
        const size_t at = (size_t)(r + i) * a.nblk + b;
        const T::F d = T::fnmadd(z, T::set1(a.sum[at]), T::cvt(sums[h]));  // exact: an integer < 2^24
        float* out = acc + i * kPanel + v * 4;
        T::storef(out, T::fmadd(d, T::mul(s, T::set1(a.scale[at])), T::loadf(out)));
      }
    }
  }
}
#include "int4_kernel.inc"
}  // namespace arm_i8mm
#pragma GCC pop_options

const Kernel kNeonDotKernel = arm_dot::kernel, kNeonI8mmKernel = arm_i8mm::kernel;

}  // namespace specrt
#endif
