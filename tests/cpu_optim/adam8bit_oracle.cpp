// The zoffload side of tests/cpu_optim/adam8bit_bnb_test.py: runs cpu_optim::adam8bit_step (or
// lion8bit_step, adagrad8bit_step) over the steps that script wrote and writes the parameters and
// the states back for it to compare with bitsandbytes. usage: adam8bit_oracle DIR THREADS ISA
// [adam|lion|adagrad] (ISA: auto, scalar, avx2, avx512; default adam), or adam8bit_oracle --maps
// FILE (writes the signed then the unsigned dynamic map, 512 floats).
//   DIR/meta.txt: n steps lr beta1 beta2 eps weight_decay (text); DIR/params.f32 (n floats);
//   DIR/grads.f32 (steps × n floats). Writes DIR/out_params.f32, out_m_codes.u8, out_m_absmax.f32
//   (Adam's exp_avg, Lion's momentum, Adagrad's sum of squares) and, for Adam, out_v_codes.u8 and
//   out_v_absmax.f32. Exit 0, or 1 with a line on stderr.
#include <cstdint>
#include <cstdio>
#include <fstream>
#include <string>
#include <vector>

#include "cpu_optim/adagrad.h"
#include "cpu_optim/adam8bit.h"
#include "cpu_optim/executor.h"
#include "cpu_optim/isa.h"
#include "cpu_optim/lion.h"
#include "tests/oracle_files.h"

namespace {

using zo::testing::read_all;
using zo::testing::write_all;

int fail(const std::string& msg) {
  std::fprintf(stderr, "adam8bit_oracle: %s\n", msg.c_str());
  return 1;
}

}  // namespace

int main(int argc, char** argv) {
  using namespace zo::cpu_optim;
  if (argc == 3 && std::string(argv[1]) == "--maps") {
    std::vector<float> maps(signed_dynamic_map().begin(), signed_dynamic_map().end());
    maps.insert(maps.end(), unsigned_dynamic_map().begin(), unsigned_dynamic_map().end());
    return write_all(argv[2], maps) ? 0 : fail(std::string("cannot write ") + argv[2]);
  }
  if (argc != 4 && argc != 5) return fail("usage: adam8bit_oracle DIR THREADS ISA [adam|lion|adagrad] | --maps FILE");
  const std::string optimizer = argc == 5 ? argv[4] : "adam";
  if (optimizer != "adam" && optimizer != "lion" && optimizer != "adagrad")
    return fail("unknown optimizer " + optimizer);
  const std::string dir = argv[1];
  size_t n = 0, steps = 0;
  zo::AdamConfig c;
  {
    std::ifstream meta(dir + "/meta.txt");
    if (!(meta >> n >> steps >> c.lr >> c.beta1 >> c.beta2 >> c.eps >> c.weight_decay)) return fail("bad meta.txt");
  }
  c.adam_w_mode = true;
  std::vector<float> params(n), grads(n * steps), m_absmax(quant_block_count(n)), v_absmax(quant_block_count(n));
  std::vector<uint8_t> m_codes(n), v_codes(n);
  if (!read_all(dir + "/params.f32", &params) || !read_all(dir + "/grads.f32", &grads))
    return fail("params.f32 or grads.f32 is not n (steps × n) floats");
  const auto isa = parse_isa(argv[3]);
  if (!isa.is_ok()) return fail(isa.status().to_string());
  auto ex = Executor::create({.n_threads = std::stoi(argv[2]), .isa = *isa});
  if (!ex.is_ok()) return fail(ex.status().to_string());
  for (size_t t = 0; t < steps; ++t) {
    const ConstElemSpan g{grads.data() + t * n, zo::DType::kF32};
    const ElemSpan none{nullptr, zo::DType::kBF16};
    zo::Status s;
    if (optimizer == "lion") {
      const LionConfig lc{.lr = c.lr, .beta1 = c.beta1, .beta2 = c.beta2, .weight_decay = c.weight_decay};
      s = lion8bit_step(lc, params, {m_codes, m_absmax}, g, 1.0f, none, **ex);
    } else if (optimizer == "adagrad") {
      const AdagradConfig ac{.lr = c.lr, .eps = c.eps, .weight_decay = c.weight_decay};
      s = adagrad8bit_step(ac, params, {m_codes, m_absmax}, g, 1.0f, none, **ex);
    } else {
      s = adam8bit_step(c, static_cast<int64_t>(t + 1), params, {m_codes, m_absmax}, {v_codes, v_absmax}, g, 1.0f, none,
                        **ex);
    }
    if (!s.is_ok()) return fail(s.to_string());
  }
  if (optimizer != "adam") {
    if (!write_all(dir + "/out_params.f32", params) || !write_all(dir + "/out_m_codes.u8", m_codes) ||
        !write_all(dir + "/out_m_absmax.f32", m_absmax))
      return fail("cannot write the outputs under " + dir);
    return 0;
  }
  if (!write_all(dir + "/out_params.f32", params) || !write_all(dir + "/out_m_codes.u8", m_codes) ||
      !write_all(dir + "/out_m_absmax.f32", m_absmax) || !write_all(dir + "/out_v_codes.u8", v_codes) ||
      !write_all(dir + "/out_v_absmax.f32", v_absmax))
    return fail("cannot write the outputs under " + dir);
  return 0;
}
