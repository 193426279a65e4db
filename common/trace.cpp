#include "common/trace.h"

#include <algorithm>
#include <map>
#include <mutex>
#include <vector>

#include "common/bytes.h"

namespace zo::trace {
namespace detail {
std::atomic<bool> g_on{false};
}

namespace {

struct State {
  std::mutex mu;
  std::vector<Recorded> spans;
  uint64_t capacity = 0;
  uint64_t dropped = 0;
  bool started = false;
};

// The FlushHooks, under their own mutex: a flush records spans, which takes State::mu.
struct Hooks {
  std::mutex mu;
  std::map<uint64_t, std::function<void()>> fns;
  uint64_t next_id = 0;
};

Hooks& hooks() {
  static Hooks h;
  return h;
}

State& state() {
  static State s;
  return s;
}

// JSON string contents: quotes, backslashes and control characters escaped.
void append_escaped(std::string* out, std::string_view s) {
  for (char c : s) {
    if (c == '"' || c == '\\') {
      out->push_back('\\');
      out->push_back(c);
    } else if (static_cast<unsigned char>(c) < 0x20) {
      char buf[8];
      std::snprintf(buf, sizeof buf, "\\u%04x", static_cast<unsigned>(c));
      *out += buf;
    } else {
      out->push_back(c);
    }
  }
}

}  // namespace

std::string_view track_name(Track t) {
  switch (t) {
    case Track::kStep: return "step";
    case Track::kCompute: return "compute";
    case Track::kFetch: return "fetch wait (NVMe, H2D)";
    case Track::kGradOffload: return "gradient offload (D2H)";
    case Track::kGradWorker: return "gradient worker";
    case Track::kOptimizer: return "optimizer";
    case Track::kNvmeRead: return "NVMe reads";
    case Track::kNvmeWrite: return "NVMe writes";
    case Track::kCheckpoint: return "checkpoint";
    case Track::kCollective: return "collectives";
    case Track::kGather: return "parameter gatherer";
    case Track::kCopyH2D: return "H2D copies (device)";
    case Track::kCopyD2H: return "D2H copies (device)";
    case Track::kDeviceCompute: return "compute (device)";
    case Track::kCount: break;
  }
  return "?";
}

void start(uint64_t max_spans) {
  State& s = state();
  {
    std::lock_guard<std::mutex> lock(s.mu);
    s.spans.clear();
    s.spans.reserve(std::min<uint64_t>(max_spans, 1u << 16));
    s.capacity = max_spans;
    s.dropped = 0;
    s.started = true;
  }
  detail::g_on.store(true, std::memory_order_relaxed);
}

void pause() { detail::g_on.store(false, std::memory_order_relaxed); }
void resume() { detail::g_on.store(true, std::memory_order_relaxed); }

void record(Track track, std::string name, int64_t start_ns, int64_t end_ns) {
  if (!on()) return;
  record_late(track, std::move(name), start_ns, end_ns);
}

namespace {

void keep(Recorded r) {
  State& s = state();
  std::lock_guard<std::mutex> lock(s.mu);
  if (!s.started) return;
  if (s.spans.size() >= s.capacity) {
    ++s.dropped;
    return;
  }
  r.end_ns = std::max(r.start_ns, r.end_ns);
  s.spans.push_back(std::move(r));
}

// Note [Spans without allocation]: the I/O engine's threads and the emulated device's stream
// threads allocate nothing of their own, so glibc never gives them a heap (an arena). A span name
// built on them did, and with the trainer's 1 GiB trim threshold (Note [Host compute]) each such
// heap, once other threads' allocations landed in it, kept up to a GiB of freed memory: the 1.1B
// bench peaked at 11.2 GB with the trace against 9.1 GB without, and at 9.2 GB with the trace and
// MALLOC_ARENA_MAX=1. Busy periods therefore keep their parts and are named when written; the
// spans' vector is reserved at start (up to 65,536 spans).
std::string period_name(const Recorded& r) {
  return std::to_string(r.items) + " " + r.what + ", " + format_bytes(r.bytes);
}

}  // namespace

void record_late(Track track, std::string name, int64_t start_ns, int64_t end_ns) {
  keep({track, std::move(name), start_ns, end_ns});
}

void record_period(Track track, const char* what, uint64_t items, uint64_t bytes, int64_t start_ns, int64_t end_ns) {
  keep({.track = track, .start_ns = start_ns, .end_ns = end_ns, .what = what, .items = items, .bytes = bytes});
}

uint64_t spans_kept() {
  std::lock_guard<std::mutex> lock(state().mu);
  return state().spans.size();
}

uint64_t spans_dropped() {
  std::lock_guard<std::mutex> lock(state().mu);
  return state().dropped;
}

FlushHook::FlushHook(std::function<void()> flush) {
  Hooks& h = hooks();
  std::lock_guard<std::mutex> lock(h.mu);
  id_ = h.next_id++;
  h.fns.emplace(id_, std::move(flush));
}

FlushHook::~FlushHook() {
  Hooks& h = hooks();
  std::lock_guard<std::mutex> lock(h.mu);
  h.fns.erase(id_);
}

bool BusyTrack::begin(uint64_t bytes) {
  if (!on()) return false;
  if (active_++ == 0) {
    since_ns_ = now_ns();
    items_ = 0;
    bytes_ = 0;
  }
  ++items_;
  bytes_ += bytes;
  return true;
}

void BusyTrack::end() {
  if (--active_ == 0 && on()) record_period(track_, what_, items_, bytes_, since_ns_, now_ns());
}

namespace {

void run_flush_hooks() {
  // Held while flushing, so that a hook is not destroyed in the middle of its call.
  Hooks& h = hooks();
  std::lock_guard<std::mutex> lock(h.mu);
  for (auto& [id, flush] : h.fns) flush();
}

}  // namespace

std::vector<Recorded> snapshot() {
  run_flush_hooks();
  std::vector<Recorded> out;
  {
    std::lock_guard<std::mutex> lock(state().mu);
    out = state().spans;
  }
  for (Recorded& r : out)
    if (r.what != nullptr) r.name = period_name(r);
  return out;
}

std::string to_chrome_json() {
  run_flush_hooks();
  State& s = state();
  std::lock_guard<std::mutex> lock(s.mu);
  int64_t t0 = INT64_MAX;
  for (const Recorded& r : s.spans) t0 = std::min(t0, r.start_ns);
  std::string out = "{\"displayTimeUnit\":\"ms\",\"otherData\":{\"spans_dropped\":" + std::to_string(s.dropped) +
                    "},\"traceEvents\":[\n";
  bool first = true;
  auto sep = [&] {
    if (!first) out += ",\n";
    first = false;
  };
  sep();
  out += R"({"ph":"M","name":"process_name","pid":1,"tid":0,"args":{"name":"zoffload train"}})";
  for (int t = 0; t < static_cast<int>(Track::kCount); ++t) {
    sep();
    out += R"({"ph":"M","name":"thread_name","pid":1,"tid":)" + std::to_string(t + 1) + R"(,"args":{"name":")";
    append_escaped(&out, track_name(static_cast<Track>(t)));
    out += "\"}}";
    sep();
    out += R"({"ph":"M","name":"thread_sort_index","pid":1,"tid":)" + std::to_string(t + 1) +
           R"(,"args":{"sort_index":)" + std::to_string(t) + "}}";
  }
  // Spans in start order (a longer one first when two start together), so that a viewer nests them.
  std::vector<const Recorded*> order;
  order.reserve(s.spans.size());
  for (const Recorded& r : s.spans) order.push_back(&r);
  std::stable_sort(order.begin(), order.end(), [](const Recorded* a, const Recorded* b) {
    return a->start_ns != b->start_ns ? a->start_ns < b->start_ns : a->end_ns > b->end_ns;
  });
  char buf[96];
  for (const Recorded* r : order) {
    sep();
    out += R"({"ph":"X","pid":1,"tid":)" + std::to_string(static_cast<int>(r->track) + 1) + R"(,"name":")";
    append_escaped(&out, r->what != nullptr ? period_name(*r) : r->name);
    // Microseconds with nanosecond digits: spans stay exact and never overlap by rounding.
    std::snprintf(buf, sizeof buf, R"(","ts":%.3f,"dur":%.3f})", static_cast<double>(r->start_ns - t0) / 1e3,
                  static_cast<double>(r->end_ns - r->start_ns) / 1e3);
    out += buf;
  }
  out += "\n]}\n";
  return out;
}

}  // namespace zo::trace
