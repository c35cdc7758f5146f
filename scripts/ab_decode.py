"""A/B of the decode loop at B = 1: an earlier git revision's `decode` package against the working tree's, in
one process, with the heads shipped for the default target (benchmarks/ab.py says how). Run with:

    python scripts/ab_decode.py --before da08d0e --prompts 10 --repeats 2 --threads 1

It prints a markdown table: per method, tau, the median tok/s of each loop and the median of the paired
after/before ratios (both loops decode each prompt back to back, their order alternating).
"""

from __future__ import annotations

import argparse
from pathlib import Path

from benchmarks.ab import run
from targets import DEFAULT_TARGET

DATA = Path(__file__).resolve().parents[1] / "data" / "smollm2"


def main(argv: list[str] | None = None) -> str:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--before", required=True, help="the git revision whose decode loop is 'before'")
    parser.add_argument("--model", default=DEFAULT_TARGET)
    parser.add_argument("--data-dir", default=str(DATA))
    parser.add_argument("--category", choices=("chat", "instruction", "code"), default="chat")
    parser.add_argument("--prompts", type=int, default=10)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=1, help="torch threads (1 on a shared 2-core machine)")
    args = parser.parse_args(argv)
    if min(args.prompts, args.repeats, args.max_new_tokens, args.threads) < 1:
        parser.error("--prompts, --repeats, --max-new-tokens and --threads must be >= 1")
    table = run(args)
    print(table)
    return table


if __name__ == "__main__":
    main()
