// The accumulator's part of the plan, answered before create(): whether gradients land where they
// are summed, the host buffers it will allocate, its kernels timed; and narrow_in_place, which
// the accumulator and the planner's figures share (grad_accumulator.h).
#include "engine/coord/grad_accumulator.h"

#include <algorithm>
#include <cstring>

#include "common/bytes.h"
#include "cpu_optim/vector_ops.h"
#include "engine/memory/swap_file.h"

namespace zo::engine {

bool gradients_land_in_place(const Placement& placement, bool partitioned, DType transfer_dtype) {
  return placement.no_accumulator && !partitioned && placement.grad_sum_dtype == DType::kF32 &&
         transfer_dtype == DType::kF32;
}

// Chunk k's output lies within the inputs of chunks 0..k, all read into the scratch by then.
Status narrow_in_place(std::byte* data, uint64_t n, DType from, DType to, std::span<std::byte> scratch,
                       const cpu_optim::Executor& executor) {
  const uint64_t fb = dtype_size_bytes(from), tb = dtype_size_bytes(to);
  const uint64_t chunk = scratch.size() / tb;
  if (tb > fb || chunk == 0) return invalid_argument("narrow_in_place: a wider dtype or a scratch under one element");
  for (uint64_t at = 0; at < n; at += chunk) {
    const uint64_t count = std::min(chunk, n - at);
    ZO_RETURN_IF_ERROR(cpu_optim::convert({data + at * fb, from}, {scratch.data(), to}, count, executor));
    std::memcpy(data + at * tb, scratch.data(), count * tb);
  }
  return Status::ok();
}

Status GradAccumulator::measure_kernel(std::byte* acc, DType acc_dtype, const std::byte* grad, DType grad_dtype,
                                       uint64_t n, const cpu_optim::Executor& executor) {
  ZO_RETURN_IF_ERROR(cpu_optim::accumulate({acc, acc_dtype}, {grad, grad_dtype}, n, /*from_zero=*/false, executor));
  return cpu_optim::squared_norm({acc, acc_dtype}, n, executor).status();
}

GradAccumulator::BufferPlan GradAccumulator::plan_buffers(const ParamRegistry& registry, const Placement& placement,
                                                          const std::vector<uint32_t>& contribution_order,
                                                          bool partitioned) {
  BufferPlan out;
  const bool rounded = placement.grads_rounded();
  const bool home_in_ram = placement.grad == Tier::kCpu && !placement.no_accumulator;
  if (home_in_ram && !partitioned && !rounded) return out;  // accumulated in place
  const auto n_groups = static_cast<uint32_t>(registry.sub_groups().size());
  std::vector<uint32_t> pending(n_groups, 0);
  for (uint32_t p : contribution_order) {
    for (const ParamPiece& piece : registry.pieces_of_param(p)) ++pending[piece.sub_group];
  }
  // Simulate one micro-step: a sub-group is open from its first contribution to its last.
  std::vector<char> opened(n_groups, 0);
  uint32_t open_now = 0;
  for (uint32_t p : contribution_order) {
    // As add() does: every sub-group of the param is opened, then those complete are flushed.
    for (const ParamPiece& piece : registry.pieces_of_param(p)) {
      if (!opened[piece.sub_group]) {
        opened[piece.sub_group] = 1;
        out.count = std::max(out.count, ++open_now);
      }
    }
    for (const ParamPiece& piece : registry.pieces_of_param(p)) {
      if (--pending[piece.sub_group] == 0) --open_now;
    }
  }
  // The owner's accumulator, read to add to (rounded sums are never added to: each window is the step's).
  if (partitioned && placement.grad != Tier::kCpu && !rounded) ++out.count;
  out.bytes_each = registry.max_group_elems() * dtype_size_bytes(placement.grad_sum_dtype);
  if (rounded && !home_in_ram)  // Note [Gradients stored in 16 bits]
    out.narrowing_bytes =
        std::min(registry.max_group_elems(), kNarrowChunkElems) * dtype_size_bytes(placement.grad_dtype);
  if (!partitioned && placement.grad == Tier::kNvme) {          // Note [Asynchronous accumulator writes]
    ++out.count;                                                // one write behind the accumulation
    out.bytes_each = align_up(out.bytes_each, kSwapAlignment);  // whole blocks: the region's padded size
  }
  return out;
}

}  // namespace zo::engine
