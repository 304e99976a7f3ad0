// How close the AVX2 int4 kernel comes to what one core can do with its instructions (docs/kernel.md,
// "Limits on an AVX2 CPU"). Without VNNI, 32 int8 products cost a vpmaddubsw and a 16-bit add; this
// times loops of those instructions alone (the core's ceiling for the kernel's arithmetic), then the
// kernel itself on one thread over weights that stay in the L2 cache (no memory stalls), and prints the
// kernel's products per second against the ceiling.
//
//   g++ -std=c++17 -O3 -ffp-contract=off -Ispecrt/engines/kernels bench/kernels/ceiling.cc \
//       specrt/engines/kernels/{int4,int4_x86,int4_arm_dot,int4_arm_i8mm,int4_none,attention}.cc -o /tmp/ceiling && /tmp/ceiling
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <vector>

#include "int4.h"

using namespace specrt;

static double seconds(void (*f)(long), long n) {
  double best = 1e30;
  for (int t = 0; t < 5; ++t) {
    const auto t0 = std::chrono::steady_clock::now();
    f(n);
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    best = s < best ? s : best;
  }
  return best;
}

// 4 dependent integer adds an iteration: one a cycle, so iterations * 4 / seconds is the clock
static void chain(long n) {
  long x = 0;
  for (long i = 0; i < n; ++i) __asm__ volatile("add $1, %0\n\tadd $1, %0\n\tadd $1, %0\n\tadd $1, %0" : "+r"(x));
}
// 8 independent vpmaddubsw, each followed by the 16-bit add of its result into an accumulator
static void pairs(long n) {
  for (long i = 0; i < n; ++i)
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
}
// 8 independent 16-bit adds an iteration, alone and with 4 broadcasts from memory (the kernel broadcasts a
// row's 4 activation bytes before its products): the same time if a broadcast takes no vector pipe
#define SPECRT_ADDS                                                                               \
  "vpaddw %%ymm0,%%ymm2,%%ymm2\n\tvpaddw %%ymm0,%%ymm3,%%ymm3\n\tvpaddw %%ymm0,%%ymm4,%%ymm4\n\t"   \
  "vpaddw %%ymm0,%%ymm5,%%ymm5\n\tvpaddw %%ymm0,%%ymm6,%%ymm6\n\tvpaddw %%ymm0,%%ymm7,%%ymm7\n\t"   \
  "vpaddw %%ymm0,%%ymm8,%%ymm8\n\tvpaddw %%ymm0,%%ymm9,%%ymm9\n\t"
static void adds(long n) {
  for (long i = 0; i < n; ++i)
    __asm__ volatile(SPECRT_ADDS ::: "xmm2", "xmm3", "xmm4", "xmm5", "xmm6", "xmm7", "xmm8", "xmm9");
}
static void adds_bcast(long n) {
  alignas(64) static float src[16];
  for (long i = 0; i < n; ++i)
    __asm__ volatile("vbroadcastss (%0),%%ymm10\n\tvbroadcastss 4(%0),%%ymm11\n\t"
                     "vbroadcastss 8(%0),%%ymm12\n\tvbroadcastss 12(%0),%%ymm13\n\t" SPECRT_ADDS ::"r"(src)
                     : "xmm2", "xmm3", "xmm4", "xmm5", "xmm6", "xmm7", "xmm8", "xmm9", "xmm10", "xmm11", "xmm12",
                       "xmm13");
}

// The AVX2 kernel on one thread: products a second, best of 5 timings of `reps` calls
static double kernel_rate(int K, int N, int M, int reps) {
  const int bs = 128, nblk = (K + bs - 1) / bs;
  std::vector<uint8_t> B((size_t)N * nblk * bs / 2), zp((size_t)N * ((nblk + 1) / 2));
  std::vector<float> sc((size_t)N * nblk), A((size_t)M * K), Y((size_t)M * N);
  srand(1);
  for (auto& v : B) v = (uint8_t)rand();
  for (auto& v : zp) v = (uint8_t)rand();
  for (auto& v : sc) v = (float)(rand() % 1000 + 1) * 1e-4f;
  for (auto& v : A) v = (float)(rand() % 20001 - 10000) * 1e-3f;
  Packed w;
  if (!pack(B.data(), sc.data(), zp.data(), nullptr, K, N, bs, &w)) return 0;
  const Impl* impl = choose("avx2", nullptr);
  if (!impl) return 0;
  std::vector<int8_t> q((size_t)M * nblk * bs + kQPad);
  std::vector<float> sa((size_t)M * nblk), sums((size_t)M * nblk);
  Acts a;
  a.M = M, a.Kp = nblk * bs, a.nblk = nblk, a.q = q.data(), a.scale = sa.data(), a.sum = sums.data();
  impl->quantize(A.data(), K, 0, M, K, bs, a);
  double best = 1e30;
  for (int t = 0; t < 5; ++t) {
    const auto t0 = std::chrono::steady_clock::now();
    for (int i = 0; i < reps; ++i)
      for (int r = 0; r < M; r += kRowChunk)
        impl->kernel(w, a, r, M - r < kRowChunk ? M - r : kRowChunk, 0, w.npanel, Y.data(), N);
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count() / reps;
    best = s < best ? s : best;
  }
  release(&w);
  return (double)K * N * M / best;
}

int main() {
  if (!choose("avx2", nullptr)) return puts("this CPU has no AVX2 + FMA: nothing to measure"), 1;
  const long n = 50000000;
  const double ghz = n * 4.0 / seconds(chain, n) / 1e9;
  const double pair_rate = n * 8.0 / seconds(pairs, n);  // vpmaddubsw + vpaddw pairs a second
  const double add_rate = n * 8.0 / seconds(adds, n), add_bcast_rate = n * 8.0 / seconds(adds_bcast, n);
  printf("clock ~%.2f GHz (a chain of dependent adds)\n", ghz);
  printf("vpmaddubsw + vpaddw: %.2f pairs a cycle = %.1f G int8 products/s (the ceiling)\n", pair_rate / ghz / 1e9,
         pair_rate * 32 / 1e9);
  printf("vpaddw %.2f a cycle alone, %.2f with a vbroadcastss from memory for every two\n", add_rate / ghz / 1e9,
         add_bcast_rate / ghz / 1e9);
  const double ceiling = pair_rate * 32;
  const int shapes[][2] = {{1536, 256}, {8960, 128}};  // weights of 0.2 and 0.6 MB: in the L2 cache
  for (const auto& s : shapes)
    for (int M : {1, 4, 8, 16, 64}) {
      const double r = kernel_rate(s[0], s[1], M, 20000 / M + 1);
      printf("kernel K=%d N=%d M=%2d: %6.1f G products/s, %.2f of the ceiling\n", s[0], s[1], M, r / 1e9, r / ceiling);
    }
  return 0;
}
