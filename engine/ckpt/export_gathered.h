// The end-of-training export of a run whose compute copies are partitioned over its ranks (ZeRO
// stage 3 across ranks): a collective, every rank calls it (Note [Exporting gathered parameters]).
// The ranks' collectives come in as functions, so this folder needs no process group. No LibTorch.
#pragma once

#include <cstdint>
#include <functional>
#include <optional>
#include <string>

#include "common/status.h"
#include "engine/ckpt/export.h"
#include "engine/memory/state_store.h"
#include "io/io_engine.h"

namespace zo::engine {

// This rank's place among the ranks, and the two collectives the export needs (blocking, the same
// sequence on every rank; the process group's).
struct ExportCollective {
  uint32_t rank = 0;
  uint32_t world_size = 1;
  // root's n_bytes at data onto every rank.
  std::function<Status(void* data, uint64_t n_bytes, uint32_t root, const std::string& what)> broadcast;
  // Every rank says whether it failed; the lowest rank that did, or nullopt, on every rank (Note [One
  // outcome for every rank] in engine/dist/data_parallel.h).
  std::function<Result<std::optional<uint32_t>>(bool failed_here, const std::string& what)> first_failed_rank;
};

// Writes the model as export_store does, on rank 0, from the compute copies of every rank's
// partition of `store` (each read is gathered from the owners of its pieces), in the compute dtype
// only: kFailedPrecondition for another dtype or when some rank's store is torn. Every rank returns
// the export's success or failure (kAborted naming the rank whose part failed).
Result<ExportResult> export_gathered(StateStore& store, const std::string& model_config_json, io::IoEngine& io,
                                     const ExportCollective& ranks, const ExportOptions& options);

}  // namespace zo::engine
