"""A/B of the decode loop at B = 1: the `decode` package of an earlier git revision against the working
tree's, in one process, on the same target, heads, prepared layout and prompts.

Speed figures from two runs on a shared machine differ by more than the change being measured; here both
loops decode each prompt back to back (their order alternating per prompt and repeat), so each pair sees the
same load, and the table reports the median of the pairs' ratios. Both must give the same tokens and tau,
which is checked on every pair.

The old revision's `decode/` is extracted with `git archive` into a temporary package, `decode_<rev>`, its
imports of `decode` renamed; it runs against the working tree's `heads/` and `targets/`, so revisions whose
decode loop calls head or target APIs that have since changed cannot be compared this way (their import or
first call fails, naming what is missing). Drafters that `heads.registry` names by module path are
imported from the working tree, so for revisions that have the registry the A/B compares the loops and growth,
not the drafters.
"""

from __future__ import annotations

import importlib
import re
import statistics
import subprocess
import sys
import tarfile
import tempfile
from io import BytesIO
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
IMPORT = re.compile(r"^(\s*)(from|import) decode\b", re.MULTILINE)


def old_decode(revision: str, folder: Path):
    """The `decode` package of git `revision`, importable as `decode_<sha>`: its `generate` and `tree`."""
    sha = subprocess.run(
        ["git", "rev-parse", "--short", revision], cwd=ROOT, capture_output=True, text=True, check=False
    )
    if sha.returncode != 0:
        raise SystemExit(f"--before {revision}: not a revision of {ROOT} ({sha.stderr.strip()})")
    name = f"decode_{sha.stdout.strip()}"
    command = ["git", "archive", revision, "decode"]
    archive = subprocess.run(command, cwd=ROOT, capture_output=True, check=True)
    with tarfile.open(fileobj=BytesIO(archive.stdout)) as tar:
        tar.extractall(folder, filter="data")
    (folder / "decode").rename(folder / name)
    for path in (folder / name).rglob("*.py"):
        path.write_text(IMPORT.sub(rf"\1\2 {name}", path.read_text()))
    sys.path.insert(0, str(folder))
    return importlib.import_module(f"{name}.generate"), importlib.import_module(f"{name}.tree"), name


def one(out):
    """The B = 1 fields of either output type (the old loop returned scalars, the new one `.one`)."""
    return out.one if hasattr(out, "one") else out


def run(args) -> str:
    """The markdown table of the A/B (`scripts/ab_decode.py`'s arguments)."""
    from benchmarks.prompts import load_prompts, prompt_ids
    from decode import DEFAULT_EAGLE_TREE, DEFAULT_TREES, generate, prepare
    from heads import load_heads
    from heads.shipping import pretrained_dir
    from targets import load_target

    torch.set_num_threads(args.threads)
    model, tokenizer = load_target(args.model)
    prompts, _ = load_prompts(Path(args.data_dir), args.prompts, 0)
    rows = [prompt_ids(tokenizer, row) for row in prompts[args.category]]
    eagle3 = load_heads(pretrained_dir(args.model, "eagle3"), target=model)
    medusa = load_heads(pretrained_dir(args.model, "medusa1"), target=model)
    tree16 = [path for path in DEFAULT_TREES["tree16"] if len(path) <= medusa.config.num_heads]
    with tempfile.TemporaryDirectory() as folder:
        old_generate, old_tree, name = old_decode(args.before, Path(folder))
        methods = {  # name: (heads, the new loop's tree, the old loop's tree)
            "plain": (None, None, None),
            "EAGLE-3 dynamic": (eagle3, DEFAULT_EAGLE_TREE, old_tree.DEFAULT_EAGLE_TREE),
            "Medusa-1 tree16": (medusa, tree16, tree16),
        }
        stats = {method: {"old": [], "new": [], "ratio": [], "tau": []} for method in methods}
        for repeat in range(args.repeats):
            for i, ids in enumerate(rows):
                for method, (heads, tree, old) in methods.items():
                    prepare(model, heads, tree, refresh=False)
                    result = {}
                    for which in ("old", "new") if (repeat + i) % 2 == 0 else ("new", "old"):
                        loop, shape = (old_generate.generate, old) if which == "old" else (generate, tree)
                        out = one(loop(model, ids, heads, max_new_tokens=args.max_new_tokens, tree=shape))
                        result[which] = (out.new_tokens / out.seconds, out.sequences.tolist(), out.tau)
                    if result["old"][1:] != result["new"][1:]:
                        raise AssertionError(f"{method}, prompt {i}: the two loops decode differently")
                    s = stats[method]
                    s["old"].append(result["old"][0])
                    s["new"].append(result["new"][0])
                    s["ratio"].append(result["new"][0] / result["old"][0])
                    s["tau"].append(result["new"][2])
    lines = [
        (
            f"B = 1, {args.category}, T=0, {len(rows)} prompts x {args.repeats} repeats, "
            f"{args.max_new_tokens} new tokens, {args.threads} threads; before = {name} (`{args.before}`), "
            "after = the working tree"
        ),
        "",
        "| method | tau (mean of prompts) | before tok/s | after tok/s | after/before (median of pairs) |",
        "|---|---|---|---|---|",
    ]
    for method, s in stats.items():
        lines.append(
            f"| {method} | {statistics.mean(s['tau']):.2f} | {statistics.median(s['old']):.1f} | "
            f"{statistics.median(s['new']):.1f} | {statistics.median(s['ratio']):.3f} |"
        )
    return "\n".join(lines)
