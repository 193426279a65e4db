// Leveled logging to stderr: ZO_LOG(kInfo) << "...". The level comes from ZO_LOG_LEVEL
// (debug|info|warn|error, default info) or set_log_level(). Thread-safe: each message is written
// with one write() so lines from different threads never interleave.
#pragma once

#include <sstream>
#include <string_view>

namespace zo {

enum class LogLevel { kDebug = 0, kInfo = 1, kWarn = 2, kError = 3, kOff = 4 };

LogLevel log_level();
void set_log_level(LogLevel level);
// Parses "debug", "info", "warn", "error", "off"; returns false for anything else.
bool parse_log_level(std::string_view text, LogLevel* out);

namespace detail {
class LogMessage {
 public:
  LogMessage(LogLevel level, const char* file, int line);
  ~LogMessage();
  LogMessage(const LogMessage&) = delete;
  LogMessage& operator=(const LogMessage&) = delete;
  template <typename T>
  LogMessage& operator<<(const T& v) {
    stream_ << v;
    return *this;
  }

 private:
  std::ostringstream stream_;
};
struct LogVoidify {
  void operator&(const LogMessage&) {}
};
}  // namespace detail

}  // namespace zo

#define ZO_LOG(level)                         \
  (::zo::LogLevel::level < ::zo::log_level()) \
      ? (void)0                               \
      : ::zo::detail::LogVoidify() & ::zo::detail::LogMessage(::zo::LogLevel::level, __FILE__, __LINE__)
