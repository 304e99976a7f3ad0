// The library's onnxruntime custom operators, registered with SessionOptions.register_custom_ops_library
// in the domain "specrt"; the CPU engine puts them in place of the nodes they can take (engines/int4.py).
//
// specrt.Int4MatMul, the kernel of int4.h: inputs A [..., K] float, then B, scales, zero points (optional)
// and bias (optional) as MatMulNBits has them; attributes K, N, bits (4), block_size, `path` ("auto" or
// a path name from int4.h) and `glu` (optional, 1: the output is [..., N / 2], a gated MLP's activation
// silu(Y[..., :N/2]) * Y[..., N/2:], int4.h's Packed::glu). The weights are packed once, when the session
// creates the kernel; a call quantizes its rows once and spreads panels of output columns over onnxruntime's
// own intra-op threads. With the attribute `norm` (1) and `epsilon`, a root-mean-square norm in front
// (int4.h, rms_norm): input 5 `skip` (optional, the shape of A) and input 6 `gamma` [K] (a constant); the
// matmul takes the normalized rows of A + skip, and output 1 is A + skip (present when skip is).
//
// specrt.Attention, attention.h: inputs query [B, S, (H + 2 Hkv) D] (or [B, S, H D] with key and value
// [B, S, Hkv D]), key, value (optional), past_key and past_value [B, Hkv, C, D], seqlens_k [B] int32,
// cos_cache and sin_cache [positions, D / 2], query_seqlens [B] int32 (optional), tree_parents [B, S]
// int32 (optional: each new token's parent among its row's new tokens, -1 for the row's last cached entry;
// absent, or each token the parent of the next, a chain: attention_tree); outputs [B, S, H D],
// present_key and present_value (the past buffers when bound to them, as the engine does); attributes
// num_heads, kv_num_heads, scale.
#include <cmath>
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#if defined(__linux__)
#include <sys/mman.h>
#include <unistd.h>
#endif

#include "attention.h"
#include "int4.h"
#include "ort_api.h"

namespace {

using specrt::Acts;
using specrt::Packed;

struct Op {
  Packed w;
  const specrt::Impl* impl = nullptr;
  bool norm = false;  // a norm folded in front (rms_norm)
  float eps = 0.0f;
  std::vector<float> gamma;  // [K]
};

ort::Status* fail(const ort::Api& api, const std::string& msg) {
  return api.CreateStatus(ort::kInvalidArgument, ("specrt.Int4MatMul: " + msg).c_str());
}

// Whether v is a tensor of `type` with `count` elements ((size_t)-1: any number); its data in *data (null
// when it has no elements), else why not in *why.
bool tensor(const ort::Api& api, const ort::Value* v, ort::ElementType type, size_t count, const void** data,
            std::string* why, std::vector<int64_t>* dims = nullptr) {
  ort::TensorInfo* info = nullptr;
  if (ort::Status* s = api.GetTensorTypeAndShape(v, &info)) return api.ReleaseStatus(s), *why = "not a tensor", false;
  ort::ElementType t = ort::kUndefined;
  size_t rank = 0;
  std::vector<int64_t> d;
  ort::Status* s = api.GetTensorElementType(info, &t);
  if (!s) s = api.GetDimensionsCount(info, &rank);
  if (!s) d.resize(rank), s = api.GetDimensions(info, d.data(), rank);
  api.ReleaseTensorTypeAndShapeInfo(info);
  if (s) return api.ReleaseStatus(s), *why = "unreadable shape", false;
  size_t n = 1;
  for (int64_t x : d) n *= x < 0 ? 0 : (size_t)x;
  if (t != type) return *why = "element type " + std::to_string((int)t), false;
  if (count != (size_t)-1 && n != count)
    return *why = std::to_string(n) + " elements where " + std::to_string(count) + " were expected", false;
  void* p = nullptr;
  if (n && (s = api.GetTensorMutableData(const_cast<ort::Value*>(v), &p))) return api.ReleaseStatus(s), *why = "no data", false;
  if (n && !p) return *why = "no data", false;
  *data = p;
  if (dims) *dims = d;
  return true;
}

// onnxruntime maps a graph's external weights from their file (privately, read-write) and keeps the mapping;
// once packed, the originals are never read again, so their pages are handed back (else the weights are
// resident twice). Only pages wholly inside [p, p + n), in a private file mapping, none of them written
// (each still the file's page, by /proc/self/pagemap): dropped, they would read the file again if touched.
// Anything else is left alone.
void drop_file_pages(const void* p, size_t n) {
#if defined(__linux__)
  const uintptr_t page = (uintptr_t)sysconf(_SC_PAGESIZE);
  const uintptr_t lo = ((uintptr_t)p + page - 1) / page * page, hi = ((uintptr_t)p + n) / page * page;
  if (!p || hi <= lo) return;
  FILE* maps = fopen("/proc/self/maps", "r");
  if (!maps) return;
  char line[512];
  bool file = false;
  while (fgets(line, sizeof line, maps)) {
    unsigned long start = 0, end = 0, inode = 0;
    char perms[8] = {0};
    if (sscanf(line, "%lx-%lx %7s %*s %*s %lu", &start, &end, perms, &inode) != 4) continue;
    if (start <= lo && hi <= end) {
      file = inode != 0 && perms[3] == 'p';
      break;
    }
  }
  fclose(maps);
  if (!file) return;
  FILE* pm = fopen("/proc/self/pagemap", "rb");
  if (!pm) return;
  std::vector<uint64_t> flags((hi - lo) / page);
  const bool read = fseek(pm, (long)(lo / page * 8), SEEK_SET) == 0 &&
                    fread(flags.data(), 8, flags.size(), pm) == flags.size();
  fclose(pm);
  if (!read) return;
  for (uint64_t f : flags)  // bit 63: present; bit 61: a file page (a written one would be anonymous)
    if ((f >> 63 & 1) && !(f >> 61 & 1)) return;
  madvise((void*)lo, hi - lo, MADV_DONTNEED);
#else
  (void)p, (void)n;
#endif
}

ort::Status* create(const ort::CustomOp*, const void* table, const ort::KernelInfo* info, void** out) {
  const ort::Api api((const void* const*)table);
  int64_t K = 0, N = 0, bs = 0, bits = 0;
  const char* names[4] = {"K", "N", "block_size", "bits"};
  int64_t* dsts[4] = {&K, &N, &bs, &bits};
  for (int i = 0; i < 4; ++i) {
    if (ort::Status* s = api.KernelInfoGetAttribute_int64(info, names[i], dsts[i]))
      return api.ReleaseStatus(s), fail(api, std::string("missing attribute ") + names[i]);
  }
  if (bits != 4 || bs < 32 || bs % 32 || K <= 0 || N <= 0 || K > (1 << 30) || N > (1 << 30))
    return fail(api, "takes bits 4, a block size that is a multiple of 32 and positive K and N");
  int64_t glu = 0;  // optional: a gated MLP's two matmuls in one (int4.h, Packed::glu)
  if (ort::Status* s = api.KernelInfoGetAttribute_int64(info, "glu", &glu)) api.ReleaseStatus(s), glu = 0;
  std::string path = "auto";
  size_t len = 0;
  if (ort::Status* s = api.KernelInfoGetAttribute_string(info, "path", nullptr, &len)) {
    api.ReleaseStatus(s);
  } else if (len > 1) {
    path.assign(len, '\0');
    if (ort::Status* s2 = api.KernelInfoGetAttribute_string(info, "path", &path[0], &len)) api.ReleaseStatus(s2);
    path.resize(strlen(path.c_str()));
  }
  size_t inputs = 0;
  if (ort::Status* s = api.KernelInfo_GetInputCount(info, &inputs)) return api.ReleaseStatus(s), fail(api, "no inputs");
  const ort::Value* v[7] = {nullptr, nullptr, nullptr, nullptr, nullptr, nullptr, nullptr};
  for (size_t i = 1; i < inputs && i < 7; ++i) {
    if (i == 5) continue;  // skip: a tensor of each call
    int constant = 0;
    if (ort::Status* s = api.KernelInfoGetConstantInput_tensor(info, i, &constant, &v[i])) api.ReleaseStatus(s);
    if (!constant) v[i] = nullptr;
  }
  if (!v[1] || !v[2]) return fail(api, "B and scales must be constant initializers (they are packed once)");
  const size_t nblk = (size_t)((K + bs - 1) / bs);
  std::string why;
  const void *B = nullptr, *scales = nullptr, *zp = nullptr, *bias = nullptr;
  if (!tensor(api, v[1], ort::kUint8, (size_t)N * nblk * (size_t)bs / 2, &B, &why)) return fail(api, "B: " + why);
  if (!tensor(api, v[2], ort::kFloat, (size_t)N * nblk, &scales, &why)) return fail(api, "scales: " + why);
  if (inputs > 3 && v[3] && !tensor(api, v[3], ort::kUint8, (size_t)N * ((nblk + 1) / 2), &zp, &why))
    return fail(api, "zero_points: " + why);
  if (inputs > 4 && v[4] && !tensor(api, v[4], ort::kFloat, (size_t)N, &bias, &why)) return fail(api, "bias: " + why);
  int64_t norm = 0;
  float eps = 0.0f;
  const void* gamma = nullptr;
  if (ort::Status* s = api.KernelInfoGetAttribute_int64(info, "norm", &norm)) api.ReleaseStatus(s), norm = 0;
  if (norm) {
    if (ort::Status* s = api.KernelInfoGetAttribute_float(info, "epsilon", &eps))
      return api.ReleaseStatus(s), fail(api, "norm needs the attribute epsilon");
    if (!(eps >= 0.0f)) return fail(api, "epsilon must be >= 0");
    if (inputs < 7 || !v[6]) return fail(api, "norm needs gamma (input 6) as a constant initializer");
    if (!tensor(api, v[6], ort::kFloat, (size_t)K, &gamma, &why)) return fail(api, "gamma: " + why);
  }
  Op* op = new Op;
  op->norm = norm != 0, op->eps = eps;
  if (gamma) op->gamma.assign((const float*)gamma, (const float*)gamma + K);
  op->impl = specrt::choose(path.c_str(), nullptr);
  if (!op->impl) return delete op, fail(api, "path '" + path + "' cannot run on this CPU");
  op->impl = &op->impl->for_block((int)bs);
  if (glu && (N % (2 * specrt::kPanel) || bias))
    return delete op, fail(api, "glu takes N a multiple of " + std::to_string(2 * specrt::kPanel) + " and no bias");
  if (!specrt::pack((const uint8_t*)B, (const float*)scales, (const uint8_t*)zp, (const float*)bias, (int)K, (int)N,
                    (int)bs, &op->w, glu != 0))
    return delete op, fail(api, "out of memory packing the weights");
  drop_file_pages(B, (size_t)N * nblk * (size_t)bs / 2);
  drop_file_pages(scales, (size_t)N * nblk * sizeof(float));
  if (zp) drop_file_pages(zp, (size_t)N * ((nblk + 1) / 2));
  if (bias) drop_file_pages(bias, (size_t)N * sizeof(float));
  *out = op;
  return nullptr;
}

void destroy(void* kernel) {
  Op* op = (Op*)kernel;
  specrt::release(&op->w);
  delete op;
}

// One call's work, split into items: a chunk of rows times a group of panels.
struct Call {
  const Op* op;
  const specrt::Impl* impl;  // the op's path for this call's number of rows (Impl::for_rows)
  const float* A;
  const float* skip = nullptr;  // with a norm: input 5, or null
  float* sum = nullptr;         // with a skip: output 1
  float* xn = nullptr;          // with a norm: the normalized rows [M][K]
  float* y;
  Acts acts;
  int M, group, groups;  // panels per item, items per row chunk
};

// Rows [r, r + n) of A quantized into c.acts, through the norm when there is one.
void quantize_rows(const Call& c, int r, int n) {
  const Op& op = *c.op;
  const int K = op.w.K;
  if (!op.norm) return c.impl->quantize(c.A, K, r, n, K, op.w.bs, c.acts);
  for (int i = r; i < r + n; ++i) {
    const size_t at = (size_t)i * K;
    specrt::rms_norm(c.A + at, c.skip ? c.skip + at : nullptr, op.gamma.data(), op.eps, K, c.sum ? c.sum + at : nullptr,
                     c.xn + at);
  }
  c.impl->quantize(c.xn, K, r, n, K, op.w.bs, c.acts);
}

void quantize_item(void* data, size_t i) {  // rows [8i, 8i + 8)
  const Call& c = *(const Call*)data;
  const int r = (int)i * 8;
  quantize_rows(c, r, c.M - r < 8 ? c.M - r : 8);
}

void panel_item(void* data, size_t i) {
  const Call& c = *(const Call*)data;
  const Packed& w = c.op->w;
  const int r = (int)(i / c.groups) * specrt::kRowChunk, p = (int)(i % c.groups) * c.group;
  const int nr = c.M - r < specrt::kRowChunk ? c.M - r : specrt::kRowChunk;
  c.impl->kernel(w, c.acts, r, nr, p, p + c.group < w.npanel ? p + c.group : w.npanel, c.y, w.out_cols());
}

const void* const* g_table = nullptr;  // set by RegisterCustomOps

ort::Status* compute(void* kernel, ort::KernelContext* ctx) {
  const ort::Api api(g_table);
  const Op& op = *(const Op*)kernel;
  const Packed& w = op.w;
  const ort::Value* a = nullptr;
  if (ort::Status* s = api.KernelContext_GetInput(ctx, 0, &a)) return s;
  std::string why;
  std::vector<int64_t> dims;
  const void* A = nullptr;
  if (!tensor(api, a, ort::kFloat, (size_t)-1, &A, &why, &dims)) return fail(api, "A: " + why);
  if (dims.empty() || dims.back() != w.K)
    return fail(api, "A's last dimension must be K = " + std::to_string(w.K));
  size_t M = 1;
  for (size_t i = 0; i + 1 < dims.size(); ++i) M *= (size_t)dims[i];
  const std::vector<int64_t> adims = dims;
  dims.back() = w.out_cols();
  ort::Value* yv = nullptr;
  if (ort::Status* s = api.KernelContext_GetOutput(ctx, 0, dims.data(), dims.size(), &yv)) return s;
  const float* skip = nullptr;  // with a norm: input 5 (optional), and then output 1 = A + skip
  void* added = nullptr;
  if (op.norm) {
    size_t inputs = 0;
    if (ort::Status* s = api.KernelContext_GetInputCount(ctx, &inputs)) return s;
    const ort::Value* sk = nullptr;
    if (inputs > 5)
      if (ort::Status* s = api.KernelContext_GetInput(ctx, 5, &sk)) return s;
    size_t outputs = 0;
    if (ort::Status* s = api.KernelContext_GetOutputCount(ctx, &outputs)) return s;
    if (sk && outputs < 2) return fail(api, "a norm with a skip input needs output 1 (the sum)");
    if (sk) {
      const void* p = nullptr;
      if (!tensor(api, sk, ort::kFloat, M * w.K, &p, &why)) return fail(api, "skip: " + why);
      skip = (const float*)p;
      ort::Value* sv = nullptr;
      if (ort::Status* s = api.KernelContext_GetOutput(ctx, 1, adims.data(), adims.size(), &sv)) return s;
      if (M)
        if (ort::Status* s = api.GetTensorMutableData(sv, &added)) return s;
    }
  }
  if (M == 0) return nullptr;
  if (M > (1u << 30) / (unsigned)w.nblk) return fail(api, "too many rows");
  void* y = nullptr;
  if (ort::Status* s = api.GetTensorMutableData(yv, &y)) return s;
  thread_local std::vector<int8_t> q;
  thread_local std::vector<float> scale, sum;
  q.resize(specrt::acts_bytes((int)M, w.nblk * w.bs)), scale.resize(M * w.nblk), sum.resize(M * w.nblk);
  Call c;
  c.op = &op, c.impl = &op.impl->for_rows((int)M), c.A = (const float*)A, c.y = (float*)y, c.M = (int)M;
  thread_local std::vector<float> xn;
  if (op.norm) xn.resize(M * w.K), c.xn = xn.data(), c.skip = skip, c.sum = (float*)added;
  c.acts.M = (int)M, c.acts.Kp = w.nblk * w.bs, c.acts.nblk = w.nblk;
  c.acts.q = q.data(), c.acts.scale = scale.data(), c.acts.sum = sum.data(), c.acts.rows_major = c.impl->rows_major;
  if (M < 16) {
    quantize_rows(c, 0, (int)M);
  } else if (ort::Status* s = api.KernelContext_ParallelFor(ctx, quantize_item, (M + 7) / 8, 0, &c)) {
    return s;
  }
  // items of about 128 KB of packed weights: long runs of sequential reads for the prefetchers, and enough
  // items to balance two threads on every matrix of a 0.5B model (measured: 32 KB items ~5% slower at one row)
  const size_t panel_bytes = (size_t)w.nblk * w.block_bytes;
  c.group = (int)((131072 + panel_bytes - 1) / panel_bytes);
  if (w.glu) c.group += c.group & 1;  // whole pairs of panels
  c.groups = (w.npanel + c.group - 1) / c.group;
  const size_t chunks = (M + specrt::kRowChunk - 1) / specrt::kRowChunk;
  return api.KernelContext_ParallelFor(ctx, panel_item, chunks * c.groups, 0, &c);
}

// ---------------------------------------------------------------------------------------------- Attention

ort::Status* afail(const ort::Api& api, const std::string& msg) {
  return api.CreateStatus(ort::kInvalidArgument, ("specrt.Attention: " + msg).c_str());
}

struct AttentionOp {
  int H = 0, Hkv = 0;
  float scale = 0.0f;
};

ort::Status* attention_create(const ort::CustomOp*, const void* table, const ort::KernelInfo* info, void** out) {
  const ort::Api api((const void* const*)table);
  int64_t H = 0, Hkv = 0;
  float scale = 0.0f;
  const char* names[2] = {"num_heads", "kv_num_heads"};
  int64_t* dsts[2] = {&H, &Hkv};
  for (int i = 0; i < 2; ++i)
    if (ort::Status* s = api.KernelInfoGetAttribute_int64(info, names[i], dsts[i]))
      return api.ReleaseStatus(s), afail(api, std::string("missing attribute ") + names[i]);
  if (ort::Status* s = api.KernelInfoGetAttribute_float(info, "scale", &scale)) api.ReleaseStatus(s), scale = 0.0f;
  if (H <= 0 || Hkv <= 0 || H % Hkv || H > 4096) return afail(api, "num_heads must be a positive multiple of kv_num_heads");
  AttentionOp* op = new AttentionOp;
  op->H = (int)H, op->Hkv = (int)Hkv, op->scale = scale;
  *out = op;
  return nullptr;
}

void attention_destroy(void* kernel) { delete (AttentionOp*)kernel; }

struct AttentionWork {
  const specrt::AttentionCall* call;
};

void attention_item(void* data, size_t i) {
  const specrt::AttentionCall& c = *((const AttentionWork*)data)->call;
  thread_local std::vector<float> scratch;
  scratch.resize(specrt::attention_scratch(c));
  specrt::attention_group(c, (int)(i / c.Hkv), (int)(i % c.Hkv), scratch.data());
}

ort::Status* attention_compute(void* kernel, ort::KernelContext* ctx) {
  const ort::Api api(g_table);
  const AttentionOp& op = *(const AttentionOp*)kernel;
  size_t inputs = 0;
  if (ort::Status* s = api.KernelContext_GetInputCount(ctx, &inputs)) return s;
  const ort::Value* in[10] = {nullptr};
  for (size_t i = 0; i < inputs && i < 10; ++i)
    if (ort::Status* s = api.KernelContext_GetInput(ctx, i, &in[i])) return s;
  std::string why;
  std::vector<int64_t> qd, kd, vd, pkd, pvd, sd, cd, nd;
  const void *q = nullptr, *k = nullptr, *v = nullptr, *pk = nullptr, *pv = nullptr, *seqlens = nullptr,
             *cs = nullptr, *sn = nullptr, *qlens = nullptr, *parents = nullptr;
  const size_t any = (size_t)-1;
  if (!in[0] || !tensor(api, in[0], ort::kFloat, any, &q, &why, &qd) || qd.size() != 3) return afail(api, "query: " + why);
  if (!in[3] || !tensor(api, in[3], ort::kFloat, any, &pk, &why, &pkd) || pkd.size() != 4) return afail(api, "past_key: " + why);
  if (!in[4] || !tensor(api, in[4], ort::kFloat, any, &pv, &why, &pvd) || pvd != pkd) return afail(api, "past_value: " + why);
  const int64_t B = qd[0], S = qd[1], D = pkd[3], C = pkd[2];
  if (pkd[0] != B || pkd[1] != op.Hkv || !specrt::attention_shapes_ok((int)D))
    return afail(api, "past_key must be [batch, kv_num_heads, capacity, head_size] with a head size that is a "
                     "multiple of 16 (at most 512)");
  const bool packed = !in[1];
  if (packed && qd[2] != (op.H + 2 * op.Hkv) * D) return afail(api, "packed query must be [batch, seq, (num_heads + 2 kv_num_heads) head_size]");
  if (!packed) {
    if (qd[2] != op.H * D) return afail(api, "query must be [batch, seq, num_heads head_size]");
    if (!in[2] || !tensor(api, in[1], ort::kFloat, any, &k, &why, &kd) || !tensor(api, in[2], ort::kFloat, any, &v, &why, &vd) ||
        kd != std::vector<int64_t>{B, S, op.Hkv * D} || vd != kd)
      return afail(api, "key and value must be [batch, seq, kv_num_heads head_size]");
  }
  if (!in[5] || !tensor(api, in[5], ort::kInt32, (size_t)B, &seqlens, &why)) return afail(api, "seqlens_k: " + why);
  if (!in[6] || !in[7] || !tensor(api, in[6], ort::kFloat, any, &cs, &why, &cd) || !tensor(api, in[7], ort::kFloat, any, &sn, &why, &nd) ||
      cd.size() != 2 || cd[1] != D / 2 || nd != cd)
    return afail(api, "cos_cache and sin_cache must be [positions, head_size / 2]");
  if (inputs > 8 && in[8] && !tensor(api, in[8], ort::kInt32, (size_t)B, &qlens, &why)) return afail(api, "query_seqlens: " + why);
  std::vector<int> n(B), P(B);
  for (int64_t b = 0; b < B; ++b) {
    const int64_t T = (int64_t)((const int32_t*)seqlens)[b] + 1;
    n[b] = qlens ? ((const int32_t*)qlens)[b] : (int)S;
    P[b] = (int)(T - n[b]);
    if (n[b] < 0 || n[b] > S || P[b] < 0 || T > C || T > cd[0])
      return afail(api, "row " + std::to_string(b) + ": seqlens_k and query_seqlens leave the cache (" +
                           std::to_string(n[b]) + " new of " + std::to_string(T) + ", capacity " + std::to_string(C) + ")");
  }
  // the rows' trees, made once for every key/value head (a chain needs none: the kernel's plain path)
  thread_local std::vector<int> depth, path;
  depth.clear(), path.clear();
  if (inputs > 9 && in[9]) {
    if (!tensor(api, in[9], ort::kInt32, (size_t)(B * S), &parents, &why)) return afail(api, "tree_parents: " + why);
    if (B && S) {
      why = specrt::attention_tree((const int32_t*)parents, n.data(), (int)B, (int)S, &depth, &path);
      if (!why.empty()) return afail(api, "tree_parents: " + why);
    }
  }
  const int64_t odims[3] = {B, S, op.H * D};
  ort::Value *ov = nullptr, *pkv = nullptr, *pvv = nullptr;
  if (ort::Status* s = api.KernelContext_GetOutput(ctx, 0, odims, 3, &ov)) return s;
  if (ort::Status* s = api.KernelContext_GetOutput(ctx, 1, pkd.data(), 4, &pkv)) return s;
  if (ort::Status* s = api.KernelContext_GetOutput(ctx, 2, pkd.data(), 4, &pvv)) return s;
  void *out = nullptr, *present_k = nullptr, *present_v = nullptr;
  if (ort::Status* s = api.GetTensorMutableData(ov, &out)) return s;
  if (ort::Status* s = api.GetTensorMutableData(pkv, &present_k)) return s;
  if (ort::Status* s = api.GetTensorMutableData(pvv, &present_v)) return s;
  const size_t cache = (size_t)B * op.Hkv * C * D * sizeof(float);
  if (cache && present_k != pk) memcpy(present_k, pk, cache);  // not bound to the past buffers: a copy
  if (cache && present_v != pv) memcpy(present_v, pv, cache);
  specrt::AttentionCall c;
  c.B = (int)B, c.S = (int)S, c.H = op.H, c.Hkv = op.Hkv, c.D = (int)D, c.C = (int)C;
  c.n = n.data(), c.P = P.data();
  c.q = (const float*)q;
  c.q_stride = (size_t)qd[2];
  c.k = packed ? c.q + op.H * D : (const float*)k;
  c.v = packed ? c.q + (op.H + op.Hkv) * D : (const float*)v;
  c.k_stride = packed ? c.q_stride : (size_t)(op.Hkv * D);
  c.v_stride = c.k_stride;
  c.cos = (const float*)cs, c.sin = (const float*)sn;
  c.present_k = (float*)present_k, c.present_v = (float*)present_v, c.out = (float*)out;
  c.scale = op.scale != 0.0f ? op.scale : 1.0f / std::sqrt((float)D);
  if (!depth.empty()) c.depth = depth.data(), c.path = path.data();
  if (!B || !S) return nullptr;
  for (int b = 0; b < c.B; ++b)  // the new keys and values first: a query attends to those before it
    for (int i = 0; i < n[b]; ++i)
      for (int g = 0; g < c.Hkv; ++g) specrt::attention_write_kv(c, b, g, i);
  AttentionWork work{&c};
  return api.KernelContext_ParallelFor(ctx, attention_item, (size_t)(B * op.Hkv), 0, &work);
}

const char* attention_name(const ort::CustomOp*) { return "Attention"; }
ort::ElementType attention_input_type(const ort::CustomOp*, size_t i) {
  return i == 5 || i == 8 || i == 9 ? ort::kInt32 : ort::kFloat;
}
size_t attention_inputs(const ort::CustomOp*) { return 10; }
size_t attention_outputs(const ort::CustomOp*) { return 3; }
ort::Characteristic attention_input_kind(const ort::CustomOp*, size_t i) {
  return i == 1 || i == 2 || i == 8 || i == 9 ? ort::kOptional : ort::kRequired;
}

// ---------------------------------------------------------------------------------------------- registration

const char* name(const ort::CustomOp*) { return "Int4MatMul"; }
const char* provider(const ort::CustomOp*) { return nullptr; }  // the CPU
ort::ElementType input_type(const ort::CustomOp*, size_t i) { return i == 1 || i == 3 ? ort::kUint8 : ort::kFloat; }
size_t inputs(const ort::CustomOp*) { return 7; }
ort::ElementType output_type(const ort::CustomOp*, size_t) { return ort::kFloat; }
size_t outputs(const ort::CustomOp*) { return 2; }
ort::Characteristic input_kind(const ort::CustomOp*, size_t i) { return i < 3 ? ort::kRequired : ort::kOptional; }
ort::Characteristic output_kind(const ort::CustomOp*, size_t) { return ort::kRequired; }
ort::Characteristic matmul_output_kind(const ort::CustomOp*, size_t i) { return i ? ort::kOptional : ort::kRequired; }
int memory_type(const ort::CustomOp*, size_t) { return 0; }  // OrtMemTypeDefault
int one(const ort::CustomOp*) { return 1; }
int zero(const ort::CustomOp*) { return 0; }

const ort::CustomOp kOp = {
    ort::kApiVersion, nullptr, name, provider, input_type, inputs, output_type, outputs, nullptr, destroy,
    input_kind, matmul_output_kind, memory_type, one, zero, one, zero, create, compute, nullptr, nullptr, nullptr,
};
const ort::CustomOp kAttentionOp = {
    ort::kApiVersion, nullptr, attention_name, provider, attention_input_type, attention_inputs, output_type,
    attention_outputs, nullptr, attention_destroy, attention_input_kind, output_kind, memory_type, one, zero, one,
    zero, attention_create, attention_compute, nullptr, nullptr, nullptr,
};

// The functions of ort_api.h that can be called outside a kernel, called on known values: a wrong index
// there calls another function, which answers otherwise (or, for some, crashes: the tests run this too).
// "" when every answer is right, else which functions answered wrong and how.
std::string check_api(const ort::Api& api) {
  ort::Status* s = api.CreateStatus(ort::kInvalidArgument, "specrt probe");
  const bool status_ok = s && api.GetErrorCode(s) == ort::kInvalidArgument && !strcmp(api.GetErrorMessage(s), "specrt probe");
  if (s) api.ReleaseStatus(s);
  if (!status_ok) return "CreateStatus, GetErrorCode or GetErrorMessage answered wrong";
  ort::MemoryInfo* mem = nullptr;
  if (ort::Status* e = api.CreateCpuMemoryInfo(0, 0, &mem)) return api.ReleaseStatus(e), "CreateCpuMemoryInfo failed";
  float data[6] = {0};
  const int64_t shape[2] = {2, 3};
  ort::Value* v = nullptr;
  std::string why;
  if (ort::Status* e = api.CreateTensorWithDataAsOrtValue(mem, data, sizeof data, shape, 2, ort::kFloat, &v)) {
    why = std::string("CreateTensorWithDataAsOrtValue failed: ") + api.GetErrorMessage(e);
    api.ReleaseStatus(e);
  } else {
    const void* p = nullptr;
    std::vector<int64_t> dims;
    if (!tensor(api, v, ort::kFloat, 6, &p, &why, &dims))
      why = "a [2, 3] float tensor reads as " + why;
    else if (p != data || dims != std::vector<int64_t>{2, 3})
      why = "a [2, 3] float tensor reads as " + std::to_string(dims.size()) + " dimensions, or not its own data";
    if (!why.empty())
      why += " (GetTensorTypeAndShape, GetTensorElementType, GetDimensionsCount, GetDimensions, GetTensorMutableData)";
    api.ReleaseValue(v);
  }
  api.ReleaseMemoryInfo(mem);
  if (!why.empty()) return why;
  ort::CustomOpDomain* d = nullptr;
  if (ort::Status* e = api.CreateCustomOpDomain("specrt.probe", &d)) return api.ReleaseStatus(e), "CreateCustomOpDomain failed";
  if (!d) return "CreateCustomOpDomain gave no domain";
  api.ReleaseCustomOpDomain(d);
  return "";
}

}  // namespace

extern "C" __attribute__((visibility("default"))) ort::Status* RegisterCustomOps(ort::SessionOptions* options,
                                                                                  const ort::ApiBase* base) {
  const void* const* table = base->GetApi(ort::kApiVersion);
  if (!table) {  // an onnxruntime older than 1.17 still answers version 1, enough to say why
    const void* const* v1 = base->GetApi(1);
    return v1 ? ort::Api(v1).CreateStatus(ort::kFail, "specrt's operators need onnxruntime >= 1.17") : nullptr;
  }
  const ort::Api api(table);
  static const std::string mismatch = check_api(api);  // once a process: the table does not change
  if (!mismatch.empty())
    return api.CreateStatus(ort::kFail, ("specrt's kernel library does not match onnxruntime " +
                                         std::string(base->GetVersionString()) + "'s C API: " + mismatch).c_str());
  g_table = table;
  // one domain for every session of the process: onnxruntime needs it (and kOp) alive as long as they are
  static ort::CustomOpDomain* domain = [&api]() -> ort::CustomOpDomain* {
    ort::CustomOpDomain* d = nullptr;
    if (ort::Status* s = api.CreateCustomOpDomain("specrt", &d)) return api.ReleaseStatus(s), nullptr;
    if (ort::Status* s = api.CustomOpDomain_Add(d, &kOp)) return api.ReleaseStatus(s), nullptr;
    if (ort::Status* s = api.CustomOpDomain_Add(d, &kAttentionOp)) return api.ReleaseStatus(s), nullptr;
    return d;
  }();
  if (!domain) return api.CreateStatus(ort::kFail, "specrt: could not create its operator domain");
  return api.AddCustomOpDomain(options, domain);
}
