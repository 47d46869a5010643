// Beam reorders of a decode cache's self K/V in one call: xattn_kernels::reorder_rows.
//
// After each beam step, row i of the cache takes the keys and values of row index[i] (the beam it extends). torch's
// index ops do that as a gather and a copy back per layer and tensor (~50 ops a step, each copying every row). Here
// each (layer, row, head)'s valid positions are one memcpy, and only rows whose source is another row are written, in
// an order that writes a row after the rows that read it (a chain 0 -> 1 -> 2 as 2, then 1). A cycle (a swap) has no
// such order: one of its rows is read into a scratch buffer first. So any mapping copies the contents from before the
// call, with one extra copy per cycle.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cstring>
#include <vector>

#include "checks.h"

namespace {

// The moved rows in an order that writes each after every moved row reading it; where only cycles are left, one of
// them gets a scratch slot (its readers read it there) and goes next.
std::vector<int64_t> write_order(const int64_t* source, const std::vector<int64_t>& moved,
                                 std::vector<int64_t>& slot) {
  const auto is_moved = [&](int64_t b) { return source[b] != b; };
  std::vector<int64_t> readers(slot.size(), 0), ready, order;  // readers: moved rows not yet written that read b
  for (const int64_t b : moved)
    if (is_moved(source[b])) ++readers[source[b]];
  for (const int64_t b : moved)
    if (readers[b] == 0) ready.push_back(b);
  std::vector<char> written(slot.size(), 0);
  int64_t saved = 0;
  for (size_t next = 0; order.size() < moved.size();) {
    if (ready.empty()) {  // every row left is on a cycle
      while (written[moved[next]]) ++next;
      slot[moved[next]] = saved++;
      ready.push_back(moved[next]);
    }
    const int64_t b = ready.back();
    ready.pop_back();
    order.push_back(b);
    written[b] = 1;
    const int64_t from = source[b];
    if (is_moved(from) && slot[from] < 0 && --readers[from] == 0) ready.push_back(from);
  }
  return order;
}

// keys/values [L, B, H, T_max, hd] (any dtype; a cache or a range of its rows: positions contiguous, the rest
// strided); index [B] int64, each in [0, B); valid: the positions [0, valid) to move.
void reorder_rows(const at::Tensor& keys, const at::Tensor& values, const at::Tensor& index, int64_t valid) {
  TORCH_CHECK(keys.defined() && keys.device().is_cpu() && keys.dim() == 5,
              "keys [L, B, H, T_max, hd]: expected a CPU tensor with 5 dimensions, got ", xattn::describe(keys));
  const int64_t L = keys.size(0), B = keys.size(1), H = keys.size(2), T = keys.size(3), hd = keys.size(4);
  xattn::check_cache(keys, values);
  TORCH_CHECK(!keys.is_alias_of(values), "keys and values must be separate tensors, not views of one storage");
  xattn::check_kind(index, at::kLong, 1, false, "index");
  TORCH_CHECK(index.size(0) == B, "index: expected one source row per cache row (", B, "), got ",
              xattn::describe(index));
  TORCH_CHECK(valid >= 0 && valid <= T, "valid: expected a number of positions in [0, ", T, "], got ", valid);
  const at::Tensor rows = index.contiguous();
  const int64_t* source = rows.data_ptr<int64_t>();
  std::vector<int64_t> moved;  // rows that take another row's K/V
  for (int64_t b = 0; b < B; ++b) {
    TORCH_CHECK(source[b] >= 0 && source[b] < B, "index[", b, "] = ", source[b], " is outside the ", B,
                " cache rows");
    if (source[b] != b) moved.push_back(b);
  }
  if (moved.empty() || valid == 0 || hd == 0) return;
  std::vector<int64_t> slot(B, -1);  // a cycle's row's place in the scratch buffer, where its reader reads it
  const std::vector<int64_t> order = write_order(source, moved, slot);
  const int64_t saved = std::count_if(slot.begin(), slot.end(), [](int64_t s) { return s >= 0; });

  const int64_t bytes = keys.element_size(), block = valid * hd * bytes;  // one (layer, row, head)'s positions
  const int64_t sL = keys.stride(0) * bytes, sB = keys.stride(1) * bytes, sH = keys.stride(2) * bytes;
  char* const bases[2] = {static_cast<char*>(keys.data_ptr()), static_cast<char*>(values.data_ptr())};
  at::parallel_for(0, 2 * L, 1, [&](int64_t begin, int64_t end) {
    std::vector<char> scratch(saved * H * block);
    for (int64_t task = begin; task < end; ++task) {
      char* layer = bases[task % 2] + (task / 2) * sL;
      for (int64_t b = 0; b < B; ++b)
        if (slot[b] >= 0)
          for (int64_t h = 0; h < H; ++h)
            std::memcpy(scratch.data() + (slot[b] * H + h) * block, layer + b * sB + h * sH, block);
      for (const int64_t b : order) {
        const int64_t from = source[b];
        for (int64_t h = 0; h < H; ++h) {
          const char* read =
              slot[from] >= 0 ? scratch.data() + (slot[from] * H + h) * block : layer + from * sB + h * sH;
          std::memcpy(layer + b * sB + h * sH, read, block);
        }
      }
    }
  });
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(xattn_kernels, m) {
  m.def("reorder_rows(Tensor(a!) keys, Tensor(b!) values, Tensor index, int valid) -> ()");
}

TORCH_LIBRARY_IMPL(xattn_kernels, CPU, m) { m.impl("reorder_rows", &reorder_rows); }
