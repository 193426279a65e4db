// The torch baseline of `zoffload-bench merge`, defined in bench_merge_torch.cpp (built only with
// LibTorch; this header includes none). Not thread-safe: it sets torch's global thread count.
#pragma once

#include <cstdint>

#include "common/status.h"

namespace zo::tools::detail {

// W += s · (B @ A) as a PyTorch user merges a LoRA adapter by hand (PEFT's delta added in place):
// `W.addmm_(B, A, /*beta=*/1, /*alpha=*/s)` over fp32 tensors viewing the caller's buffers (W [out,
// in], A [r, in], B [out, r]) on `threads` threads (0: torch's default). Seconds it took.
Result<double> torch_merge(float* w, const float* a, const float* b, uint64_t out, uint64_t in, uint64_t r, float s,
                           int threads);

}  // namespace zo::tools::detail
