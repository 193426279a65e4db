#!/usr/bin/env python3
"""cpu_optim::adam8bit_step against bitsandbytes' AdamW8bit (its CPU path) as the oracle (and
lion8bit_step and adagrad8bit_step against its Lion8bit and Adagrad8bit, at the end): 20 steps
on tensors of awkward sizes (a partial last block, a tensor under bitsandbytes' default 8-bit size
threshold, a block whose gradient is always zero, a NaN gradient), then the state bytes and the absmax
values bit for bit, and the parameters within a bound derived below: the best kernel path here with
1 and 2 threads, and the scalar one.

The parameters cannot be bit for bit: bitsandbytes takes sqrt(v) with torch's vectorized CPU sqrt,
which is not correctly rounded (1 ulp off for about 16% of fp32 inputs on an AVX2 build, measured),
and zoffload's kernels use the correctly rounded one. The moments do not depend on the parameters
(decoupled weight decay), so they stay identical; each step can then differ in the update u by the
sqrt's 1 ulp (2^-23 relative, once more through the division: 2^-22 |u|) and in the rounding of
p + u (one ulp of p); the earlier difference carries over times the decay factor (< 1). So after T
steps |p - p_bnb| <= sum over t of (ulp(p_t) + 2^-22 |u_t|), accumulated from bitsandbytes' own run.

bitsandbytes runs its own update (backends/cpu/ops.py) with one part replaced: the re-quantization,
where its CPU library looks codes up through an approximate table that often returns a farther code
near zero; here each block is re-quantized to the nearest code (ties to the lower index), as its
CUDA kernels do and zoffload does. The unmodified optimizer is also run, and how often its codes
differ from the nearest one is printed. The hyperparameters are passed to bitsandbytes as the exact
float32 values zoffload holds (its constants such as 1 - beta1 are then derived from the same doubles).
usage: adam8bit_bnb_test.py ORACLE_BINARY   (exit 77 without bitsandbytes)"""
import os
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tools"))
from cli_checks import expect, report_and_exit  # noqa: E402

try:
    import numpy as np
    import torch
    import bitsandbytes as bnb
    import bnb_nearest
    import bitsandbytes.functional as bnb_f
except ImportError as e:
    print("skipping: bitsandbytes, torch or numpy is missing (%s); tools/requirements.txt lists them" % e)
    sys.exit(77)

oracle = sys.argv[1]
STEPS = 20
f32 = lambda x: float(np.float32(x))  # noqa: E731
LR, BETAS, EPS, WD = f32(1e-3), (f32(0.9), f32(0.999)), f32(1e-8), f32(0.01)


def run_bnb(p0, grads, nearest):
    with bnb_nearest.nearest(nearest):
        p = torch.nn.Parameter(torch.from_numpy(p0.copy()))
        opt = bnb.optim.AdamW8bit([p], lr=LR, betas=BETAS, eps=EPS, weight_decay=WD, min_8bit_size=1)
        bound = np.zeros(p0.size, dtype=np.float64)
        decay = np.float32(1.0 - LR * WD)
        for g in grads:
            before = p.detach().numpy().copy()
            p.grad = torch.from_numpy(g.copy())
            opt.step()
            after = p.detach().numpy()
            u = after.astype(np.float64) - (before * decay).astype(np.float32)
            bound += np.spacing(np.abs(after)).astype(np.float64) + 2.0 ** -22 * np.abs(u)
        st = opt.state[p]
        return (p.detach().numpy().copy(), st["state1"].numpy().copy(), st["absmax1"].numpy().copy(),
                st["state2"].numpy().copy(), st["absmax2"].numpy().copy(), bound)


def run_zoffload(tmp, p0, grads, threads, isa):
    n = p0.size
    with open(os.path.join(tmp, "meta.txt"), "w") as f:
        f.write("%d %d %r %r %r %r %r\n" % (n, len(grads), LR, BETAS[0], BETAS[1], EPS, WD))
    p0.astype(np.float32).tofile(os.path.join(tmp, "params.f32"))
    np.stack(grads).astype(np.float32).tofile(os.path.join(tmp, "grads.f32"))
    r = subprocess.run([oracle, tmp, str(threads), isa], capture_output=True, text=True)
    if not expect(r.returncode == 0, "adam8bit_oracle runs: %s" % r.stderr):
        return None
    read = lambda name, dt: np.fromfile(os.path.join(tmp, name), dtype=dt)  # noqa: E731
    return (read("out_params.f32", np.float32), read("out_m_codes.u8", np.uint8), read("out_m_absmax.f32", np.float32),
            read("out_v_codes.u8", np.uint8), read("out_v_absmax.f32", np.float32))


def same_bits(a, b):
    return a.shape == b.shape and np.array_equal(a.view(np.uint32), b.view(np.uint32))


with tempfile.TemporaryDirectory() as tmp:
    # The maps: zoffload's tables are bitsandbytes' create_dynamic_map, bit for bit.
    maps = os.path.join(tmp, "maps.f32")
    r = subprocess.run([oracle, "--maps", maps], capture_output=True, text=True)
    if expect(r.returncode == 0, "adam8bit_oracle --maps: %s" % r.stderr):
        ours = np.fromfile(maps, dtype=np.float32)
        for k, (name, signed) in enumerate([("signed", True), ("unsigned", False)]):
            theirs = bnb_f.create_dynamic_map(signed=signed).numpy()
            expect(same_bits(ours[256 * k:256 * (k + 1)], theirs), "the %s dynamic map is bitsandbytes'" % name)

    rng = np.random.default_rng(8)
    cases = []
    for name, n in [("partial-last-block", 4496), ("under-threshold", 1000), ("zero-block", 2048), ("nan-grad", 4352)]:
        p0 = rng.standard_normal(n).astype(np.float32)
        grads = [(rng.standard_normal(n) * rng.uniform(0.1, 3.0)).astype(np.float32) for _ in range(STEPS)]
        if name == "zero-block":
            for g in grads:
                g[256:512] = 0.0
        if name == "nan-grad":
            grads[9][1000] = np.nan
        cases.append((name, p0, grads))

    for name, p0, grads in cases:
        want = run_bnb(p0, grads, nearest=True)
        for threads, isa in ((1, "auto"), (2, "auto"), (1, "scalar")):
            got = run_zoffload(tmp, p0, grads, threads, isa)
            if got is None:
                continue
            nan = np.isnan(want[0])
            diff = np.abs(got[0].astype(np.float64) - want[0])
            expect(np.array_equal(np.isnan(got[0]), nan) and bool(np.all(diff[~nan] <= want[5][~nan])),
                   "%s, %s, %d thread(s): parameters within the derived bound of bitsandbytes' after %d steps "
                   "(%d differ; the largest difference is %.3g of its bound)" % (
                       name, isa, threads, STEPS, int(np.sum(diff[~nan] > 0)),
                       float(np.max(diff[~nan] / want[5][~nan]))))
            for label, a, b in zip(("exp_avg codes", "exp_avg absmax", "exp_avg_sq codes", "exp_avg_sq absmax"),
                                   got[1:], want[1:5]):
                same = same_bits(a, b) if a.dtype == np.float32 else np.array_equal(a, b)
                detail = "" if same else " (%d of %d differ)" % (int(np.sum(a != b)), a.size)
                expect(same, "%s, %s, %d thread(s): %s equal bitsandbytes' after %d steps%s" % (
                    name, isa, threads, label, STEPS, detail))
        if name == "zero-block":
            expect(want[2][1] == 0 and want[4][1] == 0, "zero-block: the always-zero block keeps absmax 0")
        if name == "nan-grad":
            expect(np.isnan(want[0][1000]) and not np.isnan(np.delete(want[0], 1000)).any(),
                   "nan-grad: only the parameter whose gradient was NaN is NaN")

        # bitsandbytes as it ships: how far its CPU re-quantization moves the result.
        plain = run_bnb(p0, grads, nearest=False)
        ok = ~np.isnan(want[0])
        rel = np.abs(plain[0][ok] - want[0][ok]) / np.maximum(np.abs(want[0][ok]), 1e-6)
        print("%s: bitsandbytes' own CPU re-quantization: exp_avg codes differ at %.1f%%, exp_avg_sq at %.1f%%; "
              "parameters differ by at most %.2e relative (median %.2e)" % (
                  name, 100.0 * np.mean(plain[1] != want[1]), 100.0 * np.mean(plain[3] != want[3]),
                  float(rel.max()), float(np.median(rel))))

    # ---- Lion8bit and Adagrad8bit: one state, the signed map (bitsandbytes' qmap1 for both) --------
    # Lion has no sqrt: its parameters must be bitsandbytes' bit for bit, as its momentum is.
    # Adagrad's sqrt is torch's (not correctly rounded), so its parameters are held to the bound
    # derived above with no decay factor; without weight decay its sum of squares does not depend on
    # the parameters and must be bitsandbytes' bit for bit (with weight decay zoffload keeps its own
    # Adagrad's numerator, the gradient before decay, where bitsandbytes' is after: cpu_optim/adagrad.h).
    LION_LR, LION_BETAS = f32(3e-4), (f32(0.9), f32(0.99))
    ADAGRAD_LR, ADAGRAD_EPS = f32(1e-2), f32(1e-10)

    def run_bnb_one(kind, p0, grads, nearest):
        with bnb_nearest.nearest(nearest):
            p = torch.nn.Parameter(torch.from_numpy(p0.copy()))
            if kind == "lion":
                opt = bnb.optim.Lion8bit([p], lr=LION_LR, betas=LION_BETAS, weight_decay=WD, min_8bit_size=1)
            else:
                opt = bnb.optim.Adagrad8bit([p], lr=ADAGRAD_LR, eps=ADAGRAD_EPS, weight_decay=0.0, min_8bit_size=1)
            bound = np.zeros(p0.size, dtype=np.float64)
            for g in grads:
                before = p.detach().numpy().copy()
                p.grad = torch.from_numpy(g.copy())
                opt.step()
                after = p.detach().numpy()
                u = after.astype(np.float64) - before.astype(np.float64)
                bound += np.spacing(np.abs(after)).astype(np.float64) + 2.0 ** -22 * np.abs(u)
            st = opt.state[p]
            return p.detach().numpy().copy(), st["state1"].numpy().copy(), st["absmax1"].numpy().copy(), bound

    def run_zoffload_one(kind, p0, grads, threads, isa):
        n = p0.size
        lr, b1, b2, eps, wd = ((LION_LR, LION_BETAS[0], LION_BETAS[1], EPS, WD) if kind == "lion"
                               else (ADAGRAD_LR, BETAS[0], BETAS[1], ADAGRAD_EPS, 0.0))
        with open(os.path.join(tmp, "meta.txt"), "w") as f:
            f.write("%d %d %r %r %r %r %r\n" % (n, len(grads), lr, b1, b2, eps, wd))
        p0.astype(np.float32).tofile(os.path.join(tmp, "params.f32"))
        np.stack(grads).astype(np.float32).tofile(os.path.join(tmp, "grads.f32"))
        r = subprocess.run([oracle, tmp, str(threads), isa, kind], capture_output=True, text=True)
        if not expect(r.returncode == 0, "adam8bit_oracle %s runs: %s" % (kind, r.stderr)):
            return None
        read = lambda name, dt: np.fromfile(os.path.join(tmp, name), dtype=dt)  # noqa: E731
        return (read("out_params.f32", np.float32), read("out_m_codes.u8", np.uint8),
                read("out_m_absmax.f32", np.float32))

    for kind in ("lion", "adagrad"):
        for name, p0, grads in cases:
            want = run_bnb_one(kind, p0, grads, nearest=True)
            nan = np.isnan(want[0])
            for threads, isa in ((1, "auto"), (2, "auto"), (1, "scalar")):
                got = run_zoffload_one(kind, p0, grads, threads, isa)
                if got is None:
                    continue
                where = "%s %s, %s, %d thread(s)" % (kind, name, isa, threads)
                if kind == "lion":
                    differ = int(np.sum(got[0].view(np.uint32) != want[0].view(np.uint32)))
                    expect(same_bits(got[0], want[0]), "%s: parameters equal bitsandbytes' bit for bit after %d steps "
                           "(%d differ)" % (where, STEPS, differ))
                else:
                    diff = np.abs(got[0].astype(np.float64) - want[0])
                    expect(np.array_equal(np.isnan(got[0]), nan) and bool(np.all(diff[~nan] <= want[3][~nan])),
                           "%s: parameters within the derived bound of bitsandbytes' after %d steps (%d differ)" % (
                               where, STEPS, int(np.sum(diff[~nan] > 0))))
                expect(np.array_equal(got[1], want[1]), "%s: the state's codes equal bitsandbytes' (%d of %d differ)"
                       % (where, int(np.sum(got[1] != want[1])), got[1].size))
                expect(same_bits(got[2], want[2]), "%s: the state's absmax equal bitsandbytes'" % where)
            if name == "nan-grad":  # Lion: torch.sign(NaN) is 0, so the NaN gradient moves nothing
                expect(np.isnan(want[0][1000]) == (kind == "adagrad") and not np.isnan(np.delete(want[0], 1000)).any(),
                       "%s nan-grad: the parameter whose gradient was NaN is %s, the others finite" % (
                           kind, "NaN" if kind == "adagrad" else "finite"))
            if name == "zero-block" and kind == "lion":
                expect(want[2][1] == 0, "lion zero-block: the always-zero block keeps absmax 0")
            plain = run_bnb_one(kind, p0, grads, nearest=False)
            print("%s %s: bitsandbytes' own CPU re-quantization: state codes differ at %.1f%%" % (
                kind, name, 100.0 * np.mean(plain[1] != want[1])))

report_and_exit()
