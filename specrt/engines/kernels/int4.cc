// Packing, activation quantization, the scalar kernel, path selection and the C interface the tests and
// `specrt info` use through ctypes. The arithmetic is defined in int4.h.
#include "int4.h"
#include "attention.h"

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include <mutex>

#if defined(__x86_64__) || defined(__i386__)
#include <cpuid.h>
#endif
#if defined(__linux__)
#include <sys/mman.h>
#include <sys/syscall.h>
#include <unistd.h>
#endif
#if defined(__aarch64__) && defined(__linux__)
#include <sys/auxv.h>
#endif
#if defined(__aarch64__) && defined(__APPLE__)
#include <sys/sysctl.h>
#endif

namespace specrt {

const char* const kPathNames[kPaths] = {"avx512amx", "avx512vnni", "avx512", "avxvnni", "avx2", "neon-i8mm",
                                        "neon-dotprod", "scalar"};

static inline int nibble(const uint8_t* row, int k) { return (row[k >> 1] >> ((k & 1) * 4)) & 15; }

// Packed weights are carved from large chunks backed by transparent huge pages where the OS offers them: a
// one-row pass streams every weight once, and with 4 KB pages each page of it costs a TLB walk. Measured
// here: a one-row matmul over 110 MB of weights 10-17% faster, the 1.5B target's one-token pass 2-6%
// faster, for ~45 MB more resident memory (whole 2 MB pages). A chunk holds the weights packed one after
// another and is freed with the last of them; untouched memory at a chunk's end is never resident.
namespace {
struct Chunk {
  uint8_t* base = nullptr;
  size_t size = 0, used = 0;
  int live = 0;
};
constexpr size_t kHuge = (size_t)2 << 20, kChunk = (size_t)256 << 20;
std::mutex g_chunks;
Chunk* g_current = nullptr;

uint8_t* map_chunk(size_t size) {
#if defined(__linux__)
  void* p = mmap(nullptr, size + kHuge, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (p == MAP_FAILED) return nullptr;
  const uintptr_t at = ((uintptr_t)p + kHuge - 1) / kHuge * kHuge;  // aligned to a huge page
  if (at > (uintptr_t)p) munmap(p, at - (uintptr_t)p);
  if ((uintptr_t)p + size + kHuge > at + size) munmap((void*)(at + size), (uintptr_t)p + size + kHuge - at - size);
  madvise((void*)at, size, MADV_HUGEPAGE);
  return (uint8_t*)at;
#else
  void* p = nullptr;
  return posix_memalign(&p, 64, size) ? nullptr : (uint8_t*)p;
#endif
}

void unmap_chunk(Chunk* c) {
#if defined(__linux__)
  munmap(c->base, c->size);
#else
  free(c->base);
#endif
  delete c;
}

uint8_t* chunk_alloc(size_t bytes, void** owner) {
  bytes = (bytes + 63) / 64 * 64;
  std::lock_guard<std::mutex> lock(g_chunks);
  if (!g_current || g_current->size - g_current->used < bytes) {
    Chunk* c = new Chunk;
    c->size = bytes > kChunk ? (bytes + kHuge - 1) / kHuge * kHuge : kChunk;
    c->base = map_chunk(c->size);
    if (!c->base) return delete c, nullptr;
    if (g_current && !g_current->live) unmap_chunk(g_current);
    g_current = c;
  }
  uint8_t* p = g_current->base + g_current->used;
  g_current->used += bytes;
  g_current->live++;
  *owner = g_current;
  return p;
}

void chunk_free(void* owner) {
  if (!owner) return;
  std::lock_guard<std::mutex> lock(g_chunks);
  Chunk* c = (Chunk*)owner;
  if (--c->live == 0 && c != g_current) unmap_chunk(c);
}
}  // namespace

bool pack(const uint8_t* B, const float* scales, const uint8_t* zp, const float* bias, int K, int N, int bs,
          Packed* out, bool glu) {
  if (glu && (N % (2 * kPanel) || bias)) return false;
  Packed w;
  w.K = K, w.N = N, w.bs = bs, w.glu = glu;
  w.nblk = (K + bs - 1) / bs;
  w.npanel = (N + kPanel - 1) / kPanel;
  w.block_bytes = (size_t)bs * 8 + 2 * kPanel * sizeof(float);
  const size_t bytes = (size_t)w.npanel * w.nblk * w.block_bytes;
  if (!(w.data = chunk_alloc(bytes ? bytes : 64, &w.chunk))) return false;
  if (bias) {
    w.bias = (float*)malloc(sizeof(float) * N);
    if (!w.bias) return chunk_free(w.chunk), false;
    memcpy(w.bias, bias, sizeof(float) * N);
  }
  const int blob = bs / 2, zrow = (w.nblk + 1) / 2;
  for (int p = 0; p < w.npanel; ++p) {
    for (int b = 0; b < w.nblk; ++b) {
      uint8_t* dst = w.data + ((size_t)p * w.nblk + b) * w.block_bytes;
      float* sc = (float*)(dst + (size_t)bs * 8);
      float* zf = sc + kPanel;
      for (int c = 0; c < kPanel; ++c) {
        const int n = (glu ? (p % 2) * (N / 2) + p / 2 * kPanel : p * kPanel) + c;
        const uint8_t* src = n < N ? B + ((size_t)n * w.nblk + b) * blob : nullptr;
        for (int s = 0; s < bs / 8; ++s) {
          for (int i = 0; i < 4; ++i) {
            const int lo = src ? nibble(src, s * 8 + i) : 0, hi = src ? nibble(src, s * 8 + 4 + i) : 0;
            dst[(size_t)s * 64 + 4 * c + i] = (uint8_t)(lo | (hi << 4));
          }
        }
        sc[c] = n < N ? scales[(size_t)n * w.nblk + b] : 0.0f;
        zf[c] = n < N ? (float)(zp ? nibble(zp + (size_t)n * zrow, b) : 8) : 0.0f;
      }
    }
  }
  *out = w;
  return true;
}

void release(Packed* w) {
  chunk_free(w->chunk);
  free(w->bias);
  *w = Packed();
}

void rms_norm(const float* a, const float* skip, const float* gamma, float eps, int K, float* sum, float* y) {
  float part[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  for (int i = 0; i < K; ++i) {
    const float s = skip ? a[i] + skip[i] : a[i];
    y[i] = s;
    part[i & 7] += s * s;
  }
  if (sum) memcpy(sum, y, (size_t)K * sizeof(float));
  const float total = ((part[0] + part[1]) + (part[2] + part[3])) + ((part[4] + part[5]) + (part[6] + part[7]));
  const float inv = 1.0f / std::sqrt(total / (float)K + eps);
  for (int i = 0; i < K; ++i) y[i] = y[i] * inv * gamma[i];
}

void quantize_scalar(const float* A, size_t lda, int row0, int rows, int K, int bs, const Acts& out) {
  for (int r = row0; r < row0 + rows; ++r) {
    const float* a = A + (size_t)r * lda;
    for (int b = 0; b < out.nblk; ++b) {
      const int k0 = b * bs, k1 = k0 + bs < K ? k0 + bs : K;
      float amax = 0.0f;
      bool finite = true;
      for (int k = k0; k < k1; ++k) {
        const float x = std::fabs(a[k]);
        finite = finite && x <= 3.402823466e38f;  // false for inf and NaN
        amax = x > amax ? x : amax;
      }
      int sum = 0;
      if (amax == 0.0f || !finite) {
        for (int k = k0; k < k0 + bs; k += 8) memset(out.at(r, k), 0, 8);
        // a block of zeros adds nothing; inf or NaN in A make the whole output row NaN, as a float matmul would
        out.scale[(size_t)r * out.nblk + b] = finite ? 0.0f : NAN;
      } else {
        const float inv = 127.0f / amax;
        for (int k = k0; k < k1; ++k) {
          float v = std::nearbyint(a[k] * inv);  // the default rounding mode: half to even
          v = v > 127.0f ? 127.0f : (v < -127.0f ? -127.0f : v);
          *out.at(r, k) = (int8_t)v;
          sum += (int)v;
        }
        for (int k = k1; k < k0 + bs; ++k) *out.at(r, k) = 0;
        out.scale[(size_t)r * out.nblk + b] = amax / 127.0f;
      }
      out.sum[(size_t)r * out.nblk + b] = (float)sum;
    }
  }
}

// The scalar path over the packed layout: the arithmetic of int4.h written out, one element at a time.
static void scalar_panel(const Packed& w, const Acts& a, int p, int r, float* acc) {
  for (int c = 0; c < kPanel; ++c) acc[c] = 0.0f;
  for (int b = 0; b < w.nblk; ++b) {
    const uint8_t* blk = w.data + ((size_t)p * w.nblk + b) * w.block_bytes;
    const float* sc = (const float*)(blk + (size_t)w.bs * 8);
    const float* zf = sc + kPanel;
    const float s_a = a.scale[(size_t)r * a.nblk + b];
    const int sum = (int)a.sum[(size_t)r * a.nblk + b];
    for (int c = 0; c < kPanel; ++c) {
      int dot = 0;
      for (int s = 0; s < w.bs / 8; ++s) {
        const int8_t* qk = a.at(r, b * w.bs + s * 8);
        for (int i = 0; i < 4; ++i) {
          const uint8_t v = blk[(size_t)s * 64 + 4 * c + i];
          dot += (v & 15) * qk[i] + (v >> 4) * qk[4 + i];
        }
      }
      const float d = (float)(dot - (int)zf[c] * sum);
      acc[c] = std::fma(d, sc[c] * s_a, acc[c]);
    }
  }
}

void kernel_scalar(const Packed& w, const Acts& a, int r0, int nr, int p0, int p1, float* y, size_t ldy) {
  for (int p = p0; p < p1; p += w.glu ? 2 : 1) {
    for (int r = r0; r < r0 + nr; ++r) {
      float acc[kPanel], up[kPanel];
      scalar_panel(w, a, p, r, acc);
      if (w.glu) {
        scalar_panel(w, a, p + 1, r, up);
        silu_mul(acc, up, kPanel, y + (size_t)r * ldy + (size_t)p / 2 * kPanel);
        continue;
      }
      for (int c = 0; c < kPanel && p * kPanel + c < w.N; ++c) {
        const int n = p * kPanel + c;
        y[(size_t)r * ldy + n] = w.bias ? acc[c] + w.bias[n] : acc[c];
      }
    }
  }
}

// Whether the CPU is Intel's (CPUID leaf 0's vendor "GenuineIntel"): a per-CPU trait of the AVX-512 VNNI path,
// whose prefetch was measured on each vendor's cores (docs/kernel.md); every other CPU keeps Zen 4's choice.
static bool intel_cpu() {
#if defined(__x86_64__) || defined(__i386__)
  unsigned a = 0, b = 0, c = 0, d = 0;
  if (!__get_cpuid(0, &a, &b, &c, &d)) return false;
  return b == 0x756e6547u && d == 0x49656e69u && c == 0x6c65746eu;  // "Genu" "ineI" "ntel"
#else
  return false;
#endif
}

Impl impl_for(Path path) {
  Impl x86;
  x86.quantize = kAvx2Quantize;
  Impl arm;
  arm.quantize = quantize_scalar;
  switch (path) {
    case kAvx512Amx: return x86.kernel = kAvx512AmxKernel, x86.rows_major = true, x86.takes = amx_takes, x86;
    case kAvx512Vnni: return x86.kernel = intel_cpu() ? kAvx512VnniIntelKernel : kAvx512VnniKernel, x86;
    case kAvx512: return x86.kernel = kAvx512Kernel, x86;
    case kAvxVnni: return x86.kernel = kAvxVnniKernel, x86;
    case kAvx2: return x86.kernel = kAvx2Kernel, x86;
    case kNeonI8mm: return arm.kernel = kNeonI8mmKernel, arm;
    case kNeonDot: return arm.kernel = kNeonDotKernel, arm;
    case kScalar: return arm.kernel = kernel_scalar, arm;
    default: return Impl();
  }
}

#if defined(__x86_64__) || defined(__i386__)
// XCR0: whether the OS saves the vector registers a path uses (a CPU flag alone is not enough).
static unsigned long long xcr0() {
  unsigned a, b, c, d;
  __cpuid(1, a, b, c, d);
  if (!(c & (1u << 27))) return 0;  // no OSXSAVE
  unsigned lo, hi;
  __asm__ volatile("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
  return ((unsigned long long)hi << 32) | lo;
}
#endif

#if defined(__x86_64__) || defined(__i386__)
// AMX-TILE and AMX-INT8 (CPUID 7.0 EDX bits 24, 25), their state enabled by the OS (XCR0 bits 17, 18), and on
// Linux the tile data state granted to this process, which Linux does only on request (once a process,
// for all its threads: arch_prctl ARCH_REQ_XCOMP_PERM of XFEATURE_XTILEDATA).
static bool amx_granted(unsigned edx7, unsigned long long xcr0) {
  if (!(edx7 & (1u << 24)) || !(edx7 & (1u << 25)) || (xcr0 & 0x60000) != 0x60000) return false;
#if defined(__linux__)
  return syscall(SYS_arch_prctl, 0x1023, 18) == 0;
#else
  return false;  // no way known to this library to ask another OS for the tile state
#endif
}
#endif

bool cpu_has(Path path) {
#if defined(__x86_64__) || defined(__i386__)
  unsigned a = 0, b = 0, c = 0, d = 0, a1 = 0, b1 = 0, c1 = 0, d1 = 0;
  if (__get_cpuid_max(0, nullptr) < 7) return path == kScalar;
  __cpuid(1, a1, b1, c1, d1);
  __cpuid_count(7, 0, a, b, c, d);
  unsigned eax71 = 0, ebx71 = 0, ecx71 = 0, edx71 = 0;
  __cpuid_count(7, 1, eax71, ebx71, ecx71, edx71);
  const unsigned long long x = xcr0();
  const bool ymm = (x & 6) == 6, zmm = (x & 0xe6) == 0xe6;
  const bool avx2 = ymm && (b & (1u << 5)) && (c1 & (1u << 12));  // AVX2 and FMA
  const bool avx512 = zmm && (b & (1u << 16)) && (b & (1u << 30));  // F and BW
  switch (path) {
    case kAvx512Amx: return avx512 && (c & (1u << 11)) && amx_granted(d, x);
    case kAvx512Vnni: return avx512 && (c & (1u << 11));
    case kAvx512: return avx512;
    case kAvxVnni: return avx2 && (eax71 & (1u << 4));
    case kAvx2: return avx2;
    case kScalar: return true;
    default: return false;
  }
#elif defined(__aarch64__) && defined(__linux__)
  const unsigned long hw = getauxval(AT_HWCAP), hw2 = getauxval(AT_HWCAP2);
  switch (path) {
    case kNeonI8mm: return (hw & (1ul << 20)) && (hw2 & (1ul << 13));  // ASIMDDP and I8MM
    case kNeonDot: return hw & (1ul << 20);  // HWCAP_ASIMDDP
    case kScalar: return true;
    default: return false;
  }
#elif defined(__aarch64__) && defined(__APPLE__)
  // macOS names each Arm feature the CPU has (Apple's "Determining instruction set characteristics")
  auto has = [](const char* name) {
    int v = 0;
    size_t n = sizeof v;
    return sysctlbyname(name, &v, &n, nullptr, 0) == 0 && v == 1;
  };
  switch (path) {
    case kNeonI8mm: return has("hw.optional.arm.FEAT_DotProd") && has("hw.optional.arm.FEAT_I8MM");
    case kNeonDot: return has("hw.optional.arm.FEAT_DotProd");
    case kScalar: return true;
    default: return false;
  }
#else
  return path == kScalar;
#endif
}

}  // namespace specrt

using namespace specrt;

namespace {

// The arithmetic of int4.h over MatMulNBits' own layout: what defines the result for the tests.
void reference(const uint8_t* B, const float* scales, const uint8_t* zp, const float* bias, int K, int N, int bs,
               const float* A, int M, float* Y) {
  const int nblk = (K + bs - 1) / bs, blob = bs / 2, zrow = (nblk + 1) / 2;
  std::vector<int8_t> q(acts_bytes(M, nblk * bs));
  std::vector<float> s_a((size_t)M * nblk), sums((size_t)M * nblk);
  Acts a;
  a.M = M, a.Kp = nblk * bs, a.nblk = nblk, a.q = q.data(), a.scale = s_a.data(), a.sum = sums.data();
  quantize_scalar(A, K, 0, M, K, bs, a);
  for (int r = 0; r < M; ++r) {
    for (int n = 0; n < N; ++n) {
      float acc = 0.0f;
      for (int b = 0; b < nblk; ++b) {
        const uint8_t* w = B + ((size_t)n * nblk + b) * blob;
        int dot = 0;
        for (int k = 0; k < bs; ++k) dot += nibble(w, k) * *a.at(r, b * bs + k);
        const int z = zp ? nibble(zp + (size_t)n * zrow, b) : 8;
        const float d = (float)(dot - z * (int)sums[(size_t)r * nblk + b]);
        acc = std::fma(d, scales[(size_t)n * nblk + b] * s_a[(size_t)r * nblk + b], acc);
      }
      Y[(size_t)r * N + n] = bias ? acc + bias[n] : acc;
    }
  }
}

// A small problem with known bits: a path that disagrees with the scalar path is not offered.
bool self_check(Path path) {
  const int K = 300, N = 37, bs = 32, M = 5, nblk = (K + bs - 1) / bs;
  std::vector<uint8_t> B((size_t)N * nblk * bs / 2), zp((size_t)N * ((nblk + 1) / 2));
  std::vector<float> sc((size_t)N * nblk), bias(N), A((size_t)M * K);
  unsigned s = 12345;
  auto next = [&s]() { return s = s * 1103515245u + 12345u, (s >> 8) & 0xffff; };
  for (auto& v : B) v = (uint8_t)next();
  for (auto& v : zp) v = (uint8_t)next();
  for (auto& v : sc) v = (float)(next() % 1000 + 1) * 1e-4f;
  for (auto& v : bias) v = (float)((int)(next() % 200) - 100) * 1e-2f;
  for (auto& v : A) v = (float)((int)(next() % 20001) - 10000) * 1e-3f;
  Packed w;
  if (!pack(B.data(), sc.data(), zp.data(), bias.data(), K, N, bs, &w)) return false;
  std::vector<int8_t> q(acts_bytes(M, nblk * bs));
  std::vector<float> sa((size_t)M * nblk), sums((size_t)M * nblk), want((size_t)M * N), got((size_t)M * N);
  const Impl impl = impl_for(path);
  Acts a;
  a.M = M, a.Kp = nblk * bs, a.nblk = nblk, a.q = q.data(), a.scale = sa.data(), a.sum = sums.data();
  a.rows_major = impl.rows_major;
  impl.quantize(A.data(), K, 0, M, K, bs, a);
  reference(B.data(), sc.data(), zp.data(), bias.data(), K, N, bs, A.data(), M, want.data());
  impl.kernel(w, a, 0, M, 0, w.npanel, got.data(), N);
  release(&w);
  return memcmp(want.data(), got.data(), sizeof(float) * want.size()) == 0;
}

// Calls of at most this many rows take the AVX-512 VNNI path on an AMX CPU: each block's result tile goes
// through memory for its float step, and up to 12 rows that costs more than VNNI's products (docs/kernel.md,
// "AMX").
constexpr int kAmxNarrowRows = 12;

struct Selection {
  bool usable[kPaths] = {false};
  Impl impls[kPaths];
  std::string notes;  // paths this CPU has that failed their self-check
  Selection() {
    for (int p = 0; p < kPaths; ++p) {
      const Path path = (Path)p;
      impls[p] = impl_for(path);
      if (!impls[p].kernel || !impls[p].quantize || !cpu_has(path)) continue;
      usable[p] = self_check(path);
      if (!usable[p]) notes += std::string(notes.empty() ? "" : "; ") + kPathNames[p] + " failed its self-check";
    }
    // the AMX path leans on the AVX-512 VNNI one (few rows, other block sizes): offered only with it
    usable[kAvx512Amx] = usable[kAvx512Amx] && usable[kAvx512Vnni];
    impls[kAvx512Amx].narrow = &impls[kAvx512Vnni], impls[kAvx512Amx].narrow_rows = kAmxNarrowRows;
  }
};

const Selection& selection() {
  static const Selection s;
  return s;
}

}  // namespace

namespace specrt {

const Impl* choose(const char* name, Path* chosen) {
  const Selection& s = selection();
  for (int p = 0; p < kPaths; ++p) {
    const bool wanted = (!name || !*name || !strcmp(name, "auto")) ? p != kScalar : !strcmp(name, kPathNames[p]);
    if (wanted && s.usable[p]) {
      if (chosen) *chosen = (Path)p;
      return &s.impls[p];
    }
  }
  return nullptr;
}

}  // namespace specrt

#define EXPORT extern "C" __attribute__((visibility("default")))

// Comma-separated paths usable here, best first ("scalar" is always last; it is not chosen by "auto").
EXPORT const char* specrt_int4_paths() {
  static std::string out;
  if (out.empty()) {
    for (int p = 0; p < kPaths; ++p)
      if (selection().usable[p]) out += std::string(out.empty() ? "" : ",") + kPathNames[p];
  }
  return out.c_str();
}

// Why a path this CPU has is not offered ("" when none failed).
EXPORT const char* specrt_int4_notes() { return selection().notes.c_str(); }

EXPORT void* specrt_int4_pack(const uint8_t* B, const float* scales, const uint8_t* zp, const float* bias, int K,
                              int N, int bs) {
  if (K <= 0 || N <= 0 || bs < 32 || bs % 32) return nullptr;
  Packed* w = new Packed;
  if (!pack(B, scales, zp, bias, K, N, bs, w)) return delete w, nullptr;
  return w;
}

// The same, packed as a gated MLP's two matmuls in one (Packed::glu): N even, N / 2 a multiple of 16, no
// bias; a matmul of it gives N / 2 columns. Null when the shape does not allow it.
EXPORT void* specrt_int4_pack_gated(const uint8_t* B, const float* scales, const uint8_t* zp, int K, int N, int bs) {
  if (K <= 0 || N <= 0 || bs < 32 || bs % 32) return nullptr;
  Packed* w = new Packed;
  if (!pack(B, scales, zp, nullptr, K, N, bs, w, true)) return delete w, nullptr;
  return w;
}

EXPORT void specrt_int4_free(void* w) {
  if (w) release((Packed*)w), delete (Packed*)w;
}

// Y [M][N] = A [M][K] times the packed weight (Y [M][N / 2] when gated), on one thread, by path `path`
// ("auto" or a name); panels [p0, p1) only when p1 > 0 (the rest of Y untouched; even bounds when gated).
// Returns 0, or -1 when the path cannot run here.
EXPORT int specrt_int4_matmul(const void* packed, const float* A, int M, float* Y, const char* path, int p0, int p1) {
  const Packed& w = *(const Packed*)packed;
  const Impl* chosen = choose(path, nullptr);
  if (!chosen) return -1;
  const Impl* impl = &chosen->for_block(w.bs).for_rows(M);
  std::vector<int8_t> q(acts_bytes(M, w.nblk * w.bs));
  std::vector<float> sa((size_t)M * w.nblk), sums((size_t)M * w.nblk);
  Acts a;
  a.M = M, a.Kp = w.nblk * w.bs, a.nblk = w.nblk, a.q = q.data(), a.scale = sa.data(), a.sum = sums.data();
  a.rows_major = impl->rows_major;
  impl->quantize(A, w.K, 0, M, w.K, w.bs, a);
  if (p1 <= 0) p0 = 0, p1 = w.npanel;
  for (int r = 0; r < M; r += kRowChunk)
    impl->kernel(w, a, r, M - r < kRowChunk ? M - r : kRowChunk, p0, p1, Y, w.out_cols());
  return 0;
}

// rms_norm over M rows of K (skip and sum may be null), for the tests.
EXPORT void specrt_rms_norm(const float* a, const float* skip, const float* gamma, float eps, int M, int K, float* sum,
                            float* y) {
  for (int r = 0; r < M; ++r)
    rms_norm(a + (size_t)r * K, skip ? skip + (size_t)r * K : nullptr, gamma, eps, K, sum ? sum + (size_t)r * K : nullptr,
             y + (size_t)r * K);
}

EXPORT void specrt_int4_reference(const uint8_t* B, const float* scales, const uint8_t* zp, const float* bias, int K,
                                  int N, int bs, const float* A, int M, float* Y) {
  reference(B, scales, zp, bias, K, N, bs, A, M, Y);
}
