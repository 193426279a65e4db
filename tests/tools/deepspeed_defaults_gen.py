#!/usr/bin/env python3
"""Writes DeepSpeed's own defaults, read from its config classes, as the golden file
deepspeed_defaults_test.py compares `zoffload config check` with.

Needs DeepSpeed importable (tools/deepspeed_zero3.py's --help says how to install it beside this
repository; DS_ACCELERATOR=cpu works without a GPU):

    DS_ACCELERATOR=cpu PYTHONPATH=/tmp/ds python3 tests/tools/deepspeed_defaults_gen.py \\
        > tests/tools/deepspeed_defaults.json

The sections are those a DeepSpeed JSON config holds and zoffload reads: zero_optimization (with
offload_param and offload_optimizer as their own classes give them, where DeepSpeed's own default is
null), aio, fp16, bf16, tensorboard, csv_monitor, and the top-level scalars from
deepspeed.runtime.constants. Keys are the JSON names (pydantic aliases), as a config file spells them.
"""
import json
import sys

import deepspeed
from deepspeed.monitor.config import get_monitor_config
from deepspeed.runtime import constants as C
from deepspeed.runtime.precision_config import DeepSpeedBF16Config, DeepSpeedFP16Config
from deepspeed.runtime.swap_tensor.aio_config import get_aio_config
from deepspeed.runtime.zero.config import DeepSpeedZeroConfig
from deepspeed.runtime.zero.offload_config import DeepSpeedZeroOffloadOptimizerConfig, DeepSpeedZeroOffloadParamConfig


def dump(model):
    # by_alias: the names a config file uses (stage3_prefetch_bucket_size, not prefetch_bucket_size).
    return json.loads(model.model_dump_json(by_alias=True))


zero = dump(DeepSpeedZeroConfig())
# Deprecated fields DeepSpeed keeps only to read old files; their replacements are listed.
for old in ("cpu_offload", "cpu_offload_param", "cpu_offload_use_pin_memory", "stage3_gather_fp16_weights_on_model_save"):
    zero.pop(old, None)
zero["offload_param"] = dump(DeepSpeedZeroOffloadParamConfig())
zero["offload_optimizer"] = dump(DeepSpeedZeroOffloadOptimizerConfig())
monitors = get_monitor_config({})
out = {
    "deepspeed_version": deepspeed.__version__,
    "defaults": {
        "gradient_clipping": C.GRADIENT_CLIPPING_DEFAULT,
        "steps_per_print": C.STEPS_PER_PRINT_DEFAULT,
        "wall_clock_breakdown": C.WALL_CLOCK_BREAKDOWN_DEFAULT,
        "zero_optimization": zero,
        "aio": get_aio_config({}),
        "fp16": dump(DeepSpeedFP16Config()),
        "bf16": dump(DeepSpeedBF16Config()),
        "tensorboard": dump(monitors.tensorboard),
        "csv_monitor": dump(monitors.csv_monitor),
    },
}
json.dump(out, sys.stdout, indent=1, sort_keys=True)
sys.stdout.write("\n")
