#include "tools/bench_merge_torch.h"

#include <torch/torch.h>

#include "common/timer.h"

namespace zo::tools::detail {

Result<double> torch_merge(float* w, const float* a, const float* b, uint64_t out, uint64_t in, uint64_t r, float s,
                           int threads) {
  if (threads > 0) torch::set_num_threads(threads);
  const auto f32 = torch::TensorOptions().dtype(torch::kFloat32);
  const auto o = static_cast<int64_t>(out), i = static_cast<int64_t>(in), k = static_cast<int64_t>(r);
  try {
    torch::Tensor W = torch::from_blob(w, {o, i}, f32);
    const torch::Tensor A = torch::from_blob(const_cast<float*>(a), {k, i}, f32);
    const torch::Tensor B = torch::from_blob(const_cast<float*>(b), {o, k}, f32);
    Stopwatch t;
    W.addmm_(B, A, /*beta=*/1, /*alpha=*/s);
    return t.elapsed_s();
  } catch (const std::exception& e) { return internal_error(std::string("torch addmm_: ") + e.what()); }
}

}  // namespace zo::tools::detail
