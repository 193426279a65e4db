#include "tools/bench_io_config.h"

#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>

#include "common/string_util.h"

namespace zo::tools {
namespace {

using Json = nlohmann::ordered_json;

// Loads the existing config: an empty object if the file does not exist.
Result<Json> load(const std::string& path) {
  std::ifstream in(path);
  if (!in) {
    if (errno == ENOENT) return Json::object();
    return errno_status("open " + path, errno);
  }
  std::stringstream ss;
  ss << in.rdbuf();
  const std::string text = ss.str();
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

Status write_all(int fd, const std::string& data, const std::string& path) {
  size_t done = 0;
  while (done < data.size()) {
    const ssize_t n = ::write(fd, data.data() + done, data.size() - done);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) return errno_status("write " + path, errno);
    done += static_cast<size_t>(n);
  }
  return Status::ok();
}

}  // namespace

Status check_emit_config_target(const std::string& path) {
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
  const std::string text = config.dump(2) + "\n";

  const std::string tmp = path + ".tmp." + std::to_string(::getpid());
  const int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) return errno_status("create " + tmp, errno);
  Status s = write_all(fd, text, tmp);
  if (s.is_ok() && ::fsync(fd) != 0) s = errno_status("fsync " + tmp, errno);
  if (::close(fd) != 0 && s.is_ok()) s = errno_status("close " + tmp, errno);
  if (s.is_ok() && std::rename(tmp.c_str(), path.c_str()) != 0) s = errno_status("rename " + tmp + " to " + path, errno);
  if (!s.is_ok()) std::remove(tmp.c_str());
  return s;
}

}  // namespace zo::tools
