"""Train one head per arm of an ablation spec and tabulate their acceptance (train/ablation.py has the spec
format). Rerun the same command to resume: finished arms are skipped, an interrupted one resumes.

    python scripts/ablate.py configs/ablation/smollm2.yaml [--arms baseline ttt5] [--no-train] [--dump-only]
        [--train-only]

Two lanes on a 2-core CPU: `OMP_NUM_THREADS=1 python scripts/ablate.py SPEC --arms A B --train-only` and
the same with other arms, side by side; then `python scripts/ablate.py SPEC --no-train` judges every trained
arm in one table.

Prompts per category: chat and instruction from data/smollm2/prompts_eval.jsonl, code from HumanEval
(prompts_code_eval.jsonl), the benchmark's own (benchmarks.prompts.load_prompts), never trained on; with the
spec's `heldout: true` also the held-out-source categories, pooled per kind with their ratio, and with its
`seen` globs prompts of those kinds that the training chats hold (benchmarks.prompts.load_seen_prompts).
Writes ablation.json and ablation.md to the spec's output_dir and prints the table.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from benchmarks.prompts import load_prompts, load_seen_prompts
from targets import load_target
from train.ablation import (
    DUMPED,
    check_arms,
    dump_states,
    judge_arm,
    load_spec,
    reference_record,
    run_arm,
    write_results,
)
from train.config import EagleRunConfig, MedusaRunConfig, load_config

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT / "data" / "smollm2"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("spec", type=Path, help="ablation YAML (train/ablation.py)")
    parser.add_argument(
        "--arms",
        nargs="*",
        default=None,
        help="only these arms or references (default: every arm in order, then the spec's references)",
    )
    parser.add_argument("--no-train", action="store_true", help="evaluate the arms trained so far only")
    parser.add_argument("--dump-only", action="store_true", help="offline spec: dump the states, then stop")
    parser.add_argument(
        "--train-only",
        action="store_true",
        help="train the arms, then stop (judge them later with --no-train)",
    )
    args = parser.parse_args(argv)
    try:
        spec = load_spec(args.spec)
    except (TypeError, ValueError) as error:
        raise SystemExit(str(error)) from error
    names = args.arms or [*spec.arms, *spec.references]
    unknown = [n for n in names if n not in spec.arms and n not in spec.references]
    if unknown:
        raise SystemExit(
            f"{args.spec}: no arm(s) {unknown}; the spec has {list(spec.arms)}"
            + (f" and references {list(spec.references)}" if spec.references else "")
        )
    if not args.no_train:
        try:  # every arm's config before the dump and the first launch
            check_arms(spec, [n for n in names if n in spec.arms])
        except ValueError as error:
            raise SystemExit(f"{args.spec}: {error}") from error
    if args.train_only and args.no_train:
        raise SystemExit("--train-only and --no-train exclude each other")
    if args.dump_only and spec.states_dir is None:
        raise SystemExit(f"{args.spec}: --dump-only: the spec trains online (no hidden_states: offline)")
    dumped = None
    if spec.states_dir is not None and not args.no_train:
        dumped = dump_states(spec)  # once for every arm (skipped when done before)
        if args.dump_only:
            return
    elif spec.states_dir is not None and (spec.states_dir / DUMPED).is_file():
        dumped = json.loads((spec.states_dir / DUMPED).read_text())["seconds"]
    records = []
    for name in names:
        if name in spec.references:  # judged as it is: nothing to train
            if not args.train_only:
                try:
                    records.append(reference_record(spec, name))
                except FileNotFoundError as error:
                    raise SystemExit(f"{args.spec}: {error}") from error
            continue
        if args.no_train:
            done = spec.output_dir / name / "ablation_done.json"
            if not done.is_file():
                print(f"[{name}] not trained: left out")
                continue
        records.append(run_arm(spec, name))
    if args.train_only:
        print(f"trained: {', '.join(r['arm'] for r in records)} (judge them with --no-train)")
        return
    classes = {"eagle": EagleRunConfig, "medusa": MedusaRunConfig}
    base = load_config(classes[spec.recipe], spec.base, spec.overrides)
    model, tokenizer = load_target(base.model.target)
    prompts, _ = load_prompts(DATA, spec.prompts, 0, heldout=spec.heldout)
    if spec.seen:
        try:
            prompts |= load_seen_prompts(spec.seen_files, spec.prompts)
        except ValueError as error:
            raise SystemExit(f"{args.spec}: seen {spec.seen}: {error}") from error
    results = []
    for record in records:
        for result in judge_arm(model, tokenizer, spec, record, prompts):
            results.append(result)
            taus = ", ".join(f"{c} tau {t['tau']:.2f}" for c, t in result["tau"].items())
            print(
                f"[{record['arm']}] {result['head']}: draft {result['draft_ms']:.1f} ms/step, {taus}",
                flush=True,
            )
    _, table = write_results(spec, results, dumped)
    print(table.read_text())


if __name__ == "__main__":
    main()
