#!/usr/bin/env bash
# GPU smoke run on one CUDA device, meant to finish in under 8 minutes (each stage prints its elapsed time):
#   1. train an EAGLE-3 head on the default target for 200 steps: bf16 autocast over the fp32 head, the
#      frozen target stored in bf16, sdpa attention; prints tokens/s and the final loss (from the run's
#      tensorboard log)
#   2. scripts/gpu_decode_check.py: greedy decoding of 5 held-out chat prompts with the fp32 target must be
#      identical to plain decoding (else exit 1); how many diverge from plain decoding with the bf16 target;
#      tau and speedup
#     bash scripts/gpu_smoke.sh [section.key=value ...]     (extra overrides for the training run)
# Without CUDA it prints one line and exits 0. Outputs: runs/gpu_smoke/<date-time>/ (or $GPU_SMOKE_OUT).
set -euo pipefail
cd "$(dirname "$0")/.."

cuda=$(python -c 'import torch; print(torch.cuda.is_available())')
if [ "$cuda" != "True" ]; then
    echo "gpu_smoke: no CUDA device, skipped"
    exit 0
fi
RUN=${GPU_SMOKE_OUT:-runs/gpu_smoke/$(date +%Y%m%d-%H%M%S)}  # a new folder: a finished run would only resume
started=$SECONDS
stage() { echo "gpu_smoke [$((SECONDS - started)) s] $*"; }
device=$(python -c 'import torch; print(torch.cuda.get_device_name(0) + ", torch " + torch.__version__)')
stage "$device, run folder $RUN"

stage "1/2 train EAGLE-3: 200 steps of 8 chats (data/smollm2/regen), bf16 autocast, bf16 target${*:+; $*}"
python train/eagle.py configs/eagle3_smollm2.yaml "train.output_dir=$RUN" train.max_steps=200 \
    train.per_device_batch_size=8 train.learning_rate=1e-3 train.warmup_ratio=0.05 \
    train.mixed_precision=bf16 model.dtype=bfloat16 model.attn_implementation=sdpa \
    train.report_to=tensorboard train.log_every_steps=10 train.save_every_steps=0 train.eval_every_steps=0 \
    train.eval_tau_prompts=0 "$@"
python - "$RUN" <<'EOF'
"""tokens/s and loss from the run's tensorboard scalars (the recipe logs them every train.log_every_steps)."""
import glob
import os
import statistics
import sys

from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

files = glob.glob(f"{sys.argv[1]}/**/events.out.tfevents.*", recursive=True)
folders = sorted({os.path.dirname(f) for f in files})
for folder in folders:
    log = EventAccumulator(folder)
    log.Reload()
    if "loss" in log.Tags()["scalars"]:
        loss, rate = log.Scalars("loss"), [e.value for e in log.Scalars("tokens_per_s")]
        steady = rate[1:] or rate  # the first interval includes start-up (CUDA context, kernel selection)
        print(f"train: tokens/s {statistics.median(steady):.0f} (median over {len(steady)} logged intervals, "
              f"the first left out), loss {loss[0].value:.3f} at step {loss[0].step} -> final loss "
              f"{loss[-1].value:.3f} at step {loss[-1].step}")
        break
else:
    sys.exit(f"no tensorboard scalars under {sys.argv[1]}")
EOF

stage "2/2 decode check: 5 held-out chat prompts, greedy, fp32 then bf16 target"
python scripts/gpu_decode_check.py --head "$RUN/head" --device cuda --prompts 5

stage "done (budget 480 s)"
