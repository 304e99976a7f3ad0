// The vector traits both Arm paths use (int4_arm_dot.cc, int4_arm_i8mm.cc), for a path's `struct T`: 4 columns
// a vector, sums in 32-bit lanes.
#pragma once
#include <arm_neon.h>

#define SPECRT_NEON_TRAITS                                                                              \
  static constexpr int L = 4, R = 4;                                                                  \
  static constexpr bool kWide = true;                                                                 \
  static constexpr int kPrefetchFrom = 1, kAhead = 4, kFarFrom = 1 << 30, kFar = 0;                   \
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
