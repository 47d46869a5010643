// One decode step through every GPT-2 block in one call: xattn_kernels::decoder_layers.
//
// At small batch a step's projections stream ~550 MB of weights, and the rest of the block (layer norms, attention
// over the cache and the encoder's K/V, residuals, GELU: ~30 small torch ops per layer) costs ~3 ms of dispatch on
// top. Here that rest is plain loops between the products (products.h's, or fbgemm's prepacked int8 ones where
// `packed` is given), so the step is the weight stream plus the attention's own reads.
//
// Per layer: h += attn_out(self_attention(qkv(ln_1(h)))); h += cross_out(cross_attention(cross_q(ln_cross(h))));
// h += mlp_out(gelu_tanh(mlp_in(ln_2(h)))). Layouts are the decoder's (xattn/cache.py): self K/V
// [L, B, H, T_max, hd] written at `position`; cross K/V [L, B_enc, H, S, hd] read by row b at enc_index[b] or,
// without it, at b / (B / B_enc); cross_mask [B_enc, S] true where an encoder position is real.

#include <ATen/ATen.h>
#include <ATen/native/quantized/PackedParams.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>
#include <vector>

#include "products.h"
#include "rowwise.h"

namespace {

using xattn::Store;
using xattn::Weight;
using xattn::exponentiate;
using xattn::layer_norm;
using Packed = c10::intrusive_ptr<LinearPackedParamsBase>;

// scores[t] = q . keys[t] for t < positions, four keys at a time (four independent FMA chains).
void dots(const float* q, const float* keys, int64_t positions, int64_t hd, float* scores) {
  const int64_t h8 = hd - hd % 8;
  int64_t t = 0;
  for (; t + 4 <= positions; t += 4) {
    const float* k = keys + t * hd;
    __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
    for (int64_t i = 0; i < h8; i += 8) {
      const __m256 qv = _mm256_loadu_ps(q + i);
      a0 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k + i), a0);
      a1 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k + hd + i), a1);
      a2 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k + 2 * hd + i), a2);
      a3 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k + 3 * hd + i), a3);
    }
    // lanes: (a0 a0 a1 a1 | a0 a0 a1 a1) -> (a0 a1 a2 a3 | a0 a1 a2 a3), then the two halves added
    const __m256 h = _mm256_hadd_ps(_mm256_hadd_ps(a0, a1), _mm256_hadd_ps(a2, a3));
    __m128 four = _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
    alignas(16) float sums[4];
    _mm_store_ps(sums, four);
    for (int j = 0; j < 4; ++j) {
      for (int64_t i = h8; i < hd; ++i) sums[j] += q[i] * k[j * hd + i];
      scores[t + j] = sums[j];
    }
  }
  for (; t < positions; ++t) {
    float sum = 0.f;
    for (int64_t i = 0; i < hd; ++i) sum += q[i] * keys[t * hd + i];
    scores[t] = sum;
  }
}

// out = sum_t p[t] v[t] * inv, with hd = 8 V held in V registers.
template <int V>
void weighted_sum_regs(const float* p, const float* v, int64_t positions, float inv, float* out) {
  __m256 acc[V];
  for (int i = 0; i < V; ++i) acc[i] = _mm256_setzero_ps();
  for (int64_t t = 0; t < positions; ++t) {
    if (p[t] == 0.f) continue;  // masked
    const __m256 w = _mm256_set1_ps(p[t]);
    for (int i = 0; i < V; ++i) acc[i] = _mm256_fmadd_ps(w, _mm256_loadu_ps(v + t * 8 * V + 8 * i), acc[i]);
  }
  const __m256 scale = _mm256_set1_ps(inv);
  for (int i = 0; i < V; ++i) _mm256_storeu_ps(out + 8 * i, _mm256_mul_ps(acc[i], scale));
}

void weighted_sum(const float* p, const float* v, int64_t positions, int64_t hd, float total, float* out) {
  const float inv = 1.f / total;
  switch (hd) {
    case 8: return weighted_sum_regs<1>(p, v, positions, inv, out);
    case 16: return weighted_sum_regs<2>(p, v, positions, inv, out);
    case 32: return weighted_sum_regs<4>(p, v, positions, inv, out);
    case 64: return weighted_sum_regs<8>(p, v, positions, inv, out);
  }
  for (int64_t i = 0; i < hd; ++i) out[i] = 0.f;
  for (int64_t t = 0; t < positions; ++t)
    for (int64_t i = 0; i < hd; ++i) out[i] += p[t] * v[t * hd + i];
  for (int64_t i = 0; i < hd; ++i) out[i] *= inv;
}

// softmax(q K^T * scale) V for one query row of one head; keys/values [positions, hd]; mask may be null.
void attend(const float* q, const float* keys, const float* values, int64_t positions, int64_t hd, float scale,
            const bool* mask, std::vector<float>& scores, float* out) {
  scores.resize(positions);
  dots(q, keys, positions, hd, scores.data());
  float peak = -std::numeric_limits<float>::infinity();
  for (int64_t t = 0; t < positions; ++t) {
    if (mask && !mask[t]) continue;
    scores[t] *= scale;
    peak = std::max(peak, scores[t]);
  }
  weighted_sum(scores.data(), values, positions, hd, exponentiate(scores.data(), positions, peak, mask), out);
}

// fp32 weights come as panels [N / 16, K, 16], int8 ones as blocks [N / 8, K / 32, 8, 32] with one scale per row
// (products.h): whole panels and blocks, so that N and K follow from the shape.
Weight weight_of(const at::Tensor& w, at::TensorList scales, at::TensorList biases, size_t i) {
  TORCH_CHECK(w.is_contiguous(), "projection weights must be contiguous");
  const bool int8 = w.scalar_type() == at::kChar;
  TORCH_CHECK(int8 ? w.dim() == 4 && w.size(2) == xattn::kRows && w.size(3) == xattn::kBytes
                   : w.scalar_type() == at::kFloat && w.dim() == 3 && w.size(2) == xattn::kPanel,
              "projection weights must be float32 panels [N / 16, K, 16] or int8 blocks [N / 8, K / 32, 8, 32]");
  TORCH_CHECK(!int8 || i < scales.size(), "int8 weights need their scales");
  const int64_t N = int8 ? w.size(0) * xattn::kRows : w.size(0) * xattn::kPanel;
  const int64_t K = int8 ? w.size(1) * xattn::kBytes : w.size(1);
  return Weight{w.data_ptr(), int8 ? scales[i].data_ptr<float>() : nullptr,
                i < biases.size() && biases[i].defined() ? biases[i].data_ptr<float>() : nullptr, N, K};
}

at::Tensor decoder_layers(const at::Tensor& hidden, const at::Tensor& norm_weight, const at::Tensor& norm_bias,
                          at::TensorList weights, at::TensorList scales, at::TensorList biases,
                          const std::vector<Packed>& packed, const at::Tensor& keys,
                          const at::Tensor& values, const c10::optional<at::Tensor>& cross_keys,
                          const c10::optional<at::Tensor>& cross_values, const c10::optional<at::Tensor>& cross_mask,
                          const c10::optional<at::Tensor>& enc_index, const at::Tensor& position,
                          at::ArrayRef<double> scalings, double eps) {
  TORCH_CHECK(hidden.dim() == 2 && hidden.scalar_type() == at::kFloat && hidden.device().is_cpu(),
              "hidden must be a float32 CPU [B, D] tensor");
  TORCH_CHECK(keys.is_contiguous() && values.is_contiguous() && keys.dim() == 5 && keys.sizes() == values.sizes(),
              "self-attention K/V must be contiguous [L, B, H, T_max, hd] tensors");
  const int64_t L = keys.size(0), B = hidden.size(0), D = hidden.size(1), H = keys.size(2), T = keys.size(3),
                hd = keys.size(4);
  TORCH_CHECK(keys.size(1) == B && H * hd == D, "the cache does not match hidden's rows or width");
  const bool has_cross = cross_keys.has_value();
  const int64_t per_layer = has_cross ? 6 : 4;
  TORCH_CHECK(static_cast<int64_t>(weights.size()) == per_layer * L, "expected ", per_layer * L, " weights");
  TORCH_CHECK(packed.empty() || packed.size() == weights.size(), "packed: none, or one per weight");
  TORCH_CHECK(norm_weight.is_contiguous() && norm_bias.is_contiguous() && norm_weight.numel() == L * 3 * D &&
                  norm_bias.numel() == L * 3 * D,
              "norm_weight/norm_bias must be contiguous [L, 3, D]");
  TORCH_CHECK(static_cast<int64_t>(scalings.size()) == L, "one scaling per layer");
  const int64_t p = position.item<int64_t>();
  TORCH_CHECK(p >= 0 && p < T, "position ", p, " is outside the cache (", T, " positions)");

  int64_t B_enc = 1, S = 0;
  const float *ck = nullptr, *cv = nullptr;
  const bool* cmask = nullptr;
  std::vector<int64_t> enc_row(B);
  if (has_cross) {
    TORCH_CHECK(cross_values.has_value() && cross_keys->is_contiguous() && cross_values->is_contiguous() &&
                    cross_keys->dim() == 5 && cross_keys->sizes() == cross_values->sizes() &&
                    cross_keys->size(0) == L && cross_keys->size(2) == H && cross_keys->size(4) == hd,
                "cross K/V must be contiguous [L, B_enc, H, S, hd] tensors");
    B_enc = cross_keys->size(1);
    S = cross_keys->size(3);
    ck = cross_keys->data_ptr<float>();
    cv = cross_values->data_ptr<float>();
    if (cross_mask.has_value()) {
      TORCH_CHECK(cross_mask->scalar_type() == at::kBool && cross_mask->is_contiguous() &&
                      cross_mask->numel() == B_enc * S,
                  "cross_mask must be a contiguous bool [B_enc, S] tensor");
      cmask = cross_mask->data_ptr<bool>();
    }
    for (int64_t b = 0; b < B; ++b) {
      enc_row[b] = enc_index.has_value() ? enc_index->data_ptr<int64_t>()[b] : b / (B / B_enc);
      TORCH_CHECK(enc_row[b] >= 0 && enc_row[b] < B_enc, "encoder row out of range");
    }
  }

  at::Tensor out = hidden.contiguous().clone();
  float* h = out.data_ptr<float>();
  float* kc = keys.data_ptr<float>();
  float* vc = values.data_ptr<float>();
  const float* gammas = norm_weight.data_ptr<float>();
  const float* betas = norm_bias.data_ptr<float>();
  std::vector<float> x(B * D), attn(B * D), qkv(B * 3 * D), inner;

  // (row, head) pairs as b * H + head, the rows that read one encoder row's K/V (its beams) next to each other: a
  // head's cross K/V (2 x S x hd floats, 100 KB for ViT-B) then come from memory once per step, not once per beam
  std::vector<int64_t> pairs(B * H);
  std::iota(pairs.begin(), pairs.end(), 0);
  if (has_cross)
    std::stable_sort(pairs.begin(), pairs.end(), [&](int64_t a, int64_t c) {
      return enc_row[a / H] * H + a % H < enc_row[c / H] * H + c % H;
    });

  // attention of every (row, head) pair, in parallel: query q_of(b) + head * hd, output attn[b] + head * hd
  auto attention = [&](auto q_of, auto source) {
    at::parallel_for(0, B * H, 1, [&](int64_t begin, int64_t end) {
      std::vector<float> scores;
      for (int64_t i = begin; i < end; ++i) {
        const int64_t b = pairs[i] / H, head = pairs[i] % H;
        source(b, head, q_of(b) + head * hd, scores, attn.data() + b * D + head * hd);
      }
    });
  };

  for (int64_t l = 0; l < L; ++l) {
    const float* gamma = gammas + l * 3 * D;
    const float* beta = betas + l * 3 * D;
    const float scale = static_cast<float>(scalings[l]);
    int64_t next = l * per_layer;
    // y (+)= the next projection of `in` ([B, K] -> [B, N]): fbgemm's prepacked int8 product where given (faster
    // than xattn's from ~5 rows on), else xattn's
    auto project = [&](const float* in, float* y, Store how) {
      const int64_t i = next++;
      const Weight w = weight_of(weights[i], scales, biases, i);
      if (packed.empty()) return xattn::product(in, B, w, y, how);
      const at::Tensor result =
          packed[i]->apply_dynamic(at::from_blob(const_cast<float*>(in), {B, w.K}, hidden.options()), true);
      const float* r = result.data_ptr<float>();
      for (int64_t j = 0; j < B * w.N; ++j) y[j] = how == Store::kAdd ? y[j] + r[j] : r[j];
    };

    // self-attention: K/V of this position into the cache, then attend over positions 0..p
    layer_norm(h, B, D, gamma, beta, eps, x.data());
    const Weight qkv_w = weight_of(weights[next], scales, biases, next);
    TORCH_CHECK(qkv_w.N == 3 * D && qkv_w.K == D, "layer ", l, ": qkv weight must be [3D, D]");
    project(x.data(), qkv.data(), Store::kSet);
    for (int64_t b = 0; b < B; ++b)
      for (int64_t head = 0; head < H; ++head) {
        const int64_t at = (((l * B + b) * H + head) * T + p) * hd;
        std::copy_n(qkv.data() + b * 3 * D + D + head * hd, hd, kc + at);
        std::copy_n(qkv.data() + b * 3 * D + 2 * D + head * hd, hd, vc + at);
      }
    attention([&](int64_t b) { return qkv.data() + b * 3 * D; },
              [&](int64_t b, int64_t head, const float* q, std::vector<float>& scores, float* o) {
                const int64_t at = ((l * B + b) * H + head) * T * hd;
                attend(q, kc + at, vc + at, p + 1, hd, scale, nullptr, scores, o);
              });
    project(attn.data(), h, Store::kAdd);

    if (has_cross) {
      layer_norm(h, B, D, gamma + D, beta + D, eps, x.data());
      project(x.data(), qkv.data(), Store::kSet);  // the cross query, [B, D] in qkv's buffer
      attention([&](int64_t b) { return qkv.data() + b * D; },
                [&](int64_t b, int64_t head, const float* q, std::vector<float>& scores, float* o) {
                  const int64_t e = enc_row[b];
                  const int64_t at = ((l * B_enc + e) * H + head) * S * hd;
                  attend(q, ck + at, cv + at, S, hd, scale, cmask ? cmask + e * S : nullptr, scores, o);
                });
      project(attn.data(), h, Store::kAdd);
    }

    layer_norm(h, B, D, gamma + 2 * D, beta + 2 * D, eps, x.data());
    const int64_t width = weight_of(weights[next], scales, biases, next).N;
    inner.resize(B * width);
    project(x.data(), inner.data(), Store::kSet);
    at::Tensor activations = at::from_blob(inner.data(), {B, width}, hidden.options());
    at::gelu_(activations, "tanh");  // torch's own vectorized GELU, as the decoder's blocks run it
    project(inner.data(), h, Store::kAdd);
  }
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(xattn_kernels, m) {
  m.def(
      "decoder_layers(Tensor hidden, Tensor norm_weight, Tensor norm_bias, Tensor[] weights, Tensor[] scales, "
      "Tensor[] biases, __torch__.torch.classes.quantized.LinearPackedParamsBase[] packed, "
      "Tensor(a!) keys, Tensor(b!) values, Tensor? cross_keys, Tensor? cross_values, "
      "Tensor? cross_mask, Tensor? enc_index, Tensor position, float[] scalings, float eps) -> Tensor");
}

TORCH_LIBRARY_IMPL(xattn_kernels, CPU, m) { m.impl("decoder_layers", &decoder_layers); }
