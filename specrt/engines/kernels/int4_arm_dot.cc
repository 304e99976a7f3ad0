// The Arm path with the dot-product instructions (Armv8.2 dotprod: Cortex-A76/A78, Jetson Orin, Graviton 2+,
// Apple M1+): the shared tile, 4 columns a vector. int4.cc checks the CPU.
// On Arm, setup.py compiles this file alone with -march=armv8.2-a+dotprod (kernels/sources.py):
// clang (14 here, and others) declares these intrinsics only in a file compiled so, not in a function
// given a target attribute. Only this path's code is here, all of it static but the kernel's pointer, so
// nothing else the library runs is compiled for that instruction set. Built without it, the path is null.
#include "attention.h"
#include "int4.h"

#if defined(__aarch64__) && defined(__ARM_FEATURE_DOTPROD)
#include <cstring>

#include "int4_neon.h"

namespace specrt {

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

const Kernel kNeonDotKernel = arm_dot::kernel;

}  // namespace specrt
#else
namespace specrt {
const Kernel kNeonDotKernel = nullptr;
}  // namespace specrt
#endif
