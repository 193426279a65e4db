// ProcessGroup: this run's ranks joined through LibTorch's c10d — the TCPStore rendezvous at
// MASTER_ADDR:MASTER_PORT and a ProcessGroupGloo over TCP — and the few collectives the trainer
// uses. Blocking calls, on host memory. Not thread-safe: one thread issues the collectives, in the
// same order on every rank. The process must ignore SIGPIPE (as Python does), or a peer that dies
// mid-send kills it instead of failing the collective. This header includes no LibTorch header.
#pragma once

#include <chrono>
#include <cstdint>
#include <memory>
#include <span>
#include <string>

#include "common/dtype.h"
#include "common/status.h"
#include "engine/dist/world.h"

namespace zo::engine::dist {

class ProcessGroup {
 public:
  // Joins the rendezvous (rank 0 serves the TCPStore unless torchrun's agent does) and connects
  // every pair of ranks. `timeout` bounds the rendezvous and every later collective: a rank that
  // has not arrived within it fails the call. kUnavailable naming the address on failure.
  static Result<std::unique_ptr<ProcessGroup>> create(const WorldInfo& world, std::chrono::milliseconds timeout);
  // Another group of the same ranks, over the same rendezvous, with its own connections and its own
  // order of collectives: for a second thread that issues collectives beside the first (the
  // stage-3 parameter gatherer). Every rank calls it with the same `name`, at the same point of
  // this group's sequence (it connects the ranks). kUnavailable on failure, as create.
  Result<std::unique_ptr<ProcessGroup>> create_sibling(const std::string& name);
  ~ProcessGroup();
  ProcessGroup(const ProcessGroup&) = delete;
  ProcessGroup& operator=(const ProcessGroup&) = delete;

  const WorldInfo& world() const;
  uint32_t rank() const { return world().rank; }
  uint32_t world_size() const { return world().world_size; }

  // In place, on every rank: data = Σ over ranks of data (n_elems of `dtype`, summed in that
  // dtype; every rank ends with the same bits). `what` names the call in errors.
  // Note [A rank that fails]: when a collective fails — a peer's connection closed (it died) or
  // the timeout passed (it stalled) — the surviving ranks check in with the store for a few
  // seconds, and the error names the ranks that did not: "rank 1 of 2 did not respond (died or
  // stalled): ...". kAborted.
  Status all_reduce_sum(void* data, uint64_t n_elems, DType dtype, const std::string& what);
  Status all_reduce_sum(std::span<double> values, const std::string& what);
  // In place: on `root`, data = Σ over ranks of data, summed in `dtype` (with two ranks the same
  // bits as all_reduce_sum); on the other ranks data is left unspecified (used as scratch).
  Status reduce_sum(void* data, uint64_t n_elems, DType dtype, uint32_t root, const std::string& what);
  // In place: every rank's n_bytes at data become root's.
  Status broadcast(void* data, uint64_t n_bytes, uint32_t root, const std::string& what);
  // Every rank has reached this call.
  Status barrier(const std::string& what);

  // A collective of this group has failed (Note [A rank that fails]): the ranks are no longer all
  // connected, and every later collective would fail too, after waiting for the timeout again.
  // Asked by the thread that issues the collectives.
  bool broken() const;

  // Payload bytes this rank has passed to collectives, and the wall time spent in them.
  uint64_t bytes() const;
  double seconds() const;

  struct Impl;

 private:
  explicit ProcessGroup(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace zo::engine::dist
