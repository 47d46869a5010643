// A beam step's candidates in one call: xattn_kernels::beam_candidates.
//
// Each beam search step ranks, per input, every beam's log-probabilities plus that beam's running score (beams * V
// values) and keeps the best `keep`. In torch that is an add that writes all of them and top-ks over them. Here each
// row (one beam) is read once: its keep + 1 best are kept in a short sorted list, and a vector compare against the
// list's last value skips almost every other value. The rows' lists are then merged per input.
//
// Where the merged keep + 1 best are strictly decreasing, the keep best are torch.topk's exactly, values and indices
// (generate.top_candidates gives the argument). Where they are not (equal values among them, or a NaN in a row,
// which torch.topk ranks above everything), the op returns no columns and the caller asks torch.topk, whose choice
// among equals is its own.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <torch/library.h>

#include <algorithm>
#include <numeric>
#include <tuple>
#include <vector>

#include "checks.h"

namespace {

// value v at index i into the sorted list vals/idx of count entries (at most n, descending); the last one drops out
// when the list is full. Equal values keep the earlier index first (any order would do: equals make the op decline).
inline void insert(float v, int64_t i, float* vals, int64_t* idx, int64_t& count, int64_t n) {
  int64_t j = count < n ? count++ : n - 1;
  for (; j > 0 && vals[j - 1] < v; --j) {
    vals[j] = vals[j - 1];
    idx[j] = idx[j - 1];
  }
  vals[j] = v;
  idx[j] = i;
}

// The n best of row[0, V) + add (n <= V), descending, into vals/idx; false where a value is NaN.
bool row_best(const float* row, int64_t V, float add, int64_t n, float* vals, int64_t* idx) {
  int64_t count = 0;
  for (int64_t i = 0; i < n; ++i) {
    const float v = row[i] + add;
    if (v != v) return false;
    insert(v, i, vals, idx, count, n);
  }
  const __m256 shift = _mm256_set1_ps(add);
  __m256 worst = _mm256_set1_ps(vals[n - 1]), nan = _mm256_setzero_ps();
  int64_t i = n;
  for (; i + 8 <= V; i += 8) {
    const __m256 v = _mm256_add_ps(_mm256_loadu_ps(row + i), shift);
    nan = _mm256_or_ps(nan, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
    int above = _mm256_movemask_ps(_mm256_cmp_ps(v, worst, _CMP_GT_OQ));
    if (!above) continue;
    alignas(32) float lanes[8];
    _mm256_store_ps(lanes, v);
    for (; above; above &= above - 1) {
      const int lane = __builtin_ctz(above);
      if (lanes[lane] > vals[n - 1]) insert(lanes[lane], i + lane, vals, idx, count, n);
    }
    worst = _mm256_set1_ps(vals[n - 1]);
  }
  if (_mm256_movemask_ps(nan)) return false;
  for (; i < V; ++i) {
    const float v = row[i] + add;
    if (v != v) return false;
    if (v > vals[n - 1]) insert(v, i, vals, idx, count, n);
  }
  return true;
}

// log_probs [B * beams, V] float32 (each input's beams consecutive), scores [B, beams] float32 (the beams' running
// scores), keep in [1, V - 1] -> (values [B, keep], index [B, keep] into [beams * V]): torch.topk((log_probs +
// scores per row).view(B, beams * V), keep), or two [B, 0] tensors where equal values or a NaN leave it to torch.
std::tuple<at::Tensor, at::Tensor> beam_candidates(const at::Tensor& log_probs, const at::Tensor& scores,
                                                   int64_t keep) {
  xattn::check_kind(log_probs, at::kFloat, 2, true, "log_probs [B * beams, V]");
  xattn::check_kind(scores, at::kFloat, 2, true, "scores [B, beams]");
  const int64_t B = scores.size(0), beams = scores.size(1), V = log_probs.size(1), R = B * beams;
  TORCH_CHECK(beams > 0 && log_probs.size(0) == R, "log_probs: expected one row per beam (", B, " x ", beams,
              "), got ", xattn::describe(log_probs));
  TORCH_CHECK(keep >= 1 && keep < V, "keep: expected a count in [1, ", V - 1, "] (each row gives keep + 1), got ",
              keep);
  const int64_t n = keep + 1;
  std::vector<float> vals(R * n);
  std::vector<int64_t> idx(R * n);
  std::vector<char> exact(R, 1);
  const float* lp = log_probs.data_ptr<float>();
  const float* sc = scores.data_ptr<float>();
  at::parallel_for(0, R, 1, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r)
      exact[r] = row_best(lp + r * V, V, sc[r], n, vals.data() + r * n, idx.data() + r * n);
  });
  const auto none = [&] {
    return std::make_tuple(at::empty({B, 0}, log_probs.options()), at::empty({B, 0}, at::kLong));
  };
  if (std::find(exact.begin(), exact.end(), 0) != exact.end()) return none();
  at::Tensor values = at::empty({B, keep}, log_probs.options()), index = at::empty({B, keep}, at::kLong);
  float* out_values = values.data_ptr<float>();
  int64_t* out_index = index.data_ptr<int64_t>();
  std::vector<int64_t> order(beams * n);
  for (int64_t b = 0; b < B; ++b) {
    const float* pool = vals.data() + b * beams * n;  // this input's rows' lists, one after another
    std::iota(order.begin(), order.end(), 0);
    std::partial_sort(order.begin(), order.begin() + n, order.end(),
                      [&](int64_t x, int64_t y) { return pool[x] > pool[y]; });
    for (int64_t j = 0; j + 1 < n; ++j)
      if (!(pool[order[j]] > pool[order[j + 1]])) return none();
    for (int64_t j = 0; j < keep; ++j) {
      const int64_t at = order[j], beam = at / n;
      out_values[b * keep + j] = pool[at];
      out_index[b * keep + j] = beam * V + idx[(b * beams) * n + at];
    }
  }
  return std::make_tuple(values, index);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(xattn_kernels, m) {
  m.def("beam_candidates(Tensor log_probs, Tensor scores, int keep) -> (Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(xattn_kernels, CPU, m) { m.impl("beam_candidates", &beam_candidates); }
