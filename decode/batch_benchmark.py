"""What speculation is worth at each batch size (`scripts/bench.py --batch-sizes`): per batch size B, the
first B held-out chat prompts decoded together with plain batched decoding, with a fixed tree (the rows
drafting together, and each row drafting on its own), and with the batch policy (`decode.sizing.batch_policy`:
a tree per batch size, or none where speculation loses), all in one process, in a rotating order, tokens/s as
the median of `repeats` rounds. At temperature 0 every speculative reply is compared with the plain one."""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from functools import partial
from pathlib import Path

import torch
from torch import nn

from decode.batch import generate_batch, left_padded
from decode.sizing import BatchChoice, policy_tree
from decode.tree import DynamicTree


def tree_name(tree) -> str:
    if tree is None:
        return "plain"
    if isinstance(tree, DynamicTree):
        return f"dynamic({tree.depth},{tree.top_k},{tree.total_tokens})"
    return f"static({len(tree)} nodes)"


@torch.no_grad()
def batch_benchmark(
    model: nn.Module,
    heads: nn.Module,
    prompts: Sequence[torch.Tensor],
    batch_sizes: Sequence[int],
    choices: dict[int, BatchChoice],
    *,
    tree=None,
    max_new_tokens: int = 64,
    repeats: int = 3,
    pad_token_id: int = 0,
) -> list[dict]:
    """One record per batch size: tokens/s of plain, fixed-tree and policy decoding (median of `repeats`
    rounds), the speedups over plain, the policy's choice and predicted speedup, and whether every greedy
    reply equals plain decoding's.

    Args:
        model: the target.
        heads: the draft head (one drafter per row).
        prompts: (1, T) or (T,) prompt ids; batch size B uses the first B (there must be enough).
        batch_sizes: the B to measure.
        choices: `decode.sizing.batch_policy`'s result (`decode.calibrate.calibrate_batches`).
        tree: the fixed tree (None: the head's default).
        max_new_tokens: new tokens per row.
        repeats: timing rounds (the methods rotate their order between rounds).
        pad_token_id: left padding of the prompts.
    """
    if max(batch_sizes) > len(prompts):
        raise ValueError(f"batch size {max(batch_sizes)} needs as many prompts; {len(prompts)} given")
    records = []
    for batch in batch_sizes:
        ids, mask = left_padded([p.reshape(-1) for p in prompts[:batch]], pad_token_id)
        runs = {  # name -> (heads, tree, batch_draft)
            "plain": (None, None, True),
            "tree": (heads, tree, True),
            "rowwise": (heads, tree, False),  # the same tree, each row drafting on its own
            "policy": (heads, partial(policy_tree, choices), True),
        }
        speeds: dict[str, list[float]] = {name: [] for name in runs}
        replies: dict[str, list[list[int]]] = {}
        taus: dict[str, float] = {}
        order = list(runs)
        for round_ in range(max(repeats, 1)):
            for name in order[round_ % len(order) :] + order[: round_ % len(order)]:
                drafts, spec, together = runs[name]
                out = generate_batch(
                    model, ids, mask, drafts, max_new_tokens=max_new_tokens, tree=spec, batch_draft=together
                )
                speeds[name].append(sum(out.new_tokens) / out.seconds)
                replies[name] = out.replies
                taus[name] = statistics.mean(out.tau)
        tok_s = {name: statistics.median(values) for name, values in speeds.items()}
        chosen = policy_tree(choices, batch)
        predicted = min(choices, key=lambda b: abs(b - batch))
        records.append(
            {
                "batch": batch,
                "plain_tok_s": tok_s["plain"],
                "tree_tok_s": tok_s["tree"],
                "tree_speedup": tok_s["tree"] / tok_s["plain"],
                "tree_tau": taus["tree"],
                "rowwise_tok_s": tok_s["rowwise"],
                "rowwise_speedup": tok_s["rowwise"] / tok_s["plain"],
                "policy": tree_name(chosen),
                "policy_tok_s": tok_s["policy"],
                "policy_speedup": tok_s["policy"] / tok_s["plain"],
                "policy_predicted_speedup": choices[predicted].speedup,
                "identical": all(replies[name] == replies["plain"] for name in ("tree", "rowwise", "policy")),
            }
        )
    return records


def render_batch(records: list[dict], tree) -> str:
    """The markdown table of `batch_benchmark`'s records."""
    fixed = tree_name(tree) if tree is not None else "default"  # None: the head's default tree, not plain
    header = (
        f"| batch | plain tok/s | tree {fixed} tok/s | speedup | tau | rows drafting alone | "
        "policy | policy tok/s | speedup | predicted | same as plain |"
    )
    lines = [
        header,
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in records:
        lines.append(
            f"| {r['batch']} | {r['plain_tok_s']:.1f} | {r['tree_tok_s']:.1f} | {r['tree_speedup']:.2f}x | "
            f"{r['tree_tau']:.2f} | {r['rowwise_speedup']:.2f}x | {r['policy']} | {r['policy_tok_s']:.1f} | "
            f"{r['policy_speedup']:.2f}x | "
            f"{r['policy_predicted_speedup']:.2f}x | {'yes' if r['identical'] else 'NO'} |"
        )
    return "\n".join(lines) + "\n"


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
