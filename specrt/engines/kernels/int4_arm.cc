// The Arm path: NEON with the dot-product instructions (Armv8.2 dotprod: Cortex-A76/A78, Jetson Orin,
// Graviton 2+), the shared tile body (int4_tile.inc) with 4 columns a vector; int4.cc checks the CPU.
#include "int4.h"

#if defined(__aarch64__)
#include <arm_neon.h>

namespace specrt {

#pragma GCC push_options
#pragma GCC target("arch=armv8.2-a+dotprod")
namespace arm_dot {
struct T {
  static constexpr int L = 4, R = 4;
  static constexpr bool kWide = true;
  using V = int32x4_t;
  using F = float32x4_t;
  static V zero() { return vdupq_n_s32(0); }
  static V load(const uint8_t* p) { return vreinterpretq_s32_u8(vld1q_u8(p)); }
  static V lo(V v) { return vreinterpretq_s32_u8(vandq_u8(vreinterpretq_u8_s32(v), vdupq_n_u8(15))); }
  static V hi(V v) { return vreinterpretq_s32_u8(vshrq_n_u8(vreinterpretq_u8_s32(v), 4)); }
  static V bcast(const int8_t* p) { return vld1q_dup_s32((const int32_t*)(const void*)p); }
  // signed x signed bytes: the weights' nibbles (0..15) are valid signed bytes
  static V dot(V acc, V w, V a) { return vdotq_s32(acc, vreinterpretq_s8_s32(w), vreinterpretq_s8_s32(a)); }
  static V dotp(V acc, V w, const int8_t* p) { return dot(acc, w, bcast(p)); }
  static V fold(V s32, V acc) { return vaddq_s32(s32, acc); }
  static F cvt(V v) { return vcvtq_f32_s32(v); }
  static F loadf(const float* p) { return vld1q_f32(p); }
  static void storef(float* p, F v) { vst1q_f32(p, v); }
  static F set1(float x) { return vdupq_n_f32(x); }
  static F fnmadd(F a, F b, F c) { return vfmsq_f32(c, a, b); }  // c - a*b, fused
  static F mul(F a, F b) { return vmulq_f32(a, b); }
  static F fmadd(F a, F b, F c) { return vfmaq_f32(c, a, b); }   // a*b + c, fused
};
#include "int4_tile.inc"
}  // namespace arm_dot
#pragma GCC pop_options

const Kernel kNeonDotKernel = arm_dot::kernel;

}  // namespace specrt
#endif
