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
// with every sum in a fixed order that depends only on that query's own length. The arithmetic uses GCC's
// vector extensions (elementwise IEEE operations, no fused multiply-add: -ffp-contract=off) and explicit
// reduction trees, so it is the same on every instruction set too.
#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "attention.h"

// 32-byte vectors pass between always-inlined helpers only: the ABI note about them does not apply
#pragma GCC diagnostic ignored "-Wpsabi"

// On x86 the two entry points are built twice, for AVX2 and for the baseline, and the loader picks one by
// the CPU; the helpers are inlined into each. The numbers are the same either way.
#if defined(__x86_64__)
#define SPECRT_CLONES __attribute__((target_clones("avx2", "default")))
#else
#define SPECRT_CLONES
#endif
#define SPECRT_INLINE inline __attribute__((always_inline))

namespace specrt {
namespace {

typedef float f8 __attribute__((vector_size(32)));
typedef int32_t i8v __attribute__((vector_size(32)));

SPECRT_INLINE f8 load8(const float* p) {
  f8 v;
  memcpy(&v, p, sizeof v);
  return v;
}
SPECRT_INLINE void store8(float* p, f8 v) { memcpy(p, &v, sizeof v); }
SPECRT_INLINE f8 splat(float x) { return f8{x, x, x, x, x, x, x, x}; }

// The sum of 8 lanes, in a fixed order: (0+4, 1+5, 2+6, 3+7), then (0+2, 1+3), then (0+1).
SPECRT_INLINE float hsum(f8 v) {
  const float a0 = v[0] + v[4], a1 = v[1] + v[5], a2 = v[2] + v[6], a3 = v[3] + v[7];
  const float b0 = a0 + a2, b1 = a1 + a3;
  return b0 + b1;
}

SPECRT_INLINE float hmax(f8 v) {
  float m = v[0];
  for (int i = 1; i < 8; ++i) m = v[i] > m ? v[i] : m;
  return m;
}

// e^x for x <= 0 (a softmax's exponents), lane by lane: x = n ln2 + r, |r| <= ln2 / 2, e^r by a degree-6
// polynomial (relative error ~2e-7), times 2^n built in the exponent bits. Below -87 the result is 0.
SPECRT_INLINE f8 exp8(f8 x) {
  const f8 lo = splat(-87.0f);
  const i8v under = x < lo;  // lanes whose result is 0
  x = x < lo ? lo : x;
  const f8 magic = splat(12582912.0f);  // 1.5 * 2^23: adding and subtracting it rounds to an integer
  const f8 n = (x * splat(1.44269504088896341f) + magic) - magic;
  f8 r = x - n * splat(0.693145751953125f);  // ln 2 in two parts, the first exact in a float's mantissa
  r = r - n * splat(1.428606765330187e-06f);
  f8 p = splat(1.0f / 720.0f);
  p = p * r + splat(1.0f / 120.0f);
  p = p * r + splat(1.0f / 24.0f);
  p = p * r + splat(1.0f / 6.0f);
  p = p * r + splat(0.5f);
  p = p * r + splat(1.0f);
  p = p * r + splat(1.0f);
  const i8v bits = (__builtin_convertvector(n, i8v) + 127) << 23;
  f8 scale;
  memcpy(&scale, &bits, sizeof scale);
  const f8 out = p * scale;
  return (f8)((i8v)out & ~under);
}

// x * cos - rot * sin with the rotary embedding's halves: out[:h] = x1 c - x2 s, out[h:] = x2 c + x1 s.
SPECRT_INLINE void rotary(const float* x, const float* cos, const float* sin, int D, float* out) {
  const int h = D / 2;
  for (int d = 0; d < h; d += 8) {
    const f8 x1 = load8(x + d), x2 = load8(x + h + d), c = load8(cos + d), s = load8(sin + d);
    store8(out + d, x1 * c - x2 * s);
    store8(out + h + d, x2 * c + x1 * s);
  }
}

// out[0 .. 8W) = (sum over j < T of p[j] * V[j][0 .. 8W)) * inv, j in order.
template <int W>
SPECRT_INLINE void weighted(const float* p, const float* V, int D, int T, float inv, float* out) {
  f8 acc[W];
  for (int c = 0; c < W; ++c) acc[c] = splat(0.0f);
  for (int j = 0; j < T; ++j) {
    const f8 pj = splat(p[j]);
    const float* vj = V + (size_t)j * D;
    for (int c = 0; c < W; ++c) acc[c] = acc[c] + pj * load8(vj + 8 * c);
  }
  const f8 vinv = splat(inv);
  for (int c = 0; c < W; ++c) store8(out + 8 * c, acc[c] * vinv);
}

}  // namespace

bool attention_shapes_ok(int D) { return D > 0 && D % 16 == 0 && D <= 512; }

SPECRT_CLONES void attention_write_kv(const AttentionCall& c, int b, int g, int i) {
  const int pos = c.P[b] + i;
  const float* cs = c.cos + (size_t)pos * (c.D / 2);
  const float* sn = c.sin + (size_t)pos * (c.D / 2);
  const float* k = c.k + ((size_t)b * c.S + i) * c.k_stride + (size_t)g * c.D;
  const float* v = c.v + ((size_t)b * c.S + i) * c.v_stride + (size_t)g * c.D;
  const size_t slot = (((size_t)b * c.Hkv + g) * c.C + pos) * c.D;
  rotary(k, cs, sn, c.D, c.present_k + slot);
  memcpy(c.present_v + slot, v, sizeof(float) * c.D);
}

SPECRT_CLONES void attention_head(const AttentionCall& c, int b, int h, float* scores) {
  const int D = c.D, g = h / (c.H / c.Hkv);
  const float* K = c.present_k + ((size_t)b * c.Hkv + g) * c.C * D;
  const float* V = c.present_v + ((size_t)b * c.Hkv + g) * c.C * D;
  float q[512];
  for (int i = 0; i < c.S; ++i) {
    float* out = c.out + ((size_t)b * c.S + i) * c.H * D + (size_t)h * D;
    if (i >= c.n[b]) {  // a padding position of a shorter row: nothing attends
      memset(out, 0, sizeof(float) * D);
      continue;
    }
    const int pos = c.P[b] + i, T = pos + 1;
    rotary(c.q + ((size_t)b * c.S + i) * c.q_stride + (size_t)h * D, c.cos + (size_t)pos * (D / 2),
           c.sin + (size_t)pos * (D / 2), D, q);
    // scores: each key's dot product in two 8-lane halves over D, then a fixed reduction
    f8 mx = splat(-INFINITY);
    for (int j = 0; j < T; ++j) {
      const float* kj = K + (size_t)j * D;
      f8 a0 = load8(q) * load8(kj), a1 = load8(q + 8) * load8(kj + 8);
      for (int d = 16; d < D; d += 16) {
        a0 = a0 + load8(q + d) * load8(kj + d);
        a1 = a1 + load8(q + d + 8) * load8(kj + d + 8);
      }
      scores[j] = hsum(a0 + a1) * c.scale;
    }
    int j = 0;
    for (; j + 8 <= T; j += 8) mx = load8(scores + j) > mx ? load8(scores + j) : mx;
    float m = hmax(mx);
    for (; j < T; ++j) m = scores[j] > m ? scores[j] : m;
    // the exponentials, and their sum in lanes by j mod 8 (a whole vector of padding for the tail)
    f8 sum = splat(0.0f);
    const f8 vm = splat(m);
    for (j = 0; j < T; j += 8) {
      f8 s;
      if (j + 8 <= T) {
        s = load8(scores + j);
      } else {
        s = splat(-INFINITY);
        for (int l = 0; l < T - j; ++l) s[l] = scores[j + l];
      }
      const f8 e = exp8(s - vm);
      sum = sum + e;
      if (j + 8 <= T) {
        store8(scores + j, e);
      } else {
        for (int l = 0; l < T - j; ++l) scores[j + l] = e[l];
      }
    }
    const float inv = 1.0f / hsum(sum);
    for (int d = 0; d < D; d += 64) {  // 64 values of the output at a time, their sums in registers
      switch (D - d < 64 ? (D - d) / 8 : 8) {
        case 2: weighted<2>(scores, V + d, D, T, inv, out + d); break;
        case 4: weighted<4>(scores, V + d, D, T, inv, out + d); break;
        case 6: weighted<6>(scores, V + d, D, T, inv, out + d); break;
        default: weighted<8>(scores, V + d, D, T, inv, out + d); break;
      }
    }
  }
}

}  // namespace specrt

// A fixed problem through the attention (2 rows of 3 and 2 new tokens after pasts of 5 and 0 entries,
// 4 heads over 2 key/value heads of 32, 16 slots): its outputs and caches in `out` (2*3*128 + 2 * 2*2*16*32
// floats). The tests compare them across instruction sets: they are the same bits everywhere.
extern "C" __attribute__((visibility("default"))) int specrt_attention_demo(float* out) {
  using namespace specrt;
  const int B = 2, S = 3, H = 4, Hkv = 2, D = 32, C = 16;
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
  const int n[2] = {3, 2}, P[2] = {5, 0};
  AttentionCall c;
  c.B = B, c.S = S, c.H = H, c.Hkv = Hkv, c.D = D, c.C = C, c.n = n, c.P = P;
  c.q = qkv.data(), c.k = c.q + H * D, c.v = c.q + (H + Hkv) * D;
  c.q_stride = c.k_stride = c.v_stride = (size_t)(H + 2 * Hkv) * D;
  c.cos = cos.data(), c.sin = sin.data(), c.present_k = pk, c.present_v = pv, c.out = o, c.scale = 0.17f;
  for (int b = 0; b < B; ++b)
    for (int i = 0; i < n[b]; ++i)
      for (int g = 0; g < Hkv; ++g) attention_write_kv(c, b, g, i);
  std::vector<float> scores(C + 8);
  for (int b = 0; b < B; ++b)
    for (int h = 0; h < H; ++h) attention_head(c, b, h, scores.data());
  return B * S * H * D + 2 * B * Hkv * C * D;
}
