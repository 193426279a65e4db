// zoffload-bench pcie: host<->device copy speed through zoffload's Device, the path of the engine's
// own copies (parameters up, gradients down), from pinned memory (Device::allocate_pinned, as the
// engine's pinned pool) and from pageable memory, for sizes from 1 MiB to 1 GiB. The baseline is
// torch's copy_ between tensors torch allocated (pinned by its caching host allocator, or
// pageable), timed round by round in the same run. Each path is checked first: a round trip
// host -> device -> host through a poisoned device buffer gives back the host's bytes. Prints
// medians, GB/s and the ratios; --json for scripts.
#include <CLI/CLI.hpp>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <functional>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "common/aligned_buffer.h"
#include "common/bytes.h"
#include "common/status.h"
#include "common/timer.h"
#include "gpu/device.h"
#include "tools/bench_util.h"
#include "tools/commands.h"
#include "zo_build_config.h"
#if ZO_HAVE_TORCH
#include "tools/bench_pcie_torch.h"
#endif

namespace zo::tools {

namespace {

struct PcieArgs {
  std::string device = "auto";
  std::string sizes = "1MiB,4MiB,16MiB,64MiB,256MiB,1GiB";
  std::string sample_bytes = "256MiB";
  int repeats = 5;
  bool no_torch = false;
  bool json = false;
};

constexpr uint64_t kCheckBytes = 64 * kMiB;  // the round trip's size (or the largest size, if smaller)

Result<std::vector<uint64_t>> parse_sizes(const std::string& text) {
  ZO_ASSIGN_OR_RETURN(std::vector<uint64_t> out, parse_list<uint64_t>("--sizes", text, parse_size_bytes));
  for (const uint64_t n : out) {
    if (n == 0) return invalid_argument("--sizes: a size must be positive");
    if (n > 64 * kGiB)
      return invalid_argument("--sizes: " + format_bytes(n) + " is over the 64 GiB this benchmark allows");
  }
  return out;
}

void fill_pattern(std::byte* p, uint64_t n) {
  for (uint64_t i = 0; i < n; ++i) p[i] = static_cast<std::byte>((i * 131) % 251);
}

// The engine's path: `copies` copies of `bytes` on one stream, then a wait for the stream.
Status zo_copies(gpu::Device& dev, gpu::Stream stream, gpu::DevicePtr d, std::byte* host, uint64_t bytes, bool h2d,
                 int copies) {
  for (int i = 0; i < copies; ++i) {
    ZO_RETURN_IF_ERROR(h2d ? dev.copy_h2d(d, host, bytes, stream) : dev.copy_d2h(host, d, bytes, stream));
  }
  return dev.synchronize(stream);
}

// Round trip through a poisoned device buffer: the host's pattern comes back byte for byte.
Status check_round_trip(gpu::Device& dev, gpu::Stream stream, gpu::DevicePtr d, std::byte* host, uint64_t bytes,
                        const char* what) {
  ZO_ASSIGN_OR_RETURN(AlignedBuffer back, AlignedBuffer::allocate(bytes));
  std::memset(back.data(), 0xA5, bytes);
  ZO_RETURN_IF_ERROR(dev.fill_zero(d, bytes, stream));
  ZO_RETURN_IF_ERROR(dev.copy_h2d(d, host, bytes, stream));
  ZO_RETURN_IF_ERROR(dev.copy_d2h(back.data(), d, bytes, stream));
  ZO_RETURN_IF_ERROR(dev.synchronize(stream));
  if (std::memcmp(back.data(), host, bytes) != 0)
    return internal_error(std::string("the round trip host -> device -> host from ") + what +
                          " memory changed bytes (" + format_bytes(bytes) + ")");
  return Status::ok();
}

struct PcieRow {
  std::string host;  // "pinned" or "pageable"
  bool h2d = true;
  uint64_t bytes = 0;
  int copies = 1;                     // per timed sample
  std::vector<double> zo_s, torch_s;  // seconds per copy, one per round
};

int run_pcie_bench(const PcieArgs& a) {
  const BenchError usage{"pcie", 2}, failure{"pcie", 1};
  auto kind = gpu::parse_device_kind(a.device);
  if (!kind.is_ok()) return usage("--device: " + kind.status().message());
  auto sizes_r = parse_sizes(a.sizes);
  if (!sizes_r.is_ok()) return usage(sizes_r.status().message());
  const std::vector<uint64_t> sizes = *sizes_r;
  auto sample_r = parse_size_bytes(a.sample_bytes);
  if (!sample_r.is_ok() || *sample_r == 0)
    return usage("--sample-bytes: expected a positive size such as 256MiB, got '" + a.sample_bytes + "'");
  if (a.repeats < 1) return usage("--repeats must be ≥ 1");
  const uint64_t max_bytes = *std::max_element(sizes.begin(), sizes.end());

  auto dev_r = gpu::make_device(*kind, align_up(max_bytes, gpu::kDeviceAlignment) + 64 * kMiB);
  if (!dev_r.is_ok()) return failure(dev_r.status().to_string());
  gpu::Device& dev = **dev_r;
  const bool cuda = dev.kind() == gpu::DeviceKind::kCuda;
  auto d_r = dev.allocate(max_bytes);
  if (!d_r.is_ok()) return failure(d_r.status().to_string());
  auto stream_r = dev.create_stream();
  if (!stream_r.is_ok()) return failure(stream_r.status().to_string());
  const gpu::DevicePtr d = *d_r;
  const gpu::Stream stream = *stream_r;

  auto pinned_r = dev.allocate_pinned(max_bytes);
  if (!pinned_r.is_ok()) return failure(pinned_r.status().to_string() + " (try smaller --sizes)");
  std::unique_ptr<std::byte, std::function<void(std::byte*)>> pinned(static_cast<std::byte*>(*pinned_r),
                                                                     [&dev](std::byte* p) { dev.free_pinned(p); });
  auto pageable_r = AlignedBuffer::allocate(max_bytes);
  if (!pageable_r.is_ok()) return failure(pageable_r.status().to_string() + " (try smaller --sizes)");
  AlignedBuffer pageable = std::move(*pageable_r);
  fill_pattern(pinned.get(), max_bytes);
  std::memcpy(pageable.data(), pinned.get(), max_bytes);

  const bool with_torch = ZO_HAVE_TORCH && !a.no_torch;
  const std::string baseline = with_torch
                                   ? std::string("torch copy_(non_blocking=True) between torch's own tensors (") +
                                         (cuda ? "cuda:0" : "CPU: the device is emulated") + ")"
                                   : (a.no_torch ? "none (--no-torch)" : "none (built without LibTorch)");
  if (!a.json) {
    std::printf("zoffload-bench pcie: %s (%s), %zu sizes up to %s, %d rounds, >= %s per sample\n", dev.name().c_str(),
                std::string(gpu::device_kind_name(dev.kind())).c_str(), sizes.size(), format_bytes(max_bytes).c_str(),
                a.repeats, format_bytes(*sample_r).c_str());
    std::printf("baseline  %s\n", baseline.c_str());
    if (!cuda) std::printf("note      no GPU: copies between host buffers, not over PCIe\n");
  }

  // 1. Correctness first, then the rounds, host memory kind by kind (the torch buffers of one at a time).
  const uint64_t check_bytes = std::min(max_bytes, kCheckBytes);
  std::vector<std::string> checks;
  std::vector<PcieRow> rows;
  for (const bool use_pinned : {true, false}) {
    const char* host_name = use_pinned ? "pinned" : "pageable";
    std::byte* host = use_pinned ? pinned.get() : pageable.data();
    if (Status s = check_round_trip(dev, stream, d, host, check_bytes, host_name); !s.is_ok())
      return failure("check failed: " + s.to_string());
    checks.push_back(std::string("zoffload ") + host_name);
#if ZO_HAVE_TORCH
    std::unique_ptr<detail::TorchCopies> torch_copies;
    if (with_torch) {
      auto t = detail::TorchCopies::create(max_bytes, use_pinned, cuda);
      if (!t.is_ok()) return failure(t.status().to_string());
      torch_copies = std::move(*t);
      if (Status s = torch_copies->check(check_bytes); !s.is_ok()) return failure("check failed: " + s.to_string());
      checks.push_back(std::string("torch ") + host_name);
    }
#endif
    for (const uint64_t bytes : sizes) {
      for (const bool h2d : {true, false}) {
        PcieRow row{.host = host_name, .h2d = h2d, .bytes = bytes};
        row.copies = static_cast<int>(std::min<uint64_t>(1024, std::max<uint64_t>(1, (*sample_r + bytes - 1) / bytes)));
        // A warm-up of each, then the rounds, the two alternating.
        for (int r = -1; r < a.repeats; ++r) {
          Stopwatch sw;
          if (Status s = zo_copies(dev, stream, d, host, bytes, h2d, row.copies); !s.is_ok())
            return failure(s.to_string());
          const double t = sw.elapsed_s() / row.copies;
          if (r >= 0) row.zo_s.push_back(t);
#if ZO_HAVE_TORCH
          if (torch_copies) {
            sw.reset();
            if (Status s = torch_copies->run(h2d, bytes, row.copies); !s.is_ok()) return failure(s.to_string());
            const double tt = sw.elapsed_s() / row.copies;
            if (r >= 0) row.torch_s.push_back(tt);
          }
#endif
        }
        rows.push_back(std::move(row));
      }
    }
  }
  std::string check_summary =
      "round trip host -> device -> host of " + format_bytes(check_bytes) + " gives back every byte:";
  for (const std::string& c : checks) check_summary += " " + c + ";";
  check_summary.pop_back();

  if (a.json) {
    nlohmann::ordered_json j;
    j["device"] = dev.name();
    j["kind"] = gpu::device_kind_name(dev.kind());
    j["repeats"] = a.repeats;
    j["sample_bytes"] = *sample_r;
    j["baseline"] = baseline;
    j["check"] = check_summary;
    nlohmann::ordered_json results = nlohmann::ordered_json::array();
    for (const PcieRow& r : rows) {
      nlohmann::ordered_json o;
      o["host"] = r.host;
      o["direction"] = r.h2d ? "h2d" : "d2h";
      o["bytes"] = r.bytes;
      o["copies_per_sample"] = r.copies;
      const double zm = median(r.zo_s);
      o["zoffload"] = {{"median_s", zm}, {"all_s", r.zo_s}, {"gbps", gbps(r.bytes, zm)}};
      if (!r.torch_s.empty()) {
        const double tm = median(r.torch_s);
        o["torch"] = {{"median_s", tm}, {"all_s", r.torch_s}, {"gbps", gbps(r.bytes, tm)}};
        o["ratio_to_torch"] = tm / zm;
      } else {
        o["torch"] = nullptr;
        o["ratio_to_torch"] = nullptr;
      }
      results.push_back(std::move(o));
    }
    j["results"] = std::move(results);
    std::printf("%s\n", j.dump(2).c_str());
    return 0;
  }
  std::printf("check     %s\n", check_summary.c_str());
  std::printf("%-9s %-4s %10s %8s %15s %12s %7s\n", "host", "dir", "size", "copies", "zoffload GB/s", "torch GB/s",
              "ratio");
  for (const PcieRow& r : rows) {
    const double zm = median(r.zo_s);
    char torch_col[64] = "-", ratio_col[32] = "-";
    if (!r.torch_s.empty()) {
      const double tm = median(r.torch_s);
      std::snprintf(torch_col, sizeof torch_col, "%.2f", gbps(r.bytes, tm));
      std::snprintf(ratio_col, sizeof ratio_col, "%.2f", tm / zm);
    }
    std::printf("%-9s %-4s %10s %8d %15.2f %12s %7s\n", r.host.c_str(), r.h2d ? "H2D" : "D2H",
                format_bytes(r.bytes).c_str(), r.copies, gbps(r.bytes, zm), torch_col, ratio_col);
  }
  std::printf(
      "GB/s are medians of %d rounds (1e9 bytes/s); ratio = torch time / zoffload time (> 1: zoffload faster)\n",
      a.repeats);
  return 0;
}

}  // namespace

void register_bench_pcie(CLI::App& app, int* exit_code) {
  auto args = std::make_shared<PcieArgs>();
  CLI::App* cmd = app.add_subcommand(
      "pcie",
      "Host<->device copies through zoffload's device (the engine's parameter and gradient path) from pinned "
      "and pageable memory, 1 MiB to 1 GiB: GB/s each way, checked by a round trip, with torch's copy_ "
      "between its own tensors as the same-run baseline and the ratio");
  cmd->add_option("--device", args->device, "auto|cuda|host: the device (host: emulated in host memory, no PCIe)")
      ->capture_default_str();
  cmd->add_option("--sizes", args->sizes, "comma-separated copy sizes")->capture_default_str();
  cmd->add_option("--sample-bytes", args->sample_bytes,
                  "bytes copied per timed sample: small sizes repeat the copy (at most 1024 times) to reach it")
      ->capture_default_str();
  cmd->add_option("--repeats", args->repeats, "timed rounds; medians are reported")->capture_default_str();
  cmd->add_flag("--no-torch", args->no_torch, "skip the torch baseline");
  cmd->add_flag("--json", args->json, "print machine-readable results on stdout");
  cmd->callback([args, exit_code] { *exit_code = run_pcie_bench(*args); });
}

}  // namespace zo::tools
