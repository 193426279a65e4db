#include "cpu_optim/executor.h"

#include <hwloc.h>
#include <oneapi/tbb/blocked_range.h>
#include <oneapi/tbb/info.h>
#include <oneapi/tbb/parallel_for.h>
#include <oneapi/tbb/partitioner.h>
#include <oneapi/tbb/task_arena.h>
#include <oneapi/tbb/task_scheduler_observer.h>

#include <algorithm>
#include <atomic>
#include <string>

#include "common/log.h"

namespace zo::cpu_optim {
namespace {

// Pins each thread that enters the arena to one core, chosen by its arena slot, and puts its
// previous binding back when it leaves (the caller's own thread also takes a slot while it waits in
// for_each_tile, and must not stay pinned afterwards).
class CoreBinder final : public tbb::task_scheduler_observer {
 public:
  CoreBinder(tbb::task_arena& arena, hwloc_topology_t topology)
      : tbb::task_scheduler_observer(arena),
        topology_(topology),
        n_cores_(hwloc_get_nbobjs_by_type(topology, HWLOC_OBJ_CORE)) {}

  void on_scheduler_entry(bool) override {
    const int slot = tbb::this_task_arena::current_thread_index();
    if (slot < 0 || n_cores_ <= 0) return;
    hwloc_obj_t core = hwloc_get_obj_by_type(topology_, HWLOC_OBJ_CORE, static_cast<unsigned>(slot % n_cores_));
    if (core == nullptr) return;
    if (saved_ == nullptr) saved_ = hwloc_bitmap_alloc();
    if (hwloc_get_cpubind(topology_, saved_, HWLOC_CPUBIND_THREAD) != 0) hwloc_bitmap_fill(saved_);
    if (hwloc_set_cpubind(topology_, core->cpuset, HWLOC_CPUBIND_THREAD) != 0 && !warned_.exchange(true))
      ZO_LOG(kWarn) << "cpu_optim: hwloc could not bind a thread to core " << slot % n_cores_ << "; running unbound";
  }
  void on_scheduler_exit(bool) override {
    if (saved_ != nullptr) hwloc_set_cpubind(topology_, saved_, HWLOC_CPUBIND_THREAD);
  }

 private:
  hwloc_topology_t topology_;
  int n_cores_;
  std::atomic<bool> warned_{false};
  static thread_local hwloc_bitmap_t saved_;
};

thread_local hwloc_bitmap_t CoreBinder::saved_ = nullptr;

}  // namespace

struct Executor::Impl {
  int n_threads = 1;
  Isa isa = Isa::kScalar;
  std::unique_ptr<tbb::task_arena> arena;
  hwloc_topology_t topology = nullptr;
  std::unique_ptr<CoreBinder> binder;

  ~Impl() {
    if (binder) binder->observe(false);
    binder.reset();
    arena.reset();
    if (topology != nullptr) hwloc_topology_destroy(topology);
  }
};

Executor::Executor(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
Executor::~Executor() = default;

Result<std::unique_ptr<Executor>> Executor::create(const ExecutorOptions& options) {
  if (options.n_threads < 0)
    return invalid_argument("cpu_optim: thread count must be ≥ 0 (0 = all), got " + std::to_string(options.n_threads));
  const Isa isa = options.isa == Isa::kAuto ? best_isa() : options.isa;
  if (!isa_supported(isa))
    return unavailable(
        "cpu_optim: the " + std::string(isa_name(isa)) +
        " path is not supported by this CPU or build (best available: " + std::string(isa_name(best_isa())) + ")");
  auto impl = std::make_unique<Impl>();
  impl->isa = isa;
  impl->n_threads = options.n_threads > 0 ? options.n_threads : std::max(1, tbb::info::default_concurrency());
  impl->arena = std::make_unique<tbb::task_arena>(impl->n_threads);
  if (options.bind_cores) {
    if (hwloc_topology_init(&impl->topology) != 0 || hwloc_topology_load(impl->topology) != 0) {
      if (impl->topology != nullptr) hwloc_topology_destroy(impl->topology);
      impl->topology = nullptr;
      return unavailable("cpu_optim: hwloc could not load the machine topology, so cores cannot be bound");
    }
    const int n_cores = hwloc_get_nbobjs_by_type(impl->topology, HWLOC_OBJ_CORE);
    if (n_cores <= 0) return unavailable("cpu_optim: hwloc reports no cores, so threads cannot be bound");
    if (impl->n_threads > n_cores)
      ZO_LOG(kWarn) << "cpu_optim: " << impl->n_threads << " threads bound onto " << n_cores
                    << " cores: some cores run two";
    impl->arena->initialize();
    impl->binder = std::make_unique<CoreBinder>(*impl->arena, impl->topology);
    impl->binder->observe(true);
  }
  return std::unique_ptr<Executor>(new Executor(std::move(impl)));
}

int Executor::n_threads() const { return impl_->n_threads; }
Isa Executor::isa() const { return impl_->isa; }
bool Executor::cores_bound() const { return impl_->binder != nullptr; }

std::string Executor::describe() const {
  std::string s = std::string(isa_name(impl_->isa)) + ", " + std::to_string(impl_->n_threads) +
                  (impl_->n_threads == 1 ? " thread" : " threads");
  if (cores_bound()) s += ", bound to cores";
  return s;
}

void Executor::for_each_tile(size_t n_elems, const std::function<void(size_t, size_t)>& fn) const {
  const size_t n_tiles = (n_elems + kTileElems - 1) / kTileElems;
  if (n_tiles == 0) return;
  auto run_tiles = [&](size_t first, size_t last) {
    for (size_t t = first; t < last; ++t) fn(t * kTileElems, std::min(n_elems, (t + 1) * kTileElems));
  };
  if (n_tiles == 1 || (impl_->n_threads == 1 && impl_->binder == nullptr)) {
    run_tiles(0, n_tiles);
    return;
  }
  impl_->arena->execute([&] {
    tbb::parallel_for(
        tbb::blocked_range<size_t>(0, n_tiles),
        [&](const tbb::blocked_range<size_t>& r) { run_tiles(r.begin(), r.end()); }, tbb::static_partitioner());
  });
}

}  // namespace zo::cpu_optim
