// A step's metrics: the record metrics.jsonl and the monitors hold, and the parts derived from the
// run's counters (step_metrics.h).
#include "engine/train/step_metrics.h"

#include <algorithm>
#include <cmath>

#include <nlohmann/json.hpp>

namespace zo::engine {

nlohmann::json StepMetrics::record() const {
  nlohmann::json j;
  j["step"] = step;
  j["loss"] = loss;
  j["lr"] = lr;
  j["loss_scale"] = loss_scale;
  j["grad_norm"] = std::isfinite(grad_norm) ? nlohmann::json(grad_norm) : nlohmann::json(nullptr);
  j["skipped"] = skipped;
  j["tokens"] = tokens;
  j["step_s"] = step_s;
  j["tokens_per_s"] = step_s > 0 ? static_cast<double>(tokens) / step_s : 0.0;
  j["time_s"] = {{"data", data_s},
                 {"fetch", fetch_s},
                 {"compute", compute_s},
                 {"grad_offload", grad_offload_s},
                 {"optimizer_wait", optimizer_wait_s},
                 {"grad_worker", grad_worker_s},
                 {"optimizer", optimizer_s},
                 {"nvme_read_wait", nvme_read_wait_s},
                 {"nvme_write_wait", nvme_write_wait_s},
                 {"nvme_busy", nvme_busy_s},
                 {"device_h2d", device_h2d_s},
                 {"device_d2h", device_d2h_s},
                 {"device_compute", device_compute_s}};
  j["device_busy"] = device_busy;
  j["overlap"] = overlap;
  j["memory"] = nlohmann::json::parse(memory.to_json());
  j["device_peak_bytes"] = device_peak_bytes;
  j["device_budget_bytes"] = device_budget_bytes;
  j["device_arena_bytes"] = device_arena_bytes;
  j["torch_peak_bytes"] = torch_peak_bytes;
  j["process_peak_rss_bytes"] = process_peak_rss_bytes;
  j["device_pinned_bytes"] = device_pinned_bytes;
  j["collective_bytes"] = collective_bytes;
  j["time_s"]["collective"] = collective_s;
  j["time_s"]["rank_wait"] = rank_wait_s;
  j["time_s"]["gather"] = gather_s;
  j["time_s"]["grad_reduce"] = grad_reduce_s;
  if (eval) {
    auto finite = [](double v) { return std::isfinite(v) ? nlohmann::json(v) : nlohmann::json(nullptr); };
    j["eval"] = {{"loss", finite(eval->loss)},
                 {"perplexity", finite(eval->perplexity)},
                 {"batches", eval->batches},
                 {"tokens", eval->tokens},
                 {"runtime_s", eval->eval_s}};
  }
  return j;
}

std::string StepMetrics::to_json() const { return record().dump(); }

void add_counter_deltas(const StepCounters& before, const StepCounters& after, StepMetrics* out) {
  out->fetch_s = after.coord.fetch_wait_s - before.coord.fetch_wait_s + (after.ready_wait_s - before.ready_wait_s);
  out->optimizer_wait_s += after.coord.update_wait_s - before.coord.update_wait_s;
  out->collective_bytes = after.collective_bytes - before.collective_bytes;
  if (after.gathered && before.gathered) {  // Note [Gathered parameters]: the blocks gathered on the gatherer's thread
    out->collective_bytes += after.gathered->bytes - before.gathered->bytes;
    out->gather_s = after.gathered->collective_s - before.gathered->collective_s;
  }
  out->compute_s = std::max(
      0.0, out->step_s - out->fetch_s - out->grad_offload_s - out->data_s - out->optimizer_wait_s - out->collective_s);
  out->nvme_busy_s = after.io_busy_s - before.io_busy_s;
  out->device_h2d_s = after.device.h2d_s - before.device.h2d_s;
  out->device_d2h_s = after.device.d2h_s - before.device.d2h_s;
  out->device_compute_s = after.device.compute_s - before.device.compute_s;
  out->device_busy = out->step_s > 0 ? out->device_compute_s / out->step_s : 0.0;
  out->overlap = out->step_s > 0
                     ? std::max({out->compute_s, out->device_compute_s, out->device_h2d_s, out->device_d2h_s,
                                 out->grad_worker_s, out->optimizer_s, out->nvme_busy_s}) /
                           out->step_s
                     : 0.0;
  out->device_arena_bytes = after.coord.arena_bytes;
}

}  // namespace zo::engine
