"""Store a trained head in the repository as a shipped head (heads/shipping.py): half-precision weights, its
config, the recipe config of its run and a card with what it was trained on and what it measured.

    python scripts/ship_head.py runs/eagle3_smollm2_final/head --name eagle3 \\
        --command "bash scripts/reproduce_smollm2.sh" --bench results/bench_smollm2/bench.json

Writes pretrained/<target>/<name>/ (for the default target: pretrained/smollm2-135m-instruct/), which
`scripts/bench.py --pretrained` decodes with.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from heads.io import read_head_config
from heads.shipping import DTYPES, MAX_MB, ship_head
from targets.licence import licence_files


def main(argv: list[str] | None = None) -> Path:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("head", type=Path, help="the trained head's export folder")
    parser.add_argument(
        "--name", required=True, help="eagle3, medusa1, ...: its folder under pretrained/<target>/"
    )
    parser.add_argument("--command", required=True, help="the command that trained it (goes on the card)")
    parser.add_argument("--bench", type=Path, default=None, help="a bench.json that measured this head")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    parser.add_argument("--max-mb", type=float, default=MAX_MB)
    parser.add_argument("--notes", default=None, help="more text for the card (other measurements)")
    parser.add_argument(
        "--file",
        type=Path,
        action="append",
        default=[],
        help="a file copied into the folder as it is (repeatable): e.g. the licence terms and notice",
    )
    args = parser.parse_args(argv)
    bench = json.loads(args.bench.read_text()) if args.bench else None
    try:
        # what the target's licence asks a shipped derivative to carry (Gemma: its terms and a notice)
        licence = licence_files(read_head_config(args.head)["base_model"])
        dest = ship_head(
            args.head,
            args.name,
            command=args.command,
            dtype=args.dtype,
            bench=bench,
            max_mb=args.max_mb,
            notes=args.notes,
            files=args.file,
            licence=licence,
        )
    except (ValueError, FileNotFoundError, RuntimeError) as error:
        raise SystemExit(str(error)) from error
    print(f"shipped {args.head} as {dest}")
    print((dest / "CARD.md").read_text())
    return dest


if __name__ == "__main__":
    main()
