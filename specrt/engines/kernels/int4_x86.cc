// The x86 paths: AVX2 (+FMA), AVX-VNNI, AVX-512 (F+BW) and AVX-512 VNNI, each the shared tile body
// (int4_tile.inc) compiled for its instruction set; int4.cc picks one at run time from the CPU's features.
#include "attention.h"
#include "int4.h"
#include "target.h"

#if defined(__x86_64__)
#include <immintrin.h>

#include <cmath>
#include <cstring>

// GCC 12 warns that _mm512_cvtepi32_ps reads an uninitialized vector (its own _mm512_undefined_ps)
#if !defined(__clang__)
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif

namespace specrt {

// 256-bit lanes: 8 columns a vector. Without VNNI, u8 x s8 pairs are summed to 16 bits (vpmaddubsw) and
// widened to 32 bits once per 4 steps (vpmaddwd).
#define SPECRT_YMM_TRAITS                                                                               \
  static constexpr int L = 8;                                                                         \
  static constexpr int kPrefetchFrom = 1, kAhead = 4, kFarFrom = 1 << 30, kFar = 0;                   \
  using V = __m256i;                                                                                  \
  using F = __m256;                                                                                   \
  static V zero() { return _mm256_setzero_si256(); }                                                 \
  static V load(const uint8_t* p) { return _mm256_load_si256((const __m256i*)p); }                  \
  static V lo(V v) { return _mm256_and_si256(v, _mm256_set1_epi8(15)); }                             \
  static V hi(V v) { return _mm256_and_si256(_mm256_srli_epi16(v, 4), _mm256_set1_epi8(15)); }       \
  static V bcast(const int8_t* p) { return _mm256_castps_si256(_mm256_broadcast_ss((const float*)(const void*)p)); } \
  static F cvt(V v) { return _mm256_cvtepi32_ps(v); }                                                 \
  static F loadf(const float* p) { return _mm256_loadu_ps(p); }                                       \
  static void storef(float* p, F v) { _mm256_storeu_ps(p, v); }                                       \
  static F set1(float x) { return _mm256_set1_ps(x); }                                                \
  static F fnmadd(F a, F b, F c) { return _mm256_fnmadd_ps(a, b, c); }                                \
  static F mul(F a, F b) { return _mm256_mul_ps(a, b); }                                              \
  static F fmadd(F a, F b, F c) { return _mm256_fmadd_ps(a, b, c); }

#define SPECRT_ZMM_TRAITS                                                                               \
  static constexpr int L = 16;                                                                       \
  using V = __m512i;                                                                                  \
  using F = __m512;                                                                                   \
  static V zero() { return _mm512_setzero_si512(); }                                                 \
  static V load(const uint8_t* p) { return _mm512_load_si512((const void*)p); }                      \
  static V lo(V v) { return _mm512_and_si512(v, _mm512_set1_epi8(15)); }                             \
  static V hi(V v) { return _mm512_and_si512(_mm512_srli_epi16(v, 4), _mm512_set1_epi8(15)); }       \
  static V bcast(const int8_t* p) { int x; memcpy(&x, p, 4); return _mm512_set1_epi32(x); }          \
  static F cvt(V v) { return _mm512_cvtepi32_ps(v); }                                                 \
  static F loadf(const float* p) { return _mm512_loadu_ps(p); }                                       \
  static void storef(float* p, F v) { _mm512_storeu_ps(p, v); }                                       \
  static F set1(float x) { return _mm512_set1_ps(x); }                                                \
  static F fnmadd(F a, F b, F c) { return _mm512_fnmadd_ps(a, b, c); }                                \
  static F mul(F a, F b) { return _mm512_mul_ps(a, b); }                                              \
  static F fmadd(F a, F b, F c) { return _mm512_fmadd_ps(a, b, c); }

SPECRT_TARGET_BEGIN("avx2,fma")
// Step 1 of int4.h, 8 values at a time: the same operations as quantize_scalar (an exact max, one division,
// a product rounded half to even by the default rounding mode), so the same bytes.
static void quantize_avx2(const float* A, size_t lda, int row0, int rows, int K, int bs, const Acts& out) {
  const __m256 sign = _mm256_set1_ps(-0.0f), big = _mm256_set1_ps(3.402823466e38f);
  for (int r = row0; r < row0 + rows; ++r) {
    const float* a = A + (size_t)r * lda;
    for (int b = 0; b < out.nblk; ++b) {
      const int k0 = b * bs, k1 = k0 + bs < K ? k0 + bs : K;
      int k = k0;
      __m256 vmax = _mm256_setzero_ps(), ok = _mm256_castsi256_ps(_mm256_set1_epi32(-1));
      for (; k + 8 <= k1; k += 8) {
        const __m256 x = _mm256_andnot_ps(sign, _mm256_loadu_ps(a + k));
        ok = _mm256_and_ps(ok, _mm256_cmp_ps(x, big, _CMP_LE_OQ));  // false for inf and NaN
        vmax = _mm256_max_ps(vmax, x);
      }
      float lanes[8];
      _mm256_storeu_ps(lanes, vmax);
      float amax = 0.0f;
      bool finite = _mm256_movemask_ps(ok) == 0xff;
      for (int i = 0; i < 8; ++i) amax = lanes[i] > amax ? lanes[i] : amax;
      for (int t = k; t < k1; ++t) {
        const float x = std::fabs(a[t]);
        finite = finite && x <= 3.402823466e38f;
        amax = x > amax ? x : amax;
      }
      const size_t at = (size_t)r * out.nblk + b;
      if (amax == 0.0f || !finite) {
        for (k = k0; k < k0 + bs; k += 8) memset(out.at(r, k), 0, 8);
        out.scale[at] = finite ? 0.0f : NAN;
        out.sum[at] = 0.0f;
        continue;
      }
      const float inv = 127.0f / amax;
      const __m256 vinv = _mm256_set1_ps(inv);
      const __m256i lo = _mm256_set1_epi32(-127), hi = _mm256_set1_epi32(127);
      __m256i vsum = _mm256_setzero_si256();
      for (k = k0; k + 8 <= k1; k += 8) {
        __m256i v = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(a + k), vinv));  // rounds half to even
        v = _mm256_max_epi32(_mm256_min_epi32(v, hi), lo);
        vsum = _mm256_add_epi32(vsum, v);
        const __m128i w16 = _mm_packs_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
        _mm_storel_epi64((__m128i*)out.at(r, k), _mm_packs_epi16(w16, w16));
      }
      int sums[8], sum = 0;
      _mm256_storeu_si256((__m256i*)sums, vsum);
      for (int i = 0; i < 8; ++i) sum += sums[i];
      for (; k < k1; ++k) {
        float v = std::nearbyint(a[k] * inv);
        v = v > 127.0f ? 127.0f : (v < -127.0f ? -127.0f : v);
        *out.at(r, k) = (int8_t)v;
        sum += (int)v;
      }
      for (k = k1; k < k0 + bs; ++k) *out.at(r, k) = 0;
      out.scale[at] = amax / 127.0f;
      out.sum[at] = (float)sum;
    }
  }
}

namespace x86_avx2 {
struct T {
  SPECRT_YMM_TRAITS
  static constexpr int R = 4;  // 8 accumulators, 4 weight vectors, a broadcast and the mask: 14 of 16 registers
  static constexpr bool kWide = false;
  static V dot(V acc, V w, V a) {
    acc = _mm256_add_epi16(acc, _mm256_maddubs_epi16(w, a));
    __asm__("" : "+x"(acc));  // keeps the sums in the written order, so each accumulator stays in a register
    return acc;
  }
  static V dotp(V acc, V w, const int8_t* p) { return dot(acc, w, bcast(p)); }
  static V fold(V s32, V s16) { return _mm256_add_epi32(s32, _mm256_madd_epi16(s16, _mm256_set1_epi16(1))); }
};
#include "int4_tile.inc"
#include "int4_kernel.inc"
}  // namespace x86_avx2
SPECRT_TARGET_END

SPECRT_TARGET_BEGIN("avx2,fma,avxvnni")
namespace x86_avxvnni {
struct T {
  SPECRT_YMM_TRAITS
  static constexpr int R = 4;
  static constexpr bool kWide = true;
  static V dot(V acc, V w, V a) { return _mm256_dpbusd_avx_epi32(acc, w, a); }
  static V dotp(V acc, V w, const int8_t* p) { return dot(acc, w, bcast(p)); }
  static V fold(V s32, V acc) { return _mm256_add_epi32(s32, acc); }
};
#include "int4_tile.inc"
#include "int4_kernel.inc"
}  // namespace x86_avxvnni
SPECRT_TARGET_END

SPECRT_TARGET_BEGIN("avx2,fma,avx512f,avx512bw")
namespace x86_avx512 {
struct T {
  SPECRT_ZMM_TRAITS
  static constexpr int R = 8;  // 16- and 32-bit accumulators per row
  static constexpr int kPrefetchFrom = 1, kAhead = 4, kFarFrom = 1 << 30, kFar = 0;
  static constexpr bool kWide = false;
  static V dot(V acc, V w, V a) { return _mm512_add_epi16(acc, _mm512_maddubs_epi16(w, a)); }
  static V dotp(V acc, V w, const int8_t* p) { return dot(acc, w, bcast(p)); }
  static V fold(V s32, V s16) { return _mm512_add_epi32(s32, _mm512_madd_epi16(s16, _mm512_set1_epi16(1))); }
};
#include "int4_tile.inc"
#include "int4_kernel.inc"
}  // namespace x86_avx512
SPECRT_TARGET_END

SPECRT_TARGET_BEGIN("avx2,fma,avx512f,avx512bw,avx512vnni")
namespace x86_avx512vnni {
struct T {
  SPECRT_ZMM_TRAITS
  // up to 12 rows a tile, each with two accumulators (low and high nibbles): 24 of the 32 registers, and the
  // broadcast folded into vpdpbusd. 16-row tiles (one accumulator a row) serialized a row's two dots (Zen 4,
  // two threads: 1.04-1.28x at 9 to 64 rows for tiles of 8); 12 over 8 saves a second tile's unpacking and
  // reading of each step at 9 to 12 rows (1.05-1.11x at 9 rows on every target shape, same bits)
  static constexpr int R = 12;
  // Software prefetch (Zen 4, two threads, docs/kernel.md): none at 1 to 3 rows, where the hardware's
  // own prefetch streams faster without it (1.1-1.3x); from 4 rows, 8 blocks ahead into L2 (1.2-1.6x at
  // 4 to 7 rows); never into L1 (8-10% slower at 9 to 16 rows).
  static constexpr int kPrefetchFrom = 1 << 30, kAhead = 0, kFarFrom = 4, kFar = 8;
  static constexpr bool kWide = true;
  static V dot(V acc, V w, V a) { return _mm512_dpbusd_epi32(acc, w, a); }
  // vpdpbusd with its activation word broadcast from memory by the instruction itself ({1to16}): no
  // broadcast instruction of its own, and the accumulator stays in its register
  static V dotp(V acc, V w, const int8_t* p) {
    __asm__("vpdpbusd %2%{1to16%}, %1, %0" : "+v"(acc) : "v"(w), "m"(*(const int32_t*)(const void*)p));
    return acc;
  }
  static V fold(V s32, V acc) { return _mm512_add_epi32(s32, acc); }
};
#include "int4_tile.inc"
#include "int4_kernel.inc"
}  // namespace x86_avx512vnni

// The same path with Intel's prefetch (a per-CPU trait, int4.cc picks it from CPUID's vendor; the same
// instructions and bits). Measured on an Emerald Rapids Xeon (two threads, weights from memory, paired against
// a plain read of the same bytes and against the Zen 4 choice with bench/kernels/kernel_ab.cc, docs/kernel.md
// "The AVX-512 VNNI path on Intel"): Intel's hardware prefetch alone leaves a one-row call at 0.62-0.71 of
// the read's rate, where Zen 4's streams at the read's rate; 4 blocks ahead into L1 and 8 into L2 from the
// first row bring it to 0.96-1.0, and 5 rows from 0.71-0.78 to 0.79-0.91.
namespace x86_avx512vnni_intel {
struct T : x86_avx512vnni::T {
  static constexpr int kPrefetchFrom = 1, kAhead = 4, kFarFrom = 1, kFar = 8;
};
#include "int4_tile.inc"
#include "int4_kernel.inc"
}  // namespace x86_avx512vnni_intel
SPECRT_TARGET_END

const Quantizer kAvx2Quantize = quantize_avx2;
const Kernel kAvx2Kernel = x86_avx2::kernel, kAvxVnniKernel = x86_avxvnni::kernel,
             kAvx512Kernel = x86_avx512::kernel, kAvx512VnniKernel = x86_avx512vnni::kernel,
             kAvx512VnniIntelKernel = x86_avx512vnni_intel::kernel;

}  // namespace specrt
#endif
