#!/usr/bin/env python3
"""common/bnb4bit.h against bitsandbytes 0.50.2's 4-bit quantization on the CPU, bit for bit:
NF4 and FP4, blocksizes 64 to 4096, sizes with a partial last block and odd element counts, inputs
in fp32, bf16 and fp16 (with zeros, ties, huge and tiny values), with and without double
quantization (compress_statistics).
- quantize: zoffload's packed bytes and absmax values equal bitsandbytes.functional.quantize_4bit's
  (without double quantization: its absmax mean is torch's reduction, which zoffload does not
  reproduce; double-quantized checkpoints store it);
- dequantize: zoffload's output bits equal bitsandbytes' reference dequantization
  (backends/default/ops.py: _dequantize_4bit_compute, the flat blocks the CUDA kernels use) of the
  same bytes, in the tensor's dtype, and the values equal bitsandbytes.functional.dequantize_4bit's
  (its CPU library writes FP4's zero code as -0: the only bits that may differ); with double
  quantization the absmax values read back equal bitsandbytes' dequantize_blockwise + offset.
  The oracle also reads each tensor as the packed 4-bit base keeps it (its blob, common/bnb4_blob.h),
  with the host's reader and HostDevice's dequantize_packed, and fails unless both give those bits.
- 8-bit (LLM.int8) weights as bitsandbytes quantizes them (int8_vectorwise_quant: int8 codes and
  each row's SCB; zero rows, outliers, odd shapes), read back as the packed base's blob by the host's
  reader and HostDevice in fp32, bf16 and fp16: the bits equal the weight bitsandbytes' training
  path computes with (MatMul8bitFp: CB.to(dtype).mul_(SCB.unsqueeze(1).mul(1.0 / 127.0))), and a
  Linear8bitLt in training mode gives, bit for bit, torch's linear over zoffload's weights.
usage: bnb4bit_bnb_test.py ORACLE_BINARY   (exit 77 without bitsandbytes)"""
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
    import bitsandbytes.functional as F
    from bitsandbytes.backends.default.ops import _dequantize_4bit_compute, _get_4bit_quantize_bounds
except ImportError as e:
    print("skipping: bitsandbytes, torch or numpy is missing (%s); tools/requirements.txt lists them" % e)
    sys.exit(77)

oracle = sys.argv[1]
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def run(work, meta, files):
    os.makedirs(work, exist_ok=True)
    for name, array in files.items():
        array.tofile(os.path.join(work, name))
    with open(os.path.join(work, "meta.txt"), "w") as f:
        for k, v in meta.items():
            f.write("%s %s\n" % (k, v))
    p = subprocess.run([oracle, work], capture_output=True, text=True)
    expect(p.returncode == 0, "oracle on %s: %s" % (meta, p.stderr))
    return p.returncode == 0


def bits(t):
    """A tensor's bit patterns as a numpy integer array (so -0 and NaN payloads compare exactly)."""
    t = t.contiguous().reshape(-1)
    return t.view(torch.int32 if t.dtype == torch.float32 else torch.int16).numpy()


def sample(rng, shape, dtype, kind):
    x = torch.from_numpy(rng.standard_normal(shape).astype(np.float32))
    flat = x.view(-1)
    if kind == "edges":  # zeros, a zero block, ties on a midpoint, huge and tiny values
        flat[::7] = 0.0
        flat[:64] = 0.0
        flat[64:96] = torch.tensor([1.0, -1.0, 0.5, -0.5] * 8)
        flat[100] = 3e4
        flat[101] = -1e-20
        flat[-3:] = torch.tensor([1e-30, -2e-30, 5e-31])  # a tiny partial last block
    if kind == "ties":  # values that scale onto a midpoint, or next to one, in the first and last block
        pattern = [np.float32(1.7)]
        for t in ("nf4", "fp4"):
            for m in _get_4bit_quantize_bounds(t, torch.device("cpu"))[0].numpy():
                v = np.float32(m) * np.float32(1.7)
                pattern += [v, np.nextafter(v, np.float32(4)), np.nextafter(v, np.float32(-4))]
        pattern = torch.from_numpy(np.array(pattern, dtype=np.float32))
        flat[:256] = 0.0  # so that 1.7 is the absmax of the blocks that hold the pattern
        flat[-256:] = 0.0
        flat[:pattern.numel()] = pattern
        flat[-pattern.numel():] = pattern
    return x.to(dtype)


def check_case(tmp, i, shape, blocksize, qtype, dtype_name, kind, rng):
    dtype = DTYPES[dtype_name]
    x = sample(rng, shape, dtype, kind)
    n = x.numel()
    name = "%s %s bs=%d %s %s" % (qtype, tuple(shape), blocksize, dtype_name, kind)
    # Quantize: zoffload from the fp32 values bitsandbytes quantizes (x.float()).
    packed, state = F.quantize_4bit(x, blocksize=blocksize, quant_type=qtype, compress_statistics=False)
    work = os.path.join(tmp, "q%d" % i)
    if run(work, {"mode": "quantize", "n": n, "blocksize": blocksize, "type": qtype},
           {"x.f32": x.float().numpy().reshape(-1)}):
        ours = np.fromfile(os.path.join(work, "out_packed.u8"), dtype=np.uint8)
        ours_absmax = np.fromfile(os.path.join(work, "out_absmax.f32"), dtype=np.float32)
        theirs = packed.view(torch.uint8).reshape(-1).numpy()
        expect(np.array_equal(ours, theirs), "%s: packed codes equal quantize_4bit's (%d of %d bytes differ)" %
               (name, int((ours != theirs).sum()), theirs.size))
        expect(np.array_equal(ours_absmax.view(np.int32), state.absmax.numpy().view(np.int32)),
               "%s: absmax equals quantize_4bit's" % name)
    # Dequantize, plain and double-quantized.
    code = F.get_4bit_type(qtype, device="cpu")
    for nested in (False, True):
        packed, state = F.quantize_4bit(x, blocksize=blocksize, quant_type=qtype, compress_statistics=nested)
        raw = packed.view(torch.uint8).reshape(-1)
        files = {"packed.u8": raw.numpy()}
        meta = {"mode": "dequantize", "n": n, "blocksize": blocksize, "type": qtype, "dtype": dtype_name,
                "nested": int(nested)}
        if nested:
            absmax = F.dequantize_blockwise(state.absmax, state.state2)
            absmax += state.offset
            files.update({"qabsmax.u8": state.absmax.numpy(), "absmax2.f32": state.state2.absmax.numpy(),
                          "map.f32": state.state2.code.numpy()})
            meta.update({"blocksize2": state.state2.blocksize,
                         "offset": int(np.float32(state.offset.item()).view(np.uint32))})
        else:
            absmax = state.absmax
            files["absmax.f32"] = absmax.numpy()
        work = os.path.join(tmp, "d%d%s" % (i, "n" if nested else ""))
        if not run(work, meta, files):
            continue
        reference = _dequantize_4bit_compute(raw, absmax.float(), code, blocksize, tuple(shape), dtype)
        public = F.dequantize_4bit(packed, state)
        ours = np.fromfile(os.path.join(work, "out.bin"), dtype=np.float32 if dtype_name == "fp32" else np.int16)
        tag = "%s%s" % (name, " double-quantized" if nested else "")
        if nested:
            ours_absmax = np.fromfile(os.path.join(work, "out_absmax.f32"), dtype=np.float32)
            expect(np.array_equal(ours_absmax.view(np.int32), absmax.float().numpy().view(np.int32)),
                   "%s: absmax read back equals dequantize_blockwise + offset" % tag)
        ours_t = torch.from_numpy(ours).view(dtype)
        expect(np.array_equal(bits(ours_t), bits(reference)),
               "%s: bits equal bitsandbytes' reference dequantization (%d differ)" %
               (tag, int((bits(ours_t) != bits(reference)).sum())))
        expect(torch.equal(ours_t.float(), public.reshape(-1).float()),
               "%s: values equal dequantize_4bit's" % tag)


def check_int8(tmp, i, rows, cols, dtype_name, rng):
    """An 8-bit weight, quantized by bitsandbytes, read back by zoffload's blob readers."""
    dtype = DTYPES[dtype_name]
    w = torch.from_numpy(rng.standard_normal((rows, cols)).astype(np.float32))
    if rows > 2:
        w[1] = 0.0  # a zero row: SCB 0
        w[2, 0] = 300.0  # an outlier that sets its row's scale
    module = bnb.nn.Linear8bitLt(cols, rows, bias=False, has_fp16_weights=False)
    module.weight = bnb.nn.Int8Params(w.half(), requires_grad=False, has_fp16_weights=False)._quantize("cpu")
    cb, scb = module.weight.data.clone(), module.weight.SCB.clone()
    name = "int8 %dx%d %s" % (rows, cols, dtype_name)
    work = os.path.join(tmp, "i%d" % i)
    if not run(work, {"mode": "int8", "rows": rows, "cols": cols, "dtype": dtype_name},
               {"codes.i8": cb.numpy().reshape(-1), "scb.f32": scb.numpy()}):
        return
    raw = np.fromfile(os.path.join(work, "out.bin"), dtype=np.int32 if dtype == torch.float32 else np.int16)
    ours = torch.from_numpy(raw.copy()).view(dtype).reshape(rows, cols)
    theirs = cb.to(dtype).mul_(scb.unsqueeze(1).mul(1.0 / 127.0))  # MatMul8bitFp's weight
    expect(np.array_equal(bits(ours), bits(theirs)), "%s: the weights equal bitsandbytes' training path's (%d of %d "
           "differ)" % (name, int((bits(ours) != bits(theirs)).sum()), theirs.numel()))
    module.train()
    x = torch.from_numpy(rng.standard_normal((3, cols)).astype(np.float32)).to(dtype)
    with torch.no_grad():
        expect(torch.equal(module(x), torch.nn.functional.linear(x, ours)),
               "%s: Linear8bitLt (training) computes torch's linear over zoffload's weights" % name)


def main():
    rng = np.random.default_rng(4)
    cases = [((1000,), 64, "nf4", "bf16", "normal"),
             ((7, 33), 64, "nf4", "fp32", "normal"),     # odd n, a partial block across rows
             ((5, 130), 128, "fp4", "fp16", "normal"),
             ((3, 301), 256, "fp4", "bf16", "edges"),
             ((2, 2049), 64, "nf4", "bf16", "edges"),
             ((4, 4100), 4096, "nf4", "fp16", "normal"),
             ((64, 96), 32, "fp4", "fp32", "edges"),
             ((300, 257), 64, "nf4", "bf16", "normal"),
             ((3, 204), 128, "nf4", "fp32", "ties"),  # the partial block divides, a whole one multiplies
             ((3, 204), 128, "fp4", "fp32", "ties")]  # > 256 blocks: several nested blocks
    int8_cases = [(1, 1, "fp32"), (40, 3, "fp32"),  # rows narrower than a range of 5
                  (7, 33, "bf16"), (33, 70, "fp16"), (300, 257, "bf16"), (64, 96, "fp32")]
    with tempfile.TemporaryDirectory(prefix="zo-bnb4-") as tmp:
        for i, case in enumerate(cases):
            check_case(tmp, i, *case, rng)
        for i, case in enumerate(int8_cases):
            check_int8(tmp, i, *case, rng)
    print("bnb4bit: %d 4-bit layouts and %d 8-bit weights checked against bitsandbytes" % (len(cases), len(int8_cases)))
    report_and_exit()


main()
