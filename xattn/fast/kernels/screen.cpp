// Greedy tokens from a decoder's final hidden states without the whole fp32 output product:
// xattn_kernels::greedy_tokens.
//
// The LM head is ~28% of a GPT-2 decode step's weights (50257 x 768 fp32: 154 MB). Greedy search needs only the
// argmax, so the head is first read as int8 (39 MB) and each score gets a proven bound on its distance from the
// fp32 kernel's value; only tokens whose bound reaches the best lower bound are computed in fp32, summed in the same
// order as the full head's product (products.h's dot_fp32, as matvec_rows sums), so the chosen token is the full fp32 argmax, ties to
// the lowest index.
//
// Bound for token v and activation row x (w: the fp32 row, q: its int8 copy times its scale, x_q: x rounded to
// int8 as the product does, half a step of x_scale at most per element):
//   |x.w - x_q.q| <= |x.(w - q)| + |(x - x_q).q| <= |x|_2 |w - q|_2 + x_scale / 2 |q|_1,
// plus the rounding of both float paths, (K + 16) 2^-22 (|x|_2 + sqrt(K) x_scale) max(|w|_2, |q|_2) + 2^-22 |bias|.
// err2 = |w - q|_2, l1 = |q|_1 and norm = max(|w|_2, |q|_2) come per token from xattn/head.py, rounded up.

#include <ATen/ATen.h>
#include <torch/library.h>

#include <cmath>
#include <vector>

#include "checks.h"
#include "products.h"

namespace {

constexpr float kUlp = 1.f / (1 << 22);  // twice fp32's unit roundoff

float row_norm(const float* x, int64_t K) {
  double sum = 0.0;
  for (int64_t k = 0; k < K; ++k) sum += double(x[k]) * x[k];
  return static_cast<float>(std::sqrt(sum)) * (1.f + 4 * kUlp);
}

float row_scale(const float* x, int64_t K) {  // as products.h's quantize_rows
  float amax = 0.f;
  for (int64_t k = 0; k < K; ++k) amax = std::max(amax, std::abs(x[k]));
  return amax > 0.f ? amax / 127.f : 1.f;
}

// torch.argmax's choice among (index, value) pairs in ascending index order: the first maximum, NaN above all.
struct Best {
  int64_t index = -1;
  float value = 0.f;
  void offer(int64_t n, float v) {
    if (index < 0 || (!std::isnan(value) && (v > value || std::isnan(v)))) index = n, value = v;
  }
};

at::Tensor greedy_tokens(const at::Tensor& x, const at::Tensor& weight, const c10::optional<at::Tensor>& bias_opt,
                         const at::Tensor& screen, const at::Tensor& scale, const at::Tensor& bounds,
                         const at::Tensor& forbidden) {
  xattn::check_kind(x, at::kFloat, 2, true, "x");
  xattn::check_kind(bounds, at::kFloat, 2, true, "bounds");
  const int64_t M = x.size(0), K = x.size(1), N = bounds.size(1);
  TORCH_CHECK(N > 0, "bounds: expected [3, N] for a vocabulary of N > 0 tokens, got ", xattn::describe(bounds));
  xattn::check_tensor(bounds, at::kFloat, {3, N}, "bounds");
  xattn::check_tensor(weight, at::kFloat, {N, K}, "weight (the head's fp32 weight [N, K], with bounds' N and x's K)");
  xattn::check_weight(screen, at::kChar, N, K, "screen (the head's int8 copy, with bounds' N and x's K)");
  xattn::check_tensor(scale, at::kFloat, {N}, "scale");
  xattn::check_bias(bias_opt, N, "bias");
  xattn::check_kind(forbidden, at::kLong, -1, false, "forbidden");
  TORCH_CHECK(forbidden.dim() <= 1, "forbidden: expected token ids [F], got ", xattn::describe(forbidden));
  const float* bias = bias_opt.has_value() ? bias_opt->data_ptr<float>() : nullptr;
  const float* rows = weight.data_ptr<float>();
  const float* err2 = bounds.data_ptr<float>();
  const float* l1 = err2 + N;
  const float* norm = l1 + N;

  std::vector<char> allowed(N, 1);
  const at::Tensor ids = forbidden.contiguous();
  for (int64_t i = 0; i < ids.numel(); ++i) {
    const int64_t id = ids.data_ptr<int64_t>()[i];
    TORCH_CHECK(id >= 0 && id < N, "forbidden token id ", id, " is outside the vocabulary of ", N);
    allowed[id] = 0;
  }

  // int8 scores for every row, in one pass over the int8 head
  std::vector<float> approx(M * N);
  const xattn::Weight w8{screen.data_ptr(), scale.data_ptr<float>(), bias, N, K};
  xattn::product(x.data_ptr<float>(), M, w8, approx.data());

  at::Tensor tokens = at::empty({M}, x.options().dtype(at::kLong));
  int64_t* chosen = tokens.data_ptr<int64_t>();
  // rows in parallel; a single row scores its candidates in parallel instead
  at::parallel_for(0, M, 1, [&](int64_t row_begin, int64_t row_end) {
    std::vector<int64_t> candidates;
    std::vector<float> scores;
    for (int64_t m = row_begin; m < row_end; ++m) {
      const float* xm = x.data_ptr<float>() + m * K;
      const float* am = approx.data() + m * N;
      const float xn = row_norm(xm, K), half_step = row_scale(xm, K) * 0.5f * (1.f + 4 * kUlp);
      const float rounding = (K + 16) * kUlp * (xn + std::sqrt(float(K)) * 2.f * half_step);
      auto slack = [&](int64_t n) {
        return xn * err2[n] + half_step * l1[n] + rounding * norm[n] + (bias ? kUlp * std::abs(bias[n]) : 0.f);
      };
      float floor = -INFINITY;  // the best token's fp32 score is at least this
      for (int64_t n = 0; n < N; ++n)
        if (allowed[n]) floor = std::max(floor, am[n] - slack(n));
      candidates.clear();
      for (int64_t n = 0; n < N; ++n)
        if (allowed[n] && am[n] + slack(n) >= floor) candidates.push_back(n);
      if (candidates.empty())  // NaN or inf scores: no bound holds, so every allowed token is scored
        for (int64_t n = 0; n < N; ++n)
          if (allowed[n]) candidates.push_back(n);
      scores.resize(candidates.size());
      at::parallel_for(0, static_cast<int64_t>(candidates.size()), 64, [&](int64_t begin, int64_t end) {
        for (int64_t i = begin; i < end; ++i) scores[i] = xattn::dot_fp32(xm, rows + candidates[i] * K, K, bias, candidates[i]);
      });
      Best best;
      for (size_t i = 0; i < candidates.size(); ++i) best.offer(candidates[i], scores[i]);
      chosen[m] = best.index < 0 ? 0 : best.index;
    }
  });
  return tokens;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(xattn_kernels, m) {
  m.def("greedy_tokens(Tensor x, Tensor weight, Tensor? bias, Tensor screen, Tensor scale, Tensor bounds, "
        "Tensor forbidden) -> Tensor");
}

TORCH_LIBRARY_IMPL(xattn_kernels, CPU, m) { m.impl("greedy_tokens", &greedy_tokens); }
