// The two limits of a matmul pass on this host, for bench/kernels/roofline.py: the read bandwidth over a buffer of
// a given size with N threads, and the int8 product rate of the instructions a kernel path runs (each
// thread a loop of independent dot instructions, no loads). Built by roofline.py with -march=native: it
// measures the machine it is built on.
//   roofline bandwidth BYTES THREADS      -> GB/s (best of 7 passes, each thread summing its part)
//   roofline peak PATH THREADS            -> G int8 products/s (best of 5)
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

#if defined(__x86_64__)
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>
#elif defined(__aarch64__)
#include <arm_neon.h>
#endif

using Clock = std::chrono::steady_clock;

static double bandwidth(size_t bytes, int threads) {
  const size_t n = bytes / 8 / threads * threads;
  uint64_t* a = (uint64_t*)aligned_alloc(64, (n * 8 + 63) / 64 * 64);
  for (size_t i = 0; i < n; ++i) a[i] = i;  // touched, so every page is resident
  std::vector<uint64_t> sums(threads);
  double best = 1e30;
  for (int t = 0; t < 7; ++t) {
    const auto t0 = Clock::now();
    std::vector<std::thread> pool;
    for (int h = 0; h < threads; ++h)
      pool.emplace_back([&, h] {
        const uint64_t* p = a + n / threads * h;
        uint64_t s0 = 0, s1 = 0, s2 = 0, s3 = 0;
        for (size_t i = 0; i < n / threads; i += 4) s0 += p[i], s1 += p[i + 1], s2 += p[i + 2], s3 += p[i + 3];
        sums[h] += s0 + s1 + s2 + s3;
      });
    for (auto& th : pool) th.join();
    const double s = std::chrono::duration<double>(Clock::now() - t0).count();
    best = s < best ? s : best;
  }
  uint64_t all = 0;
  for (uint64_t s : sums) all += s;
  free(a);
  if (all == 42) puts("");  // keeps the sums
  return n * 8.0 / best / 1e9;
}

// One thread's loop: `iters` iterations of 8-12 independent dot instructions of the path; returns the products.
static double loop(const std::string& path, long iters) {
#if defined(__x86_64__)
  if (path == "avx2") {  // vpmaddubsw (32 products into 16-bit pairs) then vpaddw into an accumulator
    for (long i = 0; i < iters; ++i)
      __asm__ volatile(
          "vpmaddubsw %%ymm0,%%ymm1,%%ymm10\n\tvpaddw %%ymm10,%%ymm2,%%ymm2\n\t"
          "vpmaddubsw %%ymm0,%%ymm1,%%ymm11\n\tvpaddw %%ymm11,%%ymm3,%%ymm3\n\t"
          "vpmaddubsw %%ymm0,%%ymm1,%%ymm12\n\tvpaddw %%ymm12,%%ymm4,%%ymm4\n\t"
          "vpmaddubsw %%ymm0,%%ymm1,%%ymm13\n\tvpaddw %%ymm13,%%ymm5,%%ymm5\n\t"
          "vpmaddubsw %%ymm0,%%ymm1,%%ymm14\n\tvpaddw %%ymm14,%%ymm6,%%ymm6\n\t"
          "vpmaddubsw %%ymm0,%%ymm1,%%ymm15\n\tvpaddw %%ymm15,%%ymm7,%%ymm7\n\t"
          "vpmaddubsw %%ymm0,%%ymm1,%%ymm10\n\tvpaddw %%ymm10,%%ymm8,%%ymm8\n\t"
          "vpmaddubsw %%ymm0,%%ymm1,%%ymm11\n\tvpaddw %%ymm11,%%ymm9,%%ymm9\n\t" ::
              : "xmm2", "xmm3", "xmm4", "xmm5", "xmm6", "xmm7", "xmm8", "xmm9", "xmm10", "xmm11", "xmm12",
                "xmm13", "xmm14", "xmm15");
    return iters * 8.0 * 32;
  }
#if defined(__AVXVNNI__)
  if (path == "avxvnni") {  // 12 accumulators: Intel cores issue two a cycle at a latency of 5
    for (long i = 0; i < iters; ++i)
      __asm__ volatile(
          "%{vex%} vpdpbusd %%ymm0,%%ymm1,%%ymm2\n\t%{vex%} vpdpbusd %%ymm0,%%ymm1,%%ymm3\n\t"
          "%{vex%} vpdpbusd %%ymm0,%%ymm1,%%ymm4\n\t%{vex%} vpdpbusd %%ymm0,%%ymm1,%%ymm5\n\t"
          "%{vex%} vpdpbusd %%ymm0,%%ymm1,%%ymm6\n\t%{vex%} vpdpbusd %%ymm0,%%ymm1,%%ymm7\n\t"
          "%{vex%} vpdpbusd %%ymm0,%%ymm1,%%ymm8\n\t%{vex%} vpdpbusd %%ymm0,%%ymm1,%%ymm9\n\t"
          "%{vex%} vpdpbusd %%ymm0,%%ymm1,%%ymm10\n\t%{vex%} vpdpbusd %%ymm0,%%ymm1,%%ymm11\n\t"
          "%{vex%} vpdpbusd %%ymm0,%%ymm1,%%ymm12\n\t%{vex%} vpdpbusd %%ymm0,%%ymm1,%%ymm13\n\t" ::
              : "xmm2", "xmm3", "xmm4", "xmm5", "xmm6", "xmm7", "xmm8", "xmm9", "xmm10", "xmm11", "xmm12",
                "xmm13");
    return iters * 12.0 * 32;
  }
#endif
#if defined(__AVX512BW__)
  if (path == "avx512") {
    for (long i = 0; i < iters; ++i)
      __asm__ volatile(
          "vpmaddubsw %%zmm0,%%zmm1,%%zmm10\n\tvpaddw %%zmm10,%%zmm2,%%zmm2\n\t"
          "vpmaddubsw %%zmm0,%%zmm1,%%zmm11\n\tvpaddw %%zmm11,%%zmm3,%%zmm3\n\t"
          "vpmaddubsw %%zmm0,%%zmm1,%%zmm12\n\tvpaddw %%zmm12,%%zmm4,%%zmm4\n\t"
          "vpmaddubsw %%zmm0,%%zmm1,%%zmm13\n\tvpaddw %%zmm13,%%zmm5,%%zmm5\n\t"
          "vpmaddubsw %%zmm0,%%zmm1,%%zmm14\n\tvpaddw %%zmm14,%%zmm6,%%zmm6\n\t"
          "vpmaddubsw %%zmm0,%%zmm1,%%zmm15\n\tvpaddw %%zmm15,%%zmm7,%%zmm7\n\t"
          "vpmaddubsw %%zmm0,%%zmm1,%%zmm10\n\tvpaddw %%zmm10,%%zmm8,%%zmm8\n\t"
          "vpmaddubsw %%zmm0,%%zmm1,%%zmm11\n\tvpaddw %%zmm11,%%zmm9,%%zmm9\n\t" ::
              : "xmm2", "xmm3", "xmm4", "xmm5", "xmm6", "xmm7", "xmm8", "xmm9", "xmm10", "xmm11", "xmm12",
                "xmm13", "xmm14", "xmm15");
    return iters * 8.0 * 64;
  }
#endif
#if defined(__AVX512VNNI__)
  if (path == "avx512vnni") {  // 12 accumulators, as above
    for (long i = 0; i < iters; ++i)
      __asm__ volatile(
          "vpdpbusd %%zmm0,%%zmm1,%%zmm2\n\tvpdpbusd %%zmm0,%%zmm1,%%zmm3\n\tvpdpbusd %%zmm0,%%zmm1,%%zmm4\n\t"
          "vpdpbusd %%zmm0,%%zmm1,%%zmm5\n\tvpdpbusd %%zmm0,%%zmm1,%%zmm6\n\tvpdpbusd %%zmm0,%%zmm1,%%zmm7\n\t"
          "vpdpbusd %%zmm0,%%zmm1,%%zmm8\n\tvpdpbusd %%zmm0,%%zmm1,%%zmm9\n\tvpdpbusd %%zmm0,%%zmm1,%%zmm10\n\t"
          "vpdpbusd %%zmm0,%%zmm1,%%zmm11\n\tvpdpbusd %%zmm0,%%zmm1,%%zmm12\n\tvpdpbusd %%zmm0,%%zmm1,%%zmm13\n\t" ::
              : "xmm2", "xmm3", "xmm4", "xmm5", "xmm6", "xmm7", "xmm8", "xmm9", "xmm10", "xmm11", "xmm12",
                "xmm13");
    return iters * 12.0 * 64;
  }
#endif
#if defined(__AMX_INT8__) && defined(__AMX_TILE__)
  if (path == "avx512amx") {  // tdpbusd: 16 x 16 x 64 products into 4 independent int32 tiles
    struct { uint8_t palette, start_row, zero[14]; uint16_t colsb[16]; uint8_t rows[16]; } __attribute__((packed)) cfg{};
    cfg.palette = 1;
    for (int t = 0; t < 8; ++t) cfg.rows[t] = 16, cfg.colsb[t] = 64;
    _tile_loadconfig(&cfg);  // per thread: the tile state is configured by each thread that uses it
    alignas(64) static const int8_t a[16 * 64] = {3}, b[16 * 64] = {5};
    _tile_loadd(4, a, 64);
    _tile_loadd(5, b, 64);
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    for (long i = 0; i < iters; ++i) {
      _tile_dpbusd(0, 4, 5);
      _tile_dpbusd(1, 5, 4);
      _tile_dpbusd(2, 4, 5);
      _tile_dpbusd(3, 5, 4);
    }
    alignas(64) int32_t c[16 * 16];
    _tile_stored(0, c, 64);
    _tile_release();
    if (c[0] == 42) puts("");
    return iters * 4.0 * 16 * 16 * 64;
  }
#endif
#elif defined(__aarch64__) && defined(__ARM_FEATURE_DOTPROD)
  if (path == "neon-dotprod" || path == "neon-i8mm") {
    int32x4_t c[8];
    for (auto& x : c) x = vdupq_n_s32(0);
    const int8x16_t a = vdupq_n_s8(3), b = vdupq_n_s8(5);
    for (long i = 0; i < iters; ++i) {
      for (int k = 0; k < 8; ++k) {
#if defined(__ARM_FEATURE_MATMUL_INT8)
        c[k] = path == "neon-i8mm" ? vmmlaq_s32(c[k], a, b) : vdotq_s32(c[k], a, b);
#else
        c[k] = vdotq_s32(c[k], a, b);
#endif
        __asm__ volatile("" : "+w"(c[k]));
      }
    }
    return iters * 8.0 * (path == "neon-i8mm" ? 32 : 16);
  }
#endif
  return 0;
}

static double peak(const std::string& path, int threads) {
#if defined(__x86_64__)
  // Linux grants the AMX tile data state per process, on request (arch_prctl ARCH_REQ_XCOMP_PERM, XTILEDATA = 18)
  if (path == "avx512amx" && syscall(SYS_arch_prctl, 0x1023, 18) != 0) return 0;
#endif
  const long iters = path == "avx512amx" ? 2000000 : 20000000;
  if (loop(path, 1000) == 0) return 0;
  double best = 1e30, products = 0;
  for (int t = 0; t < 5; ++t) {
    const auto t0 = Clock::now();
    std::vector<std::thread> pool;
    std::vector<double> done(threads);
    for (int h = 0; h < threads; ++h) pool.emplace_back([&, h] { done[h] = loop(path, iters); });
    for (auto& th : pool) th.join();
    const double s = std::chrono::duration<double>(Clock::now() - t0).count();
    products = 0;
    for (double d : done) products += d;
    best = s < best ? s : best;
  }
  return products / best / 1e9;
}

int main(int argc, char** argv) {
  if (argc == 4 && !strcmp(argv[1], "bandwidth")) return printf("%.3f\n", bandwidth(atoll(argv[2]), atoi(argv[3]))), 0;
  if (argc == 4 && !strcmp(argv[1], "peak")) {
    const double g = peak(argv[2], atoi(argv[3]));
    if (g == 0) return fprintf(stderr, "no peak loop for path %s in this build (-march=native)\n", argv[2]), 1;
    return printf("%.3f\n", g), 0;
  }
  fprintf(stderr, "usage: roofline bandwidth BYTES THREADS | roofline peak PATH THREADS\n");
  return 2;
}
