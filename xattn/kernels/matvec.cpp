// The products of products.h as torch ops: xattn_kernels::matvec (fp32 weights as panels [ceil(N / 16), K, 16]) and
// matvec_int8 (int8 weights as blocks [ceil(N / 8), ceil(K / 32), 8, 32], one scale per row), for the projections a
// decode step runs one at a time.

#include <ATen/ATen.h>
#include <torch/library.h>

#include <vector>

#include "products.h"

namespace {

at::Tensor run(const at::Tensor& x, const at::Tensor& weight, int64_t N, int64_t K, const float* scale,
               const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.size(-1) == K, "x's last dimension must be the weight's K");
  const at::Tensor x2 = x.reshape({-1, K}).contiguous();
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
  shape.back() = N;
  at::Tensor y = at::empty({x2.size(0), N}, x.options());
  const xattn::Weight w{weight.data_ptr(), scale, bias.has_value() ? bias->data_ptr<float>() : nullptr, N, K};
  xattn::product(x2.data_ptr<float>(), x2.size(0), w, y.data_ptr<float>());
  return y.view(shape);
}

void check_x(const at::Tensor& x) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.device().is_cpu(), "x must be a float32 CPU tensor");
}

at::Tensor matvec(const at::Tensor& x, const at::Tensor& panels, int64_t N, const c10::optional<at::Tensor>& bias) {
  check_x(x);
  TORCH_CHECK(panels.dim() == 3 && panels.size(2) == 16 && panels.is_contiguous() &&
                  panels.scalar_type() == at::kFloat && N > 0 && panels.size(0) == (N + 15) / 16,
              "weight must be contiguous float32 panels [ceil(N / 16), K, 16] (xattn.kernels.panels)");
  TORCH_CHECK(!bias.has_value() || bias->numel() == N, "bias must have N elements");
  return run(x, panels, N, panels.size(1), nullptr, bias);
}

at::Tensor matvec_int8(const at::Tensor& x, const at::Tensor& blocks, int64_t N, const at::Tensor& scale,
                       const c10::optional<at::Tensor>& bias) {
  check_x(x);
  const int64_t K = x.size(-1);
  TORCH_CHECK(blocks.dim() == 4 && blocks.size(2) == 8 && blocks.size(3) == 32 && blocks.is_contiguous() &&
                  blocks.scalar_type() == at::kChar && N > 0 && blocks.size(0) == (N + 7) / 8 &&
                  blocks.size(1) == (K + 31) / 32,
              "weight must be contiguous int8 blocks [ceil(N / 8), ceil(K / 32), 8, 32] (xattn.kernels.int8_blocks) "
              "for x's last dimension");
  TORCH_CHECK(scale.numel() == N && scale.scalar_type() == at::kFloat, "scale must be float32 [N]");
  TORCH_CHECK(!bias.has_value() || bias->numel() == N, "bias must have N elements");
  return run(x, blocks, N, K, scale.data_ptr<float>(), bias);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(xattn_kernels, m) {
  m.def("matvec(Tensor x, Tensor panels, int n, Tensor? bias) -> Tensor");
  m.def("matvec_int8(Tensor x, Tensor blocks, int n, Tensor scale, Tensor? bias) -> Tensor");
}

TORCH_LIBRARY_IMPL(xattn_kernels, CPU, m) {
  m.impl("matvec", &matvec);
  m.impl("matvec_int8", &matvec_int8);
}
