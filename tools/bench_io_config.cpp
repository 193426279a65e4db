#include "tools/bench_io_config.h"

#include <nlohmann/json.hpp>
#include <string_view>

#include "common/string_util.h"
#include "engine/config/config.h"
#include "io/env.h"

namespace zo::tools {
namespace {

using Json = nlohmann::ordered_json;

constexpr std::string_view kWhat = "--emit-config file";

// Loads the existing config: an empty object if the file does not exist.
Result<Json> load(const std::string& path) {
  io::Env* env = io::Env::posix();
  ZO_ASSIGN_OR_RETURN(const io::PathKind kind, env->path_kind(path));
  if (kind == io::PathKind::kMissing) return Json::object();
  ZO_ASSIGN_OR_RETURN(const std::string text, env->read_file(path, kWhat, engine::kMaxConfigFileBytes));
  if (text.find_first_not_of(" \t\r\n") == std::string::npos) return Json::object();
  Json j;
  try {
    j = Json::parse(text);
  } catch (const Json::exception& e) {  // parse_error, or out_of_range for a number too long
    return invalid_argument(path + ": " + quote_excerpt(e.what(), 160) + " (left unchanged)");
  }
  if (!j.is_object()) return invalid_argument(path + ": the top level is not a JSON object (left unchanged)");
  if (j.contains("aio") && !j["aio"].is_object())
    return invalid_argument(path + ": \"aio\" is not an object (left unchanged)");
  return j;
}

}  // namespace

Status check_emit_config_target(const std::string& path) {
  ZO_RETURN_IF_ERROR(io::Env::posix()->check_output_file(path, kWhat));
  auto j = load(path);
  return j.is_ok() ? Status::ok() : j.status();
}

Status emit_aio_config(const std::string& path, const io::IoOptions& best) {
  ZO_ASSIGN_OR_RETURN(Json config, load(path));
  Json aio = config.contains("aio") ? config["aio"] : Json::object();
  aio.erase("thread_count");
  aio["block_size"] = best.block_size_bytes;
  aio["queue_depth"] = best.queue_depth;
  aio["intra_op_parallelism"] = best.threads;
  aio["single_submit"] = best.single_submit;
  aio["overlap_events"] = best.overlap_events;
  config["aio"] = aio;
  return io::Env::posix()->publish_file(path, config.dump(2) + "\n", kWhat);
}

}  // namespace zo::tools
