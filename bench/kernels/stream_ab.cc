// specrt's int4 matmul at one row against a plain read of the same packed bytes (docs/kernel.md, "Roofline"):
// whether a one-row call streams its weights as fast as memory gives them on this host. Two threads, each a
// contiguous half of the panels (as onnxruntime's pool splits a call); COPIES packed weights used in turn so
// that every call reads from memory; the kernel call and the read alternate within every trial (31), so the
// host's drift falls on both alike. Prints both rates (medians) and the median per-trial time ratio
// kernel / read (1.0: the kernel streams at the read's rate). AVX-512 hosts only (the read uses zmm loads).
//
//   g++ -std=c++17 -O2 -mavx512f -Ispecrt/engines/kernels bench/kernels/stream_ab.cc -ldl -pthread -o /tmp/stream_ab
//   /tmp/stream_ab specrt/engines/_int4*.so K N COPIES        e.g. 1536 17920 6; 8960 1536 12; 896 9728 20
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
  if (argc != 5) return fprintf(stderr, "usage: stream_ab LIB K N COPIES\n"), 2;
  void* h = dlopen(argv[1], RTLD_NOW);
  if (!h) return fprintf(stderr, "stream_ab: %s\n", dlerror()), 2;
  auto pack = (Pack)dlsym(h, "specrt_int4_pack"); auto mm = (Matmul)dlsym(h, "specrt_int4_matmul");
  int K = atoi(argv[2]), N = atoi(argv[3]), copies = atoi(argv[4]), bs = 128, nblk = K / bs;
  std::vector<uint8_t> B((size_t)N * nblk * bs / 2); std::vector<float> s((size_t)N * nblk); std::vector<uint8_t> z((size_t)N * ((nblk + 1) / 2));
  unsigned st = 1; for (auto& x : B) x = (st = st * 1103515245u + 12345u) >> 16; for (auto& x : s) x = 0.01f; for (auto& x : z) x = 0x88;
  std::vector<void*> w; for (int c = 0; c < copies; ++c) w.push_back(pack(B.data(), s.data(), z.data(), nullptr, K, N, bs));
  std::vector<float> A(K, 0.5f), Y(N);
  const specrt::Packed* p0 = (const specrt::Packed*)w[0];
  const int np = p0->npanel; const size_t bytes = (size_t)np * p0->nblk * p0->block_bytes;
  volatile long sink = 0; int cur = 0;
  auto run = [&](int mode) {
    const auto t0 = C::now();
    for (int rep = 0; rep < copies; ++rep) {
      const specrt::Packed* pw = (const specrt::Packed*)w[cur]; cur = (cur + 1) % copies;
      std::thread t[2];
      for (int k = 0; k < 2; ++k) t[k] = std::thread([&, k] {
        int a = np / 2 * k, b = k ? np : np / 2;
        if (mode == 0) mm(pw, A.data(), 1, Y.data(), "auto", a, b);
        else {
          const __m512i* q = (const __m512i*)(pw->data + (size_t)a * pw->nblk * pw->block_bytes);
          size_t n = (size_t)(b - a) * pw->nblk * pw->block_bytes / 64; __m512i s0 = _mm512_setzero_si512(), s1 = s0, s2 = s0, s3 = s0;
          for (size_t i = 0; i + 4 <= n; i += 4) s0 = _mm512_add_epi64(s0, q[i]), s1 = _mm512_add_epi64(s1, q[i+1]), s2 = _mm512_add_epi64(s2, q[i+2]), s3 = _mm512_add_epi64(s3, q[i+3]);
          sink += _mm512_reduce_add_epi64(_mm512_add_epi64(_mm512_add_epi64(s0, s1), _mm512_add_epi64(s2, s3)));
        }
      });
      t[0].join(); t[1].join();
    }
    return std::chrono::duration<double>(C::now() - t0).count() / copies;
  };
  std::vector<double> km, rd, ratio;
  for (int tr = 0; tr < 31; ++tr) { double a = run(0), b = run(1); km.push_back(a); rd.push_back(b); ratio.push_back(a / b); }
  auto med = [](std::vector<double> v) { std::sort(v.begin(), v.end()); return v[v.size() / 2]; };
  printf("K %d N %d: %.1f MB; kernel at 1 row %.1f GB/s, read %.1f GB/s, kernel/read time %.2f\n", K, N, bytes / 1e6, bytes / med(km) / 1e9, bytes / med(rd) / 1e9, med(ratio));
}
