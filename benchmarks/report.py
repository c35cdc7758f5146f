"""The benchmark's reports: `bench.md` (markdown tables of tau, acceptance and speedup per method, temperature
and prompt category, plus the tree-sizing tables) and its plots, rendered from the record that
`benchmarks.benchmark.benchmark` returns (bench.json)."""

from __future__ import annotations

import sys
from pathlib import Path

from benchmarks.benchmark import BLOCK_LABELS
from benchmarks.prompts import ALL, HELD_OUT, IN_SOURCE
from heads.files import write_json, write_text


def markdown(headers: list[str], rows: list[list[str]]) -> str:
    """A markdown table."""
    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    return "\n".join(lines + ["| " + " | ".join(row) + " |" for row in rows])


def render(results: dict) -> str:
    """bench.md: the setup, one tau / speedup table per temperature (in the order of the rows), and each
    cost-model sizing with its predictions."""
    weights = (
        "in oneDNN's reordered layout for every pass, plain decoding included"
        if results.get("onednn")
        else "pretransposed for multi-token passes"
        if results["pretransposed"]
        else "as loaded"
    )
    drafts = "int8 draft heads (EAGLE fc in fp32)" if results.get("int8_draft") else "fp32 draft heads"
    parts = [
        f"Command: `{results['command']}`\n",
        (
            f"Target {results['model']}, fp32, {results['threads']} threads, {results['max_new_tokens']} "
            f"new tokens at most, torch {results['torch']}, transformers {results['transformers']}, Linear "
            f"weights {weights}, {drafts}. "
            "Cells: tau (tokens per target forward, bonus token included) / speedup (method tok/s over plain "
            "tok/s on the same prompts, pooled) (median of per-prompt speedups). Temperature 0: outputs "
            "compared token for token with plain greedy decoding (column `same as plain`; an fp32 tie: the "
            "first differing token is one where the target's two logits are closer than fp32 rounding, "
            "benchmarks/agreement.py); temperature > 0: the lossless rule."
        ),
    ]
    for temperature in dict.fromkeys(r["temperature"] for r in results["rows"]):
        rows = [r for r in results["rows"] if r["temperature"] == temperature]
        for length, cats in columns(rows).items():
            parts += _table(rows, cats, temperature, length)
    for name, sizing in results["sizing"].items():
        parts.append(f"\n### Cost-model tree sizing for {name}\n")
        costs = ", ".join(f"n={n}: {ms:.1f}" for n, ms in sizing["verify_ms"].items())
        ranks = "; ".join(
            f"d{d + 1}: " + " ".join(f"{a:.2f}" for a in row)
            for d, row in enumerate(sizing["acceptance_per_rank"])
        )
        parts.append(
            f"Verify cost C_T(n) ms: {costs}\n\nAcceptance per (depth, rank), calibration prompts: {ranks}"
        )
        parts.append(f"\nChosen tree: **{sizing['chosen']}**\n")
        labelled = [
            (f"{method} (fixed default): {c['tree']}", c) for method, c in sizing["fixed_trees"].items()
        ]
        labelled += [
            (("**chosen**: " if i == 0 else "") + c["tree"], c)
            for i, c in enumerate(sizing["candidates"][:6])
        ]
        table = [
            [
                label,
                f"{c['expected_tokens']:.2f}",
                f"{c['verify_ms']:.1f}",
                f"{c['propose_ms']:.1f}",
                f"{c['predicted_speedup']:.2f}x",
            ]
            for label, c in labelled
        ]
        parts.append(
            markdown(["tree", "E[tokens]/step", "C_T(n+1) ms", "draft ms", "predicted speedup"], table)
        )
    sizings = results.get("best_first_sizing") or {}
    if isinstance(sizings, list):  # bench.json before P-EAGLE: the DFlash head's only
        sizings = {"dflash": sizings}
    for name, sizing in sizings.items():
        label = BLOCK_LABELS.get(name, name)
        parts.append(f"\n### Cost-model budget of the {label} best-first tree (tau measured per budget)\n")
        rows = [
            [
                ("**chosen**: " if i == 0 else "") + str(c["budget"]),
                f"{c['tau']:.2f}",
                f"{c['verify_ms']:.1f}",
                f"{c['propose_ms']:.1f}",
                f"{c['predicted_speedup']:.2f}x",
            ]
            for i, c in enumerate(sizing)
        ]
        parts.append(markdown(["budget", "tau", "C_T(n+1) ms", "draft ms", "predicted speedup"], rows))
    return "\n".join(parts) + "\n"


def columns(rows: list[dict]) -> dict[str, list[str]]:
    """The category columns per length (the first length "", then "@N"): each length's categories in the order
    of the rows, then its pooled kinds (in-source, held-out), then "all" (or "all@N") where the rows hold it.

    A record of several lengths written before 2026-12-07 has one "all" row pooled over every length: it is
    shown nowhere (its tables' totals read n/a) rather than beside the first length's columns."""
    labels = list(dict.fromkeys(r["category"] for r in rows))
    out: dict[str, list[str]] = {}
    for label in labels:
        if label.partition("@")[0] != ALL:
            out.setdefault(label.partition("@")[2], []).append(label)
    mixed = len(out) > 1 and not any(label.startswith(f"{ALL}@") for label in labels)
    for length, cats in out.items():
        pooled = [c for c in cats if c.partition("@")[0] in (IN_SOURCE, HELD_OUT)]
        total = ALL + (f"@{length}" if length else "")
        shown = [total] if total in labels and not mixed else []
        out[length] = [c for c in cats if c not in pooled] + pooled + shown
    return out


def _cell(row: dict | None) -> str:
    """tau / speedup (median of per-prompt speedups) of one row, or n/a."""
    if row is None:
        return "n/a"
    return f"{row['tau']:.2f} / {row['speedup']:.2f}x ({row['speedup_median_of_prompts']:.2f}x)"


def _table(rows: list[dict], cats: list[str], temperature: float, length: str) -> list[str]:
    """One tau / speedup table: a row per method, a column per category label in `cats`."""
    headers = ["method", "tree", *cats, "tok/s (all)", "plain tok/s (all)", "acceptance per depth (all)"]
    table = []
    for name in dict.fromkeys(r["method"] for r in rows):
        cell = {r["category"]: r for r in rows if r["method"] == name}
        total = cell.get(cats[-1]) if cats and cats[-1].partition("@")[0] == ALL else None
        if total is None:  # a record whose only "all" row pools several lengths (`columns`)
            tree = next(r["tree"] for r in rows if r["method"] == name)
            table.append([name, tree] + [_cell(cell.get(c)) for c in cats] + ["n/a"] * 4)
            continue
        same = f"{total['identical_to_plain']}/{total['prompts']}" if temperature == 0 else "n/a"
        if temperature == 0 and total.get("fp32_ties"):
            same += f" ({total['fp32_ties']} fp32 tie{'s' if total['fp32_ties'] > 1 else ''})"
        table.append(
            [name, total["tree"]]
            + [_cell(cell.get(c)) for c in cats]
            + [
                f"{total['tokens_per_second']:.1f}",
                f"{total['plain_tokens_per_second']:.1f}",
                " ".join(f"{a:.2f}" for a in total["acceptance_per_depth"]) or "n/a",
                same,
            ]
        )
    title = f"Temperature {temperature:g}" + (f", {length} new tokens" if length else "")
    first = next(iter(dict.fromkeys(r["method"] for r in rows)), None)
    looped = {r["category"]: r for r in rows if r["method"] == first and "plain_looped" in r}
    loops = ", ".join(f"{c} {looped[c]['plain_looped']}/{looped[c]['prompts']}" for c in cats if c in looped)
    text = "Plain replies ending in a repetition loop (most 8-token runs of their second half repeat): "
    note = [f"\n{text}{loops}\n"] if loops else []
    return [
        f"\n### {title}: tau / speedup per category\n",
        markdown([*headers, "same as plain"], table),
        *note,
    ]


def plots(results: dict, out: Path) -> list[str]:
    """acceptance.png (acceptance per depth per method) and speedup_vs_tree.png; needs matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is missing (pip install -e '.[bench]'): no plots written", file=sys.stderr)
        return []
    temps = sorted({r["temperature"] for r in results["rows"]})
    fig, axes = plt.subplots(1, len(temps), figsize=(6 * len(temps), 4), squeeze=False)
    for ax, temp in zip(axes[0], temps):
        for row in results["rows"]:
            if row["temperature"] == temp and row["category"] == ALL and row["acceptance_per_depth"]:
                rates = row["acceptance_per_depth"]
                ax.plot(range(1, len(rates) + 1), rates, marker="o", label=row["method"])
        ax.set(
            title=f"acceptance per depth, T={temp:g}",
            xlabel="depth d",
            ylabel="P(d accepted | d-1)",
            ylim=(0, 1),
        )
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out / "acceptance.png", dpi=110)
    fig, ax = plt.subplots(figsize=(6, 4))
    for name, sizing in results.get("sizing", {}).items():
        best: dict[int, float] = {}
        for c in sizing["candidates"]:
            best[c["draft_nodes"]] = max(best.get(c["draft_nodes"], 0.0), c["predicted_speedup"])
        xs = sorted(best)
        ax.plot(xs, [best[x] for x in xs], linestyle="--", label=f"{name}: predicted best at size")
    for row in results["rows"]:
        if row["temperature"] == 0 and row["category"] == ALL and row["draft_nodes_per_step"]:
            ax.scatter(row["draft_nodes_per_step"], row["speedup"], label=f"{row['method']} (measured)")
    ax.axhline(1.0, color="grey", linewidth=0.8)
    ax.set(title="speedup vs tree size, T=0", xlabel="draft tokens per step", ylabel="speedup over plain")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out / "speedup_vs_tree.png", dpi=110)
    plt.close("all")
    return ["acceptance.png", "speedup_vs_tree.png"]


def write_report(results: dict, out: Path) -> dict:
    """Write bench.md, bench.json and the plots of a `benchmark` run to `out`, print the table; returns
    `results` with the plots' paths added (after bench.json was written)."""
    report = render(results)
    write_text(out / "bench.md", report)
    write_json(out / "bench.json", results)
    results["plots"] = plots(results, out)
    print(report)
    print(f"wrote {out}/bench.md, bench.json" + "".join(f", {p}" for p in results["plots"]))
    return results
