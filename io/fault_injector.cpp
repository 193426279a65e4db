#include "io/fault_injector.h"

namespace zo::io {

void FaultInjector::add(FaultRule rule) {
  std::lock_guard<std::mutex> lock(mu_);
  rules_.push_back(std::move(rule));
}

void FaultInjector::clear() {
  std::lock_guard<std::mutex> lock(mu_);
  rules_.clear();
}

uint64_t FaultInjector::injected() const {
  std::lock_guard<std::mutex> lock(mu_);
  return injected_;
}

std::optional<FaultKind> FaultInjector::decide(const std::string& path, IoOp op, uint64_t offset_bytes,
                                               uint64_t size_bytes) {
  std::lock_guard<std::mutex> lock(mu_);
  for (FaultRule& rule : rules_) {
    if (rule.times == 0) continue;
    if (rule.op && *rule.op != op) continue;
    if (!rule.path_contains.empty() && path.find(rule.path_contains) == std::string::npos) continue;
    if (rule.offset_bytes < offset_bytes || rule.offset_bytes >= offset_bytes + size_bytes) continue;
    if (rule.skip > 0) {
      --rule.skip;
      continue;
    }
    if (rule.times > 0) --rule.times;
    ++injected_;
    return rule.kind;
  }
  return std::nullopt;
}

}  // namespace zo::io
