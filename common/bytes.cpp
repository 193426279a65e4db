#include "common/bytes.h"

#include <cctype>
#include <charconv>
#include <cmath>
#include <cstdio>
#include <string>

namespace zo {
namespace {

std::string_view trim(std::string_view s) {
  while (!s.empty() && std::isspace(static_cast<unsigned char>(s.front()))) s.remove_prefix(1);
  while (!s.empty() && std::isspace(static_cast<unsigned char>(s.back()))) s.remove_suffix(1);
  return s;
}

std::string lower(std::string_view s) {
  std::string out(s);
  for (char& c : out) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  return out;
}

// Parses the leading number of `text` (digits, '.', exponent); `rest` gets what follows.
bool parse_leading_number(std::string_view text, long double* value, std::string_view* rest) {
  size_t i = 0;
  bool digits = false;
  while (i < text.size() && std::isdigit(static_cast<unsigned char>(text[i]))) {
    ++i;
    digits = true;
  }
  if (i < text.size() && text[i] == '.') {
    ++i;
    while (i < text.size() && std::isdigit(static_cast<unsigned char>(text[i]))) {
      ++i;
      digits = true;
    }
  }
  if (!digits) return false;
  if (i < text.size() && (text[i] == 'e' || text[i] == 'E')) {
    size_t j = i + 1;
    if (j < text.size() && (text[j] == '+' || text[j] == '-')) ++j;
    size_t exp_start = j;
    while (j < text.size() && std::isdigit(static_cast<unsigned char>(text[j]))) ++j;
    if (j > exp_start) i = j;  // "5e8"; a bare "e" is left for the unit check to reject
  }
  std::string number(text.substr(0, i));
  char* end = nullptr;
  *value = std::strtold(number.c_str(), &end);
  if (end != number.c_str() + number.size()) return false;
  *rest = text.substr(i);
  return true;
}

}  // namespace

Result<uint64_t> parse_size_bytes(std::string_view text) {
  const std::string_view t = trim(text);
  const std::string quoted = "\"" + std::string(text) + "\"";
  if (!t.empty() && t.front() == '-') return invalid_argument("size " + quoted + " is negative");
  long double value = 0;
  std::string_view rest;
  if (!parse_leading_number(t, &value, &rest))
    return invalid_argument("size " + quoted + " is not a number with an optional unit (e.g. 24GiB, 5GB, 4096)");
  const std::string unit = lower(trim(rest));
  long double mult = 1;
  if (unit.empty() || unit == "b") mult = 1;
  else if (unit == "k" || unit == "kib") mult = kKiB;
  else if (unit == "m" || unit == "mib") mult = kMiB;
  else if (unit == "g" || unit == "gib") mult = kGiB;
  else if (unit == "t" || unit == "tib") mult = kTiB;
  else if (unit == "kb") mult = 1e3L;
  else if (unit == "mb") mult = 1e6L;
  else if (unit == "gb") mult = 1e9L;
  else if (unit == "tb") mult = 1e12L;
  else
    return invalid_argument("size " + quoted + " has unknown unit \"" + std::string(trim(rest)) +
                            "\" (use B, KiB, MiB, GiB, TiB, K, M, G, T, KB, MB, GB or TB)");
  const long double bytes = value * mult;
  if (!(bytes < 18446744073709551616.0L)) return invalid_argument("size " + quoted + " is too large");
  if (bytes != std::floor(bytes)) return invalid_argument("size " + quoted + " is not a whole number of bytes");
  return static_cast<uint64_t>(bytes);
}

Result<uint64_t> parse_count(std::string_view text) {
  const std::string_view t = trim(text);
  const std::string quoted = "\"" + std::string(text) + "\"";
  if (!t.empty() && t.front() == '-') return invalid_argument("count " + quoted + " is negative");
  long double value = 0;
  std::string_view rest;
  if (!parse_leading_number(t, &value, &rest) || !rest.empty())
    return invalid_argument("count " + quoted + " is not a number (e.g. 100000 or 5e8)");
  if (!(value < 18446744073709551616.0L)) return invalid_argument("count " + quoted + " is too large");
  if (value != std::floor(value)) return invalid_argument("count " + quoted + " is not a whole number");
  return static_cast<uint64_t>(value);
}

std::string format_bytes(uint64_t size_bytes) {
  static constexpr const char* kUnits[] = {"B", "KiB", "MiB", "GiB", "TiB", "PiB", "EiB"};
  if (size_bytes < kKiB) return std::to_string(size_bytes) + " B";
  double v = static_cast<double>(size_bytes);
  int u = 0;
  while (v >= 1024.0 && u < 6) {
    v /= 1024.0;
    ++u;
  }
  char buf[32];
  std::snprintf(buf, sizeof buf, v < 10 ? "%.2f %s" : v < 100 ? "%.1f %s" : "%.0f %s", v, kUnits[u]);
  return buf;
}

std::string format_count(uint64_t n) {
  char buf[32];
  if (n >= 1'000'000'000) std::snprintf(buf, sizeof buf, "%.2f B", static_cast<double>(n) / 1e9);
  else if (n >= 1'000'000) std::snprintf(buf, sizeof buf, "%.2f M", static_cast<double>(n) / 1e6);
  else std::snprintf(buf, sizeof buf, "%llu", static_cast<unsigned long long>(n));
  return buf;
}

}  // namespace zo
