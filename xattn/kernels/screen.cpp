// Greedy tokens from a decoder's final hidden states without the whole fp32 output product:
// xattn_kernels::greedy_tokens.
//
// The LM head is ~28% of a GPT-2 decode step's weights (50257 x 768 fp32: 154 MB). Greedy search needs only the
// argmax, so the head is first read as int8 (39 MB) and each score gets a proven bound on its distance from the
// fp32 kernel's value; only tokens whose bound reaches the best lower bound are computed in fp32, summed in the same
// order as the full head's product (products.h's column_fp32), so the chosen token is the full fp32 argmax, ties to
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

at::Tensor greedy_tokens(const at::Tensor& x, const at::Tensor& panels, const c10::optional<at::Tensor>& bias_opt,
                         const at::Tensor& screen, const at::Tensor& scale, const at::Tensor& bounds,
                         const at::Tensor& forbidden) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(), "x must be contiguous float32 [M, K]");
  const int64_t M = x.size(0), K = x.size(1), N = bounds.size(-1);
  TORCH_CHECK(screen.dim() == 4 && screen.size(0) == (N + 7) / 8 && screen.size(1) == (K + 31) / 32 &&
                  screen.scalar_type() == at::kChar && screen.is_contiguous(),
              "screen must be the head's int8 blocks [ceil(N / 8), ceil(K / 32), 8, 32] with x's K");
  TORCH_CHECK(panels.dim() == 3 && panels.size(0) == (N + 15) / 16 && panels.size(1) == K && panels.size(2) == 16 &&
                  panels.scalar_type() == at::kFloat && panels.is_contiguous(),
              "panels must be the head's fp32 panels [ceil(N / 16), K, 16] with x's K");
  TORCH_CHECK(scale.numel() == N && scale.scalar_type() == at::kFloat, "scale must be float32 [N]");
  TORCH_CHECK(bounds.dim() == 2 && bounds.size(0) == 3 && bounds.size(1) == N && bounds.scalar_type() == at::kFloat &&
                  bounds.is_contiguous(), "bounds must be contiguous float32 [3, N]");
  TORCH_CHECK(forbidden.scalar_type() == at::kLong, "forbidden must be int64 token ids");
  const float* bias = bias_opt.has_value() ? bias_opt->data_ptr<float>() : nullptr;
  const xattn::Weight w32{panels.data_ptr(), nullptr, bias, N, K};
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
        for (int64_t i = begin; i < end; ++i) scores[i] = xattn::column_fp32(xm, w32, candidates[i]);
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
  m.def("greedy_tokens(Tensor x, Tensor panels, Tensor? bias, Tensor screen, Tensor scale, Tensor bounds, "
        "Tensor forbidden) -> Tensor");
}

TORCH_LIBRARY_IMPL(xattn_kernels, CPU, m) { m.impl("greedy_tokens", &greedy_tokens); }
