// specrt's int4 matmul at ROWS rows against a plain read of the same packed bytes, THREADS threads (each a
// contiguous share of the panels, as onnxruntime's pool splits a call), paired: the kernel call and the read
// alternate within every trial (21), so the host's drift falls on both alike. Prints per row count the
// kernel's and the read's rate (medians) and read time / kernel time (median [quartiles]; 1.0: the kernel
// streams its weights as fast as the same minute's memory gives them). stream_ab.cc's one-row question asked
// at any width and thread count; PATH forces a kernel path ("auto", "avx512vnni", ...). COPIES packed weights
// used in turn: make them add up to more than the L3 (300 MB on the Emerald Rapids hosts) so every call reads
// memory. AVX-512 hosts only (the read uses zmm loads). docs/kernel.md, "The AVX-512 VNNI path on Intel".
//
//   g++ -std=c++17 -O2 -mavx512f -Ispecrt/engines/kernels bench/kernels/stream_rows.cc -ldl -pthread -o /tmp/stream_rows
//   /tmp/stream_rows LIB PATH K N COPIES THREADS ROWS...   e.g. LIB avx512vnni 1536 17920 40 2 1 5 9
#include <dlfcn.h>
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <thread>
#include <vector>
#include <immintrin.h>
#include "int4.h"
using Pack = void* (*)(const uint8_t*, const float*, const uint8_t*, const float*, int, int, int);
using Matmul = int (*)(const void*, const float*, int, float*, const char*, int, int);
using C = std::chrono::steady_clock;
int main(int argc, char** argv) {
  if (argc < 8) return fprintf(stderr, "usage: stream_rows LIB PATH K N COPIES THREADS ROWS...\n"), 2;
  void* h = dlopen(argv[1], RTLD_NOW);
  if (!h) return fprintf(stderr, "%s\n", dlerror()), 2;
  auto pack = (Pack)dlsym(h, "specrt_int4_pack"); auto mm = (Matmul)dlsym(h, "specrt_int4_matmul");
  const char* path = argv[2];
  int K = atoi(argv[3]), N = atoi(argv[4]), copies = atoi(argv[5]), th = atoi(argv[6]), bs = 128, nblk = K / bs;
  std::vector<uint8_t> B((size_t)N * nblk * bs / 2); std::vector<float> s((size_t)N * nblk); std::vector<uint8_t> z((size_t)N * ((nblk + 1) / 2));
  unsigned st = 1; for (auto& x : B) x = (st = st * 1103515245u + 12345u) >> 16; for (auto& x : s) x = 0.01f; for (auto& x : z) x = 0x88;
  std::vector<void*> w; for (int c = 0; c < copies; ++c) w.push_back(pack(B.data(), s.data(), z.data(), nullptr, K, N, bs));
  std::vector<float> A((size_t)16 * K); for (auto& x : A) x = (float)((st = st * 1103515245u + 12345u) >> 16) * 1e-4f - 3.0f;
  std::vector<float> Y((size_t)16 * N);
  const specrt::Packed* p0 = (const specrt::Packed*)w[0];
  const int np = p0->npanel; const size_t bytes = (size_t)np * p0->nblk * p0->block_bytes;
  volatile long sink = 0; int cur = 0;
  for (int ai = 7; ai < argc; ++ai) {
    const int rows = atoi(argv[ai]);
    auto run = [&](int mode) {
      const auto t0 = C::now();
      for (int rep = 0; rep < copies; ++rep) {
        const specrt::Packed* pw = (const specrt::Packed*)w[cur]; cur = (cur + 1) % copies;
        std::vector<std::thread> t;
        auto work = [&, pw](int k) {
          int a = np * k / th, b = np * (k + 1) / th;
          if (mode == 0) mm(pw, A.data(), rows, Y.data(), path, a, b);
          else {
            const __m512i* q = (const __m512i*)(pw->data + (size_t)a * pw->nblk * pw->block_bytes);
            size_t n = (size_t)(b - a) * pw->nblk * pw->block_bytes / 64; __m512i s0 = _mm512_setzero_si512(), s1 = s0, s2 = s0, s3 = s0;
            for (size_t i = 0; i + 4 <= n; i += 4) s0 = _mm512_add_epi64(s0, q[i]), s1 = _mm512_add_epi64(s1, q[i+1]), s2 = _mm512_add_epi64(s2, q[i+2]), s3 = _mm512_add_epi64(s3, q[i+3]);
            sink += _mm512_reduce_add_epi64(_mm512_add_epi64(_mm512_add_epi64(s0, s1), _mm512_add_epi64(s2, s3)));
          }
        };
        for (int k = 1; k < th; ++k) t.emplace_back(work, k);
        work(0);
        for (auto& x : t) x.join();
      }
      return std::chrono::duration<double>(C::now() - t0).count() / copies;
    };
    std::vector<double> km, rd, ratio;
    for (int tr = 0; tr < 21; ++tr) { double a, b; if (tr & 1) { b = run(1); a = run(0); } else { a = run(0); b = run(1); } km.push_back(a); rd.push_back(b); ratio.push_back(a / b); }
    auto q = [](std::vector<double> v, double f) { std::sort(v.begin(), v.end()); return v[(size_t)(f * (v.size() - 1))]; };
    printf("K %5d N %5d th %d rows %2d: %.1f MB x%d; kernel %.1f GB/s (%.0f us), read %.1f GB/s, read/kernel %.3f [%.3f %.3f]\n", K, N, th, rows, bytes / 1e6, copies,
           bytes / q(km, .5) / 1e9, q(km, .5) * 1e6, bytes / q(rd, .5) / 1e9, 1 / q(ratio, .5), 1 / q(ratio, .75), 1 / q(ratio, .25));
    fflush(stdout);
  }
}
