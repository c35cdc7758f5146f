"""Training throughput of each recipe's step against the frozen target's forward alone (the floor).

    python scripts/bench_train.py [--model M] [--batch-size 4] [--seq-len 256] [--steps 5]

Same batches for every row; medians over steps after one warm-up (`train.throughput`). The EAGLE-3 online step
should reach at least 0.6 of the floor (the issue's goal): the target forward is work every online recipe must
do. The heads are configured as the shipped SmolLM2 configs say.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from targets import DEFAULT_TARGET, load_target
from train.config import EagleRunConfig, MedusaRunConfig, load_config
from train.throughput import step_times, synthetic_batches, table

CONFIGS = Path(__file__).resolve().parents[1] / "configs"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=DEFAULT_TARGET)
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--steps", type=int, default=5)
    args = parser.parse_args()
    target, _ = load_target(args.model)
    vocab_size = target.config.get_text_config().vocab_size
    batches = synthetic_batches(vocab_size, args.batch_size, args.seq_len, args.steps + 1)
    eagle = [
        load_config(EagleRunConfig, CONFIGS / f"{name}_smollm2.yaml").eagle for name in ("eagle3", "eagle1")
    ]
    medusa = load_config(MedusaRunConfig, CONFIGS / "medusa1_smollm2.yaml").medusa
    rows = step_times(target, batches, eagle, medusa)
    print(
        f"\nbatch {args.batch_size} x {args.seq_len} tokens, {args.steps} timed steps, "
        f"{torch.get_num_threads()} threads, medians\n"
    )
    print(table(rows, args.batch_size * args.seq_len))


if __name__ == "__main__":
    main()
