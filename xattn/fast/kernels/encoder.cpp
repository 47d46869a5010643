// Every layer of a pre-norm ViT encoder over a batch in one call: xattn_kernels::encoder_layers.
//
// A batch's encoder pass is bound by its products (fbgemm's prepacked int8 ones, or torch's fp32 addmm), but torch
// gives every op's output fresh memory, and here a 38 MB tensor (one MLP activation at batch 16) costs ~15 ms of page
// faults before it is written: a quarter of the int8 encoder's time. In this op every intermediate result lives in
// a workspace the caller keeps between calls (fp32 products write into it; int8 ones run in row blocks small enough
// for malloc to hand the same memory back), and attention runs per (image, head) with its Q, K^T, V and scores in
// L2 (products.h's tiles), not through [B, H, S, S] tensors.
//
// Per layer: h += out(attention(qkv(ln_before(h)))); h += fc2(gelu(fc1(ln_after(h)))).

#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/native/quantized/PackedParams.h>
#include <torch/library.h>

#include <algorithm>
#include <limits>
#include <optional>
#include <vector>

#include "amx_attention.h"
#include "amx_bf16.h"
#include "bf16.h"
#include "checks.h"
#include "products.h"
#include "rowwise.h"

namespace {

using xattn::add_bias;
using xattn::bf16_data;
using xattn::kPanel;
using xattn::Store;
using Packed = c10::intrusive_ptr<LinearPackedParamsBase>;

int64_t panels_of(int64_t n) { return (n + kPanel - 1) / kPanel; }

// One head's K^T as panels [ceil(S / 16), hd, 16]: the weight of the Q K^T product. Entries past S are never
// written, so they keep the zeros the buffer starts with.
void key_panels(const float* k, int64_t S, int64_t hd, int64_t stride, float* out) {
  for (int64_t s = 0; s < S; ++s)
    for (int64_t d = 0; d < hd; ++d) out[((s / kPanel) * hd + d) * kPanel + s % kPanel] = k[s * stride + d];
}

// One head's V as panels [ceil(hd / 16), S, 16] (entries past hd left zero): the weight of the P V product.
void value_panels(const float* v, int64_t S, int64_t hd, int64_t stride, float* out) {
  for (int64_t s = 0; s < S; ++s)
    for (int64_t d0 = 0; d0 < hd; d0 += kPanel)
      std::copy_n(v + s * stride + d0, std::min(kPanel, hd - d0), out + ((d0 / kPanel) * S + s) * kPanel);
}

// One head's Q [S, hd], times the attention's scale.
void scaled_queries(const float* q, int64_t S, int64_t hd, int64_t stride, float scale, float* out) {
  const __m256 factor = _mm256_set1_ps(scale);
  const int64_t h8 = hd - hd % 8;
  for (int64_t s = 0; s < S; ++s) {
    const float* row = q + s * stride;
    for (int64_t d = 0; d < h8; d += 8)
      _mm256_storeu_ps(out + s * hd + d, _mm256_mul_ps(_mm256_loadu_ps(row + d), factor));
    for (int64_t d = h8; d < hd; ++d) out[s * hd + d] = row[d] * scale;
  }
}

// y [M, N] (row stride ldy, from column n0) = x [M, K] times the panels of an [N, K] matrix.
void tiles(const float* x, int64_t M, int64_t K, const float* panels, int64_t N, float* y, int64_t ldy, int64_t n0) {
  for (int64_t m0 = 0, rows; m0 < M; m0 += rows) {
    rows = xattn::tile_rows(M - m0);
    for (int64_t p = 0; p < panels_of(N); ++p)
      xattn::tile_fp32_rows(rows, x + m0 * K, K, panels + p * K * kPanel, nullptr, n0 + p * kPanel,
                            std::min(kPanel, N - p * kPanel), nullptr, y + m0 * ldy, ldy, Store::kSet);
  }
}

// ctx [B * S, D] = softmax(Q K^T * scale) V for every image and head, Q/K/V read from qkv [B * S, 3D].
void attention(const float* qkv, int64_t B, int64_t S, int64_t H, int64_t hd, float scale, float* ctx) {
  const int64_t D = H * hd, stride = 3 * D;
  at::parallel_for(0, B * H, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> q(S * hd), kt(panels_of(S) * hd * kPanel), v(panels_of(hd) * S * kPanel), scores(S * S);  // zeros
    for (int64_t i = begin; i < end; ++i) {
      const int64_t b = i / H, head = i % H;
      const float* base = qkv + b * S * stride + head * hd;
      scaled_queries(base, S, hd, stride, scale, q.data());
      key_panels(base + D, S, hd, stride, kt.data());
      value_panels(base + 2 * D, S, hd, stride, v.data());
      tiles(q.data(), S, hd, kt.data(), S, scores.data(), S, 0);
      for (int64_t s = 0; s < S; ++s) xattn::softmax(scores.data() + s * S, S);
      tiles(scores.data(), S, S, v.data(), hd, ctx + b * S * D, D, head * hd);
    }
  });
}

// int8 products are fbgemm's dynamic ones (x quantized to 7 bits per call, as torch.ops.quantized.linear_dynamic(x,
// w, True)), run over blocks of rows whose outputs stay under ~2 MB: apply_dynamic gives its output and int32 sums
// fresh memory on every call, and blocks that small are served again from malloc's heap rather than mapped and
// faulted in anew. x's range is taken per block, which only narrows it.
int64_t block_rows(int64_t N) { return std::max<int64_t>(64, (int64_t{1} << 19) / N); }

// rows of x from m0 times packed[i], which must give N columns (fbgemm checks x's K itself; a wrong N would be
// broadcast or refused by the copy, so it is checked here)
at::Tensor int8_block(const std::vector<Packed>& packed, int64_t i, const at::Tensor& x, int64_t m0, int64_t rows,
                      int64_t N) {
  at::Tensor out = packed[i]->apply_dynamic(x.narrow(0, m0, rows), /*reduce_range=*/true);
  xattn::check_tensor(out, at::kFloat, {rows, N}, "packed[", i, "]'s product");
  return out;
}

// y (+)= x times packed[i], block by block
void int8_product(const std::vector<Packed>& packed, int64_t i, const at::Tensor& x, at::Tensor& y, Store how) {
  const int64_t M = x.size(0), N = y.size(1), block = block_rows(N);
  for (int64_t m0 = 0; m0 < M; m0 += block) {
    const int64_t rows = std::min(block, M - m0);
    at::Tensor out = y.narrow(0, m0, rows);
    if (how == Store::kAdd)
      out.add_(int8_block(packed, i, x, m0, rows, N));
    else
      out.copy_(int8_block(packed, i, x, m0, rows, N));
  }
}

// h += fc2(gelu(fc1(x))) with fc1 = packed[i], fc2 = packed[i + 1], block by block: a block's MLP activations never
// leave L2/L3
void int8_mlp(const std::vector<Packed>& packed, int64_t i, const at::Tensor& x, at::Tensor& h, int64_t F) {
  const int64_t M = x.size(0), D = h.size(1), block = block_rows(F);
  for (int64_t m0 = 0; m0 < M; m0 += block) {
    const int64_t rows = std::min(block, M - m0);
    at::Tensor inner = int8_block(packed, i, x, m0, rows, F);
    at::gelu_(inner);
    h.narrow(0, m0, rows).add_(int8_block(packed, i + 1, inner, 0, rows, D));
  }
}

// bfloat16 products: where the CPU has AMX or AVX-512 BF16, torch hands them to oneDNN, several times fbgemm's int8
// rate. The passes between fp32 and bfloat16 around them are written here, each one sweep over rows in parallel:
// torch's mixed-dtype add and its copies cost as much as the products themselves.

// out [M, N] fp32 = (or +=) in [M, N] bfloat16 + bias [N]
void widen_rows(const at::Tensor& in, const at::Tensor& bias, const at::Tensor& out, Store how) {
  const int64_t N = out.size(1);
  at::parallel_for(0, out.size(0), 8, [&](int64_t begin, int64_t end) {
    for (int64_t m = begin; m < end; ++m)
      add_bias(bf16_data(in) + m * N, bias.data_ptr<float>(), N, out.data_ptr<float>() + m * N, how == Store::kAdd);
  });
}

// oneDNN's linear over bfloat16 x [M, K] and weight [N, K] with the fp32 bias, and GELU where asked, fused
// (mkldnn::_linear_pointwise, in torch's x86 builds): the sums, the bias and the GELU in fp32, rounded once to the
// bfloat16 result, where a product rounded to bfloat16 and a sweep adding the bias (and GELU) would round twice and
// read and write the result once more.
at::Tensor biased_product(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& bias, bool gelu) {
  using Signature = at::Tensor(const at::Tensor&, const at::Tensor&, const std::optional<at::Tensor>&,
                               c10::string_view, c10::List<std::optional<at::Scalar>>, std::optional<c10::string_view>);
  static const std::optional<c10::TypedOperatorHandle<Signature>> fused = []() -> decltype(fused) {
    const auto handle = c10::Dispatcher::singleton().findSchema({"mkldnn::_linear_pointwise", ""});
    if (!handle.has_value() || !handle->hasKernelForDispatchKey(c10::DispatchKey::CPU)) return std::nullopt;
    return handle->typed<Signature>();
  }();
  TORCH_CHECK(fused.has_value(), "bfloat16 encoder layers need oneDNN's fused linear (mkldnn::_linear_pointwise), "
              "which this torch build lacks: use the int8 or packed encoder");
  return fused->call(x, weight, bias, gelu ? "gelu" : "none", c10::List<std::optional<at::Scalar>>(), "none");
}

// Attention over qkv [B * S, 3D] (bfloat16 rows: Q, K, V) into ctx [B * S, D] bfloat16 rows, fp32 sums and softmax,
// each image's result independent of the others: on AMX tiles where the CPU has AMX-BF16 and the head width is a
// multiple of 32 (amx_attention.h), else torch's attention over bfloat16 Q, K, V (its flash attention).
void bf16_attention(const at::Tensor& qkv, int64_t B, int64_t S, int64_t H, const at::Tensor& ctx) {
  const int64_t D = qkv.size(1) / 3, hd = D / H;
  if (xattn::amx_bf16_supported() && hd % 32 == 0)
    return xattn::tile_attention(bf16_data(qkv), B, S, H, hd,
                                 static_cast<float>(1.0 / std::sqrt(static_cast<double>(hd))), bf16_data(ctx));
  const at::Tensor heads = qkv.view({B, S, 3, H, hd});
  const at::Tensor out = at::scaled_dot_product_attention(heads.select(2, 0).transpose(1, 2),
                                                          heads.select(2, 1).transpose(1, 2),
                                                          heads.select(2, 2).transpose(1, 2));
  ctx.view({B, S, H, hd}).copy_(out.transpose(1, 2));  // [B, H, S, hd] as rows
}

// The op: bf16_attention over qkv [B * S, 3D] bfloat16 for B images and H heads.
at::Tensor attention_op(const at::Tensor& qkv, int64_t images, int64_t heads) {
  xattn::check_kind(qkv, at::kBFloat16, 2, true, "qkv [B * S, 3D]");
  TORCH_CHECK(images > 0 && qkv.size(0) % images == 0 && qkv.size(0) > 0, "images: expected a divisor of qkv's ",
              qkv.size(0), " rows, got ", images);
  TORCH_CHECK(heads > 0 && qkv.size(1) % (3 * heads) == 0, "heads: expected qkv's width ", qkv.size(1),
              " to be 3 x heads x head width, got heads=", heads);
  at::Tensor ctx = at::empty({qkv.size(0), qkv.size(1) / 3}, qkv.options());
  bf16_attention(qkv, images, qkv.size(0) / images, heads, ctx);
  return ctx;
}

// out [M, N] fp32 = x [M, K] bfloat16 times the AMX tiles of an [N, K] bfloat16 weight (kernels.bf16_tiles) + bias
// [N] (the ViT's patch projection): every row's sums the same tile steps whatever M.
at::Tensor tile_linear(const at::Tensor& x, const at::Tensor& tiles, const at::Tensor& bias) {
  TORCH_CHECK(xattn::amx_bf16_supported(), "tile_linear needs a CPU (and OS) with AMX-BF16");
  xattn::check_kind(x, at::kBFloat16, 2, true, "x [M, K]");
  xattn::check_kind(tiles, at::kBFloat16, 4, true, "tiles [N / 16, K / 32, 16, 32]");
  const int64_t M = x.size(0), K = x.size(1), N = tiles.size(0) * 16;
  xattn::check_tensor(tiles, at::kBFloat16, {N / 16, K / 32, 16, 32}, "tiles [N / 16, K / 32, 16, 32] (K = x's ", K,
                      ", a multiple of 32)");
  TORCH_CHECK(K % 32 == 0 && K > 0, "x [M, K]: expected K a multiple of 32, got ", xattn::describe(x));
  xattn::check_tensor(bias, at::kFloat, {N}, "bias [N]");
  at::Tensor out = at::zeros({M, N}, x.options().dtype(at::kFloat));
  if (M > 0)
    xattn::tile_product({bf16_data(x), bf16_data(tiles), bias.data_ptr<float>(), out.data_ptr<float>(), M, K, N,
                         xattn::Finish::kAccumulate});
  return out;
}

// h += out(attention(qkv(x))) over x [M, D] in bfloat16, with oneDNN's bfloat16 products and bf16_attention over
// bfloat16 Q, K, V, the qkv bias added before Q, K, V are rounded. ctx [M, D]: the attention's output; out [M, D]:
// the out projection's bfloat16 result; oneDNN gives Q, K, V fresh memory.
void bf16_attention_block(const at::Tensor& x, const at::Tensor& qkv_weight, const at::Tensor& qkv_bias,
                          const at::Tensor& out_weight, const at::Tensor& out_bias, int64_t B, int64_t S, int64_t H,
                          const at::Tensor& ctx, at::Tensor& out, const at::Tensor& h) {
  const at::Tensor qkv = biased_product(x, qkv_weight, qkv_bias, false);
  bf16_attention(qkv, B, S, H, ctx);
  at::mm_out(out, ctx, out_weight.t());
  widen_rows(out, out_bias, h, Store::kAdd);
}

// Runs hidden [B, S, D] through every layer in place. Per layer, four projections (qkv [3D, D], out [D, D],
// fc1 [F, D], fc2 [D, F]): fbgemm's prepacked int8 ones (`packed`, biases inside), else fp32 or bfloat16 `weights`
// [N, K] with fp32 `biases` [N]. norm_weight/norm_bias: [L, 2, D] (before and after attention). workspace, for fp32
// and int8 weights: x [M, D], qkv [M, 3D], ctx [M, D], tmp [M, D], ff [M, F] with M = B * S (tmp and ff are used by
// fp32 weights only: int8 ones run the MLP and the residual sums block by block). For bfloat16 weights: the products'
// bfloat16 inputs [M, D], outputs [M, D] (the attention's, the tiles'; oneDNN's out and fc2 products') and wide
// results [M, max(3D, F)] (the tiles' Q, K, V and fc2 inputs; oneDNN's attention output, its own products' wide
// results being fresh tensors): the norms' outputs and so each product's input are rounded to bfloat16, attention
// runs over bfloat16 Q, K, V, the biases and GELU are added in fp32 before a result is rounded, and the residual
// stream stays fp32 (bf16_attention_block, biased_product). Every argument is checked before hidden is written,
// except the int8 products' widths, which fbgemm's packed weights tell only by their bias (checked first) or their
// product.
void encoder_layers(const at::Tensor& hidden, const at::Tensor& norm_weight, const at::Tensor& norm_bias,
                    at::TensorList weights, at::TensorList biases, const std::vector<Packed>& packed, int64_t heads,
                    double eps, at::TensorList workspace) {
  xattn::check_kind(hidden, at::kFloat, 3, true, "hidden [B, S, D]");
  const int64_t B = hidden.size(0), S = hidden.size(1), D = hidden.size(2), M = B * S;
  TORCH_CHECK(heads > 0 && D % heads == 0, "heads: expected a divisor of hidden's width ", D, ", got ", heads);
  xattn::check_kind(norm_weight, at::kFloat, 3, true, "norm_weight [L, 2, D]");
  const int64_t L = norm_weight.size(0);
  xattn::check_tensor(norm_weight, at::kFloat, {L, 2, D}, "norm_weight [L, 2, D]");
  xattn::check_tensor(norm_bias, at::kFloat, {L, 2, D}, "norm_bias [L, 2, D]");
  const bool bf16 = !weights.empty() && weights[0].scalar_type() == at::kBFloat16;
  int64_t F;
  if (bf16) {
    TORCH_CHECK(weights.size() > 2 && (weights[2].dim() == 2 || weights[2].dim() == 4) && weights[2].size(0) > 0,
                "weights[2] (layer 0 fc1 [F, D], or its tiles [F / 16, D / 32, 16, 32]): expected a 2-d or 4-d "
                "weight, got ", weights.size() > 2 ? xattn::describe(weights[2]) : std::string("none"));
    F = weights[2].dim() == 2 ? weights[2].size(0) : weights[2].size(0) * 16;
    TORCH_CHECK(workspace.size() == 3, "workspace: expected 3 tensors with bfloat16 weights (the products' "
                "bfloat16 inputs [M, D], outputs [M, D] and wide results [M, max(3D, F)]), got ", workspace.size());
    xattn::check_tensor(workspace[0], at::kBFloat16, {M, D}, "workspace[0] (bfloat16 inputs [M, D], M = B * S)");
    xattn::check_tensor(workspace[1], at::kBFloat16, {M, D}, "workspace[1] (bfloat16 outputs [M, D], M = B * S)");
    xattn::check_tensor(workspace[2], at::kBFloat16, {M, std::max(3 * D, F)},
                        "workspace[2] (bfloat16 wide results [M, max(3D, F)], M = B * S)");
  } else {
    TORCH_CHECK(workspace.size() == 5, "workspace: expected 5 tensors (x, qkv, ctx, tmp, ff), got ",
                workspace.size());
    xattn::check_kind(workspace[4], at::kFloat, 2, true, "workspace[4] (ff [M, F])");
    F = workspace[4].size(1);
    TORCH_CHECK(F > 0, "workspace[4] (ff [M, F]): expected F > 0, got ", xattn::describe(workspace[4]));
    const char* names[] = {"x [M, D]", "qkv [M, 3D]", "ctx [M, D]", "tmp [M, D]", "ff [M, F]"};
    const int64_t widths[] = {D, 3 * D, D, D, F};
    for (int i = 0; i < 5; ++i)
      xattn::check_tensor(workspace[i], at::kFloat, {M, widths[i]}, "workspace[", i, "] (", names[i],
                          ", M = B * S)");
  }
  const char* roles[] = {"qkv", "out", "fc1", "fc2"};
  const int64_t in_widths[] = {D, D, D, F}, out_widths[] = {3 * D, D, F, D};
  // bfloat16 weights packed as AMX tiles (kernels.bf16_tiles): xattn's tile products, each row independent of the
  // others; unpacked [N, K]: oneDNN's
  const bool tiles = bf16 && weights[0].dim() == 4;
  TORCH_CHECK(!tiles || xattn::amx_bf16_supported(), "weights: tiles need a CPU (and OS) with AMX-BF16; pass "
              "bfloat16 weights [N, K] here");
  const bool int8 = !packed.empty();
  if (int8) {
    TORCH_CHECK(static_cast<int64_t>(packed.size()) == 4 * L, "packed: expected 4 projections per layer for ", L,
                " layers (", 4 * L, "), got ", packed.size());
    TORCH_CHECK(weights.empty() && biases.empty(),
                "weights/biases: expected none with packed int8 projections (their biases are inside), got ",
                weights.size(), " and ", biases.size());
    for (int64_t i = 0; i < 4 * L; ++i) {
      const c10::optional<at::Tensor> bias = packed[i]->bias();  // the output width, where fbgemm holds a bias
      TORCH_CHECK(!bias.has_value() || bias->numel() == out_widths[i % 4], "packed[", i, "] (layer ", i / 4, " ",
                  roles[i % 4], "): expected an [N=", out_widths[i % 4], ", K=", in_widths[i % 4],
                  "] weight, got one with ", bias->numel(), " outputs");
    }
  } else {
    TORCH_CHECK(static_cast<int64_t>(weights.size()) == 4 * L && biases.size() == weights.size(),
                "weights/biases: expected 4 projections per layer for ", L, " layers (", 4 * L,
                ") with a bias each, got ", weights.size(), " weights and ", biases.size(), " biases");
    for (int64_t i = 0; i < 4 * L; ++i) {
      const int64_t N = out_widths[i % 4], K = in_widths[i % 4];
      if (tiles) {
        TORCH_CHECK(N % 16 == 0 && K % 32 == 0, "weights[", i, "] (layer ", i / 4, " ", roles[i % 4], "): tiles "
                    "need N a multiple of 16 and K of 32, got N=", N, ", K=", K);
        xattn::check_tensor(weights[i], at::kBFloat16, {N / 16, K / 32, 16, 32}, "weights[", i, "] (layer ", i / 4,
                            " ", roles[i % 4], " tiles [N / 16, K / 32, 16, 32])");
      } else {
        xattn::check_tensor(weights[i], bf16 ? at::kBFloat16 : at::kFloat, {N, K}, "weights[", i, "] (layer ",
                            i / 4, " ", roles[i % 4], " [N, K])");
      }
      xattn::check_tensor(biases[i], at::kFloat, {out_widths[i % 4]}, "biases[", i, "] (layer ", i / 4, " ",
                          roles[i % 4], ")");
    }
  }

  at::Tensor h = hidden.view({M, D});
  float* hp = h.data_ptr<float>();
  const float* gammas = norm_weight.data_ptr<float>();
  const float* betas = norm_bias.data_ptr<float>();
  // [M, width] bfloat16 rows at the start of the wide workspace (Q, K, V, then the MLP's inner activations): kept
  // between calls, since fresh tensors this size cost their page faults again on every layer
  auto wide = [&](int64_t width) { return workspace[2].view(-1).narrow(0, 0, M * width).view({M, width}); };
  if (tiles) {  // the norms write the products' bfloat16 inputs directly; each product finishes its own output
    const at::Tensor in_bf16 = workspace[0], ctx = workspace[1];
    const uint16_t* in = bf16_data(in_bf16);
    auto product = [&](const uint16_t* x, int64_t i, void* out, int64_t K, int64_t N, xattn::Finish how) {
      xattn::tile_product({x, bf16_data(weights[i]), biases[i].data_ptr<float>(), out, M, K, N, how});
    };
    for (int64_t l = 0; l < L; ++l) {
      const float* gamma = gammas + l * 2 * D;
      const float* beta = betas + l * 2 * D;
      xattn::layer_norm(hp, M, D, gamma, beta, eps, bf16_data(in_bf16));
      const at::Tensor qkv = wide(3 * D);
      product(in, 4 * l, bf16_data(qkv), D, 3 * D, xattn::Finish::kRound);
      bf16_attention(qkv, B, S, heads, ctx);
      product(bf16_data(ctx), 4 * l + 1, hp, D, D, xattn::Finish::kAccumulate);
      xattn::layer_norm(hp, M, D, gamma + D, beta + D, eps, bf16_data(in_bf16));
      const at::Tensor inner = wide(F);
      product(in, 4 * l + 2, bf16_data(inner), D, F, xattn::Finish::kGelu);
      product(bf16_data(inner), 4 * l + 3, hp, F, D, xattn::Finish::kAccumulate);
    }
    return;
  }
  if (bf16) {  // the norms write the products' bfloat16 inputs directly
    const at::Tensor in_bf16 = workspace[0];
    at::Tensor out_bf16 = workspace[1];
    for (int64_t l = 0; l < L; ++l) {
      const float* gamma = gammas + l * 2 * D;
      const float* beta = betas + l * 2 * D;
      xattn::layer_norm(hp, M, D, gamma, beta, eps, bf16_data(in_bf16));
      bf16_attention_block(in_bf16, weights[4 * l], biases[4 * l], weights[4 * l + 1], biases[4 * l + 1], B, S,
                           heads, wide(D), out_bf16, h);
      xattn::layer_norm(hp, M, D, gamma + D, beta + D, eps, bf16_data(in_bf16));
      const at::Tensor inner = biased_product(in_bf16, weights[4 * l + 2], biases[4 * l + 2], true);
      at::mm_out(out_bf16, inner, weights[4 * l + 3].t());
      widen_rows(out_bf16, biases[4 * l + 3], h, Store::kAdd);
    }
    return;
  }
  at::Tensor x = workspace[0], qkv = workspace[1], ctx = workspace[2], tmp = workspace[3], ff = workspace[4];
  const int64_t hd = D / heads;
  const float scale = static_cast<float>(1.0 / std::sqrt(static_cast<double>(hd)));
  // out (+)= the projection i of in
  auto project = [&](int64_t i, const at::Tensor& in, at::Tensor& out, Store how) {
    if (int8) return int8_product(packed, i, in, out, how);
    if (how == Store::kSet) return void(at::addmm_out(out, biases[i], in, weights[i].t()));
    at::addmm_out(tmp, biases[i], in, weights[i].t());
    out.add_(tmp);
  };
  for (int64_t l = 0; l < L; ++l) {
    const float* gamma = gammas + l * 2 * D;
    const float* beta = betas + l * 2 * D;
    xattn::layer_norm(hp, M, D, gamma, beta, eps, x.data_ptr<float>());
    project(4 * l, x, qkv, Store::kSet);
    attention(qkv.data_ptr<float>(), B, S, heads, hd, scale, ctx.data_ptr<float>());
    project(4 * l + 1, ctx, h, Store::kAdd);
    xattn::layer_norm(hp, M, D, gamma + D, beta + D, eps, x.data_ptr<float>());
    if (int8) {
      int8_mlp(packed, 4 * l + 2, x, h, F);
    } else {
      project(4 * l + 2, x, ff, Store::kSet);
      at::gelu_(ff);  // exact (erf) GELU, in place
      project(4 * l + 3, ff, h, Store::kAdd);
    }
  }
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(xattn_kernels, m) {
  m.def(
      "encoder_layers(Tensor(a!) hidden, Tensor norm_weight, Tensor norm_bias, Tensor[] weights, Tensor[] biases, "
      "__torch__.torch.classes.quantized.LinearPackedParamsBase[] packed, int heads, float eps, "
      "Tensor(b!)[] workspace) -> ()");
  m.def("bf16_attention(Tensor qkv, int images, int heads) -> Tensor");
  m.def("tile_linear(Tensor x, Tensor tiles, Tensor bias) -> Tensor");
}

TORCH_LIBRARY_FRAGMENT(xattn_kernels, m) { m.def("amx_bf16() -> bool", [] { return xattn::amx_bf16_supported(); }); }

TORCH_LIBRARY_IMPL(xattn_kernels, CPU, m) {
  m.impl("encoder_layers", &encoder_layers);
  m.impl("bf16_attention", &attention_op);
  m.impl("tile_linear", &tile_linear);
}
