// Writes the best settings found by `zoffload-bench io` into a DeepSpeed/zoffload JSON config as
// its top-level "aio" block, keeping everything else. Files go through io::Env::posix(); not
// thread-safe for the same path.
#pragma once

#include <string>

#include "common/status.h"
#include "io/io_options.h"

namespace zo::tools {

// Checks that `path` is absent or a regular file holding a JSON object (Note [Output files] in
// io/env.h), so a sweep never runs only to fail at the end. InvalidArgument naming the path and
// what is wrong (a directory, a FIFO, the parse error) otherwise.
Status check_emit_config_target(const std::string& path);

// Reads `path` if it exists, sets aio.block_size (bytes), aio.queue_depth,
// aio.intra_op_parallelism, aio.single_submit and aio.overlap_events from `best` (other keys of
// "aio" stay, except the deprecated alias thread_count, which intra_op_parallelism replaces), keeps
// every other key in its order, and writes the result atomically with io::Env::publish_file (a
// temporary file beside it, fdatasynced, renamed over it, the directory fsynced). An unparseable
// existing file is an error and is left untouched.
Status emit_aio_config(const std::string& path, const io::IoOptions& best);

}  // namespace zo::tools
