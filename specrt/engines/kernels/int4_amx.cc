// The AMX path (Intel CPUs with AMX-TILE and AMX-INT8): the integer part of each block by tile multiplies,
// the float part with AVX-512, in the order int4.h fixes, so the same bits as every other path.
//
// Per panel of 16 columns and block of bs values, the block's packed steps are unpacked once into weight
// tiles in the layout `tdpbssd` takes (kb / 4 rows of 16 columns x 4 consecutive K), the zero point
// subtracted from each weight on the way (w - z lies in -15..15): a tile multiply then sums
// q * (w - z) = dot(q, w) - z * sum(q) exactly, which is step 2's integer. Rows go in groups of up to 16
// (rows-major Acts: a tile row is kb consecutive values of one row). Step 3 needs each block's integers
// as floats, so every block's result tile is stored and read back into vector registers; the sums of a
// panel's rows stay in registers across its blocks, and two result tiles alternate so that one block's
// float step runs while the next one multiplies.
#include "attention.h"
#include "int4.h"
#include "target.h"

#if defined(__x86_64__)
#include <immintrin.h>

#include <cstdlib>
#include <cstring>

#if !defined(__clang__)
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif

namespace specrt {

SPECRT_TARGET_BEGIN("avx2,fma,avx512f,avx512bw,avx512vnni")
namespace x86_amx {

// The tile instructions, written out so that a tile number can be a template argument (GCC's intrinsics
// paste theirs into the instruction text) and so that no compiler needs to know AMX's intrinsics.
template <int t>
static inline void tile_load(const void* p, size_t stride) {
  __asm__ volatile("tileloadd (%0,%1,1), %%tmm%c2" ::"r"(p), "r"(stride), "i"(t) : "memory");
}
template <int t>
static inline void tile_store(void* p, size_t stride) {
  __asm__ volatile("tilestored %%tmm%c2, (%0,%1,1)" ::"r"(p), "r"(stride), "i"(t) : "memory");
}
template <int t>
static inline void tile_zero() {
  __asm__ volatile("tilezero %%tmm%c0" ::"i"(t));
}
template <int c, int a, int b>  // c += a (signed bytes) times b (signed bytes, 4 K values per int32)
static inline void tile_dot() {
  __asm__ volatile("tdpbssd %%tmm%c2, %%tmm%c1, %%tmm%c0" ::"i"(c), "i"(a), "i"(b));
}

struct __attribute__((packed)) Config {
  uint8_t palette = 1, start_row = 0, zero[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

constexpr int kTileRows = 16;
constexpr size_t kRunBytes = 131072;  // packed weights of the panels that share each load of activations
// Software prefetch of the packed weights, as the AVX-512 VNNI path's on Intel (docs/kernel.md): 4 blocks ahead into
// L1 and 8 into L2 while a run's first group of rows unpacks them. Emerald Rapids, two threads, gate/up from memory,
// paired against none (the same bits): 1.27x at 13 and 16 rows, 1.18x at 32.
constexpr int kAhead = 4, kFar = 8;

// Block spans it takes: a block of bs values is S spans of kb (64, or 32 when bs is not a multiple of 64).
inline int spans(int bs) { return bs % 64 ? bs / 32 : bs / 64; }

// One block of one panel's packed weights as S weight tiles (bs * 16 bytes): step s's low nibbles are K
// values 8s..8s+3 of its 16 columns (tile row 2s), its high nibbles 8s+4..8s+7 (row 2s + 1), each minus its
// column's zero point (in the 4 bytes of lane c).
static inline void unpack(const uint8_t* blk, int bs, int8_t* out) {
  const __m512i mask = _mm512_set1_epi8(15);
  const float* zf = (const float*)(blk + (size_t)bs * 8) + kPanel;
  const __m512i z = _mm512_mullo_epi32(_mm512_cvttps_epi32(_mm512_loadu_ps(zf)), _mm512_set1_epi32(0x01010101));
  for (int s = 0; s < bs / 8; ++s) {
    const __m512i x = _mm512_load_si512((const void*)(blk + (size_t)s * 64));
    _mm512_store_si512((void*)(out + s * 128), _mm512_sub_epi8(_mm512_and_si512(x, mask), z));
    _mm512_store_si512((void*)(out + s * 128 + 64), _mm512_sub_epi8(_mm512_and_si512(_mm512_srli_epi16(x, 4), mask), z));
  }
}

// Tiles for blocks of S spans: 0 and 1 weights (span by span in turn), 2 .. 2 + S - 1 the activations of a
// block (one per span), the rest results, used in turn.
template <int S>
struct Tiles {
  static constexpr int kFirstResult = 2 + S, kResults = 6 - S;

  static void configure(int rows, int kb) {
    Config cfg;
    for (int t = 0; t < 2; ++t) cfg.rows[t] = (uint8_t)(kb / 4), cfg.colsb[t] = 64;
    for (int t = 2; t < 2 + S; ++t) cfg.rows[t] = (uint8_t)rows, cfg.colsb[t] = (uint16_t)kb;
    for (int t = kFirstResult; t < 8; ++t) cfg.rows[t] = (uint8_t)rows, cfg.colsb[t] = 64;
    __asm__ volatile("ldtilecfg %0" ::"m"(cfg));
  }

  template <int s>
  static void load_acts(const Acts& a, int r, int k, int kb) {
    if constexpr (s < S) {
      tile_load<2 + s>(a.at(r, k + s * kb), (size_t)a.Kp);
      load_acts<s + 1>(a, r, k, kb);
    }
  }

  template <int c, int s>
  static void spans_into(const int8_t* wt, int kb) {
    if constexpr (s < S) {
      tile_load<s & 1>(wt + (size_t)s * kb * 16, 64);
      tile_dot<c, 2 + s, s & 1>();
      spans_into<c, s + 1>(wt, kb);
    }
  }

  // result tile kFirstResult + i = this block's activations times wt, stored to `out`
  template <int i>
  static void block(int which, const int8_t* wt, int kb, int32_t* out) {
    if constexpr (i < kResults) {
      if (which != i) return block<i + 1>(which, wt, kb, out);
      tile_zero<kFirstResult + i>();
      spans_into<kFirstResult + i, 0>(wt, kb);
      tile_store<kFirstResult + i>(out, 64);
    }
  }
};

// Step 3 of one block into the rows' accumulators, held in registers across a panel's blocks.
static inline __attribute__((always_inline)) void fold(const int32_t* dots, const float* sw, const float* sa,
                                                       size_t sa_stride, int n, __m512 (&acc)[kTileRows]) {
  const __m512 s = _mm512_loadu_ps(sw);
#pragma GCC unroll 16
  for (int i = 0; i < kTileRows; ++i)
    if (i < n)
      acc[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_load_si512((const void*)(dots + i * kPanel))),
                               _mm512_mul_ps(s, _mm512_set1_ps(sa[i * sa_stride])), acc[i]);
}

// One run of panels [q0, q1) for rows [r0, r0 + nr) into out ([panel - q0][row][16]), `wt` room for their
// unpacked weights: groups of rows in turn, then panels, then blocks in order. A panel's sums stay in
// registers over its blocks; each block's result tile alternates between two, so that the float step of
// one block overlaps the next one's multiplies.
template <int S>
static void run(const Packed& w, const Acts& a, int r0, int nr, int rows, int q0, int q1, int8_t* wt, float* out) {
  using Tl = Tiles<S>;
  const int kb = w.bs / S, groups = (nr + rows - 1) / rows;
  const size_t blk_bytes = (size_t)w.bs * 16;
  alignas(64) int32_t dots[2][kTileRows * kPanel];
  for (int g = 0; g < groups; ++g) {
    const int r = r0 + g * rows, n = nr - g * rows < rows ? nr - g * rows : rows;
    const float* sa = a.scale + (size_t)r * a.nblk;
    for (int p = q0; p < q1; ++p) {
      __m512 acc[kTileRows];
#pragma GCC unroll 16
      for (int i = 0; i < kTileRows; ++i) acc[i] = _mm512_setzero_ps();
      const uint8_t* panel = w.data + (size_t)p * w.nblk * w.block_bytes;
      int8_t* wp = wt + (size_t)(p - q0) * w.nblk * blk_bytes;
      for (int b = 0; b < w.nblk; ++b) {
        const uint8_t* blk = panel + (size_t)b * w.block_bytes;
        int8_t* wb = wp + (size_t)b * blk_bytes;
        if (g == 0) {
          const uint8_t* end = w.data + (size_t)q1 * w.nblk * w.block_bytes;  // the run's last panel's end
          const uint8_t* ahead = blk + kAhead * w.block_bytes;
          if (ahead < end)
            for (size_t at = 0; at < w.block_bytes; at += 64) __builtin_prefetch(ahead + at, 0, 3);
          const uint8_t* far = blk + kFar * w.block_bytes;
          if (far < end)
            for (size_t at = 0; at < w.block_bytes; at += 64) __builtin_prefetch(far + at, 0, 2);
          unpack(blk, w.bs, wb);
        }
        Tl::template load_acts<0>(a, r, b * w.bs, kb);
        Tl::template block<0>(b & 1, wb, kb, dots[b & 1]);
        if (b > 0) {
          const uint8_t* prev = blk - w.block_bytes;
          fold(dots[(b - 1) & 1], (const float*)(prev + (size_t)w.bs * 8), sa + b - 1, a.nblk, n, acc);
        }
      }
      const uint8_t* last = panel + (size_t)(w.nblk - 1) * w.block_bytes;
      fold(dots[(w.nblk - 1) & 1], (const float*)(last + (size_t)w.bs * 8), sa + w.nblk - 1, a.nblk, n, acc);
      float* o = out + ((size_t)(p - q0) * nr + (r - r0)) * kPanel;
#pragma GCC unroll 16
      for (int i = 0; i < kTileRows; ++i)
        if (i < n) _mm512_store_ps(o + i * kPanel, acc[i]);
    }
  }
}

// A run's results to y: gated pairs through silu_mul, else with the bias.
static void write(const Packed& w, int r0, int nr, int q0, int q1, const float* acc, float* y, size_t ldy) {
  for (int p = q0; p < q1; ++p) {
    const float* pa = acc + (size_t)(p - q0) * nr * kPanel;
    if (w.glu) {
      if (p & 1)
        for (int i = 0; i < nr; ++i)
          silu_mul(pa - (size_t)nr * kPanel + i * kPanel, pa + i * kPanel, kPanel,
                   y + (size_t)(r0 + i) * ldy + (size_t)p / 2 * kPanel);
      continue;
    }
    const int cols = w.N - p * kPanel < kPanel ? w.N - p * kPanel : kPanel;
    for (int i = 0; i < nr; ++i) {
      float* dst = y + (size_t)(r0 + i) * ldy + (size_t)p * kPanel;
      for (int c = 0; c < cols; ++c) dst[c] = w.bias ? pa[i * kPanel + c] + w.bias[p * kPanel + c] : pa[i * kPanel + c];
    }
  }
}

// Grown on demand and kept by each thread between calls.
struct Scratch {
  void* data = nullptr;
  size_t size = 0;
  void* get(size_t need) {
    if (size >= need) return data;
    free(data);
    size = 0;
    if ((data = aligned_alloc(64, (need + 63) / 64 * 64))) size = need;
    return data;
  }
  ~Scratch() { free(data); }
};

template <int S>
static void kernel_of(const Packed& w, const Acts& a, int r0, int nr, int p0, int p1, float* y, size_t ldy) {
  // groups of nearly equal size; each reads `rows` rows, the last perhaps a few past the call's (Acts has room)
  const int groups = (nr + kTileRows - 1) / kTileRows, rows = (nr + groups - 1) / groups;
  const size_t panel_bytes = (size_t)w.nblk * w.block_bytes;
  int per_run = (int)(kRunBytes / panel_bytes) > 1 ? (int)(kRunBytes / panel_bytes) : 1;
  if (w.glu) per_run += per_run & 1;  // whole pairs of panels
  thread_local Scratch unpacked, accs;
  int8_t* wt = (int8_t*)unpacked.get((size_t)per_run * w.nblk * w.bs * 16);
  float* acc = (float*)accs.get((size_t)per_run * nr * kPanel * sizeof(float));
  if (!wt || !acc) return;  // out of memory for a few hundred KB: the output stays as it was
  Tiles<S>::configure(rows, w.bs / S);  // every call: another library on this thread may have loaded its own
  for (int q0 = p0; q0 < p1; q0 += per_run) {
    const int q1 = q0 + per_run < p1 ? q0 + per_run : p1;
    run<S>(w, a, r0, nr, rows, q0, q1, wt, acc);
    write(w, r0, nr, q0, q1, acc, y, ldy);
  }
  __asm__ volatile("tilerelease");  // the tile state back to its initial one: cheaper to save on a switch
}

static void kernel(const Packed& w, const Acts& a, int r0, int nr, int p0, int p1, float* y, size_t ldy) {
  switch (spans(w.bs)) {
    case 1: return kernel_of<1>(w, a, r0, nr, p0, p1, y, ldy);
    case 2: return kernel_of<2>(w, a, r0, nr, p0, p1, y, ldy);
    case 3: return kernel_of<3>(w, a, r0, nr, p0, p1, y, ldy);
    case 4: return kernel_of<4>(w, a, r0, nr, p0, p1, y, ldy);
    default: return;  // not offered for such blocks (amx_takes)
  }
}

}  // namespace x86_amx
SPECRT_TARGET_END

const Kernel kAvx512AmxKernel = x86_amx::kernel;
bool amx_takes(int bs) { return bs >= 32 && bs % 32 == 0 && x86_amx::spans(bs) <= 4; }

}  // namespace specrt
#else
namespace specrt {
const Kernel kAvx512AmxKernel = nullptr;
bool amx_takes(int) { return false; }
}  // namespace specrt
#endif
