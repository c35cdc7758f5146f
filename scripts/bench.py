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

from benchmarks.batch import batch_run
from benchmarks.benchmark import benchmark, load_prompts, prompt_ids
from benchmarks.report import write_report
from decode.tree import DynamicTree
from heads import load_heads
from heads.shipping import pretrained_dir
from targets import DEFAULT_TARGET, load_target

DATA = Path(__file__).resolve().parents[1] / "data" / "smollm2"
SHIPPED = ("eagle3", "medusa1")  # the heads --pretrained looks for


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add = parser.add_argument
    add("--model", default=DEFAULT_TARGET)
    for name in ("eagle3", "eagle1", "medusa1"):
        add(f"--{name}", help=f"{name} head folder")
    add("--medusa2", help="Medusa-2 run folder (holding head/ and lora/)")
    shipped = (
        "decode with the heads shipped for --model in pretrained/<target>/ (scripts/ship_head.py): its "
        "eagle3 and medusa1 folders, where --eagle3 / --medusa1 do not name others"
    )
    add("--pretrained", action="store_true", help=shipped)
    add(
        "--eagle3-tree",
        nargs="+",
        action="append",
        default=[],
        metavar="DEPTH TOP_K TOTAL [MIN_PROB]",
        help="one more EAGLE-3 dynamic tree (repeatable); MIN_PROB: decode.DynamicTree's confidence bound",
    )
    add(
        "--medusa1-dynamic",
        nargs="+",
        action="append",
        default=[],
        metavar="DEPTH TOP_K TOTAL [MIN_PROB]",
        help="a Medusa-1 dynamic tree (repeatable; depth at most the heads'), beside its static tree16",
    )
    add("--prompts", type=int, default=4, help="prompts per category")
    skip = "start each category after its first N prompts: rows a default run never reports, to tune trees on"
    add("--skip-prompts", type=int, default=0, metavar="N", help=skip)
    add("--calibration-prompts", type=int, default=4, help="chat prompts for --size-tree")
    add("--max-new-tokens", type=int, default=96)
    add("--temperatures", type=float, nargs="+", default=[0.0, 1.0])
    add("--size-tree", action="store_true", help="add cost-model-sized trees (EAGLE-3, Medusa-1)")
    nodes = (
        "one more Medusa-1 static tree: the NODES likeliest nodes under the acceptance --size-tree measured "
        "(repeatable)"
    )
    add("--medusa1-tree", type=int, action="append", default=[], metavar="NODES", help=nodes)
    draft = "a separate draft model made of the target's first N layers (targets.layer_draft; repeatable)"
    add("--draft-layers", type=int, action="append", default=[], metavar="N", help=draft)
    add("--repeats", type=int, default=3, help="timing repeats of the cost measurements")
    add("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's)")
    add("--seed", type=int, default=0)
    layout = "keep the loaded weight layout for every method, plain included (no decode.prepare layout)"
    add(
        "--no-pretranspose", dest="pretranspose", action="store_const", const=False, default=None, help=layout
    )
    mkl = "MKL's transposed and packed weights instead of oneDNN's reordered ones, for every method"
    add("--no-onednn", dest="onednn", action="store_const", const=False, default=None, help=mkl)
    int8 = "fp32 draft heads (default: int8 where decode.prepare applies them; the target stays fp32)"
    add("--no-int8-draft", dest="int8_draft", action="store_const", const=False, default=None, help=int8)
    add(
        "--int8-draft",
        dest="int8_draft",
        action="store_const",
        const=None,
        help="the default (older commands)",
    )
    batches = (
        "instead of the per-prompt benchmark: batched decoding of the same held-out chat prompts in groups "
        "of B at each batch size B, plain vs a fixed tree vs the batch-size policy and the adaptive policy "
        "(calibrated here), with the EAGLE-3 head (else Medusa-1)"
    )
    add("--batch-sizes", type=int, nargs="+", default=None, metavar="B", help=batches)
    add(
        "--batch-prompts", type=int, default=None, help="chat prompts per batch size (default: the largest B)"
    )
    add("--batch-rowwise", action="store_true", help="also time the fixed tree with each row drafting alone")
    add("--out", type=Path, default=Path("results/bench"))
    args = parser.parse_args(argv)
    if args.pretrained:
        found = {name: pretrained_dir(args.model, name) for name in SHIPPED}
        found = {name: path for name, path in found.items() if (path / "config.json").is_file()}
        if not found:
            parser.error(
                f"--pretrained: no shipped head for {args.model} in {pretrained_dir(args.model, '')}"
            )
        for name, path in found.items():
            setattr(args, name, getattr(args, name) or str(path))
    args.eagle3_tree = [tree_spec(parser, "--eagle3-tree", values) for values in args.eagle3_tree]
    args.medusa1_dynamic = [tree_spec(parser, "--medusa1-dynamic", values) for values in args.medusa1_dynamic]
    if args.batch_sizes and not (args.eagle3 or args.medusa1):
        parser.error("--batch-sizes needs --eagle3 or --medusa1 (the head every row drafts with)")
    if args.medusa1_tree and not (args.size_tree and args.medusa1):
        parser.error(
            "--medusa1-tree needs --size-tree and --medusa1 (it builds trees from the measured acceptance)"
        )
    return args


def tree_spec(parser: argparse.ArgumentParser, option: str, values: list[str]) -> tuple:
    """(depth, top_k, total[, min_prob]) of one --eagle3-tree or --medusa1-dynamic, checked as `DynamicTree`
    checks it."""
    try:
        if len(values) not in (3, 4):
            raise ValueError(f"{len(values)} values; expected DEPTH TOP_K TOTAL [MIN_PROB]")
        spec = (*map(int, values[:3]), *map(float, values[3:]))
        DynamicTree(*spec)
    except ValueError as err:
        parser.error(f"{option} {' '.join(values)}: {err}")
    return spec


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
        DATA, args.prompts, args.calibration_prompts if args.size_tree else 0, args.skip_prompts
    )
    paths = {name: getattr(args, name) for name in ("medusa1", "eagle1", "eagle3", "medusa2")}
    results = {
        "command": command,
        **benchmark(
            model,
            tokenizer,
            args.model,
            paths,
            prompts,
            calibration,
            temperatures=args.temperatures,
            max_new_tokens=args.max_new_tokens,
            repeats=args.repeats,
            seed=args.seed,
            size_tree=args.size_tree,
            eagle3_trees=args.eagle3_tree,
            medusa1_trees=args.medusa1_dynamic,
            medusa1_nodes=args.medusa1_tree,
            draft_layers=args.draft_layers,
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
        max_new_tokens=args.max_new_tokens,
        repeats=args.repeats,
        pad_token_id=tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0,
        rowwise=args.batch_rowwise,
        out=args.out,
        command=command,
        head_path=str(head_path),
    )


if __name__ == "__main__":
    main()
