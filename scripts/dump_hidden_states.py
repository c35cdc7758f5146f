"""Write the offline hidden states of an EAGLE run's training data (data.hidden_states: offline).

    python scripts/dump_hidden_states.py configs/eagle3_smollm2.yaml data.offline_dir=runs/states [k=v ...]

Then train with the same config plus `data.hidden_states=offline data.offline_dir=runs/states`. Prints the
size before writing; finished shards are kept when rerun. Every dump also holds the target's final states,
so a Medusa-1 run with the same data settings (train_files, max_length, eval split) reads the same dump:

    python train/medusa.py configs/medusa1_smollm2.yaml data.hidden_states=offline data.offline_dir=runs/states
"""

import sys

import torch

from heads import EagleConfig
from heads.target import load_target
from train.common import load_datasets, make_accelerator
from train.config import EagleRunConfig, load_config
from train.eagle import DTYPES
from train.offline import dump_hidden_states


def main(cfg: EagleRunConfig) -> None:
    if not cfg.data.offline_dir:
        raise SystemExit("set data.offline_dir=<folder> (where the states go)")
    accelerator = make_accelerator(cfg.train)
    target, tokenizer = load_target(cfg.model.target, dtype=DTYPES[cfg.model.dtype],
                                    attn_implementation=cfg.model.attn_implementation, device=accelerator.device)
    train_set, _ = load_datasets(cfg.data, tokenizer, accelerator)
    overrides = {"aux_layer_ids": tuple(cfg.eagle.aux_layer_ids)} if cfg.eagle.aux_layer_ids else {}
    head_config = EagleConfig.from_target(target.config, cfg.eagle.head_type, **overrides)
    layers = (-1,) if head_config.head_type == "eagle1" else head_config.aux_layer_ids
    dump_hidden_states(target, train_set, tuple(layers), cfg.data.offline_dir, dtype=torch.float32)


if __name__ == "__main__":
    main(load_config(EagleRunConfig, sys.argv[1], sys.argv[2:]))
