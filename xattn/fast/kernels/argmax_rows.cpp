// A greedy step's choice: xattn_kernels::argmax_rows, torch.argmax(scores, dim=-1) over fp32 rows.
//
// torch's CPU argmax walks a row one value after another; at 16 rows of GPT-2's 50257 logits that took ~0.8 ms of a
// ~20 ms decode step. Here each row is read once in four interleaved chains of 8 lanes, each lane keeping its first
// largest value (a strictly greater value replaces it), and the lanes are merged by value, then by the smaller index:
// torch's answer, the first index of the largest value. A row holding a NaN, which torch's argmax ranks above every
// number, answers its first NaN's index, as torch does.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <torch/library.h>

#include <cstdint>

#include "checks.h"

namespace {

constexpr int64_t kChains = 4;  // 8-lane chains in flight: a compare waits on the blend before it

int64_t first_nan(const float* row, int64_t V) {
  for (int64_t t = 0; t < V; ++t)
    if (row[t] != row[t]) return t;
  return -1;
}

int64_t argmax_row(const float* row, int64_t V) {
  int64_t best = 0;
  float top = row[0];
  if (V < 8 * kChains) {
    for (int64_t t = 0; t < V; ++t) {
      if (row[t] != row[t]) return t;
      if (row[t] > top) top = row[t], best = t;
    }
    return best;
  }
  __m256 values[kChains];
  __m256i indices[kChains];
  __m256 unordered = _mm256_setzero_ps();
  const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  for (int c = 0; c < kChains; ++c) {
    values[c] = _mm256_loadu_ps(row + 8 * c);
    indices[c] = _mm256_add_epi32(lane, _mm256_set1_epi32(8 * c));
    unordered = _mm256_or_ps(unordered, _mm256_cmp_ps(values[c], values[c], _CMP_UNORD_Q));
  }
  const int64_t whole = V - V % (8 * kChains);
  const __m256i round = _mm256_set1_epi32(8 * kChains);
  __m256i at[kChains];  // the indices of each chain's next 8 values
  for (int c = 0; c < kChains; ++c) at[c] = _mm256_add_epi32(indices[c], round);
  for (int64_t t = 8 * kChains; t < whole; t += 8 * kChains) {
    for (int c = 0; c < kChains; ++c) {
      const __m256 v = _mm256_loadu_ps(row + t + 8 * c);
      const __m256 greater = _mm256_cmp_ps(v, values[c], _CMP_GT_OQ);
      unordered = _mm256_or_ps(unordered, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
      values[c] = _mm256_blendv_ps(values[c], v, greater);
      indices[c] = _mm256_blendv_epi8(indices[c], at[c], _mm256_castps_si256(greater));
      at[c] = _mm256_add_epi32(at[c], round);
    }
  }
  if (!_mm256_testz_ps(unordered, unordered)) return first_nan(row, V);
  alignas(32) float lane_values[8 * kChains];
  alignas(32) int32_t lane_indices[8 * kChains];
  for (int c = 0; c < kChains; ++c) {
    _mm256_store_ps(lane_values + 8 * c, values[c]);
    _mm256_store_si256(reinterpret_cast<__m256i*>(lane_indices + 8 * c), indices[c]);
  }
  top = lane_values[0];
  best = lane_indices[0];
  for (int j = 1; j < 8 * kChains; ++j)
    if (lane_values[j] > top || (lane_values[j] == top && lane_indices[j] < best))
      top = lane_values[j], best = lane_indices[j];
  for (int64_t t = whole; t < V; ++t) {  // the tail's indices come after every lane's
    if (row[t] != row[t]) return t;
    if (row[t] > top) top = row[t], best = t;
  }
  return best;
}

// scores [R, V] fp32 (V < 2^31) -> [R] int64: each row's first index of its largest value (of its first NaN, if any).
at::Tensor argmax_rows(const at::Tensor& scores) {
  xattn::check_kind(scores, at::kFloat, 2, true, "scores [R, V]");
  const int64_t R = scores.size(0), V = scores.size(1);
  TORCH_CHECK(V > 0 && V < (int64_t{1} << 31), "scores [R, V]: expected 0 < V < 2^31, got ", xattn::describe(scores));
  at::Tensor out = at::empty({R}, scores.options().dtype(at::kLong));
  const float* x = scores.data_ptr<float>();
  int64_t* y = out.data_ptr<int64_t>();
  at::parallel_for(0, R, 2, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) y[r] = argmax_row(x + r * V, V);
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(xattn_kernels, m) { m.def("argmax_rows(Tensor scores) -> Tensor"); }

TORCH_LIBRARY_IMPL(xattn_kernels, CPU, m) { m.impl("argmax_rows", &argmax_rows); }
