// The x86 paths elsewhere: null, so int4.cc never offers them (each Arm file says so of its own path).
#include "int4.h"

namespace specrt {
#if !defined(__x86_64__)
const Kernel kAvx2Kernel = nullptr, kAvxVnniKernel = nullptr, kAvx512Kernel = nullptr, kAvx512VnniKernel = nullptr,
             kAvx512VnniIntelKernel = nullptr;
const Quantizer kAvx2Quantize = nullptr;
#endif
}  // namespace specrt
