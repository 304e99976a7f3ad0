// Code compiled for an instruction set beyond the build's baseline, chosen at run time from the CPU's
// features, written as a region both compilers accept: GCC's target pragma, or on clang (which ignores
// `#pragma GCC target`) the same target attribute pushed onto every function the region declares.
//   SPECRT_TARGET_BEGIN("avx2,fma") ... SPECRT_TARGET_END
#pragma once

#define SPECRT_PRAGMA(x) _Pragma(#x)
#if defined(__clang__)
#define SPECRT_TARGET_BEGIN(isa) SPECRT_PRAGMA(clang attribute push(__attribute__((target(isa))), apply_to = function))
#define SPECRT_TARGET_END SPECRT_PRAGMA(clang attribute pop)
#else
#define SPECRT_TARGET_BEGIN(isa) SPECRT_PRAGMA(GCC push_options) SPECRT_PRAGMA(GCC target(isa))
#define SPECRT_TARGET_END SPECRT_PRAGMA(GCC pop_options)
#endif
