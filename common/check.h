// ZO_CHECK(cond) << "message": aborts with file:line when an invariant is broken. For bugs only;
// expected failures return a Status (common/status.h). Thread-safe (writes one line to stderr).
#pragma once

#include <sstream>

namespace zo::detail {

class CheckFailure {
 public:
  CheckFailure(const char* file, int line, const char* condition);
  [[noreturn]] ~CheckFailure();
  CheckFailure(const CheckFailure&) = delete;
  CheckFailure& operator=(const CheckFailure&) = delete;

  template <typename T>
  CheckFailure& operator<<(const T& v) {
    stream_ << v;
    return *this;
  }

 private:
  std::ostringstream stream_;
};

// Lets `ZO_CHECK(c) << x` be an expression whose unused branch has type void.
struct Voidify {
  void operator&(const CheckFailure&) {}
};

}  // namespace zo::detail

#define ZO_CHECK(cond)                      \
  (__builtin_expect(!!(cond), 1)) ? (void)0 \
                                  : ::zo::detail::Voidify() & ::zo::detail::CheckFailure(__FILE__, __LINE__, #cond)

#define ZO_CHECK_EQ(a, b) ZO_CHECK((a) == (b)) << "(" << (a) << " vs " << (b) << ") "
#define ZO_CHECK_LE(a, b) ZO_CHECK((a) <= (b)) << "(" << (a) << " vs " << (b) << ") "
#define ZO_CHECK_LT(a, b) ZO_CHECK((a) < (b)) << "(" << (a) << " vs " << (b) << ") "
