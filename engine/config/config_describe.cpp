// The config's key table (config_schema.h) walked by the two visitors that do not read: the writer
// (to_json) and the lister (config_keys). The optimizer's and scheduler's params, which depend on
// their type, are written here by hand.
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "common/string_util.h"
#include "engine/config/config.h"
#include "engine/config/config_schema.h"
#include "engine/config/json_reader.h"

namespace zo::engine {
namespace {

using detail::AutoOk;
using detail::Named;
using detail::NoEffectValue;
using detail::Range;
using nlohmann::json;

template <class E, size_t N>
std::string_view name_of(E value, const std::array<Named<E>, N>& names) {
  for (const Named<E>& n : names)
    if (n.value == value) return n.name;
  return "?";
}

json optimizer_json(const OptimizerConfig& o) {
  json params = {{"lr", o.lr}, {"weight_decay", o.weight_decay}};
  if (o.type != OptimizerType::kAdagrad) params["betas"] = {o.betas[0], o.betas[1]};
  if (o.type != OptimizerType::kLion) params["eps"] = o.eps;
  if (o.type == OptimizerType::kAdam || o.type == OptimizerType::kAdamW) {
    params["adam_w_mode"] = o.adam_w_mode;
    params["bias_correction"] = o.bias_correction;
  }
  if (o.type == OptimizerType::kAdagrad) params["initial_accumulator_value"] = o.initial_accumulator_value;
  return {{"type", to_string(o.type)}, {"params", params}};
}

json scheduler_json(const SchedulerConfig& s) {
  json sp = {{"warmup_num_steps", s.warmup_num_steps}, {"warmup_type", to_string(s.warmup_type)}};
  if (s.type == SchedulerType::kWarmupCosineLR) {
    sp["warmup_min_ratio"] = s.warmup_min_ratio;
    sp["cos_min_ratio"] = s.cos_min_ratio;
  } else {
    sp["warmup_min_lr"] = s.warmup_min_lr;
    sp["warmup_max_lr"] = s.warmup_max_lr;
  }
  if (s.type != SchedulerType::kWarmupLR) sp["total_num_steps"] = s.total_num_steps;
  return {{"type", to_string(s.type)}, {"params", sp}};
}

// Writes each key's value into the JSON object of its path.
class Writer {
 public:
  explicit Writer(json* root) { stack_.push_back(root); }

  void flag(std::string_view key, bool& v, AutoOk = AutoOk::kNo) { put(key, v); }
  void count(std::string_view key, uint64_t& v, uint64_t, AutoOk = AutoOk::kNo) { put(key, v); }
  void integer(std::string_view key, int& v, int, int) { put(key, v); }
  void number(std::string_view key, double& v, Range, AutoOk = AutoOk::kNo) { put(key, v); }
  void text(std::string_view key, std::string& v) { put(key, v); }
  void texts(std::string_view key, std::vector<std::string>& v) { put(key, v); }
  void bytes(std::string_view key, uint64_t& v) { put(key, v); }
  void choice(std::string_view key, std::string& v, std::span<const std::string_view>, AutoOk = AutoOk::kNo) {
    put(key, v);
  }
  template <class E, size_t N>
  void choice(std::string_view key, E& v, const std::array<Named<E>, N>& names, AutoOk = AutoOk::kNo) {
    put(key, name_of(v, names));
  }
  template <class Fn>
  void object(std::string_view key, Fn&& visit_keys) {
    json& child = (*stack_.back())[std::string(key)] = json::object();
    stack_.push_back(&child);
    visit_keys();
    stack_.pop_back();
  }
  void custom(std::string_view key, OptimizerConfig& o) { put(key, optimizer_json(o)); }
  void custom(std::string_view key, SchedulerConfig& s) {
    if (s.type != SchedulerType::kNone) put(key, scheduler_json(s));  // no block: a constant lr
  }
  void alias(std::string_view, std::string_view, bool) {}
  void legacy(std::string_view, std::string_view) {}
  void no_effect(std::string_view, std::string_view, NoEffectValue = NoEffectValue::kAny) {}
  template <class Fn>
  void rule(Fn&&) {}

 private:
  template <class T>
  void put(std::string_view key, const T& v) {
    (*stack_.back())[std::string(key)] = v;
  }
  std::vector<json*> stack_;
};

std::string range_text(const Range& r) {
  const std::string lo = format_number(r.min);
  if (r.max == detail::kMaxDouble) return std::string(r.min_exclusive ? "> " : "≥ ") + lo;
  const std::string hi = r.max == detail::kMaxFloat ? "3.4028e38 (fp32 max)" : format_number(r.max);
  return std::string("in ") + (r.min_exclusive ? "(" : "[") + lo + ", " + hi + "]";
}

// Lists each key with its type and default; aliases and no-effect keys beside them.
class Lister {
 public:
  explicit Lister(ConfigKeyList* out) : out_(out) {}

  void flag(std::string_view key, bool& v, AutoOk a = AutoOk::kNo) { add(key, "bool", json(v), a); }
  void count(std::string_view key, uint64_t& v, uint64_t min, AutoOk a = AutoOk::kNo) {
    add(key, min == 0 ? "count" : "count ≥ " + std::to_string(min), json(v), a);
  }
  void integer(std::string_view key, int& v, int min, int max) {
    add(key, "integer " + std::to_string(min) + "–" + std::to_string(max), json(v), AutoOk::kNo);
  }
  void number(std::string_view key, double& v, Range r, AutoOk a = AutoOk::kNo) {
    add(key, "number " + range_text(r), json(v), a);
  }
  void text(std::string_view key, std::string& v) { add(key, "string", json(v), AutoOk::kNo); }
  void texts(std::string_view key, std::vector<std::string>& v) {
    add(key, "string or list of strings", json(v), AutoOk::kNo);
  }
  void bytes(std::string_view key, uint64_t& v) { add(key, "byte size", json(v), AutoOk::kNo); }
  void choice(std::string_view key, std::string& v, std::span<const std::string_view> names, AutoOk a = AutoOk::kNo) {
    std::vector<std::string_view> all(names.begin(), names.end());
    add(key, one_of(all), json(v), a);
  }
  template <class E, size_t N>
  void choice(std::string_view key, E& v, const std::array<Named<E>, N>& names, AutoOk a = AutoOk::kNo) {
    std::vector<std::string_view> all;
    for (const Named<E>& n : names) all.push_back(n.name);
    add(key, one_of(all), json(name_of(v, names)), a);
  }
  template <class Fn>
  void object(std::string_view key, Fn&& visit_keys) {
    const std::string saved = prefix_;
    prefix_ = path(key) + ".";
    visit_keys();
    prefix_ = saved;
  }
  void custom(std::string_view key, OptimizerConfig& o) {
    add(key, "object {type, params}", optimizer_json(o), AutoOk::kNo);
  }
  void custom(std::string_view key, SchedulerConfig&) { add(key, "object {type, params}", json(nullptr), AutoOk::kNo); }
  void alias(std::string_view old_key, std::string_view new_key, bool deprecated) {
    out_->aliases.push_back({path(old_key), path(new_key), deprecated});
  }
  void legacy(std::string_view key, std::string_view reads_as) {
    out_->aliases.push_back({path(key), std::string(reads_as), true});
  }
  void no_effect(std::string_view key, std::string_view why, NoEffectValue = NoEffectValue::kAny) {
    out_->no_effect.push_back({path(key), std::string(why)});
  }
  template <class Fn>
  void rule(Fn&&) {}

 private:
  std::string path(std::string_view key) const { return prefix_ + std::string(key); }
  static std::string one_of(const std::vector<std::string_view>& names) {
    std::string s = "one of ";
    for (size_t i = 0; i < names.size(); ++i) s += (i ? "|" : "") + std::string(names[i]);
    return s;
  }
  void add(std::string_view key, std::string type, const json& default_value, AutoOk a) {
    out_->keys.push_back({path(key), std::move(type), default_value.dump(), a == AutoOk::kYes});
  }

  ConfigKeyList* out_;
  std::string prefix_;
};

}  // namespace

json to_json(const Config& config) {
  Config c = config;  // the table's visitors take the fields by reference; the writer only reads them
  json out = json::object();
  Writer writer(&out);
  detail::keys(writer, c);
  return out;
}

ConfigKeyList config_keys() {
  Config defaults;
  ConfigKeyList out;
  Lister lister(&out);
  detail::keys(lister, defaults);
  return out;
}

}  // namespace zo::engine
