"""The command line of `scripts/bench.py`: its options and their checks (the script itself stays a thin
entry point)."""

from __future__ import annotations

import argparse
from pathlib import Path

from benchmarks.benchmark import BLOCK_LABELS
from decode.tree import DynamicTree
from heads.shipping import pretrained_dir
from targets import DEFAULT_TARGET

SHIPPED = ("eagle3", "medusa1", "dflash", "peagle")  # the heads --pretrained looks for
BLOCK_HEADS = tuple(BLOCK_LABELS)  # block drafters: a chain of all their depths and best-first trees


def parse_args(argv: list[str] | None, description: str = "") -> argparse.Namespace:
    """`scripts/bench.py`'s arguments, checked (an error exits naming the option)."""
    parser = argparse.ArgumentParser(
        description=description, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add = parser.add_argument
    add("--model", default=DEFAULT_TARGET)
    for name in ("eagle3", "eagle1", "medusa1", *BLOCK_HEADS):
        add(f"--{name}", help=f"{name} head folder")
    add("--medusa2", help="Medusa-2 run folder (holding head/ and lora/)")
    shipped = (
        "decode with the heads shipped for --model in pretrained/<target>/ (scripts/ship_head.py): its "
        "eagle3, medusa1, dflash and peagle folders, where --eagle3 / --medusa1 / --dflash / --peagle do not "
        "name others"
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
    budget = (
        "a DDTree budget the block drafters (DFlash, P-EAGLE) decode with (decode.BestFirstTree; "
        "repeatable), beside their chains (default: 16)"
    )
    add("--block-budget", "--dflash-budget", type=int, action="append", default=[], metavar="N", help=budget)
    add("--prompts", type=int, default=4, help="prompts per category")
    skip = "start each category after its first N prompts: rows a default run never reports, to tune trees on"
    add("--skip-prompts", type=int, default=0, metavar="N", help=skip)
    add("--calibration-prompts", type=int, default=4, help="chat prompts for --size-tree")
    lengths = (
        "new tokens per prompt; several values decode every category at each (the first over --prompts rows, "
        "the others over --long-prompts rows), reported side by side"
    )
    add("--max-new-tokens", type=int, nargs="+", default=[96], help=lengths)
    add("--long-prompts", type=int, default=None, help="prompts per category at the later --max-new-tokens")
    heldout = (
        "also the held-out-source categories (summary, open_qa, creative, system, followup: "
        "data/smollm2/prompts_eval_heldout.jsonl, sources no training file reads)"
    )
    add("--heldout", action="store_true", help=heldout)
    only = "decode only these methods (exact names, as the tables print them), plus the sized ones"
    add("--only", nargs="+", default=[], metavar="METHOD", help=only)
    add(
        "--chain",
        type=int,
        action="append",
        default=[],
        metavar="N",
        help="every head also decodes with a chain of N drafts (what vLLM serves; repeatable)",
    )
    add("--temperatures", type=float, nargs="+", default=[0.0, 1.0])
    sized = "add cost-model-sized trees (EAGLE-3, Medusa-1, DFlash, P-EAGLE)"
    add("--size-tree", action="store_true", help=sized)
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
    if any(getattr(args, name) for name in BLOCK_HEADS) and not args.block_budget:
        args.block_budget = [16]
    if min(args.max_new_tokens) < 1 or min(args.chain, default=1) < 1:
        parser.error("--max-new-tokens and --chain must be at least 1")
    if args.long_prompts is not None and not 1 <= args.long_prompts <= args.prompts:
        parser.error(f"--long-prompts must be in [1, --prompts {args.prompts}], got {args.long_prompts}")
    if min(args.block_budget, default=1) < 1:
        parser.error(f"--block-budget must be at least 1, got {min(args.block_budget)}")
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
