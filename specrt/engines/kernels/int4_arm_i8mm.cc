// The Arm path with the int8 matrix multiply (i8mm: Neoverse V1/V2 and N2, Graviton 3+, Cortex-A710+, Apple
// M2+): a tile of its own, two rows at a time. int4.cc checks the CPU.
// On Arm, setup.py compiles this file alone with -march=armv8.2-a+dotprod+i8mm (kernels/sources.py):
// clang (14 here, and others) declares these intrinsics only in a file compiled so, not in a function
// given a target attribute. Only this path's code is here, all of it static but the kernel's pointer, so
// nothing else the library runs is compiled for that instruction set. Built without it, the path is null.
#include "attention.h"
#include "int4.h"

#if defined(__aarch64__) && defined(__ARM_FEATURE_MATMUL_INT8)
#include <cstring>

#include "int4_neon.h"

namespace specrt {

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

const Kernel kNeonI8mmKernel = arm_i8mm::kernel;

}  // namespace specrt
#else
namespace specrt {
const Kernel kNeonI8mmKernel = nullptr;
}  // namespace specrt
#endif
