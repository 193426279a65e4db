#include "engine/memory/accounting.h"

#include <nlohmann/json.hpp>

#include "common/check.h"

namespace zo::engine {

std::string_view tier_name(Tier tier) {
  switch (tier) {
    case Tier::kDevice: return "device";
    case Tier::kCpu: return "cpu";
    case Tier::kNvme: return "nvme";
  }
  return "unknown";
}

namespace {

nlohmann::json usage_json(const TierUsage& u) {
  return {{"resident_bytes", u.resident_bytes}, {"peak_bytes", u.peak_bytes}};
}

}  // namespace

std::string MemoryStats::to_json() const {
  nlohmann::ordered_json j;
  j["device"] = usage_json(device);
  j["cpu"] = usage_json(cpu);
  j["pinned"] = usage_json(pinned);
  j["nvme"] = usage_json(nvme);
  j["h2d_bytes"] = h2d_bytes;
  j["d2h_bytes"] = d2h_bytes;
  j["nvme_read_bytes"] = nvme_read_bytes;
  j["nvme_write_bytes"] = nvme_write_bytes;
  return j.dump();
}

void MemoryAccounting::add(Counter& c, uint64_t size_bytes) {
  const uint64_t now = c.resident.fetch_add(size_bytes, std::memory_order_relaxed) + size_bytes;
  // A CAS loop rather than load+store: two threads adding at once must not lose the larger peak.
  uint64_t peak = c.peak.load(std::memory_order_relaxed);
  while (now > peak && !c.peak.compare_exchange_weak(peak, now, std::memory_order_relaxed)) {}
}

void MemoryAccounting::remove(Counter& c, uint64_t size_bytes, const char* what) {
  const uint64_t before = c.resident.fetch_sub(size_bytes, std::memory_order_relaxed);
  ZO_CHECK(before >= size_bytes) << "MemoryAccounting: removing " << size_bytes << " bytes from " << what
                                 << " which has only " << before << " resident";
}

void MemoryAccounting::add_resident(Tier tier, uint64_t size_bytes, bool pinned) {
  switch (tier) {
    case Tier::kDevice: add(device_, size_bytes); break;
    case Tier::kCpu:
      add(cpu_, size_bytes);
      if (pinned) add(pinned_, size_bytes);
      break;
    case Tier::kNvme: add(nvme_, size_bytes); break;
  }
}

void MemoryAccounting::remove_resident(Tier tier, uint64_t size_bytes, bool pinned) {
  switch (tier) {
    case Tier::kDevice: remove(device_, size_bytes, "device"); break;
    case Tier::kCpu:
      remove(cpu_, size_bytes, "cpu");
      if (pinned) remove(pinned_, size_bytes, "pinned");
      break;
    case Tier::kNvme: remove(nvme_, size_bytes, "nvme"); break;
  }
}

void MemoryAccounting::add_moved(Move move, uint64_t size_bytes) {
  moved_[static_cast<size_t>(move)].fetch_add(size_bytes, std::memory_order_relaxed);
}

MemoryStats MemoryAccounting::snapshot() const {
  auto usage = [](const Counter& c) {
    return TierUsage{c.resident.load(std::memory_order_relaxed), c.peak.load(std::memory_order_relaxed)};
  };
  MemoryStats s;
  s.device = usage(device_);
  s.cpu = usage(cpu_);
  s.pinned = usage(pinned_);
  s.nvme = usage(nvme_);
  s.h2d_bytes = moved_[static_cast<size_t>(Move::kHostToDevice)].load(std::memory_order_relaxed);
  s.d2h_bytes = moved_[static_cast<size_t>(Move::kDeviceToHost)].load(std::memory_order_relaxed);
  s.nvme_read_bytes = moved_[static_cast<size_t>(Move::kNvmeRead)].load(std::memory_order_relaxed);
  s.nvme_write_bytes = moved_[static_cast<size_t>(Move::kNvmeWrite)].load(std::memory_order_relaxed);
  return s;
}

void MemoryAccounting::reset_peaks() {
  for (Counter* c : {&device_, &cpu_, &pinned_, &nvme_}) {
    c->peak.store(c->resident.load(std::memory_order_relaxed), std::memory_order_relaxed);
  }
}

}  // namespace zo::engine
