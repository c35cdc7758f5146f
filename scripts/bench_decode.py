"""Benchmark plain decoding (`decode.generate`, heads=None) against transformers' `generate`, and the
target's verify cost C_T(n) for n tree tokens (docs/design.md, When speculation pays;
benchmarks/plain.py). Run with:

    python scripts/bench_decode.py --threads 1 --max-new-tokens 64 --repeats 5 --prompts 3 --json
    bench_decode.json

On a shared 2-core machine use --threads 1: two OpenMP threads stall whenever another process takes a core.
"""

from __future__ import annotations

import argparse

import torch

from benchmarks.plain import PROMPTS, report, run
from heads.files import write_json
from targets import DEFAULT_TARGET, load_target


def main(argv: list[str] | None = None) -> dict:
    """Run both benchmarks, print two markdown tables, optionally write JSON; returns the results."""
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default=DEFAULT_TARGET, help="target name or local HF folder")
    parser.add_argument("--attn-implementation", choices=("eager", "sdpa"), default="eager")
    parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's)")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=5, help="timed runs per method, after one warm-up")
    parser.add_argument(
        "--prompts", type=int, default=3, help=f"how many of the {len(PROMPTS)} fixed prompts"
    )
    parser.add_argument("--json", default=None, help="write the results to this path")
    args = parser.parse_args(argv)
    if not 1 <= args.prompts <= len(PROMPTS):
        parser.error(f"--prompts must be in 1..{len(PROMPTS)}")
    if args.repeats < 1 or args.max_new_tokens < 1:
        parser.error("--repeats and --max-new-tokens must be >= 1")
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    model, tokenizer = load_target(
        args.model, dtype=torch.float32, attn_implementation=args.attn_implementation
    )
    results = run(
        model,
        tokenizer,
        args.model,
        prompts=args.prompts,
        max_new_tokens=args.max_new_tokens,
        repeats=args.repeats,
    )
    print(report(results))
    if args.json:
        write_json(args.json, results)
    return results


if __name__ == "__main__":
    main()
