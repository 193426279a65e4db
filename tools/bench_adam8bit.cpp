// zoffload-bench adam --moments 8bit|bf16 [--masters bf16]: one cpu_optim step with narrow states
// over N parameters — 8-bit blockwise moments (adam8bit_step, zoffload.moment_dtype "8bit"), bf16
// moments (adam_step_bf16_moments, "bf16"), and with --masters bf16 the same moments (fp32 too)
// beside bf16 masters rounded stochastically (adam_step_bf16_master, adam8bit_step_bf16_master,
// zoffload.master_dtype "bf16") — after checking the chosen SIMD path against the scalar path bit
// for bit; then, alternating round by round on the same threads and parameters, the fp32 kernel
// (adam_step) and a STREAM triad. Prints medians, the kernel's effective bandwidth over its
// own byte mix against the triad's, and its speed against the fp32 kernel's; --json for scripts
// (tools/bench_adam_bnb.py reads the 8-bit one).
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <nlohmann/json.hpp>
#include <span>
#include <string>
#include <type_traits>
#include <vector>

#include "common/aligned_buffer.h"
#include "common/bytes.h"
#include "common/status.h"
#include "common/timer.h"
#include "cpu_optim/adam.h"
#include "cpu_optim/adam8bit.h"
#include "cpu_optim/dtype.h"
#include "cpu_optim/executor.h"
#include "cpu_optim/isa.h"
#include "cpu_optim/vector_ops.h"
#include "tools/bench_adam.h"
#include "tools/bench_util.h"

namespace zo::tools {

namespace {

using cpu_optim::ConstElemSpan;
using cpu_optim::DType;
using cpu_optim::ElemSpan;
using cpu_optim::Executor;

// bitsandbytes' AdamW8bit defaults (betas, eps), the weight decay of the fp32 run.
constexpr cpu_optim::AdamConfig kHyper{
    .lr = 1e-3f, .beta1 = 0.9f, .beta2 = 0.999f, .eps = 1e-8f, .weight_decay = 0.01f, .adam_w_mode = true};

// One moment's codes and absmax, owned; the elements and blocks where two differ.
struct Moment8 {
  std::vector<uint8_t> codes;
  std::vector<float> absmax;
  explicit Moment8(size_t n) : codes(n, 0), absmax(cpu_optim::quant_block_count(n), 0.0f) {}
  cpu_optim::BlockwiseState state() { return {codes, absmax}; }
  size_t differ(const Moment8& o) const {
    size_t bad = 0;
    for (size_t i = 0; i < codes.size(); ++i) bad += codes[i] != o.codes[i];
    for (size_t b = 0; b < absmax.size(); ++b)
      bad += cpu_optim::float_bits(absmax[b]) != cpu_optim::float_bits(o.absmax[b]);
    return bad;
  }
};

// The same bits, or both NaN (payloads aside).
bool same_bits(float a, float b) {
  return cpu_optim::float_bits(a) == cpu_optim::float_bits(b) || (std::isnan(a) && std::isnan(b));
}
bool same_bits(uint16_t a, uint16_t b) {  // bf16
  auto nan = [](uint16_t x) { return (x & 0x7F80) == 0x7F80 && (x & 0x7F) != 0; };
  return a == b || (nan(a) && nan(b));
}

// One fp32 moment (beside bf16 masters) or bf16 moment, owned.
template <class T, DType D>
struct MomentOf {
  std::vector<T> values;
  explicit MomentOf(size_t n) : values(n, T{}) {}
  cpu_optim::ElemSpan span() { return {values.data(), D}; }
  size_t differ(const MomentOf& o) const {
    size_t bad = 0;
    for (size_t i = 0; i < values.size(); ++i) bad += !same_bits(values[i], o.values[i]);
    return bad;
  }
};
using Moment32 = MomentOf<float, DType::kF32>;
using Moment16 = MomentOf<uint16_t, DType::kBF16>;

// Correctness first: three steps on a slice (denormals, ±inf, NaN and ±0 planted in the gradients
// and parameters, a partial last block) with the timed path and with the scalar path; parameters,
// moments and the copy must match bit for bit (NaN payloads aside). step(t, p, m, v, grad, copy,
// executor) runs one step with parameters of type P (float, or uint16_t: bf16 masters) and moments
// of type M.
template <class P, class M, class Step>
Status check_against_scalar(Step step, const char* moments, DType gdt, bool has_copy, DType cdt, const Executor& ex,
                            size_t n, std::string* summary) {
  ZO_ASSIGN_OR_RETURN(auto scalar, Executor::create({.n_threads = ex.n_threads(), .isa = cpu_optim::Isa::kScalar}));
  const size_t gs = cpu_optim::dtype_size_bytes(gdt), cs = cpu_optim::dtype_size_bytes(cdt);
  std::vector<unsigned char> g(n * gs);
  random_fill(g.data(), gdt, n, 4, -1.0f, 1.0f, ex);
  std::vector<float> f0(n);
  random_fill(f0.data(), DType::kF32, n, 3, -1.0f, 1.0f, ex);
  const float specials[] = {1e-40f, -3e-39f, INFINITY, -INFINITY, NAN, -0.0f, 0.0f, 3e38f};
  for (size_t i = 0, s = 0; i < n; i += 997, ++s) {
    cpu_optim::store_from_float(g.data(), gdt, i, specials[s % 8]);
    f0[(i + 13) % n] = specials[(s + 3) % 8];
  }
  std::vector<P> p0(n);
  for (size_t i = 0; i < n; ++i) {
    if constexpr (std::is_same_v<P, float>) p0[i] = f0[i];
    else p0[i] = cpu_optim::float_to_bf16(f0[i]);
  }
  std::vector<P> p[2] = {p0, p0};
  std::vector<M> m{M(n), M(n)}, v{M(n), M(n)};
  std::vector<unsigned char> c[2] = {std::vector<unsigned char>(has_copy ? n * cs : 0),
                                     std::vector<unsigned char>(has_copy ? n * cs : 0)};
  for (int k = 0; k < 2; ++k) {
    for (int64_t t = 1; t <= 3; ++t)
      ZO_RETURN_IF_ERROR(step(t, std::span<P>(p[k]), m[k], v[k], ConstElemSpan{g.data(), gdt},
                              has_copy ? ElemSpan{c[k].data(), cdt} : ElemSpan{}, k == 0 ? ex : *scalar));
  }
  size_t bad = m[0].differ(m[1]) + v[0].differ(v[1]);
  for (size_t i = 0; i < n; ++i) {
    bad += !same_bits(p[0][i], p[1][i]) || (has_copy && c[0][i * cs] != c[1][i * cs]) ||
           (has_copy && c[0][i * cs + 1] != c[1][i * cs + 1]);
  }
  if (bad > 0)
    return internal_error(std::to_string(bad) + " parameters, moments or blocks of " + std::to_string(n) +
                          " differ between " + std::string(cpu_optim::isa_name(ex.isa())) + " and scalar");
  *summary = std::string(cpu_optim::isa_name(ex.isa())) + " vs scalar on " + std::to_string(n) + " params x 3 steps (" +
             moments + "; denormals, inf, NaN planted): bit-identical";
  return Status::ok();
}

}  // namespace

int run_adam_narrow_moments_bench(const AdamArgs& a) {
  const BenchError usage{"adam", 2}, failure{"adam", 1};
  const bool q8 = a.moments == "8bit", m16 = a.moments == "bf16", p16 = a.masters == "bf16";
  const std::string flag = p16 ? "--masters bf16" : "--moments " + a.moments;
  const Result<AdamCommon> common = parse_adam_common(a);
  if (!common.is_ok()) return usage(common.status().message());
  if (a.optimizer != "adamw" && a.optimizer != "adam")
    return usage(flag + ": Adam's and AdamW's (--optimizer adamw or adam), not " + a.optimizer + "'s");
  if (a.torch_loop)
    return usage("--torch-loop: not with " + flag + " (torch has no " +
                 (p16  ? "bf16-master"
                  : q8 ? "8-bit"
                       : "bf16-moment") +
                 " Adam)");
  const size_t n = common->n;
  const DType gdt = common->grad;
  const bool has_copy = common->has_copy;
  const DType cdt = common->copy;
  if (p16 && has_copy && cdt != DType::kBF16)
    return usage("--masters bf16: the copy-out is the masters' own bits, bf16 (--copy-out bf16 or none), not " +
                 a.copy_out);
  auto ex_r = Executor::create({.n_threads = a.threads, .bind_cores = a.bind_cores, .isa = common->isa});
  if (!ex_r.is_ok()) return failure(ex_r.status().to_string());
  const Executor& ex = **ex_r;
  cpu_optim::AdamConfig h = kHyper;
  h.adam_w_mode = a.optimizer == "adamw";
  const size_t gs = cpu_optim::dtype_size_bytes(gdt), cs = has_copy ? cpu_optim::dtype_size_bytes(cdt) : 0;
  // Bytes per parameter the kernel moves each way: the params (fp32, or bf16 masters) and the two
  // moments (8-bit: a code and 4 B of absmax per 256 each; bf16: 2 B each; fp32: 4 B each), the
  // gradient read and the copy written.
  const double moment_bytes = q8 ? 2.0 + 2.0 * 4.0 / static_cast<double>(cpu_optim::kQuantBlockElems) : m16 ? 4.0 : 8.0;
  const double param_bytes = p16 ? 2.0 : 4.0;
  const double read_bytes = param_bytes + moment_bytes + static_cast<double>(gs);
  const double write_bytes = param_bytes + moment_bytes + static_cast<double>(cs);
  const double fp32_bytes = 12 + static_cast<double>(gs) + 12 + static_cast<double>(cs);
  const std::string label = std::string(q8    ? "8-bit"
                                        : m16 ? "bf16"
                                              : "fp32") +
                            " moments" + (p16 ? ", bf16 masters" : "");
  if (!a.json) {
    std::printf("zoffload-bench adam: %s with %s, %zu params, grad %s, copy-out %s, %s\n", a.optimizer.c_str(),
                label.c_str(), n, a.grad_dtype.c_str(), has_copy ? a.copy_out.c_str() : "none", ex.describe().c_str());
    std::printf("hyper     lr %g, betas (%g, %g), eps %g, weight_decay %g\n", h.lr, h.beta1, h.beta2, h.eps,
                h.weight_decay);
  }
  // bf16 masters: each step's rounding keyed as the engine keys parameter 0 of a run seeded 1.
  auto key = [](int64_t t) { return cpu_optim::sr_key(1, static_cast<uint64_t>(t), 0); };
  std::string check_summary;
  // 2^20 + 100 elements: whole tiles on every path and a partial last block.
  const size_t check_n = std::min<size_t>(n, (size_t{1} << 20) + 100);
  const float scale = 1.0f / 1024.0f;
  Status checked;
  if (!p16) {
    checked = q8 ? check_against_scalar<float, Moment8>(
                       [&](int64_t t, std::span<float> p, Moment8& m, Moment8& v, ConstElemSpan g, ElemSpan c,
                           const Executor& e) {
                         return cpu_optim::adam8bit_step(h, t, p, m.state(), v.state(), g, scale, c, e);
                       },
                       "params, codes, absmax", gdt, has_copy, cdt, ex, check_n, &check_summary)
                 : check_against_scalar<float, Moment16>(
                       [&](int64_t t, std::span<float> p, Moment16& m, Moment16& v, ConstElemSpan g, ElemSpan c,
                           const Executor& e) {
                         return cpu_optim::adam_step_bf16_moments(h, t, p, m.values, v.values, g, scale, c, e);
                       },
                       "params, bf16 moments", gdt, has_copy, cdt, ex, check_n, &check_summary);
  } else if (q8) {
    checked = check_against_scalar<uint16_t, Moment8>(
        [&](int64_t t, std::span<uint16_t> p, Moment8& m, Moment8& v, ConstElemSpan g, ElemSpan c, const Executor& e) {
          return cpu_optim::adam8bit_step_bf16_master(h, t, {p, key(t), 0}, m.state(), v.state(), g, scale, c, e);
        },
        "bf16 masters, codes, absmax", gdt, has_copy, cdt, ex, check_n, &check_summary);
  } else {
    auto step = [&](int64_t t, std::span<uint16_t> p, auto& m, auto& v, ConstElemSpan g, ElemSpan c,
                    const Executor& e) {
      return cpu_optim::adam_step_bf16_master(h, t, {p, key(t), 0}, m.span(), v.span(), g, scale, c, e);
    };
    checked = m16 ? check_against_scalar<uint16_t, Moment16>(step, "bf16 masters, bf16 moments", gdt, has_copy, cdt, ex,
                                                             check_n, &check_summary)
                  : check_against_scalar<uint16_t, Moment32>(step, "bf16 masters, fp32 moments", gdt, has_copy, cdt, ex,
                                                             check_n, &check_summary);
  }
  if (!checked.is_ok()) return failure("check failed: " + checked.to_string());
  if (!a.json) std::printf("check     %s\n", check_summary.c_str());

  // Buffers: the params and gradients both kernels step, the narrow states, and fp32 moments that
  // the fp32 kernel steps and the triad runs over (a = p, b = m, c = v, as zoffload-bench adam's).
  // 8-bit moments: codes (n bytes) and absmax; bf16: n × 2 bytes each (in the codes buffers); fp32
  // moments beside bf16 masters: their own n × 4 bytes each; bf16 masters: n × 2 bytes.
  AlignedBuffer p_buf, p16_buf, g_buf, c_buf, m32_buf, v32_buf, mc_buf, vc_buf, ma_buf, va_buf;
  const size_t blocks = cpu_optim::quant_block_count(n);
  const size_t narrow_elem = q8 ? 1 : m16 ? 2 : 4;
  for (auto [buf, bytes] : {std::pair{&p_buf, n * 4},
                            {&p16_buf, p16 ? n * 2 : 0},
                            {&g_buf, n * gs},
                            {&c_buf, has_copy ? n * cs : 0},
                            {&m32_buf, n * 4},
                            {&v32_buf, n * 4},
                            {&mc_buf, n * narrow_elem},
                            {&vc_buf, n * narrow_elem},
                            {&ma_buf, q8 ? blocks * 4 : 0},
                            {&va_buf, q8 ? blocks * 4 : 0}}) {
    if (bytes == 0) continue;
    auto r = AlignedBuffer::allocate(bytes);
    if (!r.is_ok()) return failure(r.status().to_string() + " (try a smaller --params)");
    *buf = std::move(r).value();
  }
  auto p = p_buf.as<float>(), m32 = m32_buf.as<float>(), v32 = v32_buf.as<float>();
  random_fill(p.data(), DType::kF32, n, 1, -1.0f, 1.0f, ex);
  cpu_optim::fill(m32, 0.0f, ex);
  cpu_optim::fill(v32, 0.0f, ex);
  random_fill(g_buf.data(), gdt, n, 2, -1024.0f, 1024.0f, ex);
  ex.for_each_tile(n, [&](size_t lo, size_t hi) {  // first touch in the step's partition
    std::fill(mc_buf.as<uint8_t>().begin() + lo * narrow_elem, mc_buf.as<uint8_t>().begin() + hi * narrow_elem, 0);
    std::fill(vc_buf.as<uint8_t>().begin() + lo * narrow_elem, vc_buf.as<uint8_t>().begin() + hi * narrow_elem, 0);
    if (p16) {
      for (size_t i = lo; i < hi; ++i) p16_buf.as<uint16_t>()[i] = cpu_optim::float_to_bf16(p[i]);
    }
  });
  if (q8) {
    std::fill(ma_buf.as<float>().begin(), ma_buf.as<float>().end(), 0.0f);
    std::fill(va_buf.as<float>().begin(), va_buf.as<float>().end(), 0.0f);
  }
  const ConstElemSpan grad{g_buf.data(), gdt};
  const ElemSpan copy = has_copy ? ElemSpan{c_buf.data(), cdt} : ElemSpan{};
  const DType narrow_dtype = m16 ? DType::kBF16 : DType::kF32;
  auto step_narrow = [&](int64_t t) {
    const cpu_optim::BlockwiseState m8{mc_buf.as<uint8_t>(), ma_buf.as<float>()},
        v8{vc_buf.as<uint8_t>(), va_buf.as<float>()};
    if (p16) {
      const cpu_optim::Bf16Master master{p16_buf.as<uint16_t>(), key(t), 0};
      if (q8) return cpu_optim::adam8bit_step_bf16_master(h, t, master, m8, v8, grad, scale, copy, ex);
      return cpu_optim::adam_step_bf16_master(h, t, master, {mc_buf.data(), narrow_dtype},
                                              {vc_buf.data(), narrow_dtype}, grad, scale, copy, ex);
    }
    if (q8) return cpu_optim::adam8bit_step(h, t, p, m8, v8, grad, scale, copy, ex);
    return cpu_optim::adam_step_bf16_moments(h, t, p, mc_buf.as<uint16_t>(), vc_buf.as<uint16_t>(), grad, scale, copy,
                                             ex);
  };
  auto step32 = [&](int64_t t) { return cpu_optim::adam_step(h, t, p, m32, v32, grad, scale, copy, ex); };

  // Warm-ups, then --repeats rounds of: the narrow step, the fp32 step, the triad.
  if (Status s = step_narrow(1); !s.is_ok()) return failure(s.to_string());
  if (Status s = step32(1); !s.is_ok()) return failure(s.to_string());
  if (Status s = cpu_optim::stream_triad(p, m32, v32, 3.0f, ex); !s.is_ok()) return failure(s.to_string());
  std::vector<double> sn, s32, triad;
  for (int r = 0; r < a.repeats; ++r) {
    Stopwatch sw;
    if (Status s = step_narrow(2 + r); !s.is_ok()) return failure(s.to_string());
    sn.push_back(sw.elapsed_s());
    sw.reset();
    if (Status s = step32(2 + r); !s.is_ok()) return failure(s.to_string());
    s32.push_back(sw.elapsed_s());
    sw.reset();
    (void)cpu_optim::stream_triad(p, m32, v32, 3.0f, ex);
    triad.push_back(sw.elapsed_s());
  }
  const double n_d = static_cast<double>(n);
  const double medn = median(sn), med32 = median(s32), med_triad = median(triad);
  const double ppsn = n_d / medn, pps32 = n_d / med32;
  const double gbpsn = n_d * (read_bytes + write_bytes) / medn / 1e9;
  const double triad_gbps = n_d * 12.0 / med_triad / 1e9;
  const double ratio_triad = gbpsn / triad_gbps, ratio_fp32 = ppsn / pps32;
  const std::string moment_streams = q8    ? "exp_avg and exp_avg_sq codes (1 B) and absmax (4 B per 256)"
                                     : m16 ? "exp_avg and exp_avg_sq bf16 (2 B)"
                                           : "exp_avg and exp_avg_sq fp32 (4 B)";
  const std::string param_stream = p16 ? "params bf16 (stochastic rounding)" : "params fp32";
  if (a.json) {
    nlohmann::json j = adam_run_json(a, n, has_copy, ex, h, check_summary);
    j["moments"] = a.moments;
    j["masters"] = a.masters;
    j["bytes_per_param"] = {{"read", read_bytes},
                            {"write", write_bytes},
                            {"total", read_bytes + write_bytes},
                            {"streams", param_stream + ", " + moment_streams + " read+write; grad " + a.grad_dtype +
                                            " read" + (has_copy ? "; copy " + a.copy_out + " written" : "")}};
    j["step_s"] = {{"median", medn}, {"all", sn}};
    j["params_per_s"] = ppsn;
    j["effective_gbps"] = gbpsn;
    j["fp32_kernel"] = {{"median_s", med32}, {"all_s", s32}, {"params_per_s", pps32}, {"bytes_per_param", fp32_bytes}};
    j["ratio_to_fp32"] = ratio_fp32;
    j["triad"] = {{"bytes_per_elem", 12}, {"median_s", med_triad}, {"all_s", triad}, {"gbps", triad_gbps}};
    j["ratio_to_triad"] = ratio_triad;
    j["targets"] = {{"ratio_to_triad", 0.85}};
    std::printf("%s\n", j.dump(2).c_str());
    return 0;
  }
  std::printf(
      "bytes     %.2f B/param = read %.2f (%s, %s, grad %s) + write %.2f (the same%s); fp32 states: %.0f B/param\n",
      read_bytes + write_bytes, read_bytes, param_stream.c_str(), moment_streams.c_str(), a.grad_dtype.c_str(),
      write_bytes, has_copy ? (", copy " + a.copy_out).c_str() : "", fp32_bytes);
  std::printf("narrow    median %.4f s/step of %d (min %.4f, max %.4f): %.1f M params/s, %.2f GB/s effective\n", medn,
              a.repeats, *std::min_element(sn.begin(), sn.end()), *std::max_element(sn.begin(), sn.end()), ppsn / 1e6,
              gbpsn);
  std::printf("fp32      median %.4f s/step of %d: %.1f M params/s (adam_step, fp32 masters and moments)\n", med32,
              a.repeats, pps32 / 1e6);
  std::printf("triad     median %.4f s of %d: %.2f GB/s\n", med_triad, a.repeats, triad_gbps);
  std::printf("ratio     effective/triad %.2f (target >= 0.85), vs the fp32 kernel %.2fx params/s\n", ratio_triad,
              ratio_fp32);
  return 0;
}

}  // namespace zo::tools
