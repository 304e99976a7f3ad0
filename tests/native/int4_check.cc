// Checks every kernel path this CPU runs against the reference arithmetic and for batch invariance, on
// random problems; built with the kernel sources by tests/test_kernel.py for another architecture (Arm,
// run under qemu-user). Prints the paths it checked; exit status 1 on the first mismatch.
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <random>
#include <string>
#include <vector>

extern "C" {
const char* specrt_int4_paths();
void* specrt_int4_pack(const uint8_t* B, const float* scales, const uint8_t* zp, const float* bias, int K, int N,
                       int bs);
int specrt_int4_matmul(const void* packed, const float* A, int M, float* Y, const char* path, int p0, int p1);
void specrt_int4_reference(const uint8_t* B, const float* scales, const uint8_t* zp, const float* bias, int K, int N,
                           int bs, const float* A, int M, float* Y);
void specrt_int4_free(void* w);
int specrt_attention_demo(float* out, int base, int big);
}

int main() {
  std::printf("paths: %s\n", specrt_int4_paths());
  std::vector<std::string> paths;
  for (const char *p = specrt_int4_paths(), *q; *p; p = *q ? q + 1 : q) {
    q = std::strchr(p, ',');
    if (!q) q = p + std::strlen(p);
    paths.emplace_back(p, q - p);
  }
  std::mt19937 rng(7);
  struct Shape { int K, N, bs, M; bool zp, bias; };
  const Shape shapes[] = {{300, 37, 32, 13, true, false}, {256, 64, 128, 1, false, true}, {1000, 70, 64, 70, true, true},
                          {512, 33, 256, 9, true, false}, {96, 17, 32, 5, false, false}};
  for (const Shape& s : shapes) {
    const int nblk = (s.K + s.bs - 1) / s.bs;
    std::vector<uint8_t> B((size_t)s.N * nblk * s.bs / 2), zp((size_t)s.N * ((nblk + 1) / 2));
    std::vector<float> sc((size_t)s.N * nblk), bias(s.N), A((size_t)s.M * s.K), want((size_t)s.M * s.N);
    for (auto& v : B) v = (uint8_t)rng();
    for (auto& v : zp) v = (uint8_t)rng();
    std::uniform_real_distribution<float> u(-4.0f, 4.0f), pos(1e-4f, 0.05f);
    for (auto& v : sc) v = pos(rng);
    for (auto& v : bias) v = u(rng);
    for (auto& v : A) v = u(rng);
    const uint8_t* z = s.zp ? zp.data() : nullptr;
    const float* b = s.bias ? bias.data() : nullptr;
    specrt_int4_reference(B.data(), sc.data(), z, b, s.K, s.N, s.bs, A.data(), s.M, want.data());
    void* w = specrt_int4_pack(B.data(), sc.data(), z, b, s.K, s.N, s.bs);
    for (const std::string& path : paths) {
      std::vector<float> got((size_t)s.M * s.N), row(s.N);
      if (specrt_int4_matmul(w, A.data(), s.M, got.data(), path.c_str(), 0, 0)) return std::printf("%s: cannot run\n", path.c_str()), 1;
      if (std::memcmp(got.data(), want.data(), sizeof(float) * got.size()))
        return std::printf("%s: differs from the reference (K=%d N=%d bs=%d M=%d)\n", path.c_str(), s.K, s.N, s.bs, s.M), 1;
      for (int r = 0; r < s.M; ++r) {
        specrt_int4_matmul(w, A.data() + (size_t)r * s.K, 1, row.data(), path.c_str(), 0, 0);
        if (std::memcmp(row.data(), got.data() + (size_t)r * s.N, sizeof(float) * s.N))
          return std::printf("%s: row %d alone differs from the row in a call of %d\n", path.c_str(), r, s.M), 1;
      }
    }
    specrt_int4_free(w);
  }
  // the attention's fixed problems: hashes of their bits, which the test compares with this machine's own
  for (int big = 0; big < 3; ++big) {  // 2: the big one's rows as trees
    std::vector<float> att(big ? 2 * 9 * 768 + 2 * 2 * 2 * 48 * 128 : 2 * 3 * 128 + 2 * 2 * 2 * 16 * 32);
    const int count = specrt_attention_demo(att.data(), 0, big);
    uint64_t h = 1469598103934665603ull;
    for (int i = 0; i < count; ++i) {
      uint32_t bits;
      std::memcpy(&bits, &att[i], 4);
      h = (h ^ bits) * 1099511628211ull;
    }
    std::printf("attention%s %016llx\n", big == 2 ? "-tree" : big ? "-big" : "", (unsigned long long)h);
  }
  std::printf("ok\n");
  return 0;
}
