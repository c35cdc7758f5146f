#!/usr/bin/env bash
# The README's "Results" on the default target, end to end on a CPU: regenerate (resumes; the committed shards
# make it a no-op), dump hidden states once, train the four heads, benchmark. Every step resumes when rerun.
#
#   bash scripts/reproduce_smollm2.sh            # EPOCHS=1 by default (what the README reports)
#
# The EAGLE-3 / Medusa-1 / EAGLE-1 runs read one offline dump (data.hidden_states=offline); Medusa-2 trains LoRA
# on the target, so it runs the target online, briefly. Needs pip install -e ".[train,bench]".
set -euo pipefail
cd "$(dirname "$0")/.."
EPOCHS="${EPOCHS:-1}"
STATES="${STATES:-runs/states_smollm2}"
OFFLINE=(data.hidden_states=offline "data.offline_dir=$STATES")

python scripts/regenerate.py --prompts data/smollm2/prompts_train.jsonl --out data/smollm2/regen \
    --max-new-tokens 128 --batch-size 48 --limit 2048
python scripts/dump_hidden_states.py configs/eagle3_smollm2.yaml "data.offline_dir=$STATES"

# EAGLE-3 and Medusa-1 side by side, one core each.
OMP_NUM_THREADS=1 accelerate launch --num_processes 1 train/eagle.py configs/eagle3_smollm2.yaml "${OFFLINE[@]}" \
    train.num_epochs="$EPOCHS" train.learning_rate=5e-4 train.warmup_ratio=0.05 train.per_device_batch_size=8 \
    train.eval_every_steps=0 train.save_every_steps=100 > runs/eagle3_smollm2.log 2>&1 &
OMP_NUM_THREADS=1 accelerate launch --num_processes 1 train/medusa.py configs/medusa1_smollm2.yaml "${OFFLINE[@]}" \
    train.num_epochs="$EPOCHS" train.per_device_batch_size=8 train.eval_every_steps=0 train.save_every_steps=100 \
    > runs/medusa1_smollm2.log 2>&1 &
wait
OMP_NUM_THREADS=1 accelerate launch --num_processes 1 train/eagle.py configs/eagle1_smollm2.yaml "${OFFLINE[@]}" \
    train.num_epochs=1 train.learning_rate=5e-4 train.warmup_ratio=0.05 train.per_device_batch_size=8 \
    train.eval_every_steps=0 train.save_every_steps=100 > runs/eagle1_smollm2.log 2>&1 &
OMP_NUM_THREADS=1 accelerate launch --num_processes 1 train/medusa.py configs/medusa2_smollm2.yaml \
    train.max_steps=60 medusa.heads_only_steps=20 train.eval_every_steps=0 train.save_every_steps=20 \
    > runs/medusa2_smollm2.log 2>&1 &
wait

python scripts/bench.py --eagle3 runs/eagle3_smollm2/head --eagle1 runs/eagle1_smollm2/head \
    --medusa1 runs/medusa1_smollm2/head --medusa2 runs/medusa2_smollm2 --prompts 3 --max-new-tokens 64 \
    --temperatures 0 1 --size-tree --out results/bench_smollm2
