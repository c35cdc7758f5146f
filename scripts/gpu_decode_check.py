"""Decode check of the GPU smoke run (scripts/gpu_smoke.sh): greedy decoding with an EAGLE head must equal
plain decoding with the fp32 target; with the target (and so the draft) in bf16, count the outputs that differ
from plain bf16 decoding (bf16 ties can flip an argmax between a 1-row and a tree pass: reported, not a
failure). Prints tau and speedup for both.

    python scripts/gpu_decode_check.py --head runs/gpu_smoke/<run>/head [--device cuda] [--prompts 5]

Exits 1 when an fp32 output differs from plain decoding. `--device cpu` runs the same checks on a CPU.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from decode import generate, prepare
from heads import load_heads
from targets import DEFAULT_TARGET, load_target

PROMPTS = Path(__file__).resolve().parents[1] / "data" / "smollm2" / "prompts_eval.jsonl"  # never trained on


def timed(model, ids: torch.Tensor, head, max_new_tokens: int):
    """`generate` timed between device synchronisations (CUDA runs asynchronously): (output, seconds)."""
    sync = torch.cuda.synchronize if model.device.type == "cuda" else (lambda: None)
    sync()
    start = time.perf_counter()
    out = generate(model, ids, head, max_new_tokens=max_new_tokens).one
    sync()
    return out, time.perf_counter() - start


def first_difference(a: torch.Tensor, b: torch.Tensor) -> int:
    """Index of the first differing token of two (1, T) sequences (the shorter length if one is a prefix)."""
    n = min(a.shape[1], b.shape[1])
    differ = (a[0, :n] != b[0, :n]).nonzero()
    return int(differ[0]) if len(differ) else n


def check(dtype: torch.dtype, rows: list[dict], args) -> int:
    """Plain vs speculative greedy decoding of each prompt, target in `dtype`; returns how many differ."""
    started = time.perf_counter()
    model, tokenizer = load_target(args.target, dtype=dtype, device=args.device)
    head = load_heads(args.head, target=model, dtype=dtype, device=model.device)  # generate: target's dtype
    # what a user does once: nothing on CUDA; on an x86 CPU with the fp32 target, its layout and int8 drafts
    prepare(model, head)
    prompts = [
        tokenizer.apply_chat_template(
            row["messages"], add_generation_prompt=True, return_tensors="pt", return_dict=True
        )["input_ids"].to(model.device)
        for row in rows
    ]
    for warm_up in (None, head):  # untimed: kernel selection, allocator, caches
        timed(model, prompts[0], warm_up, 8)
    taus, speedups, plain_rates, spec_rates, diverged = [], [], [], [], []
    for row, ids in zip(rows, prompts):
        plain, plain_s = timed(model, ids, None, args.max_new_tokens)
        spec, spec_s = timed(model, ids, head, args.max_new_tokens)
        if not torch.equal(plain.sequences, spec.sequences):
            at = first_difference(plain.sequences, spec.sequences) - ids.shape[1]
            diverged.append(f"{row['id']} at new token {at}")
        taus.append(spec.tau)
        speedups.append(plain_s / spec_s)
        plain_rates.append(plain.new_tokens / plain_s)
        spec_rates.append(spec.new_tokens / spec_s)
    name = str(dtype).removeprefix("torch.")
    print(
        f"{name} target on {args.device}: {len(rows) - len(diverged)}/{len(rows)} outputs identical to "
        f"plain {name} decoding; tau {statistics.median(taus):.2f}, speedup "
        f"{statistics.median(speedups):.2f}x (plain {statistics.median(plain_rates):.1f} tok/s, "
        f"speculative {statistics.median(spec_rates):.1f} tok/s; medians over {len(rows)} prompts, "
        f"{args.max_new_tokens} new tokens at most) [{time.perf_counter() - started:.0f} s]",
        flush=True,
    )
    for where in diverged:
        print(f"  differs from plain {name} decoding: {where}", flush=True)
    return len(diverged)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--head", required=True, help="exported EAGLE or Medusa head folder")
    parser.add_argument("--target", default=DEFAULT_TARGET, help="the target the head was trained on")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--prompts", type=int, default=5, help="first chat prompts of prompts_eval.jsonl")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    args = parser.parse_args()
    rows = [json.loads(line) for line in PROMPTS.read_text().splitlines()]
    rows = [row for row in rows if row["source"] == "chitchat"][: args.prompts]

    if check(torch.float32, rows, args):
        raise SystemExit(
            "LOSSLESS CHECK FAILED: with the fp32 target, speculative greedy output differs "
            "from plain decoding"
        )
    diverged = check(torch.bfloat16, rows, args)
    print(
        f"bf16: {diverged}/{len(rows)} speculative outputs diverge from plain bf16 decoding (reported, not "
        "a failure: bf16 rounding differs between a 1-row pass and a tree pass; near-ties flip the argmax)"
    )


if __name__ == "__main__":
    main()
