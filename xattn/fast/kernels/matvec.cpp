// The products of products.h as torch ops: xattn_kernels::matvec (fp32 weights as panels [ceil(N / 16), K, 16]),
// matvec_rows (fp32 weights as they are, [N, K] in rows) and matvec_int8 (int8 weights as blocks [ceil(N / 8), ceil(K / 32), 8, 32], one scale per row), for the projections a
// decode step runs one at a time.

#include <ATen/ATen.h>
#include <torch/library.h>

#include <algorithm>
#include <iterator>
#include <string>
#include <vector>

#include "checks.h"
#include "products.h"

namespace {

at::Tensor run(const at::Tensor& x, const at::Tensor& weight, int64_t N, int64_t K, const float* scale,
               const c10::optional<at::Tensor>& bias) {
  const at::Tensor x2 = x.reshape({-1, K}).contiguous();
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
  shape.back() = N;
  at::Tensor y = at::empty({x2.size(0), N}, x.options());
  const xattn::Weight w{weight.data_ptr(), scale, bias.has_value() ? bias->data_ptr<float>() : nullptr, N, K};
  xattn::product(x2.data_ptr<float>(), x2.size(0), w, y.data_ptr<float>());
  return y.view(shape);
}

// x [..., K] (any strides: it is copied to rows), n > 0 output columns
void check_x(const at::Tensor& x, int64_t N) {
  xattn::check_kind(x, at::kFloat, -1, false, "x");
  TORCH_CHECK(x.dim() >= 1, "x: expected a tensor [..., K], got ", xattn::describe(x));
  TORCH_CHECK(N > 0, "n: expected a positive number of output columns, got ", N);
}

at::Tensor matvec(const at::Tensor& x, const at::Tensor& panels, int64_t N, const c10::optional<at::Tensor>& bias) {
  check_x(x, N);
  const int64_t K = x.size(-1);
  TORCH_CHECK(panels.dim() != 3 || panels.size(1) == K, "x's last dimension (", K, ") must be the weight's K (",
              panels.size(1), ")");
  xattn::check_weight(panels, at::kFloat, N, K, "weight");
  xattn::check_bias(bias, N, "bias");
  return run(x, panels, N, K, nullptr, bias);
}

at::Tensor matvec_rows(const at::Tensor& x, const at::Tensor& weight, const c10::optional<at::Tensor>& bias) {
  xattn::check_kind(weight, at::kFloat, 2, true, "weight");
  const int64_t N = weight.size(0), K = weight.size(1);
  check_x(x, N);
  TORCH_CHECK(x.size(-1) == K, "x's last dimension (", x.size(-1), ") must be the weight's K (", K, ")");
  xattn::check_bias(bias, N, "bias");
  const at::Tensor x2 = x.reshape({-1, K}).contiguous();
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
  shape.back() = N;
  at::Tensor y = at::empty({x2.size(0), N}, x.options());
  xattn::product_rows_fp32(x2.data_ptr<float>(), x2.size(0), weight.data_ptr<float>(), N, K,
                           bias.has_value() ? bias->data_ptr<float>() : nullptr, y.data_ptr<float>());
  return y.view(shape);
}

at::Tensor matvec_int8(const at::Tensor& x, const at::Tensor& blocks, int64_t N, const at::Tensor& scale,
                       const c10::optional<at::Tensor>& bias) {
  check_x(x, N);
  const int64_t K = x.size(-1);
  TORCH_CHECK(blocks.dim() != 4 || blocks.size(1) == (K + 31) / 32, "x's last dimension (", K,
              ") does not fit the weight's ", blocks.size(1), " blocks of 32 columns");
  xattn::check_weight(blocks, at::kChar, N, K, "weight");
  xattn::check_tensor(scale, at::kFloat, {N}, "scale");
  xattn::check_bias(bias, N, "bias");
  return run(x, blocks, N, K, scale.data_ptr<float>(), bias);
}

// The int8 kernel products use ("amx", "vnni" or "avx2"), switched to `use` first where given (each only where the
// CPU has it): all give the same results, and tests compare them.
std::string int8_kernel(const c10::optional<std::string>& use) {
  const char* names[] = {"avx2", "vnni", "amx"};
  if (use.has_value()) {
    const auto kernel = std::find(std::begin(names), std::end(names), *use) - std::begin(names);
    TORCH_CHECK(kernel < 3, "use: expected 'avx2', 'vnni' or 'amx', got '", *use, "'");
    TORCH_CHECK(kernel != 1 || xattn::vnni_supported(), "use: this CPU has no AVX-512 VNNI");
    TORCH_CHECK(kernel != 2 || xattn::amx_supported(), "use: this CPU (or its OS) gives no AMX-INT8");
    xattn::int8_kernel().store(static_cast<int>(kernel));
  }
  return names[xattn::int8_kernel().load()];
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(xattn_kernels, m) {
  m.def("matvec(Tensor x, Tensor panels, int n, Tensor? bias) -> Tensor");
  m.def("matvec_rows(Tensor x, Tensor weight, Tensor? bias) -> Tensor");
  m.def("matvec_int8(Tensor x, Tensor blocks, int n, Tensor scale, Tensor? bias) -> Tensor");
  m.def("int8_kernel(str? use) -> str", &int8_kernel);
}

TORCH_LIBRARY_IMPL(xattn_kernels, CPU, m) {
  m.impl("matvec", &matvec);
  m.impl("matvec_rows", &matvec_rows);
  m.impl("matvec_int8", &matvec_int8);
}
