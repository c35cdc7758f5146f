r"""Write the offline hidden states of an EAGLE run's training data (data.hidden_states: offline).

    accelerate launch scripts/dump_hidden_states.py configs/eagle3_smollm2.yaml data.offline_dir=runs/states \
        [--batch-size 8] [--shard-size 32] [k=v ...]

Every process dumps its share of the shards (shard n on process n % num_processes), `--batch-size` examples
per target forward, in the config's `model.dtype` (the target is loaded and the states are stored in it).
The shards do not depend on the number of processes, so one process (`python scripts/dump_hidden_states.py
...`) and several (e.g. `accelerate launch --config_file configs/accelerate/ddp_cpu.yaml ...`) write
interchangeable dumps. Prints the size before writing; finished shards are kept when rerun, under any number
of processes (with the same `--shard-size`, dtype, target, taps and data). `train.offline.dump_for_run`.

Then train with the same config plus `data.hidden_states=offline data.offline_dir=runs/states`. Every dump
also holds the target's final states, so a Medusa-1 run with the same data settings (train_files,
max_length, eval split) reads the same dump:

    python train/medusa.py configs/medusa1_smollm2.yaml data.hidden_states=offline \
        data.offline_dir=runs/states
"""

import argparse

from train.config import EagleRunConfig, load_config
from train.offline import dump_for_run

if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("config", help="the run's YAML file")
    parser.add_argument("overrides", nargs="*", help="key=value overrides, as for the recipes")
    parser.add_argument("--batch-size", type=int, default=8, help="examples per target forward (default 8)")
    parser.add_argument("--shard-size", type=int, default=32, help="examples per shard file (default 32)")
    args = parser.parse_intermixed_args()
    dump_for_run(load_config(EagleRunConfig, args.config, args.overrides), args.batch_size, args.shard_size)
