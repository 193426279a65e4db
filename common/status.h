// Status and Result<T>: the error values every module returns for expected failures (I/O errors,
// missing kernel features, bad configs). No exceptions cross module boundaries.
// Value types; safe to copy and move between threads. Not synchronised: don't share one mutably.
#pragma once

#include <cerrno>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <variant>

#include "common/check.h"

namespace zo {

enum class StatusCode {
  kOk = 0,
  kInvalidArgument,  // bad input: config, command line, file contents
  kNotFound,
  kAlreadyExists,
  kIoError,      // an I/O syscall failed (errno is set)
  kNoSpace,      // ENOSPC, or a byte budget that cannot be met
  kOutOfMemory,  // allocation failed or a device/pinned budget was exceeded
  kUnavailable,  // a feature the kernel/hardware/build lacks (io_uring, CUDA, ...)
  kCorruption,   // checksum or format mismatch
  kFailedPrecondition,
  kAborted,
  kInternal,
};

std::string_view status_code_name(StatusCode code);

class [[nodiscard]] Status {
 public:
  Status() = default;  // OK
  Status(StatusCode code, std::string message, int sys_errno = 0)
      : code_(code), errno_(sys_errno), message_(std::move(message)) {}

  static Status ok() { return Status(); }

  bool is_ok() const { return code_ == StatusCode::kOk; }
  explicit operator bool() const { return is_ok(); }
  StatusCode code() const { return code_; }
  int sys_errno() const { return errno_; }
  const std::string& message() const { return message_; }

  // Prepends context ("while reading shard 3: ") and returns *this for chaining.
  Status& with_context(std::string_view context);

  // "IoError: pread /x offset 4096: Input/output error (errno 5)".
  std::string to_string() const;

 private:
  StatusCode code_ = StatusCode::kOk;
  int errno_ = 0;
  std::string message_;
};

// Helpers that read like the failure they describe.
Status invalid_argument(std::string message);
Status not_found(std::string message);
Status io_error(std::string message, int sys_errno);
Status unavailable(std::string message);
Status corruption(std::string message);
Status out_of_memory(std::string message);
Status failed_precondition(std::string message);
Status internal_error(std::string message);
// ENOSPC maps to kNoSpace, everything else to kIoError; the errno text is appended.
Status errno_status(std::string message, int sys_errno);

// A value or the Status explaining why there is none.
template <typename T>
class [[nodiscard]] Result {
 public:
  Result(T value) : v_(std::move(value)) {}        // NOLINT(google-explicit-constructor)
  Result(Status status) : v_(std::move(status)) {  // NOLINT(google-explicit-constructor)
    ZO_CHECK(!std::get<Status>(v_).is_ok()) << "Result constructed from an OK Status";
  }

  bool is_ok() const { return std::holds_alternative<T>(v_); }
  explicit operator bool() const { return is_ok(); }

  const Status& status() const {
    static const Status kOk;
    return is_ok() ? kOk : std::get<Status>(v_);
  }
  T& value() & {
    ZO_CHECK(is_ok()) << "Result::value() on error: " << std::get<Status>(v_).to_string();
    return std::get<T>(v_);
  }
  const T& value() const& {
    ZO_CHECK(is_ok()) << "Result::value() on error: " << std::get<Status>(v_).to_string();
    return std::get<T>(v_);
  }
  T&& value() && {
    ZO_CHECK(is_ok()) << "Result::value() on error: " << std::get<Status>(v_).to_string();
    return std::get<T>(std::move(v_));
  }
  T* operator->() { return &value(); }
  const T* operator->() const { return &value(); }
  T& operator*() & { return value(); }
  const T& operator*() const& { return value(); }

 private:
  std::variant<T, Status> v_;
};

}  // namespace zo

// Returns the Status from the enclosing function if `expr` is not OK.
#define ZO_RETURN_IF_ERROR(expr)                \
  do {                                          \
    ::zo::Status zo_status_ = (expr);           \
    if (!zo_status_.is_ok()) return zo_status_; \
  } while (0)

#define ZO_CONCAT_INNER_(a, b) a##b
#define ZO_CONCAT_(a, b) ZO_CONCAT_INNER_(a, b)
// `ZO_ASSIGN_OR_RETURN(auto x, make_x());` declares x from the Result or returns its Status.
#define ZO_ASSIGN_OR_RETURN(lhs, expr) ZO_ASSIGN_OR_RETURN_IMPL_(ZO_CONCAT_(zo_result_, __LINE__), lhs, expr)
#define ZO_ASSIGN_OR_RETURN_IMPL_(tmp, lhs, expr) \
  auto tmp = (expr);                              \
  if (!tmp.is_ok()) return tmp.status();          \
  lhs = std::move(tmp).value()
