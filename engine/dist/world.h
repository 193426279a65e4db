// The rank this process is and how many there are, read from the launchers' standard environment
// (torchrun, Open MPI, MPICH/Intel MPI, srun) with the rendezvous address of c10d's TCPStore.
// Plain values and a pure function of an environment; thread-safe.
#pragma once

#include <cstdint>
#include <functional>
#include <optional>
#include <string>

#include "common/status.h"

namespace zo::engine::dist {

struct WorldInfo {
  uint32_t rank = 0;
  uint32_t world_size = 1;
  uint32_t local_rank = 0;  // the rank among this node's processes (device index with one GPU each)
  uint32_t local_world_size = 1;
  std::string launcher;      // "torchrun", "Open MPI", "MPICH/Intel MPI", "srun"; empty for one process
  std::string master_addr;   // the TCPStore's host (MASTER_ADDR)
  uint16_t master_port = 0;  // and port (MASTER_PORT)
  // torchrun's agent already hosts the TCPStore at master_addr:master_port
  // (TORCHELASTIC_USE_AGENT_STORE=True): rank 0 joins it as a client instead of serving one.
  bool agent_store = false;
  std::string store_prefix;  // keys of this run in that store (restarts of torchrun get new ones)

  bool distributed() const { return world_size > 1; }
  // "rank 1 of 2 (torchrun)"
  std::string describe() const;
};

// Reads a variable; std::nullopt when unset. Tests pass their own.
using EnvLookup = std::function<std::optional<std::string>(const std::string& name)>;
EnvLookup process_env();

// Note [Launchers]: the first launcher whose world-size variable is set decides — WORLD_SIZE/RANK/
// LOCAL_RANK (torchrun), OMPI_COMM_WORLD_SIZE/RANK/LOCAL_RANK (mpirun of Open MPI), PMI_SIZE/
// PMI_RANK (MPICH, Intel MPI), SLURM_STEP_NUM_TASKS/SLURM_PROCID/SLURM_LOCALID (srun). With no such
// variable, or a world size of 1, this is one process (no rendezvous). Several processes need
// MASTER_ADDR and MASTER_PORT (torchrun sets them; with mpirun and srun the user exports them).
// kInvalidArgument naming the variable and its launcher for a value that is not a count, a rank
// not below the world size, or a missing/bad MASTER_ADDR/MASTER_PORT.
Result<WorldInfo> world_from_env(const EnvLookup& env = process_env());

// Note [One GPU per rank]: the engine computes on the first GPU it sees, so each rank of a node
// must see its own. Given CUDA_VISIBLE_DEVICES (nullopt: unset), returns the value this rank sets
// before anything initialises CUDA: the local_rank-th entry of the list (local_rank itself when
// unset), or nullopt to leave it as it is — one process, or a launcher that already gave each
// process one GPU (a single entry). kInvalidArgument when the list has fewer entries than this
// node's ranks need, naming both.
Result<std::optional<std::string>> visible_device_for_rank(const WorldInfo& world,
                                                           const std::optional<std::string>& cuda_visible_devices);

}  // namespace zo::engine::dist
