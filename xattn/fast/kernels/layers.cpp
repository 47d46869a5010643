// One decode step through every GPT-2 block in one call: xattn_kernels::decoder_layers.
//
// At small batch a step's projections stream ~550 MB of weights, and the rest of the block (layer norms, attention
// over the cache and the encoder's K/V, residuals, GELU: ~30 small torch ops per layer) costs ~3 ms of dispatch on
// top. Here that rest is plain loops between the products (products.h's, or fbgemm's prepacked int8 ones where
// `packed` is given), so the step is the weight stream plus the attention's own reads.
//
// Per layer: h += attn_out(self_attention(qkv(ln_1(h)))); h += cross_out(cross_attention(cross_q(ln_cross(h))));
// h += mlp_out(gelu_tanh(mlp_in(ln_2(h)))). Layouts are the decoder's (xattn/cache.py): self K/V
// [L, B, H, T_max, hd] written at `position` (one for every row, or one per row: in-flight batching), each (layer,
// row, head)'s positions contiguous but the rest strided as a range of a larger cache's rows is; cross K/V
// [L, B_enc, H, S, hd] read by row b at enc_index[b] or, without it, at b / (B / B_enc); cross_mask [B_enc, S] true
// where an encoder position is real.

#include <ATen/ATen.h>
#include <ATen/native/quantized/PackedParams.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>
#include <vector>

#include "checks.h"
#include "products.h"
#include "rowwise.h"

namespace {

using xattn::Store;
using xattn::Weight;
using xattn::exponentiate;
using xattn::layer_norm;
using Packed = c10::intrusive_ptr<LinearPackedParamsBase>;

// K/V elements: float32 (self-attention, and cross-attention of exact formats) or float16 (the int8 format's cross
// K/V: half the bytes a step reads at many rows). A float16 value converts to float32 exactly, so a step over float16
// K/V gives the bits it gives over float32 K/V holding the same values (the scalar tails are explicit fmas: left to
// the compiler, one instantiation's `a * b + c` was contracted and the other's not).
inline __m256 load8(const float* x) { return _mm256_loadu_ps(x); }
inline __m256 load8(const at::Half* x) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(x)));
}
inline float value(float x) { return x; }
inline float value(at::Half x) { return static_cast<float>(x); }

// scores[t] = q . keys[t] for t < positions, four keys at a time (four independent FMA chains).
template <typename T>
void dots(const float* q, const T* keys, int64_t positions, int64_t hd, float* scores) {
  const int64_t h8 = hd - hd % 8;
  int64_t t = 0;
  for (; t + 4 <= positions; t += 4) {
    const T* k = keys + t * hd;
    __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
    for (int64_t i = 0; i < h8; i += 8) {
      const __m256 qv = _mm256_loadu_ps(q + i);
      a0 = _mm256_fmadd_ps(qv, load8(k + i), a0);
      a1 = _mm256_fmadd_ps(qv, load8(k + hd + i), a1);
      a2 = _mm256_fmadd_ps(qv, load8(k + 2 * hd + i), a2);
      a3 = _mm256_fmadd_ps(qv, load8(k + 3 * hd + i), a3);
    }
    // lanes: (a0 a0 a1 a1 | a0 a0 a1 a1) -> (a0 a1 a2 a3 | a0 a1 a2 a3), then the two halves added
    const __m256 h = _mm256_hadd_ps(_mm256_hadd_ps(a0, a1), _mm256_hadd_ps(a2, a3));
    __m128 four = _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
    alignas(16) float sums[4];
    _mm_store_ps(sums, four);
    for (int j = 0; j < 4; ++j) {
      for (int64_t i = h8; i < hd; ++i) sums[j] = std::fma(q[i], value(k[j * hd + i]), sums[j]);
      scores[t + j] = sums[j];
    }
  }
  for (; t < positions; ++t) {
    float sum = 0.f;
    for (int64_t i = 0; i < hd; ++i) sum = std::fma(q[i], value(keys[t * hd + i]), sum);
    scores[t] = sum;
  }
}

// out = sum_t p[t] v[t] * inv, with hd = 8 V held in V registers.
template <int V, typename T>
void weighted_sum_regs(const float* p, const T* v, int64_t positions, float inv, float* out) {
  __m256 acc[V];
  for (int i = 0; i < V; ++i) acc[i] = _mm256_setzero_ps();
  for (int64_t t = 0; t < positions; ++t) {
    if (p[t] == 0.f) continue;  // masked
    const __m256 w = _mm256_set1_ps(p[t]);
    for (int i = 0; i < V; ++i) acc[i] = _mm256_fmadd_ps(w, load8(v + t * 8 * V + 8 * i), acc[i]);
  }
  const __m256 scale = _mm256_set1_ps(inv);
  for (int i = 0; i < V; ++i) _mm256_storeu_ps(out + 8 * i, _mm256_mul_ps(acc[i], scale));
}

template <typename T>
void weighted_sum(const float* p, const T* v, int64_t positions, int64_t hd, float total, float* out) {
  const float inv = 1.f / total;
  switch (hd) {
    case 8: return weighted_sum_regs<1>(p, v, positions, inv, out);
    case 16: return weighted_sum_regs<2>(p, v, positions, inv, out);
    case 32: return weighted_sum_regs<4>(p, v, positions, inv, out);
    case 64: return weighted_sum_regs<8>(p, v, positions, inv, out);
  }
  for (int64_t i = 0; i < hd; ++i) out[i] = 0.f;
  for (int64_t t = 0; t < positions; ++t)
    for (int64_t i = 0; i < hd; ++i) out[i] = std::fma(p[t], value(v[t * hd + i]), out[i]);
  for (int64_t i = 0; i < hd; ++i) out[i] *= inv;
}

// softmax(q K^T * scale) V for one query row of one head; keys/values [positions, hd]; mask may be null.
template <typename T>
void attend(const float* q, const T* keys, const T* values, int64_t positions, int64_t hd, float scale,
            const bool* mask, std::vector<float>& scores, float* out) {
  scores.resize(positions);
  dots(q, keys, positions, hd, scores.data());
  float peak = -std::numeric_limits<float>::infinity();
  for (int64_t t = 0; t < positions; ++t) {
    if (mask && !mask[t]) continue;
    scores[t] *= scale;
    peak = std::max(peak, scores[t]);
  }
  if (peak == -std::numeric_limits<float>::infinity()) {  // every position masked (an all-padding input): zeros,
    std::fill(out, out + hd, 0.f);                          // as torch's SDPA gives, not 0 / 0
    return;
  }
  weighted_sum(scores.data(), values, positions, hd, exponentiate(scores.data(), positions, peak, mask), out);
}

// torch's own vectorized tanh GELU in place on rows [B, width], as the decoder's blocks run it. torch runs a call's
// values through its vector loop and the last (count % vector) through a scalar one: so that a row's values take the
// same path whatever rows are beside it, rows whose width is not a multiple of 64 get a call each (rows of a multiple
// of 64 have no tail). From 2 x 4096 values on, the rows are shared between the threads.
void gelu_rows(float* x, int64_t rows, int64_t width, const at::TensorOptions& options) {
  at::parallel_for(0, rows, std::max<int64_t>(1, 4096 / std::max<int64_t>(width, 1)), [&](int64_t begin, int64_t end) {
    const int64_t per_call = width % 64 ? 1 : end - begin;
    for (int64_t r = begin; r < end; r += per_call) {
      at::Tensor share = at::from_blob(x + r * width, {per_call * width}, options);
      at::gelu_(share, "tanh");
    }
  });
}

const char* const kRoles[] = {"qkv", "attn_out", "cross_q", "cross_out", "mlp_in", "mlp_out"};

// Every projection, checked against the shapes the step writes into (D wide hidden states, a qkv buffer [B, 3D], an
// MLP buffer [B, F] with F = mlp_in's N): fp32 weights as whole panels [N / 16, K, 16], int8 ones as whole blocks
// [N / 8, K / 32, 8, 32] with a float32 scale [N] each (products.h); biases float32 [N]. Whole panels and blocks
// because the kernel takes N and K from the shape: a padded one would write its padding as output columns.
std::vector<Weight> projections(at::TensorList weights, at::TensorList scales, at::TensorList biases,
                                const std::vector<Packed>& packed, int64_t L, bool has_cross, int64_t D) {
  const int64_t per_layer = has_cross ? 6 : 4;
  TORCH_CHECK(static_cast<int64_t>(weights.size()) == per_layer * L, "weights: expected ", per_layer * L, " weights (",
              per_layer, " projections per layer, ", L, " layers), got ", weights.size());
  TORCH_CHECK(scales.empty() || scales.size() == weights.size(),
              "scales: expected none (fp32 weights) or one per weight (", weights.size(), "), got ", scales.size());
  TORCH_CHECK(biases.empty() || biases.size() == weights.size(),
              "biases: expected none or one per weight (", weights.size(), "), got ", biases.size());
  TORCH_CHECK(packed.empty() || packed.size() == weights.size(),
              "packed: expected none or one per weight (", weights.size(), "), got ", packed.size());
  std::vector<Weight> out;
  for (int64_t i = 0; i < per_layer * L; ++i) {
    const int64_t l = i / per_layer;
    const int64_t slot = i % per_layer;
    const char* role = kRoles[has_cross || slot < 2 ? slot : slot + 2];
    const at::Tensor& w = weights[i];
    const bool int8 = w.defined() && w.scalar_type() == at::kChar;
    const int64_t unit = int8 ? xattn::kRows : xattn::kPanel;
    xattn::check_kind(w, int8 ? at::kChar : at::kFloat, int8 ? 4 : 3, true, "weights[", i, "] (layer ", l, " ", role,
                      ")");
    int64_t N = D, K = D;
    if (slot == 0) N = 3 * D;
    if (slot == per_layer - 2) N = w.size(0) * unit;  // mlp_in: F
    if (slot == per_layer - 1) K = out.back().N;  // mlp_out: [D, F]
    TORCH_CHECK(N > 0 && N % unit == 0 && (!int8 || K % xattn::kBytes == 0), "weights[", i, "] (layer ", l, " ",
                role, "): the fused step needs whole ", int8 ? "int8 blocks" : "fp32 panels", ", N (", N,
                ") a multiple of ", unit, int8 ? " and K a multiple of 32" : "", ", got ", xattn::describe(w));
    xattn::check_weight(w, int8 ? at::kChar : at::kFloat, N, K, "weights[", i, "] (layer ", l, " ", role, ")");
    TORCH_CHECK(!int8 || !scales.empty(), "scales: int8 weights need one scale tensor per weight, got none");
    if (int8) xattn::check_tensor(scales[i], at::kFloat, {N}, "scales[", i, "] (layer ", l, " ", role, ")");
    if (!biases.empty()) xattn::check_tensor(biases[i], at::kFloat, {N}, "biases[", i, "] (layer ", l, " ", role, ")");
    if (!packed.empty()) {
      const c10::optional<at::Tensor> bias = packed[i]->bias();  // the output width, where fbgemm holds a bias
      TORCH_CHECK(!bias.has_value() || bias->numel() == N, "packed[", i, "] (layer ", l, " ", role,
                  "): expected an [N=", N, ", K=", K, "] weight, got one with ", bias->numel(), " outputs");
    }
    out.push_back(Weight{w.data_ptr(), int8 ? scales[i].data_ptr<float>() : nullptr,
                         biases.empty() ? nullptr : biases[i].data_ptr<float>(), N, K});
  }
  return out;
}

at::Tensor decoder_layers(const at::Tensor& hidden, const at::Tensor& norm_weight, const at::Tensor& norm_bias,
                          at::TensorList weights, at::TensorList scales, at::TensorList biases,
                          const std::vector<Packed>& packed, const at::Tensor& keys,
                          const at::Tensor& values, const c10::optional<at::Tensor>& cross_keys,
                          const c10::optional<at::Tensor>& cross_values, const c10::optional<at::Tensor>& cross_mask,
                          const c10::optional<at::Tensor>& enc_index, const at::Tensor& position,
                          at::ArrayRef<double> scalings, double eps) {
  // everything is checked before the cache is written, so a refused call leaves it as it was (all but the width of a
  // packed weight without a bias, which only its product shows)
  xattn::check_kind(hidden, at::kFloat, 2, false, "hidden [B, D]");
  xattn::check_kind(keys, at::kFloat, 5, false, "keys [L, B, H, T_max, hd]");
  const int64_t L = keys.size(0), B = hidden.size(0), D = hidden.size(1), H = keys.size(2), T = keys.size(3),
                hd = keys.size(4);
  TORCH_CHECK(keys.size(1) == B && H * hd == D, "keys: the cache does not match hidden's rows or width: expected [L, B=",
              B, ", H, T_max, hd] with H * hd = D = ", D, ", got ", xattn::describe(keys));
  xattn::check_cache(keys, values);
  xattn::check_tensor(norm_weight, at::kFloat, {L, 3, D}, "norm_weight [L, 3, D]");
  xattn::check_tensor(norm_bias, at::kFloat, {L, 3, D}, "norm_bias [L, 3, D]");
  TORCH_CHECK(static_cast<int64_t>(scalings.size()) == L, "scalings: expected one per layer (", L, "), got ",
              scalings.size());
  TORCH_CHECK(position.defined() && position.dim() <= 1 && (position.numel() == 1 || position.numel() == B) &&
                  at::isIntegralType(position.scalar_type(), false),
              "position: expected one integer, or one per row (B=", B, "), got ", xattn::describe(position));
  std::vector<int64_t> pos(B);  // each row's position
  if (position.dim() == 0 || B == 1) {
    std::fill(pos.begin(), pos.end(), position.item<int64_t>());
  } else {
    const at::Tensor rows = position.to(at::kLong).contiguous();
    std::copy_n(rows.data_ptr<int64_t>(), B, pos.begin());
  }
  for (int64_t b = 0; b < B; ++b)
    TORCH_CHECK(pos[b] >= 0 && pos[b] < T, "position ", pos[b], (position.dim() ? c10::str(" (row ", b, ")") : ""),
                " is outside the cache (", T, " positions)");
  const bool has_cross = cross_keys.has_value();
  const int64_t per_layer = has_cross ? 6 : 4;
  const std::vector<Weight> ws = projections(weights, scales, biases, packed, L, has_cross, D);

  int64_t B_enc = 1, S = 0;
  const void *ck = nullptr, *cv = nullptr;
  bool half = false;  // float16 cross K/V
  at::Tensor mask;
  std::vector<int64_t> enc_row(B);
  TORCH_CHECK(has_cross || !(cross_values.has_value() || cross_mask.has_value() || enc_index.has_value()),
              "cross_values, cross_mask and enc_index need cross_keys");
  if (has_cross) {
    half = cross_keys->defined() && cross_keys->scalar_type() == at::kHalf;
    const at::ScalarType kind = half ? at::kHalf : at::kFloat;
    xattn::check_kind(*cross_keys, kind, 5, true, "cross_keys [L, B_enc, H, S, hd] (float32 or float16)");
    B_enc = cross_keys->size(1);
    S = cross_keys->size(3);
    xattn::check_tensor(*cross_keys, kind, {L, B_enc, H, S, hd}, "cross_keys [L, B_enc, H, S, hd]");
    TORCH_CHECK(B_enc > 0, "cross_keys: expected at least one encoder row, got ", xattn::describe(*cross_keys));
    TORCH_CHECK(cross_values.has_value(), "cross_keys need cross_values");
    xattn::check_tensor(*cross_values, kind, cross_keys->sizes(), "cross_values (cross_keys' shape and dtype)");
    ck = cross_keys->data_ptr();
    cv = cross_values->data_ptr();
    if (cross_mask.has_value()) {
      xattn::check_kind(*cross_mask, at::kBool, 2, false, "cross_mask");
      mask = cross_mask->contiguous();
      xattn::check_tensor(mask, at::kBool, {B_enc, S}, "cross_mask [B_enc, S]");
    }
    if (enc_index.has_value()) {
      xattn::check_kind(*enc_index, at::kLong, 1, false, "enc_index");
      const at::Tensor rows = enc_index->contiguous();
      xattn::check_tensor(rows, at::kLong, {B}, "enc_index [B]");
      for (int64_t b = 0; b < B; ++b) {
        enc_row[b] = rows.data_ptr<int64_t>()[b];
        TORCH_CHECK(enc_row[b] >= 0 && enc_row[b] < B_enc, "enc_index[", b, "] = ", enc_row[b],
                    " is outside the ", B_enc, " encoder rows");
      }
    } else {
      TORCH_CHECK(B % B_enc == 0, "without enc_index the ", B, " rows must be a multiple of the ", B_enc,
                  " encoder rows");
      for (int64_t b = 0; b < B; ++b) enc_row[b] = b / (B / B_enc);
    }
  }
  const bool* cmask = mask.defined() ? mask.data_ptr<bool>() : nullptr;

  at::Tensor out = hidden.contiguous().clone();
  float* h = out.data_ptr<float>();
  float* kc = keys.data_ptr<float>();
  float* vc = values.data_ptr<float>();
  const int64_t sL = keys.stride(0), sB = keys.stride(1), sH = keys.stride(2);
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
      const Weight& w = ws[i];
      if (packed.empty()) return xattn::product(in, B, w, y, how);
      const at::Tensor result =
          packed[i]->apply_dynamic(at::from_blob(const_cast<float*>(in), {B, w.K}, hidden.options()), true);
      xattn::check_tensor(result, at::kFloat, {B, w.N}, "packed[", i, "]'s product (layer ", l, ")");
      const float* r = result.data_ptr<float>();
      for (int64_t j = 0; j < B * w.N; ++j) y[j] = how == Store::kAdd ? y[j] + r[j] : r[j];
    };

    // self-attention: K/V of this position into the cache, then attend over positions 0..p
    layer_norm(h, B, D, gamma, beta, eps, x.data());
    project(x.data(), qkv.data(), Store::kSet);
    for (int64_t b = 0; b < B; ++b)
      for (int64_t head = 0; head < H; ++head) {
        const int64_t at = l * sL + b * sB + head * sH + pos[b] * hd;
        std::copy_n(qkv.data() + b * 3 * D + D + head * hd, hd, kc + at);
        std::copy_n(qkv.data() + b * 3 * D + 2 * D + head * hd, hd, vc + at);
      }
    attention([&](int64_t b) { return qkv.data() + b * 3 * D; },
              [&](int64_t b, int64_t head, const float* q, std::vector<float>& scores, float* o) {
                const int64_t at = l * sL + b * sB + head * sH;
                attend(q, kc + at, vc + at, pos[b] + 1, hd, scale, nullptr, scores, o);
              });
    project(attn.data(), h, Store::kAdd);

    if (has_cross) {
      layer_norm(h, B, D, gamma + D, beta + D, eps, x.data());
      project(x.data(), qkv.data(), Store::kSet);  // the cross query, [B, D] in qkv's buffer
      attention([&](int64_t b) { return qkv.data() + b * D; },
                [&](int64_t b, int64_t head, const float* q, std::vector<float>& scores, float* o) {
                  const int64_t e = enc_row[b];
                  const int64_t at = ((l * B_enc + e) * H + head) * S * hd;
                  const bool* m = cmask ? cmask + e * S : nullptr;
                  if (half)
                    attend(q, static_cast<const at::Half*>(ck) + at, static_cast<const at::Half*>(cv) + at, S, hd,
                           scale, m, scores, o);
                  else
                    attend(q, static_cast<const float*>(ck) + at, static_cast<const float*>(cv) + at, S, hd, scale,
                           m, scores, o);
                });
      project(attn.data(), h, Store::kAdd);
    }

    layer_norm(h, B, D, gamma + 2 * D, beta + 2 * D, eps, x.data());
    const int64_t width = ws[next].N;
    inner.resize(B * width);
    project(x.data(), inner.data(), Store::kSet);
    gelu_rows(inner.data(), B, width, hidden.options());
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
