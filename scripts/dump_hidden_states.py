r"""Write the offline hidden states of an EAGLE run's training data (data.hidden_states: offline).

    accelerate launch scripts/dump_hidden_states.py configs/eagle3_smollm2.yaml data.offline_dir=runs/states \
        [--batch-size 8] [--shard-size 32] [k=v ...]

Every process dumps its share of the shards (shard n on process n % num_processes), `--batch-size` examples
per target forward, in the config's `model.dtype` (the target is loaded and the states are stored in it).
The shards do not depend on the number of processes, so one process (`python scripts/dump_hidden_states.py
...`) and several (e.g. `accelerate launch --config_file configs/accelerate/ddp_cpu.yaml ...`) write
interchangeable dumps. Prints the size before writing; finished shards are kept when rerun, under any number
of processes (with the same `--shard-size`, dtype, target, taps and data).

Then train with the same config plus `data.hidden_states=offline data.offline_dir=runs/states`. Every dump
also holds the target's final states, so a Medusa-1 run with the same data settings (train_files,
max_length, eval split) reads the same dump:

    python train/medusa.py configs/medusa1_smollm2.yaml data.hidden_states=offline \
        data.offline_dir=runs/states
"""

import argparse

from heads import EagleConfig
from train.common import load_datasets, load_frozen_target, make_accelerator
from train.config import TORCH_DTYPES, EagleRunConfig, load_config
from train.offline import dump_hidden_states


def main(cfg: EagleRunConfig, batch_size: int = 8, shard_size: int = 32) -> None:
    if not cfg.data.offline_dir:
        raise SystemExit("set data.offline_dir=<folder> (where the states go)")
    accelerator = make_accelerator(cfg.train)
    target, tokenizer = load_frozen_target(cfg.model, accelerator)  # whole on every process, at its revision
    train_set, _ = load_datasets(cfg.data, tokenizer, accelerator)
    overrides = {"aux_layer_ids": tuple(cfg.eagle.aux_layer_ids)} if cfg.eagle.aux_layer_ids else {}
    head_config = EagleConfig.from_target(target.config, cfg.eagle.head_type, **overrides)
    layers = (-1,) if head_config.head_type == "eagle1" else head_config.aux_layer_ids
    dump_hidden_states(
        target,
        train_set,
        tuple(layers),
        cfg.data.offline_dir,
        shard_size=shard_size,
        dtype=TORCH_DTYPES[cfg.model.dtype],
        batch_size=batch_size,
        accelerator=accelerator,
    )
    accelerator.end_training()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("config", help="the run's YAML file")
    parser.add_argument("overrides", nargs="*", help="key=value overrides, as for the recipes")
    parser.add_argument("--batch-size", type=int, default=8, help="examples per target forward (default 8)")
    parser.add_argument("--shard-size", type=int, default=32, help="examples per shard file (default 32)")
    args = parser.parse_intermixed_args()
    main(load_config(EagleRunConfig, args.config, args.overrides), args.batch_size, args.shard_size)
