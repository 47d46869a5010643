// Argument checks shared by the ops: every tensor an op reads through a raw pointer is checked for device, dtype,
// shape and contiguity before anything is read or written, so that a wrong argument is a one-line RuntimeError
// naming it (what was expected, what came) rather than a read or write past a buffer. The name is passed as pieces,
// joined only when a check fails: a decode step checks a few tensors per projection and should build no strings.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <string>
#include <vector>

namespace xattn {

inline const char* dtype_name(at::ScalarType dtype) {
  switch (dtype) {
    case at::kFloat: return "float32";
    case at::kDouble: return "float64";
    case at::kHalf: return "float16";
    case at::kBFloat16: return "bfloat16";
    case at::kChar: return "int8";
    case at::kByte: return "uint8";
    case at::kInt: return "int32";
    case at::kLong: return "int64";
    case at::kBool: return "bool";
    default: return c10::toString(dtype);
  }
}

// "float32 [2, 3]", with " non-contiguous" and " on cuda:0" where they apply
inline std::string describe(const at::Tensor& t) {
  if (!t.defined()) return "an undefined tensor";
  return c10::str(dtype_name(t.scalar_type()), " ", t.sizes(), t.is_contiguous() ? "" : " non-contiguous",
                  t.device().is_cpu() ? "" : " on " + t.device().str());
}

// t is a CPU tensor of this dtype with `dim` dimensions (any dim if dim < 0), contiguous where asked.
template <typename... Name>
void check_kind(const at::Tensor& t, at::ScalarType dtype, int64_t dim, bool contiguous, const Name&... name) {
  TORCH_CHECK(t.defined() && t.device().is_cpu() && t.scalar_type() == dtype && (dim < 0 || t.dim() == dim) &&
                  (!contiguous || t.is_contiguous()),
              name..., ": expected a ", contiguous ? "contiguous " : "", "CPU ", dtype_name(dtype), " tensor",
              dim < 0 ? "" : c10::str(" with ", dim, " dimensions"), ", got ", describe(t));
}

// t is a contiguous CPU tensor of exactly this dtype and shape.
template <typename... Name>
void check_tensor(const at::Tensor& t, at::ScalarType dtype, at::IntArrayRef shape, const Name&... name) {
  TORCH_CHECK(t.defined() && t.device().is_cpu() && t.scalar_type() == dtype && t.sizes().equals(shape) &&
                  t.is_contiguous(),
              name..., ": expected a contiguous CPU ", dtype_name(dtype), " ", shape, " tensor, got ", describe(t));
}

// A decode cache's self K/V [L, B, H, T_max, hd] (keys a 5-d CPU tensor, checked by the caller): a whole cache or a
// range of its rows [start, stop), a view whose layers and rows are strided; each (layer, row, head)'s positions must
// be contiguous, and values must be laid out as keys are.
inline void check_cache(const at::Tensor& keys, const at::Tensor& values) {
  const int64_t B = keys.size(1), H = keys.size(2), T = keys.size(3), hd = keys.size(4);
  TORCH_CHECK(keys.stride(4) == 1 && keys.stride(3) == hd && keys.stride(2) >= T * hd &&
                  keys.stride(1) >= H * keys.stride(2) && keys.stride(0) >= B * keys.stride(1),
              "keys [L, B, H, T_max, hd]: expected a contiguous cache or a range of its rows, got ", describe(keys),
              " with strides ", keys.strides());
  TORCH_CHECK(values.defined() && values.device().is_cpu() && values.scalar_type() == keys.scalar_type() &&
                  values.sizes().equals(keys.sizes()) && values.strides().equals(keys.strides()),
              "values (keys' shape): expected a CPU ", dtype_name(keys.scalar_type()), " ", keys.sizes(),
              " tensor with keys' strides, got ", describe(values));
}

// fp32 weight [N, K] as panels [ceil(N / 16), K, 16] (xattn.kernels.panels)
inline std::vector<int64_t> panels_shape(int64_t N, int64_t K) { return {(N + 15) / 16, K, 16}; }

// int8 weight [N, K] as blocks [ceil(N / 8), ceil(K / 32), 8, 32] (xattn.kernels.int8_blocks)
inline std::vector<int64_t> blocks_shape(int64_t N, int64_t K) { return {(N + 7) / 8, (K + 31) / 32, 8, 32}; }

// t is the weight of an [N, K] product in the layout of `dtype` (float32 panels or int8 blocks).
template <typename... Name>
void check_weight(const at::Tensor& t, at::ScalarType dtype, int64_t N, int64_t K, const Name&... name) {
  const bool int8 = dtype == at::kChar;
  const std::vector<int64_t> shape = int8 ? blocks_shape(N, K) : panels_shape(N, K);
  TORCH_CHECK(t.defined() && t.device().is_cpu() && t.scalar_type() == dtype && t.sizes().equals(shape) &&
                  t.is_contiguous(),
              name..., ": expected contiguous CPU ", int8 ? "int8 blocks " : "float32 panels ", at::IntArrayRef(shape),
              " (xattn.kernels.", int8 ? "int8_blocks" : "panels", ") of an [N=", N, ", K=", K, "] weight, got ",
              describe(t));
}

// An optional [N] float32 bias.
template <typename... Name>
void check_bias(const c10::optional<at::Tensor>& bias, int64_t N, const Name&... name) {
  if (bias.has_value()) check_tensor(*bias, at::kFloat, {N}, name...);
}

}  // namespace xattn
