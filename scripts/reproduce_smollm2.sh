#!/usr/bin/env bash
# The README's "Results" on the default target, end to end on a 2-core CPU: regenerate (resumes; with the
# committed shards it has nothing to do), dump hidden states once, train the four heads, benchmark.
#
#   bash scripts/reproduce_smollm2.sh
#
# EAGLE-3, Medusa-1 and EAGLE-1 read one offline dump (data.hidden_states=offline); Medusa-2 trains LoRA on the
# target, so it runs the target online, briefly. Core 1 trains EAGLE-3 (one epoch, then twice two more, each
# from the last head with a fresh, lower schedule: five epochs), then EAGLE-1 (briefly); core 2 Medusa-1 (two
# epochs), then Medusa-2 (briefly). Then, on both cores, EAGLE-3 two more epochs with 5 TTT steps instead of 3,
# and three last epochs over 2,560 chats (512 more regenerated ones, a second dump); Medusa-1 three more epochs
# over those 2,560. About six hours after the first dump on 2 cores, most of it EAGLE-3. The benchmark decodes
# with int8 draft heads (the target stays fp32).
# Logs go to runs/*.log. Needs pip install -e ".[train,bench]".
#
# Then the heads shipped in pretrained/smollm2-135m-instruct/ (their cards say what they measured), from their
# own configs; `bash scripts/reproduce_smollm2.sh shipped` runs only this part: EAGLE-3 stage 1 over 6,599
# chats (its dump 25-38 min, two epochs 49-67 min), stage 2 over all 8,135 from stage 1's head (its dump 29-44
# min, two epochs under bf16 autocast 40-57 min), stages 3, 4 and 5 each from the last head, one epoch online
# with one more pool each (26, 39 and 47 min), Medusa-1 2,000 steps online over the 6,599 (37-63 min), the
# benchmark of both (19-33 min), their cards, then DFlash (one epoch online, 45 min; its benchmark 35 min),
# then EAGLE-3's held-out benchmarks (about 50 min), then P-EAGLE from EAGLE-3's stage-4 head (one epoch
# online, 33 min; its benchmarks 55 min): 9-10 h on 2 AMD EPYC cores by the parts' times. After a kill rerun
# the same command: the dumps keep their complete shards and training resumes from its newest state.
set -euo pipefail
cd "$(dirname "$0")/.."

shipped() {
    export OMP_NUM_THREADS=2
    local stage1=configs/eagle3_smollm2_ship_stage1.yaml
    local -A trained=(  # the commands that go on the cards
        [eagle3]="OMP_NUM_THREADS=2 python train/eagle.py $stage1, then OMP_NUM_THREADS=2 python train/eagle.py configs/eagle3_smollm2_ship_stage2.yaml, then OMP_NUM_THREADS=2 python train/eagle.py configs/eagle3_smollm2_ship_stage3.yaml, then OMP_NUM_THREADS=2 python train/eagle.py configs/eagle3_smollm2_ship_stage4.yaml, then OMP_NUM_THREADS=2 python train/eagle.py configs/eagle3_smollm2_ship.yaml"
        [medusa1]="OMP_NUM_THREADS=2 python train/medusa.py configs/medusa1_smollm2_ship.yaml"
        [dflash]="python train/eagle.py configs/dflash_smollm2_ship.yaml"
        [peagle]="OMP_NUM_THREADS=2 python train/eagle.py configs/peagle_smollm2_ship.yaml"
    )
    mkdir -p runs
    python scripts/dump_hidden_states.py "$stage1"  # EAGLE-3 stage 1: 6,599 chats, two epochs
    python train/eagle.py "$stage1" > runs/eagle3_smollm2_ship_stage1.log 2>&1
    python scripts/dump_hidden_states.py configs/eagle3_smollm2_ship_stage2.yaml  # stage 2: all 8,135, two more
    python train/eagle.py configs/eagle3_smollm2_ship_stage2.yaml > runs/eagle3_smollm2_ship_stage2.log 2>&1
    python train/eagle.py configs/eagle3_smollm2_ship_stage3.yaml > runs/eagle3_smollm2_ship_stage3.log 2>&1
    python train/eagle.py configs/eagle3_smollm2_ship_stage4.yaml > runs/eagle3_smollm2_ship_stage4.log 2>&1
    python train/eagle.py configs/eagle3_smollm2_ship.yaml > runs/eagle3_smollm2_ship.log 2>&1  # stage 5
    python train/medusa.py configs/medusa1_smollm2_ship.yaml > runs/medusa1_smollm2_ship.log 2>&1
    python train/eagle.py configs/dflash_smollm2_ship.yaml > runs/dflash_smollm2_ship.log 2>&1  # 45 min, online
    local bench=results/bench_smollm2_pretrained
    for name in eagle3 medusa1; do  # shipped, benchmarked from pretrained/, then shipped with the bench's rows
        python scripts/ship_head.py "runs/${name}_smollm2_ship/head" --name "$name" --command "${trained[$name]}"
    done
    python scripts/bench.py --pretrained --prompts 10 --max-new-tokens 64 --temperatures 0 1 --size-tree \
        --eagle3-tree 6 3 20 --eagle3-tree 8 3 24 --eagle3-tree 8 4 24 0.05 --medusa1-dynamic 3 3 9 0.05 \
        --out "$bench"
    for name in eagle3 medusa1; do
        python scripts/ship_head.py "runs/${name}_smollm2_ship/head" --name "$name" --command "${trained[$name]}" \
            --bench "$bench/bench.json"
    done
    # EAGLE-3 on the held-out sources at T=0 and T=1 (64 and 256 tokens, docs/benchmark.md); its card's rows
    # come from the T=0 run
    local eagle3=(--eagle3 pretrained/smollm2-135m-instruct/eagle3 --heldout --prompts 10 --max-new-tokens 64 256
        --long-prompts 4 --chain 3)
    python scripts/bench.py "${eagle3[@]}" --temperatures 0 --only "EAGLE-3 dynamic" "EAGLE-3 chain 3" \
        --out results/bench_heldout_stage5
    python scripts/bench.py "${eagle3[@]}" --temperatures 1 --only "EAGLE-3 chain 3" --out results/bench_sampling_stage5
    python scripts/ship_head.py runs/eagle3_smollm2_ship/head --name eagle3 --command "${trained[eagle3]}" \
        --bench results/bench_heldout_stage5/bench.json
    # DFlash: shipped, then its own benchmark beside the two (docs/benchmark.md, DFlash), then its card's rows
    python scripts/ship_head.py runs/dflash_smollm2_ship/head --name dflash --command "${trained[dflash]}"
    python scripts/bench.py --pretrained --prompts 10 --max-new-tokens 64 --temperatures 0 1 --dflash-budget 8 \
        --dflash-budget 16 --size-tree --out results/bench_dflash
    python scripts/ship_head.py runs/dflash_smollm2_ship/head --name dflash --command "${trained[dflash]}" \
        --bench results/bench_dflash/bench.json
    # P-EAGLE: from EAGLE-3's stage-4 head (its config's init_from), one epoch online over the four
    # pools (about 33 min); shipped, benchmarked beside EAGLE-3 and DFlash, then on the held-out sources at T=0
    # and T=1 (docs/benchmark.md), then its card's rows from the T=0 run
    python train/eagle.py configs/peagle_smollm2_ship.yaml > runs/peagle_smollm2_ship.log 2>&1
    python scripts/ship_head.py runs/peagle_smollm2_ship/head --name peagle --command "${trained[peagle]}"
    local shipped=pretrained/smollm2-135m-instruct
    python scripts/bench.py --eagle3 "$shipped/eagle3" --dflash "$shipped/dflash" --peagle "$shipped/peagle" \
        --prompts 10 --max-new-tokens 64 --temperatures 0 1 --block-budget 8 --size-tree --out results/bench_peagle
    local heldout=(--peagle "$shipped/peagle" --heldout --prompts 10 --max-new-tokens 64 256 --long-prompts 4 --chain 3)
    python scripts/bench.py "${heldout[@]}" --block-budget 8 --temperatures 0 \
        --only "P-EAGLE best-first 8" "P-EAGLE chain 3" --out results/bench_peagle_stage2
    python scripts/bench.py "${heldout[@]}" --temperatures 1 --only "P-EAGLE chain 3" \
        --out results/bench_peagle_sampling_stage2
    python scripts/ship_head.py runs/peagle_smollm2_ship/head --name peagle --command "${trained[peagle]}" \
        --bench results/bench_peagle_stage2/bench.json
}
if [[ "${1:-}" == shipped ]]; then
    shipped
    exit
fi
STATES="${STATES:-runs/states_smollm2}"
OFFLINE=(data.hidden_states=offline "data.offline_dir=$STATES")
COMMON=(train.eval_every_steps=0 train.save_every_steps=50 train.per_device_batch_size=8)
mkdir -p runs

python scripts/regenerate.py --prompts data/smollm2/prompts_train.jsonl --out data/smollm2/regen \
    --max-new-tokens 128 --batch-size 48 --limit 2048
python scripts/regenerate.py --prompts data/smollm2/prompts_train.jsonl --out data/smollm2/regen_extra \
    --max-new-tokens 128 --batch-size 48 --start 2048 --limit 2560
python scripts/dump_hidden_states.py configs/eagle3_smollm2.yaml "data.offline_dir=$STATES"

export OMP_NUM_THREADS=1
{
    accelerate launch --num_processes 1 train/eagle.py configs/eagle3_smollm2.yaml "${OFFLINE[@]}" "${COMMON[@]}" \
        train.num_epochs=1 train.learning_rate=6e-4 train.warmup_ratio=0.05 > runs/eagle3_smollm2.log 2>&1
    accelerate launch --num_processes 1 train/eagle.py configs/eagle3_smollm2.yaml "${OFFLINE[@]}" "${COMMON[@]}" \
        train.num_epochs=2 train.learning_rate=3e-4 train.warmup_ratio=0.02 eagle.init_from=runs/eagle3_smollm2/head \
        train.output_dir=runs/eagle3_smollm2_cont > runs/eagle3_smollm2_cont.log 2>&1
    accelerate launch --num_processes 1 train/eagle.py configs/eagle3_smollm2.yaml "${OFFLINE[@]}" "${COMMON[@]}" \
        train.num_epochs=2 train.learning_rate=2e-4 train.warmup_ratio=0.02 \
        eagle.init_from=runs/eagle3_smollm2_cont/head train.output_dir=runs/eagle3_smollm2_cont2 \
        > runs/eagle3_smollm2_cont2.log 2>&1
    accelerate launch --num_processes 1 train/eagle.py configs/eagle1_smollm2.yaml "${OFFLINE[@]}" "${COMMON[@]}" \
        train.max_steps=60 train.learning_rate=6e-4 train.warmup_ratio=0.05 > runs/eagle1_smollm2.log 2>&1
} &
core1=$!
{
    accelerate launch --num_processes 1 train/medusa.py configs/medusa1_smollm2.yaml "${OFFLINE[@]}" "${COMMON[@]}" \
        train.num_epochs=2 train.output_dir=runs/medusa1_smollm2_e2 > runs/medusa1_smollm2_e2.log 2>&1
    accelerate launch --num_processes 1 train/medusa.py configs/medusa2_smollm2.yaml train.eval_every_steps=0 \
        train.save_every_steps=20 train.max_steps=40 medusa.heads_only_steps=15 > runs/medusa2_smollm2.log 2>&1
} &
core2=$!
wait "$core1"
wait "$core2"
export OMP_NUM_THREADS=2
accelerate launch --num_processes 1 train/eagle.py configs/eagle3_smollm2.yaml "${OFFLINE[@]}" "${COMMON[@]}" \
    train.num_epochs=2 train.learning_rate=2e-4 train.warmup_ratio=0.02 eagle.ttt_steps=5 \
    eagle.init_from=runs/eagle3_smollm2_cont2/head train.output_dir=runs/eagle3_smollm2_ttt5 \
    > runs/eagle3_smollm2_ttt5.log 2>&1
# Last EAGLE-3 stage: one epoch over 2,560 chats (the 2,048 above plus regen_extra's first two shards, 512), its own dump.
MORE=("data.train_files=[data/smollm2/regen/shard-*.jsonl,data/smollm2/regen_extra/shard-00000.jsonl,data/smollm2/regen_extra/shard-00001.jsonl]")
python scripts/dump_hidden_states.py configs/eagle3_smollm2.yaml "data.offline_dir=${STATES}_2560" "${MORE[@]}"
accelerate launch --num_processes 1 train/eagle.py configs/eagle3_smollm2.yaml data.hidden_states=offline \
    "data.offline_dir=${STATES}_2560" "${MORE[@]}" "${COMMON[@]}" train.num_epochs=1 train.learning_rate=2e-4 \
    train.warmup_ratio=0.02 eagle.ttt_steps=5 eagle.init_from=runs/eagle3_smollm2_ttt5/head \
    train.output_dir=runs/eagle3_smollm2_2560 > runs/eagle3_smollm2_2560.log 2>&1
# Two more EAGLE-3 epochs over the 2,560 chats at lr 1.5e-4, from that head.
accelerate launch --num_processes 1 train/eagle.py configs/eagle3_smollm2.yaml data.hidden_states=offline \
    "data.offline_dir=${STATES}_2560" "${MORE[@]}" "${COMMON[@]}" train.num_epochs=2 train.learning_rate=1.5e-4 \
    train.warmup_ratio=0.02 eagle.ttt_steps=5 eagle.init_from=runs/eagle3_smollm2_2560/head \
    train.output_dir=runs/eagle3_smollm2_2560e3 > runs/eagle3_smollm2_2560e3.log 2>&1
# Medusa-1: three more epochs over the 2,560 chats, from the two-epoch heads.
accelerate launch --num_processes 1 train/medusa.py configs/medusa1_smollm2.yaml data.hidden_states=offline \
    "data.offline_dir=${STATES}_2560" "${MORE[@]}" "${COMMON[@]}" train.num_epochs=3 train.learning_rate=5e-4 \
    train.warmup_ratio=0.02 medusa.init_from=runs/medusa1_smollm2_e2/head train.output_dir=runs/medusa1_smollm2_e5 \
    > runs/medusa1_smollm2_e5.log 2>&1
unset OMP_NUM_THREADS

python scripts/bench.py --eagle3 runs/eagle3_smollm2_2560e3/head --eagle1 runs/eagle1_smollm2/head \
    --medusa1 runs/medusa1_smollm2_e5/head --medusa2 runs/medusa2_smollm2 --prompts 5 --max-new-tokens 64 \
    --temperatures 0 1 --size-tree --eagle3-tree 6 6 20 --eagle3-tree 7 6 24 --eagle3-tree 8 8 32 \
    --medusa1-tree 32 --int8-draft --out results/bench_smollm2
shipped
