#include "engine/dist/process_group.h"

#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>
#include <torch/types.h>

#include <c10/util/Logging.h>

#include <algorithm>
#include <cstdlib>
#include <mutex>
#include <thread>
#include <vector>

#include "common/string_util.h"

namespace zo::engine::dist {
namespace {

using Clock = std::chrono::steady_clock;

// How long the survivors of a failed collective wait for each other's check-in.
constexpr auto kCheckInGrace = std::chrono::seconds(5);

at::ScalarType scalar_type(DType d) {
  switch (d) {
    case DType::kF32: return at::kFloat;
    case DType::kBF16: return at::kBFloat16;
    case DType::kF16: return at::kHalf;
  }
  return at::kFloat;
}

std::string first_line(const std::string& s) {
  // c10::Error appends a C++ backtrace after the first line.
  const size_t nl = s.find('\n');
  return nl == std::string::npos ? s : s.substr(0, nl);
}

// The check-in after a failed collective (Note [A rank that fails]) expects the store to be gone when
// rank 0, which serves it, died. c10d logs every failed socket call of the store as a warning with
// its C++ backtrace (some 20 lines), from whichever thread made it, often after this rank's own
// error line has been printed: the user's last lines would be a backtrace instead of which rank
// failed. Those warnings say nothing the error does not, so from the first check-in on only
// c10's errors are logged — unless TORCH_CPP_LOG_LEVEL asks for a level itself.
void quiet_store_warnings() {
  static std::once_flag once;
  std::call_once(once, [] {
    if (std::getenv("TORCH_CPP_LOG_LEVEL") == nullptr)
      FLAGS_caffe2_log_level = std::max(FLAGS_caffe2_log_level, static_cast<int>(c10::GLOG_ERROR));
  });
}

}  // namespace

struct ProcessGroup::Impl {
  WorldInfo world;
  std::chrono::milliseconds timeout{0};
  c10::intrusive_ptr<c10d::Store> store;  // prefixed with world.store_prefix (and a sibling's name)
  c10::intrusive_ptr<c10d::ProcessGroupGloo> gloo;
  uint64_t bytes = 0;
  double seconds = 0;
  uint64_t failures = 0;  // check-in rounds so far (each uses its own keys)

  // Runs one collective; turns a failure into the Note [A rank that fails] error.
  Status run(const std::string& what, uint64_t payload, const std::function<c10::intrusive_ptr<c10d::Work>()>& start) {
    const auto t0 = Clock::now();
    std::string error;
    try {
      c10::intrusive_ptr<c10d::Work> work = start();
      work->wait();
    } catch (const std::exception& e) { error = first_line(e.what()); }
    seconds += std::chrono::duration<double>(Clock::now() - t0).count();
    bytes += payload;
    if (error.empty()) return Status::ok();
    return Status(StatusCode::kAborted, what + ": " + absent_ranks() + ": " + error);
  }

  // In place over n_elems elements of `type` at `data` (host memory).
  Status all_reduce_sum(void* data, uint64_t n_elems, at::ScalarType type, uint64_t elem_bytes,
                        const std::string& what) {
    if (n_elems == 0) return Status::ok();
    return run(what, n_elems * elem_bytes, [&] {
      std::vector<at::Tensor> t{host_tensor(data, n_elems, type)};
      return gloo->allreduce(t);
    });
  }

  static at::Tensor host_tensor(void* data, uint64_t n_elems, at::ScalarType type) {
    return torch::from_blob(data, {static_cast<int64_t>(n_elems)}, torch::TensorOptions().dtype(type));
  }

  // The survivors' check-in after a failed collective: which ranks did not respond.
  std::string absent_ranks() {
    const std::string round = "failed/" + std::to_string(failures++) + "/";
    quiet_store_warnings();
    std::vector<uint32_t> absent;
    try {
      store->set(round + std::to_string(world.rank), std::vector<uint8_t>{1});
      const auto deadline = Clock::now() + kCheckInGrace;
      for (uint32_t r = 0; r < world.world_size; ++r) {
        if (r == world.rank) continue;
        bool seen = false;
        while (!(seen = store->check({round + std::to_string(r)})) && Clock::now() < deadline)
          std::this_thread::sleep_for(std::chrono::milliseconds(50));
        if (!seen) absent.push_back(r);
      }
    } catch (const std::exception&) {
      // Rank 0 serves the store unless torchrun's agent does.
      return world.agent_store
                 ? "the rendezvous store (torchrun's agent) is unreachable"
                 : "rank 0 of " + std::to_string(world.world_size) +
                       " did not respond (died or stalled): the rendezvous store it serves is unreachable";
    }
    if (absent.empty()) return "every rank is still running (a collective failed on the network)";
    std::vector<std::string> names;
    for (uint32_t r : absent) names.push_back(std::to_string(r));
    return std::string(absent.size() == 1 ? "rank " : "ranks ") + join(names, ", ") + " of " +
           std::to_string(world.world_size) + " did not respond (died or stalled)";
  }
};

Result<std::unique_ptr<ProcessGroup>> ProcessGroup::create(const WorldInfo& world, std::chrono::milliseconds timeout) {
  auto impl = std::make_unique<Impl>();
  impl->world = world;
  impl->timeout = timeout;
  const std::string where = world.master_addr + ":" + std::to_string(world.master_port);
  try {
    c10d::TCPStoreOptions so;
    so.port = world.master_port;
    so.isServer = world.rank == 0 && !world.agent_store;
    so.numWorkers = world.agent_store ? std::nullopt : std::optional<std::size_t>(world.world_size);
    so.waitWorkers = !world.agent_store;
    so.timeout = timeout;
    auto tcp = c10::make_intrusive<c10d::TCPStore>(world.master_addr, so);
    impl->store = c10::make_intrusive<c10d::PrefixStore>(world.store_prefix, tcp);
  } catch (const std::exception& e) {
    return Status(StatusCode::kUnavailable,
                  world.describe() + ": the rendezvous at " + where +
                      (world.rank == 0 && !world.agent_store ? " (served by this rank)" : "") +
                      " failed: " + first_line(e.what()));
  }
  try {
    auto options = c10d::ProcessGroupGloo::Options::create_default(timeout);
    impl->gloo = c10::make_intrusive<c10d::ProcessGroupGloo>(
        c10::make_intrusive<c10d::PrefixStore>("gloo/", impl->store), static_cast<int>(world.rank),
        static_cast<int>(world.world_size), options);
  } catch (const std::exception& e) {
    return Status(StatusCode::kUnavailable, world.describe() + ": connecting the ranks (Gloo over TCP, rendezvous " +
                                                where + ") failed: " + first_line(e.what()));
  }
  return std::unique_ptr<ProcessGroup>(new ProcessGroup(std::move(impl)));
}

Result<std::unique_ptr<ProcessGroup>> ProcessGroup::create_sibling(const std::string& name) {
  auto impl = std::make_unique<Impl>();
  impl->world = impl_->world;
  impl->timeout = impl_->timeout;
  // Its own keys: the Gloo rendezvous and the check-ins of Note [A rank that fails].
  impl->store = c10::make_intrusive<c10d::PrefixStore>(name + "/", impl_->store);
  try {
    auto options = c10d::ProcessGroupGloo::Options::create_default(impl->timeout);
    impl->gloo = c10::make_intrusive<c10d::ProcessGroupGloo>(
        c10::make_intrusive<c10d::PrefixStore>("gloo/", impl->store), static_cast<int>(impl->world.rank),
        static_cast<int>(impl->world.world_size), options);
  } catch (const std::exception& e) {
    return Status(StatusCode::kUnavailable, impl->world.describe() + ": connecting the ranks for " + name +
                                                " (Gloo over TCP) failed: " + first_line(e.what()));
  }
  return std::unique_ptr<ProcessGroup>(new ProcessGroup(std::move(impl)));
}

ProcessGroup::ProcessGroup(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
ProcessGroup::~ProcessGroup() = default;

const WorldInfo& ProcessGroup::world() const { return impl_->world; }
bool ProcessGroup::broken() const { return impl_->failures > 0; }

uint64_t ProcessGroup::bytes() const { return impl_->bytes; }
double ProcessGroup::seconds() const { return impl_->seconds; }

Status ProcessGroup::all_reduce_sum(void* data, uint64_t n_elems, DType dtype, const std::string& what) {
  return impl_->all_reduce_sum(data, n_elems, scalar_type(dtype), dtype_size_bytes(dtype), what);
}

Status ProcessGroup::all_reduce_sum(std::span<double> values, const std::string& what) {
  return impl_->all_reduce_sum(values.data(), values.size(), at::kDouble, sizeof(double), what);
}

Status ProcessGroup::reduce_sum(void* data, uint64_t n_elems, DType dtype, uint32_t root, const std::string& what) {
  if (n_elems == 0) return Status::ok();
  return impl_->run(what, n_elems * dtype_size_bytes(dtype), [&] {
    std::vector<at::Tensor> t{Impl::host_tensor(data, n_elems, scalar_type(dtype))};
    c10d::ReduceOptions options;
    options.rootRank = static_cast<int64_t>(root);
    options.reduceOp = c10d::ReduceOp::SUM;
    return impl_->gloo->reduce(t, options);
  });
}

Status ProcessGroup::broadcast(void* data, uint64_t n_bytes, uint32_t root, const std::string& what) {
  if (n_bytes == 0) return Status::ok();
  return impl_->run(what, n_bytes, [&] {
    std::vector<at::Tensor> t{Impl::host_tensor(data, n_bytes, at::kByte)};
    c10d::BroadcastOptions options;
    options.rootRank = static_cast<int64_t>(root);
    return impl_->gloo->broadcast(t, options);
  });
}

Status ProcessGroup::barrier(const std::string& what) {
  return impl_->run(what, 0, [&] { return impl_->gloo->barrier(); });
}

}  // namespace zo::engine::dist
