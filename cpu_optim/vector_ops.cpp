#include "cpu_optim/vector_ops.h"

#include <string>
#include <vector>

#include "cpu_optim/detail/kernels.h"

namespace zo::cpu_optim {
namespace {

const detail::KernelTable& table_for(const Executor& executor) {
  const detail::KernelTable* table = detail::kernel_table(executor.isa());
  ZO_CHECK(table != nullptr) << "executor ISA " << isa_name(executor.isa()) << " has no kernels";
  return *table;
}

}  // namespace

Status convert(ConstElemSpan src, ElemSpan dst, size_t n_elems, const Executor& executor) {
  if (n_elems == 0) return Status::ok();
  if (src.data == nullptr || dst.data == nullptr)
    return invalid_argument("convert: null source or destination for " + std::to_string(n_elems) + " elements");
  const auto kernel = table_for(executor).convert;
  executor.for_each_tile(n_elems, [&](size_t b, size_t e) { kernel(src.data, src.dtype, dst.data, dst.dtype, b, e); });
  return Status::ok();
}

Status accumulate(ElemSpan acc, ConstElemSpan grad, size_t n_elems, bool from_zero, const Executor& executor) {
  if (n_elems == 0) return Status::ok();
  if (acc.data == nullptr || grad.data == nullptr)
    return invalid_argument("accumulate: null accumulator or gradient for " + std::to_string(n_elems) + " elements");
  const auto kernel = table_for(executor).accumulate;
  executor.for_each_tile(
      n_elems, [&](size_t b, size_t e) { kernel(acc.data, acc.dtype, grad.data, grad.dtype, from_zero, b, e); });
  return Status::ok();
}

// Note [Deterministic squared norm]: each tile's sum is formed in 16 double lanes (element i of the
// tile in lane i % 16; x*x is exact in double, so each lane only rounds its adds, in element order),
// the lanes are reduced by a fixed tree, and tile sums are added in tile order on this thread. Tile
// boundaries are fixed (kTileElems), so the result depends on neither the thread count nor the ISA.
Result<double> squared_norm(ConstElemSpan grad, size_t n_elems, const Executor& executor) {
  if (n_elems == 0) return 0.0;
  if (grad.data == nullptr)
    return invalid_argument("squared_norm: null gradient for " + std::to_string(n_elems) + " elements");
  const auto kernel = table_for(executor).squared_norm;
  std::vector<double> partial((n_elems + kTileElems - 1) / kTileElems);
  executor.for_each_tile(n_elems,
                         [&](size_t b, size_t e) { partial[b / kTileElems] = kernel(grad.data, grad.dtype, b, e); });
  double sum = 0.0;
  for (double p : partial) sum += p;
  return sum;
}

void fill(std::span<float> data, float value, const Executor& executor) {
  const auto kernel = table_for(executor).fill;
  executor.for_each_tile(data.size(), [&](size_t b, size_t e) { kernel(data.data(), value, b, e); });
}

Status stream_triad(std::span<float> a, std::span<const float> b, std::span<const float> c, float scalar,
                    const Executor& executor) {
  if (b.size() != a.size() || c.size() != a.size())
    return invalid_argument("stream_triad: sizes differ (" + std::to_string(a.size()) + ", " +
                            std::to_string(b.size()) + ", " + std::to_string(c.size()) + ")");
  const auto kernel = table_for(executor).triad;
  executor.for_each_tile(a.size(), [&](size_t lo, size_t hi) { kernel(a.data(), b.data(), c.data(), scalar, lo, hi); });
  return Status::ok();
}

Result<double> roofline_pass(std::span<float* const> rw, ConstElemSpan ro, size_t n_elems, const Executor& executor) {
  if (rw.size() > detail::kMaxRooflineRw)
    return invalid_argument("roofline_pass: " + std::to_string(rw.size()) + " written streams (at most " +
                            std::to_string(detail::kMaxRooflineRw) + ")");
  if (n_elems == 0) return 0.0;
  if (ro.data == nullptr) return invalid_argument("roofline_pass: null read stream");
  for (float* p : rw)
    if (p == nullptr) return invalid_argument("roofline_pass: null written stream");
  const auto kernel = table_for(executor).roofline;
  std::vector<double> partial((n_elems + kTileElems - 1) / kTileElems);
  executor.for_each_tile(n_elems, [&](size_t b, size_t e) {
    partial[b / kTileElems] = kernel(rw.data(), rw.size(), ro.data, ro.dtype, b, e);
  });
  double sum = 0.0;
  for (double p : partial) sum += p;
  return sum;
}

}  // namespace zo::cpu_optim
