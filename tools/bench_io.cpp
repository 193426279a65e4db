// zoffload-bench io: sweeps backend × block size × queue depth × threads on a preallocated file,
// checks the data first, times whole-file passes (warm-up excluded, nothing dropped), measures a
// plain one-thread pread/pwrite loop as the baseline in the same run, prints a table (or --json)
// and the best settings, and can write them as the "aio" block of a config (--emit-config).
#include <CLI/CLI.hpp>
#include <fcntl.h>
#include <linux/magic.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/vfs.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <csignal>
#include <cstdio>
#include <cstring>
#include <memory>
#include <mutex>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "common/aligned_buffer.h"
#include "common/bytes.h"
#include "common/host_memory.h"
#include "common/log.h"
#include "common/timer.h"
#include "io/env.h"
#include "io/io_engine.h"
#include "tools/bench_util.h"
#include "tools/commands.h"
#include "tools/bench_io_config.h"

namespace zo::tools {
namespace {

using io::Backend;
using io::File;
using io::IoEngine;
using io::IoOp;
using io::IoOptions;
using io::IoRequest;

struct IoArgs {
  std::string path;
  std::string size = "1GiB";
  std::string backend = "auto";
  std::string block_sizes = "128K,1M";
  std::string queue_depths = "8,32";
  std::string threads = "1";
  std::string direct = "on";
  std::string mode = "both";
  int runs = 1;
  bool json = false;
  bool keep = false;
  bool reuse = false;
  bool no_baseline = false;
  std::string emit_config;
};

// The settings of a sweep after parsing the command line.
struct Plan {
  std::string dir;
  uint64_t size_bytes = 0;
  std::vector<Backend> backends;
  std::vector<uint64_t> block_sizes;
  std::vector<uint32_t> queue_depths;
  std::vector<uint32_t> threads;
  bool direct = true;
  bool do_write = true;
  bool do_read = true;
  int runs = 1;
};

struct IoRow {
  IoOptions options;
  std::vector<double> write_gbps, read_gbps;  // one per run
  std::vector<double> write_cpu, read_cpu;    // process CPU time / wall time, percent, one per run
};

// The data file is removed on every exit path, including Ctrl-C.
char g_data_path[4096];
void on_signal(int sig) {
  if (g_data_path[0] != '\0') ::unlink(g_data_path);
  std::signal(sig, SIG_DFL);
  std::raise(sig);
}

Result<Plan> make_plan(const IoArgs& a) {
  Plan p;
  p.dir = a.path;
  struct stat st {};
  if (::stat(a.path.c_str(), &st) != 0 || !S_ISDIR(st.st_mode))
    return invalid_argument("--path " + a.path + " is not an existing directory");
  ZO_ASSIGN_OR_RETURN(p.size_bytes, parse_size_bytes(a.size));
  if (a.backend == "all") {
    p.backends = {Backend::kUring, Backend::kAio, Backend::kPsync};
  } else {
    ZO_ASSIGN_OR_RETURN(auto backends, parse_list<Backend>("--backend", a.backend, io::parse_backend));
    p.backends = backends;
  }
  ZO_ASSIGN_OR_RETURN(p.block_sizes, parse_list<uint64_t>("--block-size", a.block_sizes, parse_size_bytes));
  ZO_ASSIGN_OR_RETURN(auto qds, parse_list<uint64_t>("--queue-depth", a.queue_depths, parse_count));
  ZO_ASSIGN_OR_RETURN(auto ths, parse_list<uint64_t>("--threads", a.threads, parse_count));
  for (uint64_t q : qds) p.queue_depths.push_back(static_cast<uint32_t>(std::min<uint64_t>(q, UINT32_MAX)));
  for (uint64_t t : ths) p.threads.push_back(static_cast<uint32_t>(std::min<uint64_t>(t, UINT32_MAX)));
  for (uint64_t bs : p.block_sizes)
    for (uint32_t q : p.queue_depths)
      for (uint32_t t : p.threads) {
        IoOptions o;
        o.block_size_bytes = bs;
        o.queue_depth = q;
        o.threads = t;
        if (Status s = o.validate(); !s.is_ok())
          return invalid_argument("--block-size/--queue-depth/--threads: " + s.message());
      }
  if (a.direct == "on") p.direct = true;
  else if (a.direct == "off") p.direct = false;
  else return invalid_argument("--direct must be on or off, not '" + a.direct + "'");
  if (a.mode == "read") p.do_write = false;
  else if (a.mode == "write") p.do_read = false;
  else if (a.mode != "both") return invalid_argument("--mode must be read, write or both, not '" + a.mode + "'");
  if (a.runs < 1 || a.runs > 100) return invalid_argument("--runs must be in 1..100");
  p.runs = a.runs;
  const uint64_t max_bs = *std::max_element(p.block_sizes.begin(), p.block_sizes.end());
  p.size_bytes = p.size_bytes / max_bs * max_bs;
  if (p.size_bytes == 0) return invalid_argument("--size " + a.size + " is smaller than the largest block size");
  if (a.reuse && !a.keep) return invalid_argument("--reuse needs --keep (it reuses the kept data file)");
  if (!a.emit_config.empty()) ZO_RETURN_IF_ERROR(check_emit_config_target(a.emit_config));
  return p;
}

// Prints a live percentage of the current pass on a terminal (stderr), from the engine's counters.
class Progress {
 public:
  explicit Progress(bool enabled) : enabled_(enabled) {
    if (enabled_) thread_ = std::thread([this] { loop(); });
  }
  ~Progress() {
    {
      std::lock_guard<std::mutex> lock(mu_);
      stop_ = true;
    }
    cv_.notify_all();
    if (thread_.joinable()) thread_.join();
  }
  void begin(std::string label, const IoEngine* engine, uint64_t total_bytes) {
    std::lock_guard<std::mutex> lock(mu_);
    label_ = std::move(label);
    engine_ = engine;
    total_ = total_bytes;
    const io::IoStats s = engine->stats();
    base_ = s.bytes_read + s.bytes_written;
  }
  void end() {
    std::lock_guard<std::mutex> lock(mu_);
    if (engine_ != nullptr && shown_) std::fprintf(stderr, "\r\033[K");
    engine_ = nullptr;
    shown_ = false;
  }

 private:
  void loop() {
    std::unique_lock<std::mutex> lock(mu_);
    while (!stop_) {
      cv_.wait_for(lock, std::chrono::milliseconds(250));
      if (stop_ || engine_ == nullptr) continue;
      const io::IoStats s = engine_->stats();
      const double pct =
          100.0 * static_cast<double>(s.bytes_read + s.bytes_written - base_) / static_cast<double>(total_);
      std::fprintf(stderr, "\r\033[K  %s %5.1f%%", label_.c_str(), std::min(pct, 100.0));
      shown_ = true;
    }
  }

  bool enabled_;
  std::mutex mu_;
  std::condition_variable cv_;
  bool stop_ = false;
  bool shown_ = false;
  std::string label_;
  const IoEngine* engine_ = nullptr;
  uint64_t total_ = 1, base_ = 0;
  std::thread thread_;
};

// Fast deterministic bytes for the file contents.
void fill_random(std::span<std::byte> out, uint64_t seed) {
  uint64_t x = seed * 0x9E3779B97F4A7C15ull + 1;
  auto* w = reinterpret_cast<uint64_t*>(out.data());
  for (size_t i = 0; i < out.size() / 8; ++i) {
    x ^= x << 13;
    x ^= x >> 7;
    x ^= x << 17;
    w[i] = x;
  }
}

// Bytes in flight at most, capped: every block-size request of a pass uses the window cyclically.
uint64_t window_bytes(const IoOptions& o) {
  const uint64_t want = o.block_size_bytes * o.queue_depth * o.threads;
  const uint64_t cap = std::max<uint64_t>(256 * kMiB, o.block_size_bytes);
  return std::min(want, cap) / o.block_size_bytes * o.block_size_bytes;
}

double cpu_seconds() {
  rusage ru{};
  ::getrusage(RUSAGE_SELF, &ru);
  return static_cast<double>(ru.ru_utime.tv_sec + ru.ru_stime.tv_sec) +
         static_cast<double>(ru.ru_utime.tv_usec + ru.ru_stime.tv_usec) / 1e6;
}

// One pass over [0, bytes) of the file in block-size requests, all under one ticket. Returns GB/s;
// `cpu_pct`, if given, receives the process's CPU time over the pass as a percentage of wall time.
Result<double> pass(IoEngine& engine, File& file, IoOp op, uint64_t bytes, std::byte* window, uint64_t window_size,
                    bool timed_sync, Progress* progress, const std::string& label, double* cpu_pct = nullptr) {
  const uint64_t bs = engine.options().block_size_bytes;
  std::vector<IoRequest> reqs;
  reqs.reserve(bytes / bs + 1);
  for (uint64_t off = 0; off < bytes; off += bs)
    reqs.push_back(IoRequest{op, &file, off, window + (off % window_size), std::min(bs, bytes - off)});
  if (!file.direct() && op == IoOp::kRead) {
    // Buffered reads would come from the page cache; drop the file's pages first.
    ZO_RETURN_IF_ERROR(file.sync());
    ::posix_fadvise(file.fd(), 0, 0, POSIX_FADV_DONTNEED);
  }
  if (progress) progress->begin(label, &engine, bytes);
  const double cpu0 = cpu_seconds();
  Stopwatch sw;
  auto ticket = engine.submit(reqs);
  if (!ticket.is_ok()) return ticket.status();
  Status s = engine.wait(*ticket);
  if (s.is_ok() && timed_sync && op == IoOp::kWrite && !file.direct()) s = file.sync();
  const double elapsed = sw.elapsed_s();
  if (cpu_pct) *cpu_pct = 100.0 * (cpu_seconds() - cpu0) / elapsed;
  if (progress) progress->end();
  ZO_RETURN_IF_ERROR(s);
  return static_cast<double>(bytes) / elapsed / 1e9;
}

// The baseline: one thread, one request at a time, plain pread/pwrite of `bs` bytes.
Result<double> baseline_pass(File& file, IoOp op, uint64_t bytes, uint64_t bs, std::byte* buf) {
  if (!file.direct() && op == IoOp::kRead) {
    ZO_RETURN_IF_ERROR(file.sync());
    ::posix_fadvise(file.fd(), 0, 0, POSIX_FADV_DONTNEED);
  }
  Stopwatch sw;
  for (uint64_t off = 0; off < bytes; off += bs) {
    uint64_t done = 0;
    const uint64_t len = std::min(bs, bytes - off);
    while (done < len) {
      const ssize_t n = op == IoOp::kRead ? ::pread(file.fd(), buf + done, len - done, static_cast<off_t>(off + done))
                                          : ::pwrite(file.fd(), buf + done, len - done, static_cast<off_t>(off + done));
      if (n < 0 && (errno == EINTR || errno == EAGAIN)) continue;
      if (n < 0)
        return errno_status(std::string(io::op_name(op)) + " " + file.path() + " offset " + std::to_string(off + done),
                            errno);
      if (n == 0) return io_error(file.path() + ": unexpected end of file at offset " + std::to_string(off + done), 0);
      done += static_cast<uint64_t>(n);
    }
  }
  if (op == IoOp::kWrite && !file.direct()) ZO_RETURN_IF_ERROR(file.sync());
  return static_cast<double>(bytes) / sw.elapsed_s() / 1e9;
}

// Writes a distinct pattern with the engine, reads it back with the engine and with plain pread,
// and compares all three.
Status check_correctness(IoEngine& engine, File& file, uint64_t size_bytes, uint64_t seed) {
  const uint64_t bs = engine.options().block_size_bytes;
  const uint64_t n = std::min<uint64_t>(size_bytes, std::max<uint64_t>(16 * kMiB, bs * 4) / bs * bs);
  ZO_ASSIGN_OR_RETURN(AlignedBuffer src, AlignedBuffer::allocate(n));
  ZO_ASSIGN_OR_RETURN(AlignedBuffer back, AlignedBuffer::allocate(n));
  fill_random(src.bytes(), seed);
  ZO_RETURN_IF_ERROR(engine.write(file, 0, src.bytes()));
  ZO_RETURN_IF_ERROR(engine.read(file, 0, back.bytes()));
  if (std::memcmp(src.data(), back.data(), n) != 0)
    return corruption(std::string(io::backend_name(engine.backend())) + ": data read back differs from data written");
  std::memset(back.data(), 0, n);
  const int fd = ::open(file.path().c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return errno_status("open " + file.path(), errno);
  uint64_t done = 0;
  while (done < n) {
    const ssize_t r = ::pread(fd, back.data() + done, n - done, static_cast<off_t>(done));
    if (r <= 0) {
      ::close(fd);
      return errno_status("pread " + file.path(), r < 0 ? errno : EIO);
    }
    done += static_cast<uint64_t>(r);
  }
  ::close(fd);
  if (std::memcmp(src.data(), back.data(), n) != 0)
    return corruption(std::string(io::backend_name(engine.backend())) + ": file contents differ from data written");
  return Status::ok();
}

std::string fmt(double gbps) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.3f", gbps);
  return buf;
}

double score(const IoRow& r, const Plan& p) {
  if (p.do_read && p.do_write) return (median(r.read_gbps) + median(r.write_gbps)) / 2;
  return p.do_read ? median(r.read_gbps) : median(r.write_gbps);
}

int run_io_bench(const IoArgs& args) {
  const BenchError usage{"io", 2}, failure{"io", 1};
  auto plan_or = make_plan(args);
  if (!plan_or.is_ok()) return usage(plan_or.status().message());
  const Plan& plan = *plan_or;
  auto fail = [&failure](const Status& s) { return failure(s.to_string()); };

  // Resolve backends: "auto" once; unavailable ones in a list of several are skipped and said so.
  std::vector<Backend> backends;
  nlohmann::ordered_json skipped = nlohmann::ordered_json::array();
  for (Backend b : plan.backends) {
    IoOptions probe;
    probe.backend = b;
    auto e = IoEngine::create(probe);
    if (!e.is_ok()) {
      if (plan.backends.size() == 1 || args.backend != "all") return fail(e.status());
      std::fprintf(stderr, "zoffload-bench io: skipping %s: %s\n", std::string(io::backend_name(b)).c_str(),
                   e.status().message().c_str());
      skipped.push_back({{"backend", io::backend_name(b)}, {"reason", e.status().message()}});
      continue;
    }
    if (b == Backend::kAuto && !(*e)->fallback_reason().empty())
      std::fprintf(stderr, "zoffload-bench io: auto chose %s because %s\n",
                   std::string(io::backend_name((*e)->backend())).c_str(), (*e)->fallback_reason().c_str());
    if (std::find(backends.begin(), backends.end(), (*e)->backend()) == backends.end())
      backends.push_back((*e)->backend());
  }

  const std::string data_path =
      plan.dir + "/zoffload-bench-io" + (args.keep ? std::string() : "." + std::to_string(::getpid())) + ".dat";
  std::snprintf(g_data_path, sizeof g_data_path, "%s", args.keep ? "" : data_path.c_str());
  std::signal(SIGINT, on_signal);
  std::signal(SIGTERM, on_signal);
  std::signal(SIGHUP, on_signal);
  std::signal(SIGPIPE, on_signal);
  struct Cleanup {
    std::string path;
    bool keep;
    ~Cleanup() {
      if (!keep) ::unlink(path.c_str());
      g_data_path[0] = '\0';
    }
  } cleanup{data_path, args.keep};

  // --reuse: a kept file that already holds at least --size bytes was filled by an earlier run.
  struct stat existing {};
  const bool reuse = args.reuse && ::stat(data_path.c_str(), &existing) == 0 &&
                     static_cast<uint64_t>(existing.st_size) >= plan.size_bytes;
  auto file_or = io::Env::posix()->open_file(data_path, io::OpenMode::kCreate, plan.direct);
  if (!file_or.is_ok()) return fail(file_or.status());
  File& file = *file_or;
  if (plan.direct && !file.direct())
    std::fprintf(stderr, "zoffload-bench io: note: %s is buffered: %s\n", data_path.c_str(),
                 file.buffered_reason().c_str());
  if (struct statfs sf{}; ::fstatfs(file.fd(), &sf) == 0 && (sf.f_type == TMPFS_MAGIC || sf.f_type == RAMFS_MAGIC))
    std::fprintf(stderr,
                 "zoffload-bench io: warning: %s is on tmpfs/ramfs: these numbers are memory copies, not a drive\n",
                 plan.dir.c_str());
  if (Status s = file.preallocate(plan.size_bytes); !s.is_ok()) return fail(s);

  const bool tty = ::isatty(STDERR_FILENO) == 1;
  Progress progress(tty);
  Stopwatch total_time;

  // Fill the file with data so reads hit the device (ext4 returns zeros for unwritten extents
  // without reading anything), then check each backend writes and reads back correctly.
  if (!reuse) {
    IoOptions o;
    o.backend = backends.front();
    o.queue_depth = 32;
    o.direct = plan.direct;
    auto e = IoEngine::create(o);
    if (!e.is_ok()) return fail(e.status());
    auto window = AlignedBuffer::allocate(64 * kMiB);
    if (!window.is_ok()) return fail(window.status());
    fill_random(window->bytes(), 42);
    std::fprintf(stderr, "zoffload-bench io: filling %s (%s)\n", data_path.c_str(),
                 format_bytes(plan.size_bytes).c_str());
    auto r = pass(**e, file, IoOp::kWrite, plan.size_bytes, window->data(), window->size(), true, &progress, "fill");
    if (!r.is_ok()) return fail(r.status());
  }
  for (size_t i = 0; i < backends.size(); ++i) {
    IoOptions o;
    o.backend = backends[i];
    o.block_size_bytes = plan.block_sizes.front();
    o.queue_depth = plan.queue_depths.front();
    o.threads = plan.threads.front();
    auto e = IoEngine::create(o);
    if (!e.is_ok()) return fail(e.status());
    if (Status s = check_correctness(**e, file, plan.size_bytes, 1000 + i); !s.is_ok()) return fail(s);
  }

  // Baseline: a plain one-thread QD1 pread/pwrite loop at the first block size.
  const uint64_t base_bs = plan.block_sizes.front();
  auto base_buf = AlignedBuffer::allocate(base_bs);
  if (!base_buf.is_ok()) return fail(base_buf.status());
  fill_random(base_buf->bytes(), 7);
  std::vector<double> base_write, base_read;
  for (int r = 0; r < (args.no_baseline ? 0 : plan.runs); ++r) {
    if (plan.do_write) {
      auto g = baseline_pass(file, IoOp::kWrite, plan.size_bytes, base_bs, base_buf->data());
      if (!g.is_ok()) return fail(g.status());
      base_write.push_back(*g);
    }
    if (plan.do_read) {
      auto g = baseline_pass(file, IoOp::kRead, plan.size_bytes, base_bs, base_buf->data());
      if (!g.is_ok()) return fail(g.status());
      base_read.push_back(*g);
    }
  }
  if (!args.no_baseline)
    std::fprintf(stderr, "zoffload-bench io: baseline pread/pwrite 1 thread QD1 %s:%s%s\n",
                 format_bytes(base_bs).c_str(),
                 plan.do_write ? (" write " + fmt(median(base_write)) + " GB/s").c_str() : "",
                 plan.do_read ? (" read " + fmt(median(base_read)) + " GB/s").c_str() : "");

  // The sweep.
  std::vector<IoRow> rows;
  const size_t n_combos = backends.size() * plan.block_sizes.size() * plan.queue_depths.size() * plan.threads.size();
  size_t combo = 0;
  for (Backend b : backends)
    for (uint64_t bs : plan.block_sizes)
      for (uint32_t qd : plan.queue_depths)
        for (uint32_t th : plan.threads) {
          ++combo;
          IoRow row;
          row.options.backend = b;
          row.options.block_size_bytes = bs;
          row.options.queue_depth = qd;
          row.options.threads = th;
          row.options.direct = file.direct();
          auto e = IoEngine::create(row.options);
          if (!e.is_ok()) return fail(e.status());
          IoEngine& engine = **e;
          const uint64_t wsize = window_bytes(row.options);
          auto window = AlignedBuffer::allocate(wsize);
          if (!window.is_ok()) return fail(window.status());
          fill_random(window->bytes(), 11 + combo);
          const std::string label = "[" + std::to_string(combo) + "/" + std::to_string(n_combos) + "] " +
                                    std::string(io::backend_name(b)) + " bs=" + format_bytes(bs) +
                                    " qd=" + std::to_string(qd) + " threads=" + std::to_string(th);
          // Warm-up (not timed): the first pieces of each direction, to start threads and rings.
          const uint64_t warm = std::min(plan.size_bytes, std::max<uint64_t>(wsize, 32 * kMiB) / bs * bs);
          for (IoOp op : {IoOp::kWrite, IoOp::kRead}) {
            if ((op == IoOp::kWrite && !plan.do_write) || (op == IoOp::kRead && !plan.do_read)) continue;
            auto w = pass(engine, file, op, std::max<uint64_t>(warm, bs), window->data(), wsize, true, nullptr, "");
            if (!w.is_ok()) return fail(w.status());
          }
          for (int r = 0; r < plan.runs; ++r) {
            double cpu = 0;
            if (plan.do_write) {
              auto g = pass(engine, file, IoOp::kWrite, plan.size_bytes, window->data(), wsize, true, &progress,
                            label + " write", &cpu);
              if (!g.is_ok()) return fail(g.status());
              row.write_gbps.push_back(*g);
              row.write_cpu.push_back(cpu);
            }
            if (plan.do_read) {
              auto g = pass(engine, file, IoOp::kRead, plan.size_bytes, window->data(), wsize, true, &progress,
                            label + " read", &cpu);
              if (!g.is_ok()) return fail(g.status());
              row.read_gbps.push_back(*g);
              row.read_cpu.push_back(cpu);
            }
          }
          const double elapsed = total_time.elapsed_s();
          std::fprintf(stderr, "%s:%s%s  (%.0f s elapsed, ~%.0f s left)\n", label.c_str(),
                       plan.do_write ? (" write " + fmt(median(row.write_gbps)) + " GB/s").c_str() : "",
                       plan.do_read ? (" read " + fmt(median(row.read_gbps)) + " GB/s").c_str() : "", elapsed,
                       elapsed / static_cast<double>(combo) * static_cast<double>(n_combos - combo));
          rows.push_back(std::move(row));
        }

  const IoRow* best = &rows.front();
  const IoRow* best_write = &rows.front();
  const IoRow* best_read = &rows.front();
  for (const IoRow& r : rows) {
    if (score(r, plan) > score(*best, plan)) best = &r;
    if (median(r.write_gbps) > median(best_write->write_gbps)) best_write = &r;
    if (median(r.read_gbps) > median(best_read->read_gbps)) best_read = &r;
  }

  // The aio block has no backend key; say so when the winner is not what auto would pick.
  Backend auto_backend = Backend::kPsync;
  if (auto e = IoEngine::create(IoOptions{}); e.is_ok()) auto_backend = (*e)->backend();
  const std::string backend_note =
      best->options.backend == auto_backend
          ? std::string()
          : "note: the best backend, " + std::string(io::backend_name(best->options.backend)) +
                ", is not the one auto picks (" + std::string(io::backend_name(auto_backend)) +
                "); DeepSpeed's \"aio\" block has no backend key: set \"zoffload\": {\"io_backend\": \"" +
                std::string(io::backend_name(best->options.backend)) + "\"} to use it";

  auto ratio = [](double v, const std::vector<double>& base) { return base.empty() ? 0.0 : v / median(base); };
  // The buffers above sit on huge pages only where THP allows it (Note [Huge pages for I/O buffers]).
  const std::string thp = transparent_huge_pages_mode();
  if (thp != "always" && thp != "madvise") {
    ZO_LOG(kWarn) << "transparent huge pages are " << thp << ": I/O buffers are on 4 KiB pages, so a large request "
                  << "can reach the drive split in pieces (more than its queue/max_segments); "
                  << "`echo madvise > /sys/kernel/mm/transparent_hugepage/enabled` as root lets zoffload use them";
  }
  if (args.json) {
    nlohmann::ordered_json j;
    j["file"] = data_path;
    j["size_bytes"] = plan.size_bytes;
    j["direct"] = file.direct();
    if (!file.direct() && plan.direct) j["buffered_reason"] = file.buffered_reason();
    j["runs"] = plan.runs;
    j["transparent_huge_pages"] = thp;
    j["unit"] = "GB/s (1e9 bytes per second), median of runs";
    j["baseline"] = {{"what", "pread/pwrite, 1 thread, queue depth 1"}, {"block_size", base_bs}};
    if (plan.do_write && !base_write.empty()) j["baseline"]["write_gbps"] = median(base_write);
    if (plan.do_read && !base_read.empty()) j["baseline"]["read_gbps"] = median(base_read);
    j["skipped"] = skipped;
    auto row_json = [&](const IoRow& r) {
      nlohmann::ordered_json o{{"backend", io::backend_name(r.options.backend)},
                               {"block_size", r.options.block_size_bytes},
                               {"queue_depth", r.options.queue_depth},
                               {"threads", r.options.threads}};
      if (plan.do_write) {
        o["write_gbps"] = median(r.write_gbps);
        o["write_runs_gbps"] = r.write_gbps;
        if (!base_write.empty()) o["write_vs_baseline"] = ratio(median(r.write_gbps), base_write);
        o["write_cpu_pct"] = median(r.write_cpu);
      }
      if (plan.do_read) {
        o["read_gbps"] = median(r.read_gbps);
        o["read_runs_gbps"] = r.read_gbps;
        if (!base_read.empty()) o["read_vs_baseline"] = ratio(median(r.read_gbps), base_read);
        o["read_cpu_pct"] = median(r.read_cpu);
      }
      return o;
    };
    j["results"] = nlohmann::ordered_json::array();
    for (const IoRow& r : rows) j["results"].push_back(row_json(r));
    j["best"] = row_json(*best);
    j["auto_backend"] = io::backend_name(auto_backend);
    j["best"]["aio"] = {{"block_size", best->options.block_size_bytes},
                        {"queue_depth", best->options.queue_depth},
                        {"intra_op_parallelism", best->options.threads},
                        {"single_submit", false},
                        {"overlap_events", true}};
    std::printf("%s\n", j.dump(2).c_str());
  } else {
    std::printf("zoffload-bench io: %s, %s, %s, median of %d run%s, huge pages %s, GB/s = 1e9 bytes/s\n",
                data_path.c_str(), format_bytes(plan.size_bytes).c_str(),
                file.direct() ? ("O_DIRECT (alignment " + std::to_string(file.offset_align()) + ")").c_str()
                              : "buffered (writes include fdatasync; page cache dropped before reads)",
                plan.runs, plan.runs == 1 ? "" : "s", thp.c_str());
    std::printf("%-9s %10s %5s %7s %11s %10s %10s %9s\n", "backend", "block", "QD", "threads", "write GB/s",
                "read GB/s", "write/base", "read/base");
    for (const IoRow& r : rows) {
      std::printf("%-9s %10s %5u %7u %11s %10s %10s %9s\n", std::string(io::backend_name(r.options.backend)).c_str(),
                  format_bytes(r.options.block_size_bytes).c_str(), r.options.queue_depth, r.options.threads,
                  plan.do_write ? fmt(median(r.write_gbps)).c_str() : "-",
                  plan.do_read ? fmt(median(r.read_gbps)).c_str() : "-",
                  plan.do_write && !base_write.empty() ? fmt(ratio(median(r.write_gbps), base_write)).c_str() : "-",
                  plan.do_read && !base_read.empty() ? fmt(ratio(median(r.read_gbps), base_read)).c_str() : "-");
    }
    if (!args.no_baseline)
      std::printf("baseline: pread/pwrite, 1 thread, QD 1, %s blocks:%s%s\n", format_bytes(base_bs).c_str(),
                  plan.do_write ? (" write " + fmt(median(base_write)) + " GB/s").c_str() : "",
                  plan.do_read ? (" read " + fmt(median(base_read)) + " GB/s").c_str() : "");
    if (plan.do_write)
      std::printf("best write: %s  %s GB/s\n", best_write->options.to_string().c_str(),
                  fmt(median(best_write->write_gbps)).c_str());
    if (plan.do_read)
      std::printf("best read:  %s  %s GB/s\n", best_read->options.to_string().c_str(),
                  fmt(median(best_read->read_gbps)).c_str());
    std::printf("best overall (%s): %s\n", plan.do_read && plan.do_write ? "mean of read and write" : "by throughput",
                best->options.to_string().c_str());
    std::printf(
        "as a config: \"aio\": {\"block_size\": %llu, \"queue_depth\": %u, \"intra_op_parallelism\": %u, "
        "\"single_submit\": false, \"overlap_events\": true}\n",
        static_cast<unsigned long long>(best->options.block_size_bytes), best->options.queue_depth,
        best->options.threads);
    if (!backend_note.empty()) std::printf("%s\n", backend_note.c_str());
  }
  if (!args.emit_config.empty()) {
    if (Status s = emit_aio_config(args.emit_config, best->options); !s.is_ok()) return fail(s);
    std::fprintf(stderr, "zoffload-bench io: wrote the best settings to %s (\"aio\" block)\n",
                 args.emit_config.c_str());
    if (!backend_note.empty()) std::fprintf(stderr, "zoffload-bench io: %s\n", backend_note.c_str());
  }
  if (args.keep) std::fprintf(stderr, "zoffload-bench io: kept %s\n", data_path.c_str());
  return 0;
}

}  // namespace

void register_bench_io(CLI::App& app, int* exit_code) {
  auto args = std::make_shared<IoArgs>();
  CLI::App* cmd = app.add_subcommand(
      "io",
      "NVMe/file I/O: sweep backend x block size x queue depth x threads on a preallocated file; "
      "prints GB/s per combination and direction, the best settings, and a QD1 pread/pwrite baseline");
  cmd->add_option("--path", args->path, "directory on the drive to test (a temporary data file is created there)")
      ->required();
  cmd->add_option("--size", args->size, "data file size, e.g. 1GiB, 4GiB")->capture_default_str();
  cmd->add_option("--backend", args->backend, "auto|io_uring|libaio|psync|all, or a comma list")->capture_default_str();
  cmd->add_option("--block-size", args->block_sizes, "comma list of request sizes, e.g. 128K,1M,8M")
      ->capture_default_str();
  cmd->add_option("--queue-depth", args->queue_depths, "comma list of queue depths per thread")->capture_default_str();
  cmd->add_option("--threads", args->threads, "comma list of worker threads (aio.intra_op_parallelism)")
      ->capture_default_str();
  cmd->add_option("--direct", args->direct, "on|off: O_DIRECT (falls back to buffered, with a note, where unsupported)")
      ->capture_default_str();
  cmd->add_option("--mode", args->mode, "read|write|both")->capture_default_str();
  cmd->add_option("--runs", args->runs, "timed passes per combination and direction; the median is reported")
      ->capture_default_str();
  cmd->add_flag("--json", args->json, "print machine-readable results on stdout");
  cmd->add_flag("--keep", args->keep, "keep the data file as DIR/zoffload-bench-io.dat (for tools/fio_compare.sh)");
  cmd->add_flag("--reuse", args->reuse,
                "with --keep: reuse DIR/zoffload-bench-io.dat if an earlier --keep run left at least --size bytes "
                "(skips the fill)");
  cmd->add_flag("--no-baseline", args->no_baseline, "skip the QD1 pread/pwrite baseline");
  cmd->add_option("--emit-config", args->emit_config,
                  "write the best settings as the \"aio\" block of this JSON config (merged, other keys kept)");
  cmd->callback([args, exit_code] { *exit_code = run_io_bench(*args); });
}

}  // namespace zo::tools
