#include "engine/config/config.h"

#include <algorithm>
#include <cctype>
#include <cstring>
#include <set>
#include <sstream>
#include <span>
#include <tuple>
#include <vector>

#include <nlohmann/json.hpp>

#include "common/log.h"
#include "common/string_util.h"
#include "engine/config/config_schema.h"
#include "engine/config/json_reader.h"
#include "io/env.h"

namespace zo::engine {

using detail::AutoOk;
using detail::json_at;
using detail::kMaxFloat;
using detail::NoEffectValue;
using detail::ObjectReader;
using detail::ParseState;
using nlohmann::json;

std::string_view to_string(OffloadDevice v) {
  switch (v) {
    case OffloadDevice::kNone: return "none";
    case OffloadDevice::kCpu: return "cpu";
    case OffloadDevice::kNvme: return "nvme";
  }
  return "?";
}
std::string_view to_string(OptimizerType v) {
  switch (v) {
    case OptimizerType::kAdam: return "Adam";
    case OptimizerType::kAdamW: return "AdamW";
    case OptimizerType::kAdagrad: return "Adagrad";
    case OptimizerType::kLion: return "Lion";
  }
  return "?";
}
std::string_view to_string(SchedulerType v) {
  switch (v) {
    case SchedulerType::kNone: return "none";
    case SchedulerType::kWarmupLR: return "WarmupLR";
    case SchedulerType::kWarmupDecayLR: return "WarmupDecayLR";
    case SchedulerType::kWarmupCosineLR: return "WarmupCosineLR";
  }
  return "?";
}
std::string_view to_string(WarmupType v) { return v == WarmupType::kLog ? "log" : "linear"; }

DType Config::compute_dtype() const {
  if (bf16.enabled) return DType::kBF16;
  if (fp16.enabled) return DType::kF16;
  return DType::kF32;
}

DType Config::grad_store_dtype() const {
  const std::string& d = zoffload.gradient_store_dtype;
  if (d == "bf16") return DType::kBF16;
  if (d == "fp16") return DType::kF16;
  if (d == "fp32") return DType::kF32;
  return grad_accum_dtype;  // "auto"
}

namespace {

// ---- reading: JSON → structs through the key table, "auto" recorded in ParseState::autos ---------

// Why no file system takes `path`, or "": Linux's PATH_MAX (4096 bytes with its NUL) and NAME_MAX
// (255 bytes a component), and the NUL byte, which ends a path in every system call.
std::string unusable_path(std::string_view path) {
  if (path.find('\0') != std::string_view::npos) return "holds a NUL byte, which no path may";
  if (path.size() >= 4096)
    return "is " + std::to_string(path.size()) + " bytes long; a path may have at most 4095";
  for (const std::string& part : split(path, '/'))
    if (part.size() > 255)
      return "has a component of " + std::to_string(part.size()) + " bytes; a file name may have at most 255";
  return "";
}

void read_optimizer(ParseState* st, ObjectReader r, OptimizerConfig* o);
void read_scheduler(ParseState* st, ObjectReader r, SchedulerConfig* s);

// The visitor of config_schema.h that reads: each key through its ObjectReader getter, each nested
// object through a child reader that is finished (unknown keys reported) when its keys are done.
class Reader {
 public:
  Reader(ParseState* st, ObjectReader root) : st_(st) { frames_.push_back({std::move(root), {}}); }

  void flag(std::string_view key, bool& out, AutoOk a = AutoOk::kNo) { note(key, top().boolean(key, &out, a)); }
  void count(std::string_view key, uint64_t& out, uint64_t min, AutoOk a = AutoOk::kNo) {
    note(key, top().count(key, &out, min, a));
  }
  void integer(std::string_view key, int& out, int min, int max) { note(key, top().integer(key, &out, min, max)); }
  void number(std::string_view key, double& out, detail::Range range, AutoOk a = AutoOk::kNo) {
    note(key, top().number(key, &out, range.min, range.max, range.min_exclusive, a));
  }
  // Every text key names a path: one no file system takes is refused here, quoted within bounds
  // (a 10 MB path was echoed twice by the error that found it later).
  void text(std::string_view key, std::string& out) {
    std::string value;
    if (!top().string(key, &value)) return note(key, false);
    if (const std::string why = unusable_path(value); !why.empty()) {
      st_->error(top().key_path(key), "\"" + bounded_name(value, 120) + "\" " + why);
      return note(key, false);
    }
    out = std::move(value);
    note(key, true);
  }
  void texts(std::string_view key, std::vector<std::string>& out) { note(key, top().string_list(key, &out)); }
  void bytes(std::string_view key, uint64_t& out) { note(key, top().size_bytes(key, &out)); }
  void choice(std::string_view key, std::string& out, std::span<const std::string_view> names, AutoOk a = AutoOk::kNo) {
    note(key, top().choice(key, names, &out, a));
  }
  template <class E, size_t N>
  void choice(std::string_view key, E& out, const std::array<detail::Named<E>, N>& names, AutoOk a = AutoOk::kNo) {
    std::array<std::string_view, N> choices;
    for (size_t i = 0; i < N; ++i) choices[i] = names[i].name;
    std::string name;
    if (!top().choice(key, choices, &name, a)) return;
    for (const detail::Named<E>& n : names)
      if (n.name == name) out = n.value;
    note(key, true);
  }
  template <class Fn>
  void object(std::string_view key, Fn&& visit_keys) {
    ObjectReader child = top().child(key);
    frames_.push_back({std::move(child), {}});
    visit_keys();
    top().finish();
    frames_.pop_back();
  }
  // The optimizer and scheduler blocks are read only when present: their "type" is required.
  void custom(std::string_view key, OptimizerConfig& o) {
    if (top().has(key)) read_optimizer(st_, top().child(key), &o);
    else top().child(key);  // records the key as known
  }
  void custom(std::string_view key, SchedulerConfig& s) {
    if (top().has(key)) read_scheduler(st_, top().child(key), &s);
    else top().child(key);
  }
  void alias(std::string_view old_key, std::string_view new_key, bool deprecated) {
    top().alias(old_key, new_key, deprecated);
  }
  void legacy(std::string_view, std::string_view) {}  // read by the rule beside it
  void no_effect(std::string_view key, std::string_view why, NoEffectValue value = NoEffectValue::kAny) {
    top().accept_without_effect(key, why, value);
  }
  template <class Fn>
  void rule(Fn&& check) {
    check(detail::ReadContext{top(), st_, frames_.back().valid});
  }

  ObjectReader& top() { return frames_.back().reader; }

 private:
  struct Frame {
    ObjectReader reader;
    std::set<std::string> valid;  // keys read with a valid value
  };
  void note(std::string_view key, bool valid) {
    if (valid) frames_.back().valid.insert(std::string(key));
  }

  ParseState* st_;
  std::vector<Frame> frames_;
};

void read_optimizer(ParseState* st, ObjectReader r, OptimizerConfig* o) {
  static constexpr std::string_view kTypes[] = {"Adam", "AdamW", "Adagrad", "Lion"};
  std::string type;
  if (!r.has("type")) st->error(r.key_path("type"), "missing; one of Adam, AdamW, Adagrad, Lion");
  if (r.choice("type", kTypes, &type)) {
    o->type = type == "Adam"      ? OptimizerType::kAdam
              : type == "AdamW"   ? OptimizerType::kAdamW
              : type == "Adagrad" ? OptimizerType::kAdagrad
                                  : OptimizerType::kLion;
  }
  // Type-specific defaults before reading params (DeepSpeed's and the reference implementations').
  if (o->type == OptimizerType::kAdagrad) o->eps = 1e-10;
  if (o->type == OptimizerType::kLion) {
    o->lr = 1e-4;
    o->betas = {0.9, 0.99};
  }
  ObjectReader p = r.child("params");
  p.number("lr", &o->lr, 0, kMaxFloat, /*min_exclusive=*/true, AutoOk::kYes);
  p.number("weight_decay", &o->weight_decay, 0, kMaxFloat, false, AutoOk::kYes);
  if (o->type != OptimizerType::kAdagrad) p.number_array("betas", o->betas, 0.0, 1.0, AutoOk::kYes);
  if (o->type != OptimizerType::kLion) p.number("eps", &o->eps, 0, kMaxFloat, /*min_exclusive=*/true, AutoOk::kYes);
  if (o->type == OptimizerType::kAdam || o->type == OptimizerType::kAdamW) {
    bool w_mode = true;
    if (p.boolean("adam_w_mode", &w_mode)) {
      if (o->type == OptimizerType::kAdamW && !w_mode)
        st->error(p.key_path("adam_w_mode"), "AdamW always decouples weight decay; use type \"Adam\" for L2 decay");
      o->adam_w_mode = w_mode;
    }
    p.boolean("bias_correction", &o->bias_correction);
    bool amsgrad = false;
    if (p.boolean("amsgrad", &amsgrad) && amsgrad)
      st->error(p.key_path("amsgrad"), "AMSGrad is not supported; use false");
    p.accept_without_effect("torch_adam", "zoffload always uses its own vectorized CPU Adam");
    p.accept_without_effect("fused", "zoffload always uses its own vectorized CPU Adam");
  }
  if (o->type == OptimizerType::kAdagrad &&
      p.number("initial_accumulator_value", &o->initial_accumulator_value, 0, kMaxFloat) &&
      o->initial_accumulator_value != 0)
    st->error(p.key_path("initial_accumulator_value"),
              "only 0 is supported (the accumulator starts at zero, as in DeepSpeed's cpu_adagrad)");
  p.finish();
  r.finish();
}

void read_scheduler(ParseState* st, ObjectReader r, SchedulerConfig* s) {
  static constexpr std::string_view kTypes[] = {"WarmupLR", "WarmupDecayLR", "WarmupCosineLR"};
  std::string type;
  if (!r.has("type")) st->error(r.key_path("type"), "missing; one of WarmupLR, WarmupDecayLR, WarmupCosineLR");
  if (r.choice("type", kTypes, &type)) {
    s->type = type == "WarmupLR"        ? SchedulerType::kWarmupLR
              : type == "WarmupDecayLR" ? SchedulerType::kWarmupDecayLR
                                        : SchedulerType::kWarmupCosineLR;
  }
  ObjectReader p = r.child("params");
  static constexpr std::string_view kWarmupTypes[] = {"log", "linear"};
  std::string warmup_type;
  if (p.choice("warmup_type", kWarmupTypes, &warmup_type))
    s->warmup_type = warmup_type == "log" ? WarmupType::kLog : WarmupType::kLinear;
  p.count("warmup_num_steps", &s->warmup_num_steps, 0, AutoOk::kYes);
  if (s->type == SchedulerType::kWarmupCosineLR) {
    p.number("warmup_min_ratio", &s->warmup_min_ratio, 0, 1);
    p.number("cos_min_ratio", &s->cos_min_ratio, 0, 1);
  } else {
    p.number("warmup_min_lr", &s->warmup_min_lr, 0, kMaxFloat, false, AutoOk::kYes);
    p.number("warmup_max_lr", &s->warmup_max_lr, 0, kMaxFloat, false, AutoOk::kYes);
    // Without an explicit value, warm up to the optimizer's lr (resolved later).
    if (!p.has("warmup_max_lr")) st->autos.insert(p.key_path("warmup_max_lr"));
  }
  if (s->type == SchedulerType::kWarmupDecayLR || s->type == SchedulerType::kWarmupCosineLR) {
    if (!p.has("total_num_steps")) st->autos.insert(p.key_path("total_num_steps"));
    p.count("total_num_steps", &s->total_num_steps, 1, AutoOk::kYes);
  }
  p.accept_without_effect("last_batch_iteration", "resume restores the scheduler from the checkpoint");
  p.finish();
  r.finish();
}

// ---- JSON text → json, with duplicate keys rejected ----------------------------------------------

// Line and column (1-based) of byte `offset` in `text`.
std::string line_col(std::string_view text, size_t offset) {
  size_t line = 1, col = 1;
  for (size_t i = 0; i < offset && i < text.size(); ++i) {
    if (text[i] == '\n') {
      ++line;
      col = 1;
    } else {
      ++col;
    }
  }
  return "line " + std::to_string(line) + ", column " + std::to_string(col);
}

// Note [JSON pre-scan]
// One pass over the text before nlohmann parses it refuses what that parse would mishandle:
// - nesting deeper than kMaxConfigDepth. The duplicate-key callback below keeps each open object's
//   dotted path, so memory grew with the square of the depth: a 1.2 MB file nested 100 000 deep
//   took 10 GB and 22 s, or aborted on std::bad_alloc (issue 40).
// - a number literal that underflows: nlohmann reads 1e-400 as 0, silently another value. The
//   scan follows the key path, so the error names the key.
// It knows strings (brackets, quotes and digits inside them do not count) and leaves every other
// malformation to nlohmann, which reports it with its place. Returns false after reporting.
bool prescan_json_text(std::string_view text, ConfigDiagnostics* diag) {
  struct Level {
    bool object;
    std::string key;   // in an object: the key last read (as bounded_name shows it)
    size_t index = 0;  // in an array: the element being read
  };
  std::vector<Level> open;
  bool key_next = false;  // in an object, after '{' or ',': the next string is a key
  auto path = [&] {
    std::string p;
    for (const Level& l : open) p += l.object ? (p.empty() ? "" : ".") + l.key : "[" + std::to_string(l.index) + "]";
    return p;
  };
  bool ok = true;
  constexpr uint64_t kMaxReported = 20;
  uint64_t underflows = 0;
  for (size_t i = 0; i < text.size();) {
    const char c = text[i];
    if (c == '"') {
      size_t end = i + 1;
      while (end < text.size() && text[end] != '"') end += text[end] == '\\' ? 2 : 1;
      if (end >= text.size()) break;  // unterminated
      if (key_next && !open.empty() && open.back().object)
        open.back().key = bounded_name(text.substr(i + 1, end - i - 1));
      key_next = false;
      i = end + 1;
    } else if (c == '{' || c == '[') {
      if (open.size() == kMaxConfigDepth) {
        diag->errors.push_back({"", "invalid JSON (" + line_col(text, i) + "): nested deeper than " +
                                        std::to_string(kMaxConfigDepth) + " levels"});
        return false;
      }
      open.push_back({c == '{', "", 0});
      key_next = c == '{';
      ++i;
    } else if (c == '}' || c == ']') {
      if (!open.empty()) open.pop_back();
      key_next = false;
      ++i;
    } else if (c == ',') {
      if (!open.empty() && open.back().object) key_next = true;
      else if (!open.empty()) ++open.back().index;
      ++i;
    } else if (c == '-' || std::isdigit(static_cast<unsigned char>(c))) {
      size_t end = i;
      while (end < text.size() &&
             (std::isdigit(static_cast<unsigned char>(text[end])) || std::strchr(".eE+-", text[end]) != nullptr))
        ++end;
      const std::string_view number = text.substr(i, end - i);
      if (std::string why = detail::underflow_reason(number); !why.empty()) {
        // A file of a million such numbers is reported in a screenful.
        if (++underflows <= kMaxReported)
          diag->errors.push_back({path(), quote_excerpt(number, 40) + " is not representable (" + why + ")"});
        ok = false;
      }
      i = end;
    } else {
      ++i;
    }
  }
  if (underflows > kMaxReported)
    diag->errors.push_back({"", "and " + std::to_string(underflows - kMaxReported) + " more numbers that underflow"});
  return ok;
}

std::optional<json> parse_json_text(std::string_view text, ConfigDiagnostics* diag) {
  if (!prescan_json_text(text, diag)) return std::nullopt;
  // Track keys per open object to reject duplicates, which nlohmann would silently collapse.
  std::vector<std::pair<std::string, std::set<std::string>>> stack;  // (object path, keys seen)
  std::string last_key;
  bool duplicate = false;
  auto cb = [&](int depth, json::parse_event_t event, json& parsed) -> bool {
    (void)depth;
    switch (event) {
      case json::parse_event_t::object_start: {
        std::string path =
            stack.empty() ? "" : (stack.back().first.empty() ? last_key : stack.back().first + "." + last_key);
        stack.push_back({path, {}});
        break;
      }
      case json::parse_event_t::object_end:
        if (!stack.empty()) stack.pop_back();
        break;
      case json::parse_event_t::key: {
        // Paths hold keys as errors show them (a 10 MB key is an excerpt); the set, whole keys.
        const std::string& key = parsed.get_ref<const std::string&>();
        last_key = bounded_name(key);
        if (!stack.empty() && !stack.back().second.insert(key).second) {
          const std::string& base = stack.back().first;
          diag->errors.push_back({base.empty() ? last_key : base + "." + last_key, "duplicate key"});
          duplicate = true;
        }
        break;
      }
      default: break;
    }
    return true;
  };
  try {
    json j = json::parse(text.begin(), text.end(), cb, /*allow_exceptions=*/true, /*ignore_comments=*/false);
    if (duplicate) return std::nullopt;
    return j;
  } catch (const json::exception& e) {  // parse_error, or out_of_range for a number too long
    std::string what = e.what();
    // nlohmann's text: "[json.exception.parse_error.101] parse error at line 3, column 5: ..."
    const size_t colon = what.find("]");
    if (colon != std::string::npos) what = what.substr(colon + 2);
    // It quotes the last token read, which can be a 100 KB number: quote a bounded excerpt.
    what = quote_excerpt(what, 160);
    const auto* parse = dynamic_cast<const json::parse_error*>(&e);
    const std::string at = parse != nullptr ? " (" + line_col(text, parse->byte == 0 ? 0 : parse->byte - 1) + ")" : "";
    diag->errors.push_back({"", "invalid JSON" + at + ": " + what});
    return std::nullopt;
  }
}

}  // namespace

std::optional<Config> parse_config_json(const json& root, const ResolveContext& ctx, ConfigDiagnostics* diag) {
  const size_t errors_before = diag->errors.size();
  if (!root.is_object()) {
    diag->errors.push_back({"", "a config must be a JSON object, got " + detail::describe(root)});
    return std::nullopt;
  }
  ParseState st{diag, {}};
  Config c;
  Reader reader(&st, ObjectReader(&st, &root, ""));
  detail::keys(reader, c);
  reader.top().finish();

  detail::resolve_config(&st, ctx, root, &c);
  if (diag->errors.size() > errors_before) return std::nullopt;
  return c;
}

std::optional<Config> parse_config(std::string_view json_text, const ResolveContext& ctx, ConfigDiagnostics* diag) {
  std::optional<json> j = parse_json_text(json_text, diag);
  if (!j) return std::nullopt;
  return parse_config_json(*j, ctx, diag);
}

std::optional<Config> load_config_file(const std::string& path, const ResolveContext& ctx, ConfigDiagnostics* diag) {
  // The Env refuses a FIFO before opening it: it would block the read forever.
  Result<std::string> text = io::Env::posix()->read_file(path, "config file", kMaxConfigFileBytes);
  if (!text.is_ok()) {
    // The message leaves the path out: callers print it before each error, and once is enough
    // (issue 40: a 10 MB path came out twice on one line).
    const Status& st = text.status();
    std::string message;
    if (st.code() == StatusCode::kNotFound) {
      message = std::string("cannot open config file: ") + std::strerror(ENOENT);
    } else if (st.sys_errno() != 0) {
      message = std::string("cannot read config file: ") + std::strerror(st.sys_errno());
    } else {  // "config file PATH is a FIFO (named pipe), ...", "config file PATH is N bytes, over ..."
      message = st.message();
      const std::string named = "config file " + path;
      if (const size_t at = message.find(named); at != std::string::npos)
        message.replace(at, named.size(), "config file");
    }
    diag->errors.push_back({"", message});
    return std::nullopt;
  }
  return parse_config(*text, ctx, diag);
}

Result<Config> load_config(const std::string& path, const ResolveContext& ctx) {
  ConfigDiagnostics diag;
  std::optional<Config> c = load_config_file(path, ctx, &diag);
  const std::string shown = bounded_name(path);
  for (const ConfigIssue& w : diag.warnings) ZO_LOG(kWarn) << shown << ": " << w.to_string();
  if (c) return *c;
  std::string msg;
  for (const ConfigIssue& e : diag.errors) {
    if (!msg.empty()) msg += "\n";
    msg += shown + ": " + e.to_string();
  }
  return invalid_argument(msg);
}

}  // namespace zo::engine
