"""End-to-end decoding benchmark on held-out prompts: tau, acceptance per depth, tokens/s and speedup of every
head type against plain decoding and transformers' prompt-lookup decoding, measured in one process.

    python scripts/bench.py --eagle3 runs/eagle3/head --eagle1 runs/eagle1/head --medusa1 runs/medusa1/head \\
        --medusa2 runs/medusa2 --prompts 4 --max-new-tokens 96 --temperatures 0 1 --size-tree --out
        results/bench
    python scripts/bench.py --pretrained --prompts 10 --max-new-tokens 64   # the heads in pretrained/

Prompts (never trained on): chat and instruction-following from data/smollm2/prompts_eval.jsonl (the first
--prompts of each category, or those after the first --skip-prompts), code from prompts_code_eval.jsonl
(HumanEval). Tree sizing calibrates on the LAST --calibration-prompts chat prompts of the same file, disjoint
from the benchmark prompts.

Per prompt, plain decoding and every method run back to back in a rotating order (drift hits all alike). At
temperature 0 every output is compared token for token with plain decoding (counted in the `same as plain`
column, and a warning names each mismatch);
at temperature > 0 the methods use the lossless rule (decode/accept.py) with pure temperature sampling
(top_p=1, top_k=0), and prompt lookup samples from the same distribution. Metrics (docs/design.md, Metrics):
tau = tokens per target forward INCLUDING the bonus token (plain = 1), pooled over prompts; acceptance at
depth d = P(depth d accepted | depth d-1 accepted); speedup = tokens/s of the method / tokens/s of plain
decoding over the same prompts. Medusa-2 decodes its LoRA-merged target, and its speedup is over plain
decoding of that same merged target. Every method decodes after `decode.prepare` (its CPU weight layout and
int8 drafts, where they help). Writes bench.md, bench.json, acceptance.png and speedup_vs_tree.png to --out.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

from benchmarks import cli
from benchmarks.batch import batch_run
from benchmarks.benchmark import benchmark
from benchmarks.prompts import at_lengths, load_prompts, prompt_ids
from benchmarks.report import write_report
from decode.tree import DynamicTree
from heads import load_heads
from targets import load_target

DATA = Path(__file__).resolve().parents[1] / "data" / "smollm2"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    return cli.parse_args(argv, __doc__)


@torch.no_grad()  # a decorator, not set_grad_enabled(False): callers (tests) get their grad mode back
def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    args.out.mkdir(parents=True, exist_ok=True)
    model, tokenizer = load_target(args.model)
    command = "python scripts/bench.py " + " ".join(argv if argv is not None else sys.argv[1:])
    if args.batch_sizes:
        return batched(args, model, tokenizer, command)
    prompts, calibration = load_prompts(
        DATA, args.prompts, args.calibration_prompts if args.size_tree else 0, args.skip_prompts, args.heldout
    )
    columns = at_lengths(prompts, args.max_new_tokens, args.long_prompts)
    paths = {
        name: getattr(args, name) for name in ("medusa1", "eagle1", "eagle3", "medusa2", *cli.BLOCK_HEADS)
    }
    results = {
        "command": command,
        **benchmark(
            model,
            tokenizer,
            args.model,
            paths,
            {label: rows for label, (rows, _) in columns.items()},
            calibration,
            temperatures=args.temperatures,
            max_new_tokens=args.max_new_tokens[0],
            lengths={label: n for label, (_, n) in columns.items()},
            chains=args.chain,
            only=args.only,
            repeats=args.repeats,
            seed=args.seed,
            size_tree=args.size_tree,
            eagle3_trees=args.eagle3_tree,
            medusa1_trees=args.medusa1_dynamic,
            medusa1_nodes=args.medusa1_tree,
            draft_layers=args.draft_layers,
            block_budgets=args.block_budget,
            pretranspose=args.pretranspose,
            int8_draft=args.int8_draft,
            onednn=False if args.pretranspose is False else args.onednn,
        ),
    }
    return write_report(results, args.out)


def batched(args: argparse.Namespace, model, tokenizer, command: str) -> dict:
    """--batch-sizes: `benchmarks.batch.batch_run` with the EAGLE-3 head (else Medusa-1) on chat prompts."""
    head_path = args.eagle3 or args.medusa1
    prompts, calibration = load_prompts(
        DATA, args.batch_prompts or max(args.batch_sizes), max(args.calibration_prompts, 1)
    )
    return batch_run(
        model,
        load_heads(head_path, target=model),
        [prompt_ids(tokenizer, row) for row in prompts["chat"]],
        [prompt_ids(tokenizer, row) for row in calibration],
        args.batch_sizes,
        tree=DynamicTree(*args.eagle3_tree[0]) if args.eagle3 and args.eagle3_tree else None,
        max_new_tokens=args.max_new_tokens[0],
        repeats=args.repeats,
        pad_token_id=tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0,
        rowwise=args.batch_rowwise,
        out=args.out,
        command=command,
        head_path=str(head_path),
    )


if __name__ == "__main__":
    main()
