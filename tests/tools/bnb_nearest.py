"""bitsandbytes' blockwise re-quantization as its CUDA kernels and zoffload do it, for the tests that
use bitsandbytes' CPU AdamW8bit as the oracle: its CPU library looks codes up through an approximate
table that, near zero, often returns a farther code (docs/cpu_optim.md, "Adam with 8-bit moments").
`nearest()` swaps this rule in for bitsandbytes' own for the duration of a `with` block."""
import contextlib

import torch
import bitsandbytes.backends.cpu.ops as bnb_cpu_ops


def nearest_requantize(A_fp32, code, absmax_out, out_uint8, blocksize):
    """Each block: absmax = the largest |x| that is not NaN (0 if none); code = the nearest entry to
    x / absmax, the lower on a tie, 0 for NaN."""
    x = A_fp32.reshape(-1)
    for b in range(0, x.numel(), blocksize):
        blk = x[b:b + blocksize]
        am = torch.nan_to_num(blk.abs(), nan=0.0).max()
        normed = blk / am
        d = (normed.view(-1, 1) - code.view(1, -1)).abs()
        d = torch.nan_to_num(d, nan=float("inf"))
        idx = d.argmin(dim=1)  # the first minimum: the lower index on a tie; NaN rows: 0
        absmax_out[b // blocksize] = am
        out_uint8.view(-1)[b:b + blocksize] = idx.to(torch.uint8)


@contextlib.contextmanager
def nearest(enabled=True):
    saved = bnb_cpu_ops._quant_blockwise_fp32_direct
    if enabled:
        bnb_cpu_ops._quant_blockwise_fp32_direct = nearest_requantize
    try:
        yield
    finally:
        bnb_cpu_ops._quant_blockwise_fp32_direct = saved
