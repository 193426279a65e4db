#!/usr/bin/env python3
"""Describe the PyTorch this interpreter imports, for meson.build and tools/setup.sh.

Prints one `key=value` line each: version, cuda (the CUDA version LibTorch was built with, or
"none"), lib_dir, include_dirs (';'-separated), cmake_prefix_path, and the c10d backends the
build has (distributed, gloo, nccl as 0/1). Exits 0 when this PyTorch can build zoffload, and 1
with one line on stderr saying why not (no torch, too old, or built with the old C++ ABI).
Tested with the version pinned in tools/requirements.txt.
"""
import logging
import sys

# Note [Oldest PyTorch]: the code needs at::_fused_adamw_ on the CPU (zoffload-bench adam's
# baseline; CPU kernels since 2.4) and at::scaled_dot_product_attention (2.0). Older PyPI wheels
# were built with _GLIBCXX_USE_CXX11_ABI=0, which cannot link against Debian's gtest, CLI11 or our
# own std::string APIs; that is checked directly below, not inferred from the version.
MIN_VERSION = (2, 4)


def fail(why):
    print("torch_probe: " + why, file=sys.stderr)
    sys.exit(1)


# cpp_extension warns on import when no CUDA runtime is found (no GPU here); that is not our question.
logging.getLogger("torch.utils.cpp_extension").setLevel(logging.ERROR)
try:
    import torch
    import torch.utils
    from torch.utils import cpp_extension
except Exception as e:  # ImportError, or a broken install raising something else
    fail("%s cannot import torch (%s: %s)" % (sys.executable, type(e).__name__, e))

version = torch.__version__.split("+")[0]
try:
    major_minor = tuple(int(x) for x in version.split(".")[:2])
except ValueError:
    fail("cannot read torch version %r" % torch.__version__)
if major_minor < MIN_VERSION:
    fail("%s imports torch %s; zoffload needs PyTorch >= %d.%d" % ((sys.executable, torch.__version__) + MIN_VERSION))
if not torch.compiled_with_cxx11_abi():
    fail("%s imports torch %s built with the pre-C++11 std::string ABI (_GLIBCXX_USE_CXX11_ABI=0); "
         "zoffload links libraries built with the C++11 ABI" % (sys.executable, torch.__version__))

distributed = torch.distributed.is_available()
lines = {
    "version": torch.__version__,
    "cuda": torch.version.cuda or "none",
    "lib_dir": cpp_extension.library_paths()[0],
    "include_dirs": ";".join(cpp_extension.include_paths()),
    "cmake_prefix_path": torch.utils.cmake_prefix_path,
    "distributed": int(distributed),
    "gloo": int(distributed and torch.distributed.is_gloo_available()),
    "nccl": int(distributed and torch.distributed.is_nccl_available()),
}
for key, value in lines.items():
    print("%s=%s" % (key, value))
