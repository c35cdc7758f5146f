"""What speculation is worth at each batch size (`scripts/bench.py --batch-sizes`): the same held-out chat
prompts decoded at every batch size B, in consecutive groups of B, with plain batched decoding, with a fixed
tree, with the batch policy (`decode.sizing.batch_policy`: one tree per batch size from calibration, or none
where speculation loses) and with the adaptive policy (`decode.sizing.AdaptivePolicy`: the same start, then
following the acceptance of the batch it decodes), optionally with each row drafting alone; all in one
process, in a rotating order, tokens/s as the median of `repeats` rounds. Decoding the same prompts at every
B keeps the acceptance comparable across batch sizes (at B = 1 it is not one prompt's). At temperature 0
every speculative reply is compared with the plain one."""

from __future__ import annotations

import statistics
import sys
from collections import Counter
from collections.abc import Sequence
from functools import partial
from pathlib import Path

import torch
from torch import nn

from decode.batch import left_padded
from decode.calibrate import BatchCalibration, calibrate_batches
from decode.generate import generate
from decode.sizing import measured_batch, policy_tree
from decode.tree import DynamicTree
from heads.files import write_json, write_text


def tree_name(tree) -> str:
    if tree is None:
        return "plain"
    if isinstance(tree, DynamicTree):
        bound = f",p>={tree.min_prob:g}" if tree.min_prob > 0 else ""
        return f"dynamic({tree.depth},{tree.top_k},{tree.total_tokens}{bound})"
    return f"static({len(tree)} nodes)"


@torch.no_grad()
def pooled_tau(new_tokens: Sequence[int], steps: Sequence[int]) -> float:
    """Tokens emitted per verify pass over all rows, as bench.md pools (a row's first token comes from the
    prefill, no verify pass): not the mean of the rows' taus, which weighs a row of 5 steps as one of 50."""
    passes = sum(steps)
    return sum(n - 1 for n in new_tokens) / passes if passes else 1.0


def batch_benchmark(
    model: nn.Module,
    heads: nn.Module,
    prompts: Sequence[torch.Tensor],
    batch_sizes: Sequence[int],
    calibration: BatchCalibration,
    *,
    tree=None,
    max_new_tokens: int = 64,
    repeats: int = 3,
    pad_token_id: int = 0,
    rowwise: bool = False,
) -> list[dict]:
    """One record per batch size: tokens/s of plain, fixed-tree, policy and adaptive-policy decoding of all
    `prompts` in groups of B (median of `repeats` rounds), the speedups over plain, tau (pooled: emitted
    tokens over verify passes of all rows), what the policies chose (and the fixed one's predicted speedup),
    and whether every greedy reply equals plain decoding's.

    Args:
        model: the target.
        heads: the draft head.
        prompts: (1, T) or (T,) prompt ids, decoded at every batch size (the last group may be smaller).
        batch_sizes: the B to measure.
        calibration: `decode.calibrate.calibrate_batches`'s measurements.
        tree: the fixed tree (None: the head's default).
        max_new_tokens: new tokens per row.
        repeats: timing rounds (the methods rotate their order between rounds).
        pad_token_id: left padding of the prompts.
        rowwise: also time the fixed tree with each row drafting on its own (a drafter per row).
    """
    if not prompts:
        raise ValueError("no prompts to decode")
    choices = calibration.choices
    records = []
    for batch in batch_sizes:
        groups = [
            left_padded([p.reshape(-1) for p in prompts[i : i + batch]], pad_token_id)
            for i in range(0, len(prompts), batch)
        ]
        runs = {  # name -> (heads, tree or a policy factory, batch_draft)
            "plain": (None, lambda: None, True),
            "tree": (heads, lambda: tree, True),
            "policy": (heads, lambda: partial(policy_tree, choices), True),
            "adaptive": (heads, calibration.adaptive, True),
        }
        if rowwise:
            runs["rowwise"] = (heads, lambda: tree, False)
        speeds: dict[str, list[float]] = {name: [] for name in runs}
        replies: dict[str, list[list[int]]] = {}
        taus: dict[str, float] = {}
        adaptive_steps: Counter = Counter()
        time_factors: dict[str, list[float]] = {"plain": [], "spec": []}  # per adaptive group that took
        # steps of that kind: its estimate of measured over calibrated seconds, at the group's end
        order = list(runs)
        for round_ in range(max(repeats, 1)):
            for name in order[round_ % len(order) :] + order[: round_ % len(order)]:
                drafts, make_spec, together = runs[name]
                tokens, seconds, row_replies, row_tokens, row_steps = 0, 0.0, [], [], []
                for ids, mask in groups:
                    spec = make_spec()  # a fresh adaptive policy per group: it learns that group
                    out = generate(
                        model,
                        ids,
                        drafts if together else [drafts] * ids.shape[0],
                        max_new_tokens=max_new_tokens,
                        tree=spec,
                        attention_mask=mask,
                    )
                    tokens, seconds = tokens + sum(out.new_tokens), seconds + out.seconds
                    row_replies += out.replies
                    row_tokens += out.new_tokens
                    row_steps += out.steps
                    if name == "adaptive" and round_ == 0:
                        adaptive_steps.update(spec.chosen)
                        for kind, factors in time_factors.items():
                            if spec.timed[kind][1] > 0:
                                factors.append(spec.time_scale(kind))
                speeds[name].append(tokens / seconds)
                print(  # minutes per batch size on a CPU: say where the run is
                    f"batch {batch}, round {round_ + 1}/{max(repeats, 1)}, {name}: "
                    f"{tokens / seconds:.1f} tok/s",
                    file=sys.stderr,
                    flush=True,
                )
                replies[name] = row_replies
                taus[name] = pooled_tau(row_tokens, row_steps)
        tok_s = {name: statistics.median(values) for name, values in speeds.items()}
        chosen = policy_tree(choices, batch)
        steps = sum(adaptive_steps.values())
        record = {
            "batch": batch,
            "prompts": len(prompts),
            "plain_tok_s": tok_s["plain"],
            "tree_tok_s": tok_s["tree"],
            "tree_speedup": tok_s["tree"] / tok_s["plain"],
            "tree_tau": taus["tree"],
            "policy": tree_name(chosen),
            "policy_tok_s": tok_s["policy"],
            "policy_speedup": tok_s["policy"] / tok_s["plain"],
            "policy_predicted_speedup": choices[measured_batch(list(choices), batch)].speedup,
            "adaptive_tok_s": tok_s["adaptive"],
            "adaptive_speedup": tok_s["adaptive"] / tok_s["plain"],
            "adaptive_tau": taus["adaptive"],
            # share of the adaptive policy's steps that speculated, and the tree it used most
            "adaptive_speculated": 1 - adaptive_steps[None] / steps if steps else 0.0,
            "adaptive_tree": tree_name(
                max((t for t in adaptive_steps if t is not None), key=adaptive_steps.get, default=None)
            ),
            # the adaptive policy's estimate of its step time over the calibrated one, plain and speculative
            # steps (median over the groups of the first round that took such steps; None: none did). Its
            # prior (`time_prior` steps at 1.0) pulls it towards 1: calibration was off by at least that much
            **{
                f"adaptive_time_{kind}": statistics.median(factors) if factors else None
                for kind, factors in time_factors.items()
            },
            "identical": all(replies[name] == replies["plain"] for name in runs),
        }
        if rowwise:
            record["rowwise_tok_s"] = tok_s["rowwise"]
            record["rowwise_speedup"] = tok_s["rowwise"] / tok_s["plain"]
        records.append(record)
    return records


def render_batch(records: list[dict], tree) -> str:
    """The markdown table of `batch_benchmark`'s records."""
    fixed = tree_name(tree) if tree is not None else "default"  # None: the head's default tree, not plain
    rowwise = any("rowwise_speedup" in r for r in records)
    header = f"| batch | prompts | plain tok/s | tree {fixed} tok/s | speedup | tau |"
    header += " rows drafting alone |" if rowwise else ""
    header += (
        " policy | policy tok/s | speedup | predicted | adaptive tok/s | speedup | speculated steps (tree) | "
        "step time / calibrated (plain, spec) | same as plain |"
    )
    lines = [header, "|" + "---|" * header.count(" |")]
    for r in records:
        line = (
            f"| {r['batch']} | {r['prompts']} | {r['plain_tok_s']:.1f} | {r['tree_tok_s']:.1f} | "
            f"{r['tree_speedup']:.2f}x | {r['tree_tau']:.2f} |"
        )
        line += f" {r['rowwise_speedup']:.2f}x |" if rowwise else ""
        line += (
            f" {r['policy']} | {r['policy_tok_s']:.1f} | {r['policy_speedup']:.2f}x | "
            f"{r['policy_predicted_speedup']:.2f}x | {r['adaptive_tok_s']:.1f} | "
            f"{r['adaptive_speedup']:.2f}x | "
            f"{r['adaptive_speculated']:.0%} ({r['adaptive_tree']}) | "
            f"{_factor(r['adaptive_time_plain'])}, {_factor(r['adaptive_time_spec'])} | "
            f"{'yes' if r['identical'] else 'NO'} |"
        )
        lines.append(line)
    return "\n".join(lines) + "\n"


def _factor(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def plot_batch(records: list[dict], out: Path) -> Path:
    """speedup_vs_batch.png: measured speedup over plain decoding of the fixed tree and of the policy, per
    batch size."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sizes = [r["batch"] for r in records]
    figure, axes = plt.subplots(figsize=(5, 3.5))
    axes.plot(sizes, [r["tree_speedup"] for r in records], "o-", label="fixed tree")
    axes.plot(sizes, [r["policy_speedup"] for r in records], "s-", label="policy")
    axes.plot(sizes, [r["adaptive_speedup"] for r in records], "^-", label="adaptive policy")
    axes.axhline(1.0, color="grey", linestyle="--", linewidth=1)
    axes.set_xscale("log", base=2)
    axes.set_xlabel("batch size")
    axes.set_ylabel("speedup over plain decoding")
    axes.legend()
    figure.tight_layout()
    path = Path(out) / "speedup_vs_batch.png"
    figure.savefig(path, dpi=120)
    plt.close(figure)
    return path


def batch_run(
    model: nn.Module,
    head: nn.Module,
    ids: list[torch.Tensor],
    calibration_ids: list[torch.Tensor],
    batch_sizes: Sequence[int],
    *,
    tree,
    max_new_tokens: int,
    repeats: int,
    pad_token_id: int,
    rowwise: bool,
    out: Path,
    command: str,
    head_path: str,
) -> dict:
    """`scripts/bench.py --batch-sizes`: calibrate the batch-size policies on `calibration_ids`, then time
    plain, fixed-tree and policy decoding of `ids` in groups of B at each B (`batch_benchmark`); writes
    batch.md, batch.json and the plot to `out`, prints the table, and returns what batch.json holds (and the
    plot's path)."""
    print(
        f"calibrating the batch policies on {len(calibration_ids)} prompts for batch sizes "
        f"{list(batch_sizes)} ...",
        file=sys.stderr,
        flush=True,
    )
    measured = calibrate_batches(
        model, head, calibration_ids, batch_sizes, max_new_tokens=max_new_tokens, repeats=repeats
    )
    records = batch_benchmark(
        model,
        head,
        ids,
        batch_sizes,
        measured,
        tree=tree,
        max_new_tokens=max_new_tokens,
        repeats=repeats,
        pad_token_id=pad_token_id,
        rowwise=rowwise,
    )
    results = {"command": command, "head": head_path, "batches": records}
    report = render_batch(records, tree)
    write_text(out / "batch.md", report)
    write_json(out / "batch.json", results)
    results["plot"] = str(plot_batch(records, out))
    print(report)
    print(f"wrote {out}/batch.md, batch.json, {results['plot']}")
    return results
