// specrt.Attention: what com.microsoft.GroupQueryAttention computes in the lean graph (rotary inside, caches
// [B, Hkv, C, D] read and written in place, ragged rows), with one arithmetic per query row that no other row
// and no pass width changes. onnxruntime's CPU kernel for it rounds a row by the pass around it (its
// matrix products are shaped by the pass), which is what kept a token verified in a k-token pass from
// having exactly the logits of the same token decoded alone.
//
// Per row b of the batch: n new tokens (query_seqlens[b], else S), a total of T = seqlens_k[b] + 1 cache
// entries, so the new tokens sit at positions P .. T - 1 with P = T - n. First every new token's key (after
// the rotary embedding) and value are written into the caches at its position; then each query (after the
// rotary embedding) attends to the entries 0 .. its position:
//   s_j = dot(q, k_j) * scale; m = max s_j; e_j = exp(s_j - m); out = (sum_j e_j v_j) * (1 / sum_j e_j)
// with every sum in a fixed order that depends only on that query's own length.
//
// A row's new tokens may also be a tree (AttentionCall::depth, path): each token is still written at slot
// P + i, but at the rotary position of its depth, P + depth, and attends to the first P entries and then to
// its ancestors' slots by depth, itself last. Its key list is then, entry for entry, that of the same token
// in a chain of its ancestors: each query's operations run over a list of keys by index (key pointers for
// the scores, slots for the weighted sum), so it gets that chain's bits. The arithmetic
// (attention_core.inc) uses GCC's vector extensions (elementwise IEEE operations, -ffp-contract=off), fused
// multiply-adds where it says so (the instruction on AVX2 and NEON, a correctly rounded std::fma elsewhere)
// and explicit reduction trees, so it is the same on every instruction set too.
#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "attention.h"
#include "int4.h"
#include "target.h"

#if defined(__x86_64__)
#include <immintrin.h>
#elif defined(__aarch64__)
#include <arm_neon.h>
#endif

// 32-byte vectors pass between always-inlined helpers only: the ABI note about them does not apply
#pragma GCC diagnostic ignored "-Wpsabi"

#define SPECRT_INLINE inline __attribute__((always_inline))

// Lanes of two vectors picked by constant indices: the builtin clang has (GCC too, from version 12), else
// GCC's older form of it.
#if defined(__clang__) || __GNUC__ >= 12
#define SPECRT_SHUFFLE(a, b, ...) __builtin_shufflevector(a, b, __VA_ARGS__)
#else
#define SPECRT_SHUFFLE(a, b, ...) __builtin_shuffle(a, b, (i8v){__VA_ARGS__})
#endif

namespace specrt {

typedef float f8 __attribute__((vector_size(32)));
typedef int32_t i8v __attribute__((vector_size(32)));
alignas(32) static const float kZeros[512] = {};  // a key that is not there

#if defined(__x86_64__)
SPECRT_TARGET_BEGIN("avx2,fma")
namespace att_avx2 {
SPECRT_INLINE f8 fma8(f8 a, f8 b, f8 c) { return (f8)_mm256_fmadd_ps((__m256)a, (__m256)b, (__m256)c); }
#include "attention_core.inc"
}  // namespace att_avx2
SPECRT_TARGET_END
#endif

namespace att_base {
#if defined(__aarch64__)
SPECRT_INLINE f8 fma8(f8 a, f8 b, f8 c) {
  float32x4_t x[2];
  for (int h = 0; h < 2; ++h)
    x[h] = vfmaq_f32(vld1q_f32(&((const float*)&c)[4 * h]), vld1q_f32(&((const float*)&a)[4 * h]),
                     vld1q_f32(&((const float*)&b)[4 * h]));
  f8 r;
  memcpy(&r, x, sizeof r);
  return r;
}
#else
SPECRT_INLINE f8 fma8(f8 a, f8 b, f8 c) {
  f8 r;
  for (int i = 0; i < 8; ++i) r[i] = std::fma(a[i], b[i], c[i]);
  return r;
}
#endif
#include "attention_core.inc"
}  // namespace att_base

bool attention_shapes_ok(int D) { return D > 0 && D % 16 == 0 && D <= 512; }

size_t attention_scratch(const AttentionCall& c) { return (size_t)kAttentionTile * (2 * c.D + c.C + 8); }

// AVX2 with FMA where the CPU has them (the matmul's AVX2 path needs the same two)
static bool use_avx2() {
#if defined(__x86_64__)
  static const bool yes = cpu_has(kAvx2);
  return yes;
#else
  return false;
#endif
}

void attention_write_kv(const AttentionCall& c, int b, int g, int i) {
#if defined(__x86_64__)
  if (use_avx2()) return att_avx2::write_kv(c, b, g, i);
#endif
  att_base::write_kv(c, b, g, i);
}

void attention_group(const AttentionCall& c, int b, int g, float* scratch) {
#if defined(__x86_64__)
  if (use_avx2()) return att_avx2::group(c, b, g, scratch);
#endif
  att_base::group(c, b, g, scratch);
}

std::string attention_tree(const int32_t* parents, const int* n, int B, int S, std::vector<int>* depth,
                           std::vector<int>* path) {
  depth->clear(), path->clear();
  bool chain = true;
  for (int b = 0; b < B; ++b)
    for (int i = 0; i < n[b]; ++i) {
      const int p = parents[(size_t)b * S + i];
      if (p < -1 || p >= i)
        return "row " + std::to_string(b) + ", token " + std::to_string(i) + ": parent " + std::to_string(p) +
               " is neither -1 (the last cached entry) nor an earlier new token (0 .. " + std::to_string(i - 1) + ")";
      chain = chain && p == i - 1;
    }
  if (chain) return "";
  depth->assign((size_t)B * S, 0), path->assign((size_t)B * S * S, 0);
  for (int b = 0; b < B; ++b)
    for (int i = 0; i < n[b]; ++i) {  // a parent comes before its children: its path is complete
      const size_t at = (size_t)b * S + i;
      const int p = parents[at], d = p < 0 ? 0 : (*depth)[(size_t)b * S + p] + 1;
      int* mine = path->data() + at * S;
      if (p >= 0) memcpy(mine, path->data() + ((size_t)b * S + p) * S, sizeof(int) * d);
      (*depth)[at] = d, mine[d] = i;
    }
  return "";
}

void silu_mul(const float* g, const float* u, int n, float* out) {
#if defined(__x86_64__)
  if (use_avx2()) return att_avx2::silu_mul(g, u, n, out);
#endif
  att_base::silu_mul(g, u, n, out);
}

}  // namespace specrt

// A fixed problem through the attention: its outputs and caches in `out`; returns how many floats. The tests
// compare them across instruction sets: they are the same bits everywhere. `base`: through the baseline
// instructions even where AVX2 is there. `big` 0: 2 rows of 3 and 2 new tokens after pasts of 5 and 0
// entries, 4 heads over 2 key/value heads of 32, 16 slots (2*3*128 + 2 * 2*2*16*32 floats); 1: rows of 9 and
// 4 new tokens after pasts of 30 and 7, 6 heads over 2 of 128, 48 slots (2*9*768 + 2 * 2*2*48*128 floats):
// tiles of 8 and 3 rows whose lengths differ, keys across blocks of 16, a head size of two spans of 64;
// 2: problem 1 with each row's new tokens as a tree (kTreeParents), branches and depths mixed in every tile.
extern "C" __attribute__((visibility("default"))) int specrt_attention_demo(float* out, int base, int big) {
  using namespace specrt;
  static const int32_t kTreeParents[2][9] = {{-1, 0, 0, 1, 2, -1, 5, 3, 7}, {-1, -1, 1, 0}};
  const bool tree = big == 2;
  big = big != 0;
  const int B = 2, S = big ? 9 : 3, H = big ? 6 : 4, Hkv = 2, D = big ? 128 : 32, C = big ? 48 : 16;
  unsigned s = 7;
  auto next = [&s]() { return s = s * 1103515245u + 12345u, (float)((int)((s >> 9) % 2001) - 1000) / 500.0f; };
  std::vector<float> qkv((size_t)B * S * (H + 2 * Hkv) * D), cos((size_t)C * D / 2), sin((size_t)C * D / 2);
  for (auto& x : qkv) x = next();
  for (int p = 0; p < C; ++p)
    for (int i = 0; i < D / 2; ++i) {
      const float a = p / std::pow(10000.0f, (float)i / (D / 2));
      cos[(size_t)p * D / 2 + i] = std::cos(a), sin[(size_t)p * D / 2 + i] = std::sin(a);
    }
  float* o = out;
  float* pk = out + (size_t)B * S * H * D;
  float* pv = pk + (size_t)B * Hkv * C * D;
  for (size_t i = 0; i < (size_t)B * Hkv * C * D; ++i) pk[i] = next(), pv[i] = next();
  const int n[2] = {big ? 9 : 3, big ? 4 : 2}, P[2] = {big ? 30 : 5, big ? 7 : 0};
  AttentionCall c;
  c.B = B, c.S = S, c.H = H, c.Hkv = Hkv, c.D = D, c.C = C, c.n = n, c.P = P;
  c.q = qkv.data(), c.k = c.q + H * D, c.v = c.q + (H + Hkv) * D;
  c.q_stride = c.k_stride = c.v_stride = (size_t)(H + 2 * Hkv) * D;
  c.cos = cos.data(), c.sin = sin.data(), c.present_k = pk, c.present_v = pv, c.out = o, c.scale = 0.17f;
  std::vector<int> depth, path;
  if (tree) {
    if (!attention_tree(&kTreeParents[0][0], n, B, S, &depth, &path).empty() || depth.empty()) return -1;
    c.depth = depth.data(), c.path = path.data();
  }
  for (int b = 0; b < B; ++b)
    for (int i = 0; i < n[b]; ++i)
      for (int g = 0; g < Hkv; ++g) base ? att_base::write_kv(c, b, g, i) : attention_write_kv(c, b, g, i);
  std::vector<float> scratch(attention_scratch(c));
  for (int b = 0; b < B; ++b)
    for (int g = 0; g < Hkv; ++g) base ? att_base::group(c, b, g, scratch.data()) : attention_group(c, b, g, scratch.data());
  return B * S * H * D + 2 * B * Hkv * C * D;
}
