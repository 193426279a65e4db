#include "engine/config/json_reader.h"

#include <algorithm>
#include <cfloat>
#include <cmath>
#include <cstdlib>

#include "common/bytes.h"
#include "common/string_util.h"

namespace zo::engine::detail {

using nlohmann::json;

namespace {

// Decimal number text → a finite double, underflow or not.
bool read_decimal(std::string_view text, double* out) {
  std::string s(text);
  if (s.empty()) return false;
  // strtod accepts hex and "inf"/"nan"; configs use decimal only.
  for (char c : s)
    if (!(std::isdigit(static_cast<unsigned char>(c)) || c == '.' || c == 'e' || c == 'E' || c == '-' || c == '+'))
      return false;
  char* end = nullptr;
  const double v = std::strtod(s.c_str(), &end);
  if (end != s.c_str() + s.size() || !std::isfinite(v)) return false;
  *out = v;
  return true;
}

}  // namespace

std::string underflow_reason(std::string_view text) {
  double v = 0;
  if (!read_decimal(text, &v) || (v != 0 && std::fabs(v) >= DBL_MIN)) return "";
  const std::string_view mantissa = text.substr(0, text.find_first_of("eE"));
  if (mantissa.find_first_of("123456789") == std::string_view::npos) return "";  // a zero: "0.0", "0e-400"
  return v == 0 ? "it underflows to 0" : "it underflows to a denormal, below " + format_number(DBL_MIN);
}

bool parse_number_text(std::string_view text, double* out) {
  double v = 0;
  if (!read_decimal(text, &v) || !underflow_reason(text).empty()) return false;
  *out = v;
  return true;
}

std::string describe(const json& v) {
  if (v.is_object()) return "an object";
  if (v.is_array()) return "an array";
  if (v.is_null()) return "null";
  std::string s = v.dump();
  if (s.size() > 40) s = s.substr(0, 37) + "...";
  return s;
}

const json* json_at(const json& root, std::string_view dotted_path) {
  const json* node = &root;
  size_t begin = 0;
  while (true) {
    const size_t dot = dotted_path.find('.', begin);
    const std::string key(
        dotted_path.substr(begin, dot == std::string_view::npos ? std::string_view::npos : dot - begin));
    if (!node->is_object()) return nullptr;
    auto it = node->find(key);
    if (it == node->end() || it->is_null()) return nullptr;
    node = &*it;
    if (dot == std::string_view::npos) return node;
    begin = dot + 1;
  }
}

ObjectReader::ObjectReader(ParseState* state, const json* j, std::string path) : state_(state), path_(std::move(path)) {
  if (j == nullptr) return;
  for (auto it = j->begin(); it != j->end(); ++it) keys_[it.key()] = &it.value();
}

std::string ObjectReader::key_path(std::string_view key) const {
  return path_.empty() ? std::string(key) : path_ + "." + std::string(key);
}

void ObjectReader::alias(std::string_view old_key, std::string_view new_key, bool deprecated) {
  known_.emplace_back(old_key);
  auto it = keys_.find(std::string(old_key));
  if (it == keys_.end()) return;
  taken_.insert(std::string(old_key));
  if (keys_.count(std::string(new_key))) {
    state_->error(key_path(old_key),
                  "given together with its newer name " + key_path(new_key) + "; keep only " + std::string(new_key));
    return;
  }
  if (deprecated) state_->warn(key_path(old_key), "deprecated name; read as " + key_path(new_key) + " (rename it)");
  keys_[std::string(new_key)] = it->second;
  renamed_[std::string(new_key)] = std::string(old_key);
  keys_.erase(it);
}

void ObjectReader::accept_without_effect(std::string_view key, std::string_view why, NoEffectValue value) {
  known_.emplace_back(key);
  if (!has(key)) return;
  bool valid = true;
  bool flag = false;
  uint64_t n = 0;
  switch (value) {
    case NoEffectValue::kAny: take(key); break;
    case NoEffectValue::kBool: valid = boolean(key, &flag); break;
    case NoEffectValue::kCount: valid = count(key, &n); break;
  }
  if (valid) state_->warn(key_path(key), "accepted but has no effect in zoffload: " + std::string(why));
}

const json* ObjectReader::take(std::string_view key) {
  known_.emplace_back(key);
  auto it = keys_.find(std::string(key));
  if (it == keys_.end()) return nullptr;
  taken_.insert(it->first);
  return it->second;
}

bool ObjectReader::take_auto(std::string_view key, const json* v, AutoOk auto_ok) {
  if (!v->is_string() || v->get_ref<const std::string&>() != "auto") return false;
  if (auto_ok == AutoOk::kYes) {
    state_->autos.insert(key_path(key));
  } else {
    state_->error(key_path(key), "\"auto\" is not accepted here; give a value");
  }
  return true;
}

void ObjectReader::type_error(std::string_view key, const json& v, std::string_view expected) {
  state_->error(key_path(key), "expected " + std::string(expected) + ", got " + describe(v));
}

bool ObjectReader::to_double(const std::string& path, const json& v, bool strings_ok, std::string_view expected,
                             double* out) {
  if (v.is_number()) {
    // A literal that underflows never gets here: parse_config refuses it before the parse.
    *out = v.get<double>();
    return true;
  }
  std::string message = "expected " + std::string(expected) + ", got " + describe(v);
  if (v.is_string()) {
    const std::string& text = v.get_ref<const std::string&>();
    double d = 0;
    if (parse_number_text(text, &d)) {
      if (strings_ok) {  // Note [Numbers as strings]
        *out = d;
        return true;
      }
      message += " (a string; write the number without quotes)";
    } else if (std::string why = underflow_reason(text); !why.empty()) {
      message = describe(v) + " is not representable (" + why + ")";
    }
  }
  state_->error(path, message);
  return false;
}

bool ObjectReader::boolean(std::string_view key, bool* out, AutoOk auto_ok) {
  const json* v = take(key);
  if (v == nullptr || take_auto(key, v, auto_ok)) return false;
  if (!v->is_boolean()) {
    type_error(key, *v, "true or false");
    return false;
  }
  *out = v->get<bool>();
  return true;
}

bool ObjectReader::count(std::string_view key, uint64_t* out, uint64_t min, AutoOk auto_ok) {
  const json* v = take(key);
  if (v == nullptr || take_auto(key, v, auto_ok)) return false;
  uint64_t value = 0;
  if (v->is_number_unsigned()) {
    value = v->get<uint64_t>();
  } else if (v->is_number_integer()) {
    // A signed integer: what nlohmann::json gives for ints set from C++ (parsed text gives
    // unsigned for every non-negative integer).
    const int64_t i = v->get<int64_t>();
    if (i < 0) {
      state_->error(key_path(key), "must be ≥ " + std::to_string(min) + " (got " + v->dump() + ")");
      return false;
    }
    value = static_cast<uint64_t>(i);
  } else if (v->is_number_float() || v->is_string()) {
    double d = 0;
    if (!to_double(key_path(key), *v, /*strings_ok=*/true, "a whole number (e.g. 100000 or \"5e8\")", &d)) return false;
    if (d < 0) {
      state_->error(key_path(key), "must be ≥ " + std::to_string(min) + " (got " + describe(*v) + ")");
      return false;
    }
    if (d != std::floor(d) || d >= 1.8446744073709552e19) {
      state_->error(key_path(key), "must be a whole number (got " + describe(*v) + ")");
      return false;
    }
    value = static_cast<uint64_t>(d);
  } else {
    type_error(key, *v, "a whole number");
    return false;
  }
  if (value < min) {
    state_->error(key_path(key), "must be ≥ " + std::to_string(min) + " (got " + std::to_string(value) + ")");
    return false;
  }
  *out = value;
  return true;
}

bool ObjectReader::integer(std::string_view key, int* out, int min, int max, AutoOk auto_ok) {
  const json* v = take(key);
  if (v == nullptr || take_auto(key, v, auto_ok)) return false;
  double d = 0;
  if (!to_double(key_path(key), *v, /*strings_ok=*/true, "an integer", &d)) return false;
  if (d != std::floor(d)) {
    type_error(key, *v, "an integer");
    return false;
  }
  if (d < min || d > max) {
    state_->error(key_path(key), "must be between " + std::to_string(min) + " and " + std::to_string(max) + " (got " +
                                     describe(*v) + ")");
    return false;
  }
  *out = static_cast<int>(d);
  return true;
}

bool ObjectReader::number(std::string_view key, double* out, double min, double max, bool min_exclusive,
                          AutoOk auto_ok) {
  const json* v = take(key);
  if (v == nullptr || take_auto(key, v, auto_ok)) return false;
  double d = 0;
  if (!to_double(key_path(key), *v, /*strings_ok=*/false, "a number", &d)) return false;
  const bool below = min_exclusive ? d <= min : d < min;
  if (below || d > max) {
    std::string range = min_exclusive ? "> " + format_number(min) : "≥ " + format_number(min);
    if (max < std::numeric_limits<double>::max()) range += " and ≤ " + format_number(max);
    state_->error(key_path(key), "must be " + range + " (got " + describe(*v) + ")");
    return false;
  }
  *out = d;
  return true;
}

bool ObjectReader::string(std::string_view key, std::string* out) {
  const json* v = take(key);
  if (v == nullptr) return false;
  if (!v->is_string()) {
    type_error(key, *v, "a string");
    return false;
  }
  // The strings read here are paths and names, whose bytes go to the C file API: it would stop at
  // a NUL, so "a\u0000b" would silently name "a". No config string legitimately holds one.
  if (v->get_ref<const std::string&>().find('\0') != std::string::npos) {
    state_->error(key_path(key), "contains a NUL character (\\u0000)");
    return false;
  }
  *out = v->get<std::string>();
  return true;
}

bool ObjectReader::string_list(std::string_view key, std::vector<std::string>* out) {
  const json* v = take(key);
  if (v == nullptr) return false;
  if (v->is_string()) {
    if (v->get_ref<const std::string&>().find('\0') != std::string::npos) {
      state_->error(key_path(key), "contains a NUL character (\\u0000)");
      return false;
    }
    *out = {v->get<std::string>()};
    return true;
  }
  if (!v->is_array()) {
    type_error(key, *v, "a string or an array of strings");
    return false;
  }
  std::vector<std::string> values;
  for (size_t i = 0; i < v->size(); ++i) {
    const json& e = (*v)[i];
    const std::string at = key_path(key) + "[" + std::to_string(i) + "]";
    if (!e.is_string()) {
      state_->error(at, "expected a string, got " + std::string(e.type_name()));
      return false;
    }
    if (e.get_ref<const std::string&>().find('\0') != std::string::npos) {
      state_->error(at, "contains a NUL character (\\u0000)");
      return false;
    }
    values.push_back(e.get<std::string>());
  }
  *out = std::move(values);
  return true;
}

bool ObjectReader::choice(std::string_view key, std::span<const std::string_view> choices, std::string* out,
                          AutoOk auto_ok) {
  const json* v = take(key);
  if (v == nullptr) return false;
  std::vector<std::string> names(choices.begin(), choices.end());
  // Where "auto" is itself one of the choices it is a value, not a request for resolution.
  const bool auto_is_choice = std::find(names.begin(), names.end(), "auto") != names.end();
  if (!auto_is_choice && take_auto(key, v, auto_ok)) return false;
  if (v->is_string()) {
    const std::string& s = v->get_ref<const std::string&>();
    for (std::string_view c : choices)
      if (s == c) {
        *out = s;
        return true;
      }
  }
  std::string msg = "must be one of " + join(names, ", ") + " (got " + describe(*v) + ")";
  if (v->is_string()) {
    const std::string guess = closest_match(v->get_ref<const std::string&>(), names);
    if (!guess.empty()) msg += "; did you mean \"" + guess + "\"?";
  }
  state_->error(key_path(key), msg);
  return false;
}

bool ObjectReader::size_bytes(std::string_view key, uint64_t* out) {
  const json* v = take(key);
  if (v == nullptr) return false;
  if (v->is_number_unsigned()) {
    *out = v->get<uint64_t>();
    return true;
  }
  if (v->is_number_integer() && v->get<int64_t>() >= 0) {  // set from C++ rather than parsed
    *out = static_cast<uint64_t>(v->get<int64_t>());
    return true;
  }
  if (v->is_string()) {
    Result<uint64_t> r = parse_size_bytes(v->get_ref<const std::string&>());
    if (r.is_ok()) {
      *out = *r;
      return true;
    }
    state_->error(key_path(key), r.status().message());
    return false;
  }
  type_error(key, *v, "a size in bytes (e.g. 4096 or \"24GiB\")");
  return false;
}

bool ObjectReader::number_array(std::string_view key, std::span<double> out, double min, double max, AutoOk auto_ok) {
  const json* v = take(key);
  if (v == nullptr || take_auto(key, v, auto_ok)) return false;
  if (!v->is_array() || v->size() != out.size()) {
    type_error(key, *v, "an array of " + std::to_string(out.size()) + " numbers");
    return false;
  }
  bool ok = true;
  for (size_t i = 0; i < out.size(); ++i) {
    const json& e = (*v)[i];
    const std::string p = key_path(key) + "[" + std::to_string(i) + "]";
    double d = 0;
    if (!to_double(p, e, /*strings_ok=*/false, "a number", &d)) {
      ok = false;
      continue;
    }
    if (d < min || d >= max) {
      state_->error(p,
                    "must be ≥ " + format_number(min) + " and < " + format_number(max) + " (got " + describe(e) + ")");
      ok = false;
      continue;
    }
    out[i] = d;
  }
  return ok;
}

ObjectReader ObjectReader::child(std::string_view key) {
  const json* v = take(key);
  if (v != nullptr && !v->is_object()) {
    type_error(key, *v, "an object");
    v = nullptr;
  }
  return ObjectReader(state_, v, key_path(key));
}

void ObjectReader::finish() {
  for (const auto& [key, value] : keys_) {
    if (taken_.count(key)) continue;
    std::string msg = "unknown key";
    // Only a key of a known key's length can be its typo, and the edit distance costs the product
    // of the lengths: a megabyte-long key gets no suggestion, and its path is an excerpt.
    const std::string shown = bounded_name(key);
    const std::string guess = shown == key ? closest_match(key, known_) : "";
    if (!guess.empty()) msg += "; did you mean \"" + guess + "\"?";
    state_->error(key_path(shown), msg);
  }
}

}  // namespace zo::engine::detail
