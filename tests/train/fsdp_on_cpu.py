"""TEST-ONLY: run a recipe (or another wrapper) on accelerate's FSDP2 path on CPU processes.

accelerate 1.15 never selects FSDP without a GPU-like device: on CPU processes launched with
configs/accelerate/fsdp2.yaml it builds a gloo MULTI_CPU group. This wrapper makes the Accelerator that
`train.distributed.make_accelerator` builds switch that group to accelerate's FSDP2 path (the plugin read from
the launch config's FSDP_* variables) before anything is prepared, then runs its first argument as
`__main__` with the rest as its arguments. What it bypasses: only accelerate's choice of the distributed type;
sharding, state dicts and resume states are accelerate's and torch's own FSDP2 code. GPU runs never need it
(there accelerate picks FSDP from the same config by itself).

Usage: accelerate launch --config_file configs/accelerate/fsdp2.yaml tests/train/fsdp_on_cpu.py SCRIPT ARGS...
"""

import runpy
import sys

from accelerate import Accelerator, PartialState
from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin

import train.distributed


def accelerator_on_fsdp(*args, **kwargs) -> Accelerator:
    """`Accelerator(...)`, its gloo MULTI_CPU group switched to FSDP."""
    accelerator = Accelerator(*args, **kwargs)
    if accelerator.distributed_type == DistributedType.MULTI_CPU:
        accelerator.state.distributed_type = DistributedType.FSDP
        PartialState().distributed_type = DistributedType.FSDP
        accelerator.state.fsdp_plugin = FullyShardedDataParallelPlugin()
    return accelerator


if __name__ == "__main__":
    train.distributed.Accelerator = accelerator_on_fsdp  # what make_accelerator calls
    script, sys.argv = sys.argv[1], sys.argv[1:]
    runpy.run_path(script, run_name="__main__")
