// zoffload-bench adam's arguments, shared by its fp32-moment run (bench_adam.cpp) and its 8-bit
// moment run (bench_adam8bit.cpp). Plain values.
#pragma once

#include <string>

namespace zo::tools {

struct AdamArgs {
  std::string params = "2e8";
  std::string optimizer = "adamw";
  std::string moments = "fp32";  // fp32 | 8bit (zoffload.moment_dtype)
  std::string grad_dtype = "fp32";
  std::string copy_out = "bf16";
  std::string isa = "auto";
  int threads = 0;
  int repeats = 5;
  bool bind_cores = false;
  bool no_torch = false;
  bool torch_loop = false;
  bool json = false;
};

// --moments 8bit: adam8bit_step against the scalar path, then timed beside the fp32 kernel on the
// same parameters and a STREAM triad. Exit code as run_adam_bench's.
int run_adam8bit_bench(const AdamArgs& args);

}  // namespace zo::tools
