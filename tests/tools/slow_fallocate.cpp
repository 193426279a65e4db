// An LD_PRELOAD shim for tests: every fallocate(2) first sleeps ZO_TEST_FALLOCATE_DELAY_MS
// milliseconds, and every ftruncate(2) ZO_TEST_FTRUNCATE_DELAY_MS, so that a test can signal a
// process while it sizes a file — zoffload train during its start, with a swap file created and
// locked but not yet sized or filled, or during a checkpoint save, its files created but not sized.
#include <dlfcn.h>
#include <sys/types.h>

#include <cerrno>
#include <cstdlib>
#include <ctime>

namespace {

void delay(const char* variable = "ZO_TEST_FALLOCATE_DELAY_MS") {
  const char* text = std::getenv(variable);
  if (text == nullptr) return;
  const long ms = std::strtol(text, nullptr, 10);
  timespec left{ms / 1000, (ms % 1000) * 1'000'000};
  while (nanosleep(&left, &left) != 0 && errno == EINTR) {}
}

template <class Fn>
Fn next(const char* name) {
  return reinterpret_cast<Fn>(dlsym(RTLD_NEXT, name));
}

}  // namespace

extern "C" int fallocate(int fd, int mode, off_t offset, off_t len) {
  using Fn = int (*)(int, int, off_t, off_t);
  static const Fn real = next<Fn>("fallocate");
  delay();
  return real(fd, mode, offset, len);
}

extern "C" int fallocate64(int fd, int mode, off64_t offset, off64_t len) {
  using Fn = int (*)(int, int, off64_t, off64_t);
  static const Fn real = next<Fn>("fallocate64");
  delay();
  return real(fd, mode, offset, len);
}

extern "C" int ftruncate(int fd, off_t len) {
  using Fn = int (*)(int, off_t);
  static const Fn real = next<Fn>("ftruncate");
  delay("ZO_TEST_FTRUNCATE_DELAY_MS");
  return real(fd, len);
}

extern "C" int ftruncate64(int fd, off64_t len) {
  using Fn = int (*)(int, off64_t);
  static const Fn real = next<Fn>("ftruncate64");
  delay("ZO_TEST_FTRUNCATE_DELAY_MS");
  return real(fd, len);
}
