// A timeline of the training step for `zoffload train --trace`: spans on named tracks (compute,
// the gradient worker, the optimizer, NVMe reads and writes, ...), written as Chrome trace JSON
// that Perfetto and chrome://tracing open. Process-wide; thread-safe. Off by default and cheap when
// off (one relaxed atomic load per span); when on, at most the capacity given to start() spans are
// kept (the rest are counted as dropped), so memory is bounded.
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <functional>
#include <string>
#include <string_view>
#include <vector>

namespace zo::trace {

// One track per stream of work. Spans on one track never partly overlap: each track is written
// from one thread at a time, or (NVMe, device copies) as the busy periods of a resource.
enum class Track : uint8_t {
  kStep,           // the training thread: one span per Trainer::step call
  kCompute,        // the training thread: forward, recompute and backward of each block
  kFetch,          // the training thread waiting for a block's parameters (NVMe reads, H2D copies)
  kGradOffload,    // the training thread handing a block's gradients off (D2H into the landing ring)
  kGradWorker,     // the gradient worker: accumulating a parameter's gradient
  kOptimizer,      // the optimizer's thread: each sub-group's update
  kNvmeRead,       // the I/O engine with reads outstanding
  kNvmeWrite,      // the I/O engine with writes outstanding
  kCheckpoint,     // saving a checkpoint
  kCollective,     // the training thread in a collective across ranks (data parallel)
  kGather,         // the parameter gatherer's thread: each block gathered from its owners (stage 3 ranks)
  kCopyH2D,        // the device copying host → device (its copy streams' busy periods, as the device ran them)
  kCopyD2H,        // the device copying device → host
  kDeviceCompute,  // the device running a block's forward or backward, as it ran it (on a GPU, not when queued)
  kCount
};
std::string_view track_name(Track t);

namespace detail {
extern std::atomic<bool> g_on;
}

// Whether spans are being recorded now.
inline bool on() { return detail::g_on.load(std::memory_order_relaxed); }

// Starts recording (again), keeping at most `max_spans` spans in all; resume() and pause() switch
// recording on and off without losing what was kept (--trace-steps records only some steps).
void start(uint64_t max_spans);
void pause();
void resume();

inline int64_t now_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

// Records a finished span [start_ns, end_ns) (steady clock) when recording is on.
void record(Track track, std::string name, int64_t start_ns, int64_t end_ns);
// Records a span learned after the fact (a GPU's timing events), whose work was queued while
// recording was on: it is kept even if recording has been paused since, unless start() was never
// called.
void record_late(Track track, std::string name, int64_t start_ns, int64_t end_ns);

// A producer that learns its spans' times after the fact registers a function that records what
// has completed by now (with record_late); to_chrome_json() calls every registered one first.
// The registration lasts as long as the hook; the function may be called from any thread.
class FlushHook {
 public:
  explicit FlushHook(std::function<void()> flush);
  ~FlushHook();
  FlushHook(const FlushHook&) = delete;
  FlushHook& operator=(const FlushHook&) = delete;

 private:
  uint64_t id_;
};

// As record_late, for a busy period named "<items> <what>, <bytes>" (`what` a string literal):
// the name is built when the trace is written, so that the call allocates nothing on the calling
// thread while the trace's reserve lasts (Note [Spans without allocation] in trace.cpp).
void record_period(Track track, const char* what, uint64_t items, uint64_t bytes, int64_t start_ns, int64_t end_ns);

// The busy periods of a resource that several queues feed (the I/O engine's reads, the emulated
// device's copies in one direction): one span from the moment its first item starts until none is
// outstanding, named "<items> <what>, <bytes>", so spans on its track never partly overlap.
// Records with record_period while the trace records. Not thread-safe: the caller serialises
// begin and end.
class BusyTrack {
 public:
  BusyTrack(Track track, const char* what) : track_(track), what_(what) {}
  // An item of `bytes` is outstanding from now. Whether it was counted: only while recording is
  // on, and only a counted item may end().
  bool begin(uint64_t bytes);
  // A counted item is no longer outstanding; the period's span is recorded after its last one.
  void end();

 private:
  Track track_;
  const char* what_;
  uint64_t active_ = 0;
  uint64_t items_ = 0;
  uint64_t bytes_ = 0;
  int64_t since_ns_ = 0;
};

// The spans kept so far as Chrome trace JSON ({"traceEvents": [...]}, microseconds from the first
// span, one thread per track, named), with the number dropped for lack of room in its metadata.
std::string to_chrome_json();
// The spans kept so far (after the flush hooks have run), in the order they were recorded.
struct Recorded {
  Track track;
  std::string name;
  int64_t start_ns;
  int64_t end_ns;
  // record_period's, until the name is built from them.
  const char* what = nullptr;
  uint64_t items = 0;
  uint64_t bytes = 0;
};
std::vector<Recorded> snapshot();
uint64_t spans_kept();
uint64_t spans_dropped();

// A span from construction to destruction. `name` is built only when recording is on.
class Span {
 public:
  template <class NameFn>
  Span(Track track, NameFn&& name) : track_(track) {
    if (on()) {
      name_ = name();
      start_ns_ = now_ns();
    }
  }
  Span(Track track, const char* name) : Span(track, [name] { return std::string(name); }) {}
  ~Span() {
    if (start_ns_ >= 0) record(track_, std::move(name_), start_ns_, now_ns());
  }
  Span(const Span&) = delete;
  Span& operator=(const Span&) = delete;

 private:
  Track track_;
  int64_t start_ns_ = -1;
  std::string name_;
};

}  // namespace zo::trace
