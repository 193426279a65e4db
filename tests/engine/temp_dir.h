// TempDir: a fresh directory for one test's real files (swap files, run directories), removed with
// everything in it when the object dies. Under $ZO_TEST_TMPDIR, else $TMPDIR, else /tmp — point
// either at a file system with O_DIRECT to test it. Test-only; not thread-safe.
#pragma once

#include <stdlib.h>

#include <cerrno>
#include <cstring>
#include <filesystem>
#include <string>
#include <string_view>

#include "common/check.h"

namespace zo::engine {

inline std::string temp_root() {
  for (const char* var : {"ZO_TEST_TMPDIR", "TMPDIR"}) {
    const char* v = std::getenv(var);
    if (v != nullptr && *v != '\0') return v;
  }
  return "/tmp";
}

struct TempDir {
  std::string path;
  explicit TempDir(std::string_view prefix = "zo_engine_test") {
    std::string tmpl = temp_root() + "/" + std::string(prefix) + "_XXXXXX";
    const char* p = mkdtemp(tmpl.data());
    ZO_CHECK(p != nullptr) << "mkdtemp in " << temp_root() << ": " << std::strerror(errno);
    path = p;
  }
  ~TempDir() {
    std::error_code ec;
    std::filesystem::remove_all(path, ec);
  }
  TempDir(const TempDir&) = delete;
  TempDir& operator=(const TempDir&) = delete;
};

}  // namespace zo::engine
