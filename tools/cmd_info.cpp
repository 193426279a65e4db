// `zoffload info`: what this build of zoffload can do and what the host offers.
#include <CLI/CLI.hpp>

#include <iostream>
#include <limits>
#include <memory>
#include <nlohmann/json.hpp>

#include "common/bytes.h"
#include "common/host_info.h"
#include "engine/model/model_config.h"
#include "gpu/device_info.h"
#include "tools/commands.h"
#include "zo_build_config.h"

#if ZO_HAVE_TORCH
#include "engine/model/torch_runtime.h"
#endif

namespace zo::tools {
namespace {

// The LibTorch this binary runs on; null without LibTorch.
nlohmann::json libtorch_json() {
#if ZO_HAVE_TORCH
  const engine::LibTorchInfo t = engine::libtorch_info();
  return {{"version", t.version},
          {"cuda", t.cuda_linked ? nlohmann::json(t.cuda_version) : nlohmann::json(nullptr)},
          {"cuda_devices", t.cuda_devices}};
#else
  return nullptr;
#endif
}

nlohmann::json info_json() {
  const HostInfo h = host_info();
  const gpu::GpuProbe g = gpu::probe_gpus();
  nlohmann::json gpus = nlohmann::json::array();
  for (const gpu::GpuInfo& d : g.gpus)
    gpus.push_back({{"index", d.index},
                    {"name", d.name},
                    {"total_bytes", d.total_bytes},
                    {"free_bytes", d.free_bytes},
                    {"compute_capability", std::to_string(d.compute_major) + "." + std::to_string(d.compute_minor)}});
  nlohmann::json families = nlohmann::json::array();
  for (const engine::ModelFamily& f : engine::model_families())
    families.push_back({{"model_type", f.model_type}, {"architecture", f.architecture}});
  return {
      {"version", ZO_VERSION},
      {"build",
       {{"io_uring", bool(ZO_HAVE_URING)},
        {"libaio", bool(ZO_HAVE_AIO)},
        {"libtorch", bool(ZO_HAVE_TORCH)},
        {"cuda", bool(ZO_HAVE_CUDA)},
        {"nccl", bool(ZO_HAVE_NCCL)},
        {"protobuf", bool(ZO_HAVE_PROTOBUF)}}},
      {"libtorch", libtorch_json()},
      {"cpu",
       {{"model", h.cpu_model},
        {"logical_cpus", h.logical_cpus},
        {"avx2", h.avx2},
        {"fma", h.fma},
        {"f16c", h.f16c},
        {"avx512f", h.avx512f},
        {"avx512bw", h.avx512bw},
        {"avx512_bf16", h.avx512_bf16}}},
      {"memory",
       {{"total_bytes", h.mem_total_bytes},
        {"available_bytes", h.mem_available_bytes},
        {"memlock_limit_bytes", h.memlock_limit_bytes}}},
      {"gpus", gpus},
      {"gpu_note", g.gpus.empty() ? g.reason : ""},
      {"model_families", families},
  };
}

void print_text(const nlohmann::json& j) {
  auto yn = [](const nlohmann::json& b) { return b.get<bool>() ? "yes" : "no"; };
  const auto& b = j["build"];
  std::cout << "zoffload " << j["version"].get<std::string>() << "\n"
            << "build:   io_uring " << yn(b["io_uring"]) << ", libaio " << yn(b["libaio"]) << ", LibTorch "
            << yn(b["libtorch"]) << ", CUDA " << yn(b["cuda"]) << ", NCCL " << yn(b["nccl"])
            << ", protobuf (TensorBoard) " << yn(b["protobuf"]) << "\n";
  if (const auto& t = j["libtorch"]; !t.is_null()) {
    std::cout << "libtorch: " << t["version"].get<std::string>() << ", "
              << (t["cuda"].is_null() ? std::string("CPU only (no CUDA backend linked)")
                                      : "CUDA " + t["cuda"].get<std::string>() + ", " +
                                            std::to_string(t["cuda_devices"].get<int>()) + " GPU(s) usable")
              << "\n";
  }
  const auto& c = j["cpu"];
  std::cout << "cpu:     " << c["model"].get<std::string>() << ", " << c["logical_cpus"].get<unsigned>()
            << " logical CPUs; AVX2 " << yn(c["avx2"]) << ", FMA " << yn(c["fma"]) << ", F16C " << yn(c["f16c"])
            << ", AVX-512F " << yn(c["avx512f"]) << ", AVX-512BW " << yn(c["avx512bw"]) << "\n";
  const auto& m = j["memory"];
  const uint64_t memlock = m["memlock_limit_bytes"].get<uint64_t>();
  std::cout << "memory:  " << format_bytes(m["total_bytes"].get<uint64_t>()) << " total, "
            << format_bytes(m["available_bytes"].get<uint64_t>()) << " available; pinned (ulimit -l) "
            << (memlock == std::numeric_limits<uint64_t>::max() ? std::string("unlimited") : format_bytes(memlock))
            << "\n";
  std::cout << "models:  " << engine::model_type_list()
            << " (config.json's model_type; multimodal gemma3's text model too)\n";
  if (j["gpus"].empty()) std::cout << "gpus:    none (" << j["gpu_note"].get<std::string>() << ")\n";
  for (const auto& g : j["gpus"])
    std::cout << "gpu " << g["index"].get<int>() << ":   " << g["name"].get<std::string>() << ", "
              << format_bytes(g["total_bytes"].get<uint64_t>()) << " (" << format_bytes(g["free_bytes"].get<uint64_t>())
              << " free), compute " << g["compute_capability"].get<std::string>() << "\n";
}

}  // namespace

void register_info_command(CLI::App& app, int* exit_code) {
  auto json_out = std::make_shared<bool>(false);
  CLI::App* info = app.add_subcommand(
      "info",
      "Show what this build supports (the model families it trains) and what the host offers (CPU ISA, memory,\n"
      "pinned limit, GPUs)");
  info->add_flag("--json", *json_out, "Print machine-readable JSON");
  info->callback([json_out, exit_code] {
    const nlohmann::json j = info_json();
    if (*json_out) std::cout << j.dump(2) << "\n";
    else print_text(j);
    *exit_code = 0;
  });
}

}  // namespace zo::tools
