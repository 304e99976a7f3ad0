// Two builds of specrt's int4 kernel library against each other (docs/kernel.md, "Roofline"): the same
// matmul on one thread (or THREADS, each a contiguous share of the panels, as onnxruntime's pool splits a
// call) through each library's C interface (specrt_int4_matmul: quantize + kernel, path "auto"), the two alternating within every trial, so that the host's drift (often +-30% here between
// minutes) falls on both alike. Per row count: each build's best of 5 calls a trial, over 21 trials; prints
// the median products/s of each and the median and quartiles of the per-trial time ratio A/B (> 1: B is
// faster), and whether both builds give the same bits. COPIES weights of the shape (each packed by each
// library) are used in turn: enough of them (> 64 MB) and every call reads its weights from memory.
//
//   lib() { g++ -std=c++17 -O3 -ffp-contract=off -fPIC -shared -I$1 -o $2
//           $1/int4.cc $1/int4_amx.cc $1/int4_x86.cc $1/int4_arm_dot.cc $1/int4_arm_i8mm.cc $1/int4_none.cc $1/attention.cc; }
//   lib specrt/engines/kernels /tmp/a.so; lib OTHER_TREE/specrt/engines/kernels /tmp/b.so
//   g++ -std=c++17 -O2 bench/kernels/kernel_ab.cc -ldl -pthread -o /tmp/kernel_ab
//   [KERNEL_AB_THREADS=2] [KERNEL_AB_PATHS=avx512amx,avx512vnni] /tmp/kernel_ab /tmp/a.so /tmp/b.so K N COPIES ROWS...
//     e.g. 1536 17920 5 1 3 5 9 16; KERNEL_AB_PATHS: the path each side runs (default auto,auto), so that two paths
//     of one library can be compared (give the same library twice)
#include <dlfcn.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <thread>
#include <vector>

using Pack = void* (*)(const uint8_t*, const float*, const uint8_t*, const float*, int, int, int);
using Matmul = int (*)(const void*, const float*, int, float*, const char*, int, int);
using Free = void (*)(void*);

int main(int argc, char** argv) {
  if (argc < 7) {
    fprintf(stderr, "usage: kernel_ab LIB_A LIB_B K N COPIES ROWS...\n");
    return 2;
  }
  const int K = atoi(argv[3]), N = atoi(argv[4]), copies = atoi(argv[5]), bs = 128;
  const char* env = getenv("KERNEL_AB_THREADS");
  const int threads = env && *env ? atoi(env) : 1;
  if (threads < 1 || threads > 64) return fprintf(stderr, "kernel_ab: KERNEL_AB_THREADS must be 1 to 64\n"), 2;
  if (K <= 0 || K % bs || N <= 0 || copies <= 0) {
    fprintf(stderr, "kernel_ab: K must be a positive multiple of %d, N and COPIES positive\n", bs);
    return 2;
  }
  const char* names_env = getenv("KERNEL_AB_PATHS");
  std::string names[2] = {"auto", "auto"};
  if (names_env && *names_env) {
    const std::string both = names_env;
    const size_t comma = both.find(',');
    if (comma == std::string::npos) return fprintf(stderr, "kernel_ab: KERNEL_AB_PATHS is PATH_A,PATH_B\n"), 2;
    names[0] = both.substr(0, comma), names[1] = both.substr(comma + 1);
  }
  std::vector<int> rows;
  for (int i = 6; i < argc; ++i) rows.push_back(atoi(argv[i]));
  for (int m : rows)
    if (m < 1 || m > 64) return fprintf(stderr, "kernel_ab: rows must be 1 to 64\n"), 2;
  Pack pack[2];
  Matmul matmul[2];
  Free release[2];
  for (int v = 0; v < 2; ++v) {
    void* h = dlopen(argv[1 + v], RTLD_NOW | RTLD_LOCAL);
    if (!h) return fprintf(stderr, "kernel_ab: %s\n", dlerror()), 1;
    pack[v] = (Pack)dlsym(h, "specrt_int4_pack");
    matmul[v] = (Matmul)dlsym(h, "specrt_int4_matmul");
    release[v] = (Free)dlsym(h, "specrt_int4_free");
    if (!pack[v] || !matmul[v] || !release[v]) return fprintf(stderr, "kernel_ab: %s is not specrt's library\n", argv[1 + v]), 1;
  }
  const int nblk = K / bs;
  std::vector<uint8_t> B((size_t)N * nblk * bs / 2), zp((size_t)N * ((nblk + 1) / 2));
  std::vector<float> scales((size_t)N * nblk), A((size_t)64 * K);
  unsigned s = 1;
  auto next = [&s]() { return s = s * 1103515245u + 12345u, s >> 16; };
  for (auto& x : B) x = (uint8_t)next();
  for (auto& x : zp) x = (uint8_t)next();
  for (auto& x : scales) x = 1e-3f * (float)(next() % 1000 + 1);
  for (auto& x : A) x = (float)next() * 1e-4f - 3.0f;
  std::vector<void*> w[2];
  for (int v = 0; v < 2; ++v)
    for (int c = 0; c < copies; ++c) {
      w[v].push_back(pack[v](B.data(), scales.data(), zp.data(), nullptr, K, N, bs));
      if (!w[v].back()) return fprintf(stderr, "kernel_ab: out of memory packing\n"), 1;
    }
  std::vector<float> Y[2] = {std::vector<float>((size_t)64 * N), std::vector<float>((size_t)64 * N)};
  for (int m : rows) {
    std::vector<double> ratio, t[2];
    for (int trial = 0; trial < 21; ++trial) {
      double best[2];
      for (int k = 0; k < 2; ++k) {
        const int v = trial & 1 ? 1 - k : k;  // which build goes first alternates
        best[v] = 1e30;
        for (int rep = 0; rep < 5; ++rep) {
          const auto t0 = std::chrono::steady_clock::now();
          // each thread its share of the panels of every copy (threads started once a repeat, as a pool's wake)
          const int panels = (N + 15) / 16;
          auto share = [&](int h) {
            const int p0 = panels * h / threads, p1 = panels * (h + 1) / threads;
            if (p1 > p0)
              for (int c = 0; c < copies; ++c) matmul[v](w[v][c], A.data(), m, Y[v].data(), names[v].c_str(), p0, p1);
          };
          std::vector<std::thread> pool;
          for (int h = 1; h < threads; ++h) pool.emplace_back(share, h);
          share(0);
          for (auto& th : pool) th.join();
          const double e = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count() / copies;
          best[v] = std::min(best[v], e);
        }
      }
      t[0].push_back(best[0]), t[1].push_back(best[1]), ratio.push_back(best[0] / best[1]);
    }
    for (auto* x : {&ratio, &t[0], &t[1]}) std::sort(x->begin(), x->end());
    for (int v = 0; v < 2; ++v)
      if (matmul[v](w[v][0], A.data(), m, Y[v].data(), names[v].c_str(), 0, 0))
        return fprintf(stderr, "kernel_ab: path %s cannot run here\n", names[v].c_str()), 1;
    bool same = true;
    for (size_t i = 0; i < (size_t)m * N; ++i) same = same && Y[0][i] == Y[1][i];
    const double products = (double)m * K * N;
    printf("K=%d N=%d rows=%2d: A %.1f, B %.1f G products/s; time A/B %.3f [%.3f, %.3f]; bits %s\n", K, N, m,
           products / t[0][10] / 1e9, products / t[1][10] / 1e9, ratio[10], ratio[5], ratio[15],
           same ? "same" : "DIFFER");
  }
  for (int v = 0; v < 2; ++v)
    for (void* x : w[v]) release[v](x);
  return 0;
}
