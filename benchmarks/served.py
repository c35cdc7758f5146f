"""Our decoder beside a serving engine's counters: the drafts and the accepted drafts per position that
`decode.generate` gives with a chain of drafts (what vLLM drafts), in the form vLLM's speculative-decoding
counters take, and the per-category comparison `scripts/bench_vllm.py` reports (tests/engines/
test_vllm_external.py checks the same counters on chat prompts)."""

from __future__ import annotations

import torch

from decode import generate
from decode.tree import chain


def chain_counts(model, head, prompts: list[list[int]], drafts: int, new_tokens: int) -> dict:
    """Greedy `decode.generate` of each token-id prompt with a chain of `drafts` drafts (plain decoding when
    `head` is None): {"tokens": the new tokens per prompt, "drafts": drafting steps, "per_position": accepted
    drafts at each chain position}, summed over the prompts."""
    tokens, steps, per_position = [], 0, [0] * drafts
    for ids in prompts:
        out = generate(
            model,
            torch.tensor([ids]),
            head,
            tree=chain(drafts) if head is not None else None,
            max_new_tokens=new_tokens,
        ).one
        tokens.append(out.sequences[0, len(ids) :].tolist())
        steps += out.steps
        for position, count in enumerate(out.accepted_per_depth[:drafts]):
            per_position[position] += count
    return {"tokens": tokens, "drafts": steps, "per_position": per_position}


def accepted_length(counts: dict) -> float:
    """1 + accepted drafts per drafting step: the tokens one target pass yields, bonus included (vLLM's mean
    acceptance length)."""
    return 1 + sum(counts["per_position"]) / max(counts["drafts"], 1)


def compare(ours: dict[str, dict], theirs: dict[str, dict]) -> list[dict]:
    """One row per category of `ours`: both sides' counters (`chain_counts` results; `theirs` from the
    engine), whether they are equal, and on how many prompts the tokens are."""
    rows = []
    for name, mine in ours.items():
        served = theirs[name]
        if len(served["tokens"]) != len(mine["tokens"]):
            raise ValueError(
                f"{name}: the engine answered {len(served['tokens'])} prompts, ours {len(mine['tokens'])}"
            )
        rows.append(
            {
                "category": name,
                "prompts": len(mine["tokens"]),
                "served": {k: served[k] for k in ("drafts", "per_position")},
                "ours": {k: mine[k] for k in ("drafts", "per_position")},
                "same_tokens": sum(a == b for a, b in zip(served["tokens"], mine["tokens"], strict=True)),
                "same_counts": all(served[k] == mine[k] for k in ("drafts", "per_position")),
            }
        )
    return rows


def pool(rows: list[dict], label: str) -> dict:
    """One row adding the counts of `rows` (a pooled category)."""
    total = {"category": label, "prompts": sum(r["prompts"] for r in rows)}
    for side in ("served", "ours"):
        total[side] = {
            "drafts": sum(r[side]["drafts"] for r in rows),
            "per_position": [sum(n) for n in zip(*(r[side]["per_position"] for r in rows), strict=True)],
        }
    total["same_tokens"] = sum(r["same_tokens"] for r in rows)
    total["same_counts"] = all(r["same_counts"] for r in rows)
    return total


def table(rows: list[dict], engine: str = "vLLM") -> str:
    """The markdown table of `compare` and `pool` rows."""
    lines = [
        f"| category | prompts | {engine} drafts | {engine} accepted per position | {engine} accepted length"
        + " | ours accepted length | counts as ours | tokens as ours |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['category']} | {r['prompts']} | {r['served']['drafts']} | {r['served']['per_position']} "
            f"| {accepted_length(r['served']):.2f} | {accepted_length(r['ours']):.2f} "
            f"| {'yes' if r['same_counts'] else 'NO'} | {r['same_tokens']}/{r['prompts']} |"
        )
    return "\n".join(lines)
