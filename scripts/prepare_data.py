"""Build the offline prompt pool for the default target in data/smollm2/ from sources that arrive through PyPI
(licences in data/SOURCES.md); the responses come later from the target itself (scripts/regenerate.py).

    python scripts/prepare_data.py [--out data/smollm2] [--eval-fraction 0.05] [--seed 0]

Writes `messages` rows ({"id", "source", "messages": [system?, user]}) to prompts_train.jsonl,
prompts_eval.jsonl (a seeded held-out slice of every chat source, never trained on) and
prompts_code_eval.jsonl (HumanEval, kept out of training entirely). Prompts are deduplicated across sources
on lower-cased words (train/prompts.py).
"""

from __future__ import annotations

import argparse
from pathlib import Path

from heads.files import write_jsonl
from train.prompts import (
    CHITCHAT,
    HUMAN_EVAL,
    LLAMAFACTORY,
    chitchat_prompts,
    deduplicate,
    drop_near_duplicates,
    fetch,
    human_eval_prompts,
    llamafactory_prompts,
    split,
)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", type=Path, default=Path("data/smollm2"))
    parser.add_argument(
        "--eval-fraction", type=float, default=0.05, help="held-out share of each chat source"
    )
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    code_rows, entry_points = human_eval_prompts(fetch(*HUMAN_EVAL))
    chats = llamafactory_prompts(fetch(*LLAMAFACTORY)) + chitchat_prompts(fetch(*CHITCHAT))
    by_source, counts = deduplicate(chats, entry_points)
    train, held_out, sizes = split(by_source, args.eval_fraction, args.seed)
    # no training prompt repeats a held-out or HumanEval prompt, exactly or nearly (same order otherwise)
    train, near = drop_near_duplicates(train, held_out + code_rows)

    args.out.mkdir(parents=True, exist_ok=True)
    files = {
        "prompts_train.jsonl": train,
        "prompts_eval.jsonl": held_out,
        "prompts_code_eval.jsonl": code_rows,
    }
    for name, rows in files.items():
        write_jsonl(args.out / name, rows)
    print(f"{'source':<26}{'read':>7}{'dup':>7}{'empty':>7}{'leak':>7}{'near':>7}{'train':>7}{'eval':>7}")
    for source, c in counts.items():
        c |= sizes.get(source, {})
        print(
            f"{source:<26}{c['read']:>7}{c['duplicate']:>7}{c['empty']:>7}{c['humaneval']:>7}"
            f"{near.get(source, 0):>7}{c.get('train', 0) - near.get(source, 0):>7}{c.get('eval', 0):>7}"
        )
    print(f"{'humaneval (code eval)':<26}{len(code_rows):>7}")
    for name, rows in files.items():
        print(f"{args.out / name}: {len(rows)} rows, {(args.out / name).stat().st_size / 1e6:.2f} MB")


if __name__ == "__main__":
    main()
