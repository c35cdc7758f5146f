"""What speculation costs and gains on a hybrid target (recurrent layers) on this CPU: a random Qwen3.5-style
hybrid at the default target's size and its all-attention twin, plain decoding against oracle chains of 4
drafts at set acceptances (benchmarks/hybrid.py says why an oracle, and what it leaves out). Run with:

    python scripts/bench_hybrid.py --threads 2 --prompts 3 --new-tokens 64 --repeats 3 \
        --out results/bench_hybrid

Prints a markdown table and writes bench.md and bench.json to --out. Not beside other work: two shared cores.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from benchmarks.hybrid import report, run
from heads.files import write_text


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's)")
    parser.add_argument("--prompts", type=int, default=3)
    parser.add_argument("--prompt-length", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3, help="timed runs per prompt and method")
    parser.add_argument("--out", type=Path, default=None, help="folder for bench.md and bench.json")
    args = parser.parse_args(argv)
    if min(args.prompts, args.prompt_length, args.new_tokens, args.repeats) < 1:
        parser.error("--prompts, --prompt-length, --new-tokens and --repeats must be >= 1")
    if args.threads:
        torch.set_num_threads(args.threads)
    record = run(args.prompts, args.prompt_length, args.new_tokens, args.repeats)
    text = report(record)
    print(text)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        write_text(args.out / "bench.md", text + "\n")
        write_text(args.out / "bench.json", json.dumps(record, indent=1) + "\n")
    return record


if __name__ == "__main__":
    main()
