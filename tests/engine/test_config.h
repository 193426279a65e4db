// parse_test_config: a config a test wrote, parsed by the real parser with the default resolve
// context. An invalid one is a bug in the test: it aborts listing every error. Test-only.
#pragma once

#include <string>
#include <string_view>

#include "common/check.h"
#include "engine/config/config.h"

namespace zo::engine {

inline Config parse_test_config(std::string_view json) {
  ConfigDiagnostics diag;
  auto config = parse_config(json, ResolveContext{}, &diag);
  std::string errors;
  for (const auto& e : diag.errors) errors += e.to_string() + "\n";
  ZO_CHECK(config.has_value()) << errors;
  return *config;
}

}  // namespace zo::engine
