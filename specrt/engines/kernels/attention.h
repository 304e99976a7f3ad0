// specrt.Attention's arithmetic (attention.cc); the operator around it is in ort_op.cc.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

namespace specrt {

// One call: B rows of S query positions (row b has n[b] new tokens at positions P[b] ..), H query heads
// over Hkv key/value heads of D values, caches of C slots. q, k, v point at row 0, position 0, head 0 of
// their tensors, with the given strides (floats) from one position to the next.
struct AttentionCall {
  int B = 0, S = 0, H = 0, Hkv = 0, D = 0, C = 0;
  const int* n = nullptr;  // [B]
  const int* P = nullptr;  // [B]
  const float *q = nullptr, *k = nullptr, *v = nullptr;
  size_t q_stride = 0, k_stride = 0, v_stride = 0;
  const float *cos = nullptr, *sin = nullptr;  // [positions][D / 2]
  float *present_k = nullptr, *present_v = nullptr;  // [B][Hkv][C][D]
  float* out = nullptr;                              // [B][S][H * D]
  float scale = 1.0f;
  // Each row's new tokens as a tree (attention_tree; null: a chain, token i the parent of token i + 1).
  // Token i is still written at slot P + i, but its rotary position is P + depth[b][i] and its keys are
  // the first P slots and then its ancestors' by depth, itself last: the slots P + path[b][i][0 .. depth].
  const int* depth = nullptr;  // [B][S]
  const int* path = nullptr;   // [B][S][S]
};

// The tree of each row's new tokens from parents [B][S] (token i's parent among the row's new tokens, or -1
// for the row's last cached entry; positions from n[b] on are ignored): depth and path as AttentionCall
// takes them, or both left empty when every row is a chain (the call needs no tree). Returns "" or, when a
// parent is not in [-1, i - 1], why not (one line).
std::string attention_tree(const int32_t* parents, const int* n, int B, int S, std::vector<int>* depth,
                           std::vector<int>* path);

constexpr int kAttentionTile = 8;  // (head, query) rows that share each read of a block of keys and values

bool attention_shapes_ok(int D);  // head sizes the kernel takes (multiples of 16, at most 512)
// Writes token i of row b into the caches of key/value head g (its key after the rotary embedding).
void attention_write_kv(const AttentionCall& c, int b, int g, int i);
// Floats of scratch attention_group needs.
size_t attention_scratch(const AttentionCall& c);
// Every query position of row b for the query heads of key/value head g.
void attention_group(const AttentionCall& c, int b, int g, float* scratch);

// out[i] = silu(g[i]) * u[i] = g[i] * sigmoid(g[i]) * u[i] for i < n (a multiple of 8): a gated MLP's
// activation, which the int4 kernel applies to a gated matmul's output (int4.h, Packed::glu). Made of the
// attention's elementwise vector operations (its exponential included), so the same bits everywhere.
void silu_mul(const float* g, const float* u, int n, float* out);

}  // namespace specrt
