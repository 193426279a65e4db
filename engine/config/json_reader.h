// ObjectReader: strict, path-aware reading of one JSON object for the config parser. Each getter
// records the key as known, reports type/range problems at the key's full path, and `finish()`
// reports every key that no getter asked for, suggesting the closest known one.
// Internal to engine/config; not thread-safe (one reader per object being parsed).
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <set>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include <nlohmann/json.hpp>

#include "engine/config/config.h"

namespace zo::engine::detail {

// Shared state of one parse: diagnostics and the set of key paths whose value was "auto".
struct ParseState {
  ConfigDiagnostics* diag;
  std::set<std::string> autos;

  void error(std::string path, std::string message) { diag->errors.push_back({std::move(path), std::move(message)}); }
  void warn(std::string path, std::string message) { diag->warnings.push_back({std::move(path), std::move(message)}); }
  bool is_auto(const std::string& path) const { return autos.count(path) != 0; }
  bool has_error(std::string_view path) const {
    for (const ConfigIssue& e : diag->errors)
      if (e.path == path) return true;
    return false;
  }
};

// The value at a dotted key path ("optimizer.params.lr") of `root`; nullptr where any part is
// absent, null, or not an object.
const nlohmann::json* json_at(const nlohmann::json& root, std::string_view dotted_path);

// Whether "auto" is accepted for a key; when it is, the key's path is recorded in ParseState::autos
// and the output keeps its default until resolution.
enum class AutoOk { kNo, kYes };

// What a key with no effect must still hold: anything, or a value of the type DeepSpeed gives it,
// so that a typo'd value ("yes" for a flag) is an error rather than a warning about nothing.
enum class NoEffectValue { kAny, kBool, kCount };

class ObjectReader {
 public:
  // `json` may be null (key absent): every getter then leaves its default.
  ObjectReader(ParseState* state, const nlohmann::json* json, std::string path);

  const std::string& path() const { return path_; }
  std::string key_path(std::string_view key) const;
  bool has(std::string_view key) const { return keys_.count(std::string(key)) != 0; }

  // `old_key` is another name for `new_key`. With `deprecated`, using it warns and names the new
  // key. Giving both is an error. Call before reading `new_key`.
  void alias(std::string_view old_key, std::string_view new_key, bool deprecated);
  // A key DeepSpeed knows that has no effect in zoffload: accepted with a warning when its value is
  // of the kind `value` says (any value by default), a type error otherwise.
  void accept_without_effect(std::string_view key, std::string_view why, NoEffectValue value = NoEffectValue::kAny);

  // Each returns true when the key was present and valid (so `*out` was set).
  bool boolean(std::string_view key, bool* out, AutoOk auto_ok = AutoOk::kNo);
  // A whole count: JSON integer, integral float (1e9) or numeric string ("5e8"); ≥ min.
  bool count(std::string_view key, uint64_t* out, uint64_t min = 0, AutoOk auto_ok = AutoOk::kNo);
  // A whole number in [min, max], written as count's are.
  bool integer(std::string_view key, int* out, int min, int max, AutoOk auto_ok = AutoOk::kNo);
  // A real number in [min, max] (or (min, max] with min_exclusive): a JSON number only; a string
  // ("0.001") is a type error (Note [Numbers as strings]).
  bool number(std::string_view key, double* out, double min, double max, bool min_exclusive = false,
              AutoOk auto_ok = AutoOk::kNo);
  // A string without a NUL character (paths go to the C file API, which would stop at it).
  bool string(std::string_view key, std::string* out);
  // A JSON array of such strings (each element's errors name key[i]), or one such string, read as
  // a list of one (as PEFT's target_modules may be given).
  bool string_list(std::string_view key, std::vector<std::string>* out);
  // One of `choices` (exact match); the error lists them.
  bool choice(std::string_view key, std::span<const std::string_view> choices, std::string* out,
              AutoOk auto_ok = AutoOk::kNo);
  // A byte size: JSON integer (bytes) or string with a unit ("24GiB").
  bool size_bytes(std::string_view key, uint64_t* out);
  // Array of exactly `n` JSON numbers in [min, max).
  bool number_array(std::string_view key, std::span<double> out, double min, double max, AutoOk auto_ok = AutoOk::kNo);

  // The child object at `key` (absent → a reader with no JSON). A non-object is a type error.
  ObjectReader child(std::string_view key);

  // Reports keys nobody asked for. Call once after all getters.
  void finish();

 private:
  const nlohmann::json* take(std::string_view key);
  bool take_auto(std::string_view key, const nlohmann::json* v, AutoOk auto_ok);
  void type_error(std::string_view key, const nlohmann::json& v, std::string_view expected);
  // `v` as a double; else reports at `path` ("expected <expected>, got ...", or an underflow) and
  // returns false. Numeric strings are read only with `strings_ok`.
  bool to_double(const std::string& path, const nlohmann::json& v, bool strings_ok, std::string_view expected,
                 double* out);

  ParseState* state_;
  std::string path_;
  std::map<std::string, const nlohmann::json*> keys_;  // present keys, by (aliased) name
  std::vector<std::string> known_;                     // every key a getter asked about
  std::set<std::string> taken_;
  std::map<std::string, std::string> renamed_;  // new name → the old name the user wrote
};

// Note [Numbers as strings]
// DeepSpeed's configs write element counts as strings ("sub_group_size": "5e8"), so a count or an
// integer key reads a numeric string. A real-valued key (lr, betas, eps, loss_scale, ...) does not:
// DeepSpeed hands the optimizer's params to torch, which refuses "lr": "0.001", and a quoted real
// is more often a mistake than a style.

// "5e8" → a double, for numbers written as strings. Fails on anything else, and on text that
// underflows (underflow_reason).
bool parse_number_text(std::string_view text, double* out);
// Why decimal number text (a JSON literal or a numeric string) does not read as the value it
// writes: "it underflows to 0" for "1e-400" (a non-zero digit that reads as 0, or as a denormal,
// would silently be another value); "" when it reads as written or is no decimal number.
std::string underflow_reason(std::string_view text);
// A short rendering of a JSON value for error messages ("\"abc\"", "true", "[...]").
std::string describe(const nlohmann::json& v);

// Resolves `c` as parsed from `root` (config_resolve.cpp): each "auto" from the model size, the
// flags in `ctx` and the other keys, then the rules between keys of different blocks; errors and
// warnings into st.
void resolve_config(ParseState* st, const ResolveContext& ctx, const nlohmann::json& root, Config* c);

}  // namespace zo::engine::detail
