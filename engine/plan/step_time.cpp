#include "engine/plan/step_time.h"

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <functional>
#include <span>

#include "common/aligned_buffer.h"
#include "common/dtype.h"
#include "common/timer.h"
#include "cpu_optim/adam.h"
#include "cpu_optim/adam8bit.h"
#include "cpu_optim/executor.h"
#include "cpu_optim/vector_ops.h"
#include "engine/coord/grad_accumulator.h"
#include "engine/plan/planner.h"

// Note [Step-time range]
//
// A step asks each resource for an amount of work: the GPU for FLOPs (forward, then the recomputed
// forward and the backward), PCIe for bytes each way (compute copies in, gradients out), the host's
// memory for bytes (the copies' side of those transfers, the gradient worker's passes and the
// optimizer's), the CPU for the kernels' elements, the drive for bytes. Each becomes seconds at
// the rate the user gives or the plan measures: --gpu-tflops (the matmul rate) and
// --gpu-step-tflops (the rate a measured step's device compute reached: its FLOPs over its device
// time; the matmul rate when not given), --pcie, --host-triad (STREAM's triad, whose counting the
// bytes follow: what each kernel reads and writes, no write-allocate reads), the kernels' measured
// elements/s, the drive's GB/s. A host pass takes its kernel's measured time at the low end (the
// kernel as measured, or its bytes at the triad when it was not measured) and the longer of that
// and its bytes at the triad at the high end: the triad bounds a kernel only as well as its access
// pattern resembles the triad's. Kernels measured on another host and scaled to this one's triad
// (`plan --host-triad`) are taken at the triad at the low end: a kernel bound by its arithmetic on
// a small host would otherwise raise it.
//
// The low end is the step with every overlap perfect: the longest resource (the GPU at the matmul
// rate, PCIe each way, the host's memory, the CPU's kernels one after another on the executor's
// threads, the drive), but no shorter than what the schedule cannot overlap however fast the
// resources are. Without accumulators (Note [No accumulator]) the optimizer runs under backward
// and the next forward waits for all of it, so the step is at least forward + max(backward, the
// host's passes). Otherwise the optimizer runs after backward, under the next step's first forward
// only (Note [Overlapped optimizer]): max(first forward, optimizer) + the other forwards +
// max(backward, the gradient worker).
//
// The high end is the step with only the overlap the schedule builds in: the GPU at the step rate,
// every copy at its most (each compute copy fetched by every pass, forward and backward) and not
// under the compute, the host's passes at their slower bound and not under backward (the worker
// stalls backward when it falls behind; the H200 traces show backward waiting on it), the drive's
// parts one after the other; the optimizer (with its drive pipeline) beside the next step's first
// forward when there are accumulators.
//
// On the emulated device the "GPU" is LibTorch on the same cores as the host's passes, so the low
// end there is optimistic twice over; the parts still say where the time goes.

namespace zo::engine {

namespace {

std::string seconds_basis(double seconds) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.2f s", seconds);
  return buf;
}

}  // namespace

void plan_step_time(const StepWork& w, const HostSpeeds& sp, RunPlan* out) {
  RunPlan& p = *out;
  p.compute_flops_per_step = w.forward_flops + w.backward_flops;
  const double triad = sp.host_triad_bytes_per_s;
  auto part = [&](const std::string& name, double low, double high, const std::string& basis) {
    p.time_parts.push_back({name, high, basis, low});
  };

  // The GPU (or LibTorch on the host): the matmul rate at the low end, the step rate at the high.
  double fwd_lo = 0, bwd_lo = 0, fwd_hi = 0, bwd_hi = 0;
  if (w.forward_flops + w.backward_flops > 0) {
    if (sp.compute_flops <= 0) {
      p.time_unknown.push_back("compute");
    } else {
      const double step_rate =
          sp.compute_step_flops > 0 ? std::min(sp.compute_step_flops, sp.compute_flops) : sp.compute_flops;
      fwd_lo = w.forward_flops / sp.compute_flops;
      bwd_lo = w.backward_flops / sp.compute_flops;
      fwd_hi = w.forward_flops / step_rate;
      bwd_hi = w.backward_flops / step_rate;
      std::string basis = sp.compute_source;
      if (sp.compute_step_flops > 0) basis += "; " + sp.compute_step_source;
      part("compute", fwd_lo + bwd_lo, fwd_hi + bwd_hi, basis);
    }
  }

  // PCIe, each direction on its own lanes.
  double h2d_lo = 0, h2d_hi = 0, d2h = 0;
  if (w.cuda && w.h2d_max_bytes + w.d2h_bytes > 0) {
    if (sp.pcie_bytes_per_s <= 0) {
      p.time_unknown.push_back("pcie");
    } else {
      h2d_lo = w.h2d_min_bytes / sp.pcie_bytes_per_s;
      h2d_hi = w.h2d_max_bytes / sp.pcie_bytes_per_s;
      d2h = w.d2h_bytes / sp.pcie_bytes_per_s;
      part("pcie", std::max(h2d_lo, d2h), h2d_hi + d2h,
           "host<->GPU copies at " + sp.pcie_source + " (to the device, from it)");
    }
  }

  // The host's passes: the kernel as measured, bounded by its bytes at the triad.
  auto host_pass = [&](const std::string& name, const HostPass& h, double* lo, double* hi) {
    if (h.elems <= 0 && h.bytes <= 0) return;
    const double at_triad = triad > 0 ? h.bytes / triad : 0;
    const double kernel = h.kernel_rate > 0 ? h.elems / h.kernel_rate : 0;
    if (h.kernel_rate <= 0 && triad <= 0) {
      p.time_unknown.push_back(name);
      return;
    }
    *lo = h.kernel_rate > 0 && !(sp.kernels_scaled && triad > 0) ? kernel : at_triad;
    *hi = std::max(kernel, at_triad);
    std::string basis = h.kernel_rate > 0 ? h.basis : "its bytes at the triad (the kernel not measured)";
    if (triad > 0) basis += "; " + seconds_basis(at_triad) + " at the triad";
    part(name, *lo, *hi, basis);
  };
  double grad_lo = 0, grad_hi = 0, opt_lo = 0, opt_hi = 0;
  host_pass("gradients", w.gradients, &grad_lo, &grad_hi);
  host_pass("optimizer", w.optimizer, &opt_lo, &opt_hi);
  // The host's memory as one resource: every pass and the copies' side of every transfer.
  double host_memory = 0;
  if (triad > 0) {
    const double bytes = w.gradients.bytes + w.optimizer.bytes + w.dma_host_bytes;
    host_memory = bytes / triad;
    char buf[64];
    std::snprintf(buf, sizeof buf, "%.1f GB at the triad, ", bytes / 1e9);
    part("host memory", host_memory, host_memory, buf + sp.host_triad_source + " (every pass and copy)");
  }

  // The drive: the accumulators' share during backward, the optimizer's pipelined with it.
  double nvme_grad = 0, nvme_opt = 0, nvme_opt_hi = 0;
  if (w.nvme_grad_read + w.nvme_grad_write + w.nvme_opt_read_max + w.nvme_opt_write > 0) {
    if (sp.nvme_read_bytes_per_s > 0 && sp.nvme_write_bytes_per_s > 0) {
      auto seconds = [&](double r, double wr) { return r / sp.nvme_read_bytes_per_s + wr / sp.nvme_write_bytes_per_s; };
      nvme_grad = seconds(w.nvme_grad_read, w.nvme_grad_write);
      nvme_opt = seconds(w.nvme_opt_read, w.nvme_opt_write);
      // The compute copies on NVMe read by every pass (the coordinator's cache holding none of
      // them): the high end. A frozen base streamed from NVMe makes this the step's largest transfer.
      nvme_opt_hi = seconds(w.nvme_opt_read_max, w.nvme_opt_write);
      if (nvme_grad > 0) part("nvme grads", nvme_grad, nvme_grad, sp.nvme_source);
      std::string basis = sp.nvme_source;
      if (nvme_opt_hi > nvme_opt)
        basis += "; up to " + seconds_basis(nvme_opt_hi) + " with the compute copies read by every pass";
      part("nvme optim", nvme_opt, nvme_opt_hi, basis);
    } else {
      p.time_unknown.push_back("nvme");
    }
  }

  // The low end: the longest resource, and no less than what the schedule cannot overlap.
  const double passes = std::max(1.0, w.passes);
  const double opt_phase_lo = std::max(opt_lo, nvme_opt);
  const double chain_lo = w.optimizer_in_backward
                              ? fwd_lo + std::max({bwd_lo, grad_lo + opt_phase_lo, nvme_grad + nvme_opt})
                              : std::max(fwd_lo / passes, opt_phase_lo) + fwd_lo * (passes - 1) / passes +
                                    std::max({bwd_lo, grad_lo, nvme_grad});
  p.step_s_low =
      std::max({fwd_lo + bwd_lo, h2d_lo, d2h, host_memory, grad_lo + opt_lo, nvme_grad + nvme_opt, chain_lo});

  // The high end: only the overlap the schedule builds in.
  const double opt_phase_hi = std::max(opt_hi, nvme_opt_hi);
  const double serial = bwd_hi + h2d_hi + d2h + grad_hi + nvme_grad;
  p.step_s_high = w.optimizer_in_backward
                      ? fwd_hi + serial + opt_phase_hi
                      : std::max(fwd_hi / passes, opt_phase_hi) + fwd_hi * (passes - 1) / passes + serial;
  p.step_s_high = std::max(p.step_s_high, p.step_s_low);
}

// Host bytes are counted per trainable element as zoffload-bench host counts them.
StepWork step_work(const Config& c, const ModelConfig& m, const ModelLayout& layout, const ParamRegistry& registry,
                   uint64_t seq_len, uint64_t n_passes, const HostSpeeds& sp, bool cuda, uint64_t nvme_grad_read,
                   uint64_t nvme_grad_write, const RunPlan& p) {
  const uint64_t micro = c.train_micro_batch_size_per_gpu;
  const uint64_t gas = c.gradient_accumulation_steps;
  const MemoryPlan& mp = p.memory;
  const Placement& pl = mp.placement;
  StepWork w;
  w.cuda = cuda;
  w.optimizer_in_backward = pl.no_accumulator;
  w.passes = static_cast<double>(n_passes);
  const double tokens = static_cast<double>(gas * p.tokens_per_micro_step);
  const double embedding = static_cast<double>(m.vocab_size * m.hidden_size * (m.tie_word_embeddings ? 0 : 1));
  const double matmul_params = static_cast<double>(p.n_params) - embedding;
  // Of them, those with a weight gradient: a frozen one's is never computed (the embedding, a lookup,
  // counted out of the trainable ones when it trains; a frozen norm's few elements are noise).
  const double trainable_matmul =
      std::min(matmul_params,
               std::max(0.0, static_cast<double>(p.n_trainable) - (layout.params[0].trainable ? embedding : 0.0)));
  // Forward, the recomputed forward and backward: 2 + 2 FLOPs per matmul weight per token, 2 for the
  // input's gradient and 2 for the weight's (trainable weights only), and causal attention's two
  // matmuls (half of T×T) the same four times over.
  const double attention = 2.0 * static_cast<double>(gas * micro) * static_cast<double>(seq_len * seq_len) *
                           static_cast<double>(m.num_attention_heads * m.head_dim) *
                           static_cast<double>(m.num_hidden_layers);
  w.forward_flops = 2 * matmul_params * tokens + attention;
  w.backward_flops = (4 * matmul_params + 2 * trainable_matmul) * tokens + 3 * attention;
  w.h2d_min_bytes = static_cast<double>(p.h2d_min_bytes);
  w.h2d_max_bytes = static_cast<double>(p.h2d_max_bytes);
  w.d2h_bytes = static_cast<double>(p.d2h_bytes);

  // Host bytes per trainable element. The gradient lands (the copy from the device, or on the
  // emulated device its memcpy) in the ring or where it is summed (Note [Gradients that land where
  // they are summed]); from the ring the worker reads it and writes the sums (and reads them back
  // after the first window); the norm reads the sums unless the optimizer takes it in its pass;
  // rounding to a 16-bit store reads the sums and writes the store; the optimizer reads the
  // gradient, reads and writes masters and moments and writes the compute copy.
  const double n = static_cast<double>(std::max<uint64_t>(p.n_trainable, 1));
  const double passes = w.passes;
  const double tb = static_cast<double>(dtype_size_bytes(grad_transfer_dtype(c)));
  const double sb = static_cast<double>(dtype_size_bytes(pl.grad_sum_dtype));
  const bool in_place = mp.landing_buffers > 0;
  const bool fused_norm =
      in_place && !pl.grads_rounded() && pl.moments != MomentDtype::k8bit && pl.master_dtype == DType::kF32;
  double master = 0, moments = 0, compute = 0, grad_store = 0;
  for (const SubGroup& g : registry.sub_groups()) {
    if (!g.trainable || !mp.steps(g.index)) continue;
    master += static_cast<double>(group_state_bytes(pl, registry, g.index, StateKind::kMaster));
    moments += static_cast<double>(group_state_bytes(pl, registry, g.index, StateKind::kExpAvg) +
                                   group_state_bytes(pl, registry, g.index, StateKind::kExpAvgSq));
    compute += static_cast<double>(group_state_bytes(pl, registry, g.index, StateKind::kCompute));
    grad_store += static_cast<double>(group_state_bytes(pl, registry, g.index, StateKind::kGradAccum));
  }
  const double ring = in_place ? 0 : (tb + sb) * passes + sb * (passes - 1);
  const double norm = fused_norm ? 0 : sb;
  const double round = pl.grads_rounded() ? sb + static_cast<double>(dtype_size_bytes(pl.grad_dtype)) : 0;
  w.gradients.elems = in_place ? 0 : passes * n;
  w.gradients.bytes = (ring + norm + round) * n;
  w.gradients.kernel_rate = sp.accumulate_elems_per_s;
  w.gradients.basis = "accumulate + norm kernel, measured";
  const double grad_read = pl.no_accumulator ? (pl.grads_rounded() ? grad_store : sb * n) : grad_store;
  w.optimizer.elems = n;
  w.optimizer.bytes = grad_read + 2 * master + 2 * moments + compute;
  w.dma_host_bytes = tb * passes * n + w.h2d_min_bytes;
  // The kernel the placement runs, measured at plan time (measure_cpu_speeds); where its own speed
  // is not known, the nearest one measured stands for it and the basis says which.
  const int mi = pl.moments == MomentDtype::kF32 ? 0 : pl.moments == MomentDtype::kBF16 ? 1 : 2;
  const char* moments_name[] = {"fp32", "bf16", "8-bit"};
  const double fp32_master_rate[] = {sp.adam_elems_per_s, sp.adam_bf16_moments_elems_per_s, sp.adam8bit_elems_per_s};
  const bool bf16_masters = pl.master_dtype == DType::kBF16;
  std::string basis = std::string("cpu_optim Adam with ") + (bf16_masters ? "bf16" : "fp32") + " masters and " +
                      moments_name[mi] + " moments, measured";
  double rate = bf16_masters ? sp.bf16_master_elems_per_s[mi] : fp32_master_rate[mi];
  if (rate <= 0 && bf16_masters && fp32_master_rate[mi] > 0) {
    rate = fp32_master_rate[mi];
    basis = std::string("cpu_optim Adam, measured with fp32 masters and ") + moments_name[mi] + " moments";
  }
  if (rate <= 0 && mi == 1) {
    rate = sp.adam_elems_per_s;
    basis = "cpu_optim Adam, measured with fp32 masters and moments";
  }
  w.optimizer.kernel_rate = rate;
  w.optimizer.basis = basis;

  // The drive: the accumulators are written (and read back) during backward, by the gradient
  // worker; the optimizer's reads and writes (and the compute copies' reads) are pipelined with Adam.
  w.nvme_grad_read = static_cast<double>(nvme_grad_read);
  w.nvme_grad_write = static_cast<double>(nvme_grad_write);
  w.nvme_opt_read = static_cast<double>(p.nvme_read_min_bytes - nvme_grad_read);
  w.nvme_opt_read_max = static_cast<double>(p.nvme_read_max_bytes - nvme_grad_read);
  w.nvme_opt_write = static_cast<double>(p.nvme_write_bytes - nvme_grad_write);
  return w;
}

Status measure_cpu_speeds(const Config& config, HostSpeeds* speeds) {
  ZO_ASSIGN_OR_RETURN(auto executor,
                      cpu_optim::Executor::create({.n_threads = static_cast<int>(config.zoffload.optimizer_threads)}));
  constexpr uint64_t kElems = uint64_t{1} << 23;  // 8 Mi elements: 32 MiB per fp32 stream, past the caches
  ZO_ASSIGN_OR_RETURN(AlignedBuffer buf, AlignedBuffer::allocate(kElems * 4 * 5));
  std::memset(buf.data(), 0, buf.size());
  auto f32 = [&](int i) { return std::span<float>(reinterpret_cast<float*>(buf.data()) + i * kElems, kElems); };
  auto u16 = [&](int i) { return std::span<uint16_t>(reinterpret_cast<uint16_t*>(f32(i).data()), kElems); };
  const DType cdt = config.compute_dtype();
  const AdamConfig adam{.lr = 1e-4f,
                        .beta1 = 0.9f,
                        .beta2 = 0.999f,
                        .eps = 1e-8f,
                        .weight_decay = 0.0f,
                        .adam_w_mode = true,
                        .bias_correction = true};
  auto rate = [&](const std::function<Status()>& fn) -> Result<double> {
    ZO_RETURN_IF_ERROR(fn());  // first touch
    double best = 0;
    for (int i = 0; i < 3; ++i) {
      Stopwatch sw;
      ZO_RETURN_IF_ERROR(fn());
      best = std::max(best, static_cast<double>(kElems) / sw.elapsed_s());
    }
    return best;
  };
  // 8-bit moments: the codes and then the absmax in the fp32 moments' buffers (kElems bytes and kElems/64 floats).
  auto blockwise = [&](int i) {
    auto* base = reinterpret_cast<uint8_t*>(f32(i).data());
    return cpu_optim::BlockwiseState{{base, kElems},
                                     {reinterpret_cast<float*>(base + kElems), cpu_optim::quant_block_count(kElems)}};
  };
  const cpu_optim::ConstElemSpan grad{f32(3).data(), DType::kF32};
  const cpu_optim::ElemSpan out{f32(4).data(), cdt};
  ZO_ASSIGN_OR_RETURN(speeds->adam_elems_per_s, rate([&] {
                        return cpu_optim::adam_step(adam, 1, f32(0), f32(1), f32(2), grad, 1.0f, out, *executor);
                      }));
  // Measured whatever the config says: a fix the planner suggests may switch the moments.
  std::memset(buf.data(), 0, buf.size());
  ZO_ASSIGN_OR_RETURN(speeds->adam8bit_elems_per_s, rate([&] {
                        return cpu_optim::adam8bit_step(adam, 1, f32(0), blockwise(1), blockwise(2), grad, 1.0f, out,
                                                        *executor);
                      }));
  std::memset(buf.data(), 0, buf.size());
  ZO_ASSIGN_OR_RETURN(speeds->adam_bf16_moments_elems_per_s, rate([&] {
                        return cpu_optim::adam_step_bf16_moments(adam, 1, f32(0), u16(1), u16(2), grad, 1.0f, out,
                                                                 *executor);
                      }));
  // bf16 masters (a fix may switch to them whatever the config says): the master's bits in the
  // first buffer, the copy-out none (the master is the compute copy), each moment dtype.
  const cpu_optim::Bf16Master master{u16(0), 1, 0};
  const cpu_optim::ElemSpan no_copy{nullptr, DType::kBF16};
  const cpu_optim::ElemSpan m32{f32(1).data(), DType::kF32}, v32{f32(2).data(), DType::kF32};
  const cpu_optim::ElemSpan m16{u16(1).data(), DType::kBF16}, v16{u16(2).data(), DType::kBF16};
  std::memset(buf.data(), 0, buf.size());
  ZO_ASSIGN_OR_RETURN(speeds->bf16_master_elems_per_s[0], rate([&] {
                        return cpu_optim::adam_step_bf16_master(adam, 1, master, m32, v32, grad, 1.0f, no_copy,
                                                                *executor);
                      }));
  std::memset(buf.data(), 0, buf.size());
  ZO_ASSIGN_OR_RETURN(speeds->bf16_master_elems_per_s[1], rate([&] {
                        return cpu_optim::adam_step_bf16_master(adam, 1, master, m16, v16, grad, 1.0f, no_copy,
                                                                *executor);
                      }));
  std::memset(buf.data(), 0, buf.size());
  ZO_ASSIGN_OR_RETURN(speeds->bf16_master_elems_per_s[2], rate([&] {
                        return cpu_optim::adam8bit_step_bf16_master(adam, 1, master, blockwise(1), blockwise(2), grad,
                                                                    1.0f, no_copy, *executor);
                      }));
  // The host's memory as the step's resource (Note [Step-time range]): STREAM's triad on the same
  // threads, 12 bytes an element as STREAM counts them.
  ZO_ASSIGN_OR_RETURN(const double triad_elems_per_s,
                      rate([&] { return cpu_optim::stream_triad(f32(0), f32(1), f32(2), 3.0f, *executor); }));
  speeds->host_triad_bytes_per_s = 12 * triad_elems_per_s;
  speeds->host_triad_source = "the triad measured here on the optimizer's threads";
  ZO_ASSIGN_OR_RETURN(speeds->accumulate_elems_per_s, rate([&] {
                        return GradAccumulator::measure_kernel(
                            reinterpret_cast<std::byte*>(f32(0).data()), config.grad_accum_dtype,
                            reinterpret_cast<const std::byte*>(f32(1).data()), cdt, kElems, *executor);
                      }));
  return Status::ok();
}

}  // namespace zo::engine
