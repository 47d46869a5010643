// A bfloat16 cross-attention K/V projection's output written into the cache's heads: xattn_kernels::cross_heads.
//
// The projection gives [n, S, 2D] in bfloat16; the cache keeps keys and values as [n, H, S, hd] (float16 for the int8
// format's fused step, else float32). In torch that is a widening copy, the bias added, and a strided copy into each
// of keys and values: in the in-flight server these passes took more than twice the product's time. Here each
// (row, position) is read once and its heads written with the bias added in fp32, then rounded once to the cache's
// dtype (float16 to nearest even through F16C, as torch converts): the same values as torch's passes.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "bf16.h"
#include "checks.h"

namespace {

template <typename T>
void write_heads(const uint16_t* kv, const float* bias, int64_t n, int64_t S, int64_t H, int64_t hd, T* keys,
                 T* values) {
  const int64_t D = H * hd;
  at::parallel_for(0, n * S, 16, [&](int64_t begin, int64_t end) {
    for (int64_t row = begin; row < end; ++row) {
      const int64_t b = row / S, s = row % S;
      for (int64_t half = 0; half < 2; ++half) {
        T* base = half == 0 ? keys : values;
        for (int64_t h = 0; h < H; ++h) {
          const int64_t column = half * D + h * hd;
          xattn::add_bias(kv + row * 2 * D + column, bias + column, hd, base + ((b * H + h) * S + s) * hd);
        }
      }
    }
  });
}

// keys, values [n, H, S, hd] (float16 or float32, contiguous) = heads of kv [n, S, 2D] (bfloat16) + bias [2D]:
// keys from columns [0, D), values from [D, 2D), head h from columns h * hd.
void cross_heads(const at::Tensor& kv, const at::Tensor& bias, const at::Tensor& keys, const at::Tensor& values) {
  xattn::check_kind(kv, at::kBFloat16, 3, true, "kv [n, S, 2D]");
  TORCH_CHECK(keys.defined() && keys.device().is_cpu() && keys.dim() == 4 && keys.is_contiguous() &&
                  (keys.scalar_type() == at::kHalf || keys.scalar_type() == at::kFloat),
              "keys [n, H, S, hd]: expected a contiguous CPU float16 or float32 tensor with 4 dimensions, got ",
              xattn::describe(keys));
  const int64_t n = keys.size(0), H = keys.size(1), S = keys.size(2), hd = keys.size(3);
  xattn::check_tensor(values, keys.scalar_type(), keys.sizes(), "values (keys' shape and dtype)");
  xattn::check_tensor(kv, at::kBFloat16, {n, S, 2 * H * hd}, "kv [n, S, 2D] (n, S, H, hd from keys)");
  xattn::check_tensor(bias, at::kFloat, {2 * H * hd}, "bias [2D]");
  const uint16_t* in = xattn::bf16_data(kv);
  if (keys.scalar_type() == at::kHalf)
    write_heads(in, bias.data_ptr<float>(), n, S, H, hd, keys.data_ptr<at::Half>(), values.data_ptr<at::Half>());
  else
    write_heads(in, bias.data_ptr<float>(), n, S, H, hd, keys.data_ptr<float>(), values.data_ptr<float>());
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(xattn_kernels, m) {
  m.def("cross_heads(Tensor kv, Tensor bias, Tensor(a!) keys, Tensor(b!) values) -> ()");
}

TORCH_LIBRARY_IMPL(xattn_kernels, CPU, m) { m.impl("cross_heads", &cross_heads); }
