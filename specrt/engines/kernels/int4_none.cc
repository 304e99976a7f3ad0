// The paths a build lacks: null, so int4.cc never offers them.
#include "int4.h"

namespace specrt {
#if !defined(__x86_64__)
const Kernel kAvx2Kernel = nullptr, kAvxVnniKernel = nullptr, kAvx512Kernel = nullptr, kAvx512VnniKernel = nullptr;
const Quantizer kAvx2Quantize = nullptr;
#endif
#if !defined(__aarch64__)
const Kernel kNeonDotKernel = nullptr, kNeonI8mmKernel = nullptr;
#endif
}  // namespace specrt
