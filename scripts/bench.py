"""End-to-end decoding benchmark on held-out prompts: tau, acceptance per depth, tokens/s and speedup of every
head type against plain decoding and transformers' prompt-lookup decoding, measured in one process.

    python scripts/bench.py --eagle3 runs/eagle3/head --eagle1 runs/eagle1/head --medusa1 runs/medusa1/head \\
        --medusa2 runs/medusa2 --prompts 4 --max-new-tokens 96 --temperatures 0 1 --size-tree --out
        results/bench

Prompts (never trained on): chat and instruction-following from data/smollm2/prompts_eval.jsonl (the first
--prompts of each category), code from prompts_code_eval.jsonl (HumanEval). Tree sizing calibrates on the LAST
--calibration-prompts chat prompts of the same file, disjoint from the benchmark prompts.

Per prompt, plain decoding and every method run back to back in a rotating order (drift hits all alike). At
temperature 0 every output is compared token for token with plain decoding (counted in the `same as plain`
column, and a warning names each mismatch);
at temperature > 0 the methods use the lossless rule (decode/accept.py) with pure temperature sampling
(top_p=1, top_k=0), and prompt lookup samples from the same distribution. Metrics (REFERENCE section 4):
tau = tokens per target forward INCLUDING the bonus token (plain = 1), pooled over prompts; acceptance at
depth d = P(depth d accepted | depth d-1 accepted); speedup = tokens/s of the method / tokens/s of plain
decoding over the same prompts. Medusa-2 decodes its LoRA-merged target, and its speedup is over plain
decoding of that same merged target. Writes bench.md, bench.json, acceptance.png and speedup_vs_tree.png to
--out.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
import transformers

from decode import DEFAULT_TREES, DynamicTree, generate
from decode.calibrate import Calibration, calibrate
from decode.generate import DEFAULT_EAGLE_TREE
from decode.layout import is_int8_draft, pack_for_tree, pretranspose_linears, quantize_draft
from decode.sizing import best_tree
from decode.timing import synchronize
from decode.tree import tree_label
from heads import load_heads
from heads.target import DEFAULT_TARGET, load_target, merge_lora

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT / "data" / "smollm2"
CHAT_SOURCES = {"chitchat", "chitchat_starter"}
VERIFY_SIZES = (1, 2, 4, 8, 12, 16, 24, 32, 48)
PROMPT_LOOKUP_TOKENS = 10  # transformers' documented starting point for prompt_lookup_num_tokens


@dataclass
class Method:
    name: str
    heads: torch.nn.Module | None = None  # None: plain or prompt lookup
    tree: object = None
    target: str = "base"  # "base" or "medusa2" (the LoRA-merged target)
    kind: str = "ours"  # "ours" (decode.generate) or "lookup" (transformers)
    tree_label: str = ""


@dataclass
class Tally:
    """Pooled statistics of one (method, temperature, category)."""

    tokens: int = 0
    seconds: float = 0.0
    steps: int = 0
    emitted: int = 0  # tokens emitted by verify steps (what the prefill emitted is left out)
    per_depth: list[int] = field(default_factory=list)
    draft_nodes: int | None = 0  # None: unknown (prompt lookup)
    plain_tokens: int = 0
    plain_seconds: float = 0.0
    ratios: list[float] = field(default_factory=list)  # per-prompt speedups
    identical: list[bool] = field(default_factory=list)  # per prompt: same tokens as plain decoding

    def add(self, result: dict, plain: dict) -> None:
        """One prompt's run of the method (`result`) and of plain decoding on the same target (`plain`)."""
        self.tokens += result["tokens"]
        self.seconds += result["seconds"]
        self.steps += result["steps"]
        self.emitted += result["emitted"]
        self.per_depth += [0] * (len(result["per_depth"]) - len(self.per_depth))
        for d, count in enumerate(result["per_depth"]):
            self.per_depth[d] += count
        self.draft_nodes = None if result["draft_nodes"] is None else self.draft_nodes + result["draft_nodes"]
        self.plain_tokens += plain["tokens"]
        self.plain_seconds += plain["seconds"]
        self.ratios.append((result["tokens"] / result["seconds"]) / (plain["tokens"] / plain["seconds"]))
        self.identical.append(torch.equal(result["sequences"], plain["sequences"]))

    def summary(self) -> dict:
        rates, prev = [], self.steps
        for count in self.per_depth:
            rates.append(count / prev if prev else 0.0)
            prev = count
        tok_s, plain_tok_s = self.tokens / self.seconds, self.plain_tokens / self.plain_seconds
        return {
            "tau": self.emitted / self.steps if self.steps else 1.0,
            "acceptance_per_depth": rates,
            "tokens_per_second": tok_s,
            "plain_tokens_per_second": plain_tok_s,
            "speedup": tok_s / plain_tok_s,
            "speedup_median_of_prompts": statistics.median(self.ratios),
            "draft_nodes_per_step": None
            if self.draft_nodes is None
            else self.draft_nodes / max(self.steps, 1),
            "tokens": self.tokens,
            "prompts": len(self.ratios),
            "identical_to_plain": sum(self.identical),
        }


def load_prompts(n: int, calibration: int) -> tuple[dict[str, list[dict]], list[dict]]:
    """{category: first n rows} and the calibration rows (the last chat rows, disjoint from the benchmark)."""
    rows = [json.loads(line) for line in (DATA / "prompts_eval.jsonl").read_text().splitlines()]
    chat = [r for r in rows if r["source"] in CHAT_SOURCES]
    instruction = [r for r in rows if r["source"] not in CHAT_SOURCES]
    code = [json.loads(line) for line in (DATA / "prompts_code_eval.jsonl").read_text().splitlines()]
    if n + calibration > len(chat):
        raise SystemExit(
            f"--prompts {n} + --calibration-prompts {calibration} exceed the {len(chat)} chat prompts"
        )
    return {"chat": chat[:n], "instruction": instruction[:n], "code": code[:n]}, chat[
        len(chat) - calibration :
    ]


def prompt_ids(tokenizer, row: dict) -> torch.Tensor:
    return tokenizer.apply_chat_template(
        row["messages"], add_generation_prompt=True, return_dict=True, return_tensors="pt"
    )["input_ids"]


class PassCounter:
    """A transformers streamer that records how many tokens each target forward emits. Assisted decoding puts
    the prompt once, then the tokens of every forward pass (the first one, the prefill, already verifies the
    n-grams it found in the prompt)."""

    def __init__(self) -> None:
        self.puts: list[int] = []

    def put(self, value: torch.Tensor) -> None:
        self.puts.append(value.numel())

    def end(self) -> None:
        pass


def run_lookup(model, ids: torch.Tensor, max_new_tokens: int, temperature: float, seed: int) -> dict:
    """transformers' prompt-lookup decoding; sampling draws from the pure-temperature target distribution. As
    for ours, tau and acceptance leave out the prefill pass and what it emitted."""
    sampling = (
        {"do_sample": True, "temperature": temperature, "top_p": 1.0, "top_k": 0}
        if temperature > 0
        else {"do_sample": False}
    )
    counter = PassCounter()
    torch.manual_seed(seed)
    synchronize(model.device)  # CUDA runs asynchronously: time finished work only (`generate` does the same)
    start = time.perf_counter()
    out = model.generate(
        ids,
        attention_mask=torch.ones_like(ids),
        max_new_tokens=max_new_tokens,
        prompt_lookup_num_tokens=PROMPT_LOOKUP_TOKENS,
        streamer=counter,
        **sampling,
    )
    synchronize(model.device)
    seconds = time.perf_counter() - start
    passes = counter.puts[1:]  # tokens emitted per forward: prefill first, then one entry per verify pass
    per_depth: list[int] = []
    for emitted in passes[1:]:
        for depth in range(emitted - 1):  # emitted - 1 drafts were accepted in that pass
            per_depth += [0] * (depth + 1 - len(per_depth))
            per_depth[depth] += 1
    return {
        "sequences": out.cpu(),
        "tokens": out.shape[1] - ids.shape[1],
        "seconds": seconds,
        "steps": len(passes) - 1,
        "emitted": sum(passes[1:]),
        "per_depth": per_depth,
        "draft_nodes": None,
    }


def run_ours(
    model, ids: torch.Tensor, method: Method, max_new_tokens: int, temperature: float, seed: int
) -> dict:
    """`decode.generate`; its `seconds` are timed between device synchronisations."""
    pack_for_tree(model, method.heads, method.tree)  # untimed: only pretransposed modules are packed
    out = generate(
        model,
        ids,
        method.heads,
        max_new_tokens=max_new_tokens,
        temperature=temperature,
        tree=method.tree,
        seed=seed,
    )
    return {
        "sequences": out.sequences.cpu(),
        "tokens": out.new_tokens,
        "seconds": out.seconds,
        "steps": out.steps,
        "emitted": out.new_tokens - 1,
        "per_depth": out.accepted_per_depth,
        "draft_nodes": out.draft_nodes,
    }


def as_tree(tree) -> DynamicTree | list[tuple[int, ...]]:
    """A method's tree as a DynamicTree or a list of rank paths (tree names resolved)."""
    if isinstance(tree, DynamicTree):
        return tree
    return [tuple(p) for p in (DEFAULT_TREES[tree] if isinstance(tree, str) else tree)]


def sizing_record(
    calibration: Calibration, methods: list[Method], heads, label: str
) -> tuple[dict, Method | None]:
    """The JSON record of one tree sizing (with the fixed trees' predictions) and the method that decodes with
    the chosen tree; no method when nothing was ever accepted on the calibration prompts (no tree can
    help)."""
    plain = calibration.plain_tokens_per_second

    def entry(tree, prediction: dict) -> dict:
        return {
            "tree": tree_label(tree),
            "draft_nodes": prediction["draft_nodes"],
            "depth": prediction["depth"],
            "top_k": prediction["top_k"],
            "expected_tokens": prediction["expected_tokens"],
            "verify_ms": 1e3 * prediction["verify_seconds"],
            "propose_ms": 1e3 * prediction["propose_seconds"],
            "predicted_speedup": prediction["tokens_per_second"] / plain,
        }

    fixed = {
        m.name: entry(as_tree(m.tree), calibration.predict(as_tree(m.tree)))
        for m in methods
        if m.heads is heads
    }
    candidates = [
        entry(as_tree(c.tree), {**vars(c), "tokens_per_second": c.tokens_per_second})
        for c in calibration.candidates
    ]
    record = {
        "acceptance_per_rank": calibration.acceptance,
        "verify_ms": {n: 1e3 * s for n, s in calibration.verify_cost.items()},
        "fixed_trees": fixed,
        "candidates": candidates,
    }
    if not candidates:
        record["chosen"] = "none: no draft was accepted on the calibration prompts, plain decoding is best"
        return record, None
    tree = as_tree(calibration.candidates[0].tree)
    record["chosen"] = tree_label(tree)
    return record, Method(label, heads, tree, tree_label="cost model: " + tree_label(tree))


def markdown(headers: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    return "\n".join(lines + ["| " + " | ".join(row) + " |" for row in rows])


def plots(results: dict, out: Path) -> list[str]:
    """acceptance.png (acceptance per depth per method) and speedup_vs_tree.png; needs matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is missing (pip install -e '.[bench]'): no plots written", file=sys.stderr)
        return []
    written = []
    temps = sorted({r["temperature"] for r in results["rows"]})
    fig, axes = plt.subplots(1, len(temps), figsize=(6 * len(temps), 4), squeeze=False)
    for ax, temp in zip(axes[0], temps):
        for row in results["rows"]:
            if row["temperature"] == temp and row["category"] == "all" and row["acceptance_per_depth"]:
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
    written.append("acceptance.png")
    fig, ax = plt.subplots(figsize=(6, 4))
    for name, sizing in results.get("sizing", {}).items():
        best: dict[int, float] = {}
        for c in sizing["candidates"]:
            best[c["draft_nodes"]] = max(best.get(c["draft_nodes"], 0.0), c["predicted_speedup"])
        xs = sorted(best)
        ax.plot(xs, [best[x] for x in xs], linestyle="--", label=f"{name}: predicted best at size")
    for row in results["rows"]:
        if row["temperature"] == 0 and row["category"] == "all" and row["draft_nodes_per_step"]:
            ax.scatter(row["draft_nodes_per_step"], row["speedup"], label=f"{row['method']} (measured)")
    ax.axhline(1.0, color="grey", linewidth=0.8)
    ax.set(title="speedup vs tree size, T=0", xlabel="draft tokens per step", ylabel="speedup over plain")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out / "speedup_vs_tree.png", dpi=110)
    written.append("speedup_vs_tree.png")
    plt.close("all")
    return written


def build_methods(args, model) -> tuple[list[Method], dict, dict]:
    """The methods to compare, the loaded heads by name, and the targets ("medusa2": the LoRA-merged one)."""
    loaded = {
        name: load_heads(path, target=model)
        for name, path in (("medusa1", args.medusa1), ("eagle1", args.eagle1), ("eagle3", args.eagle3))
        if path
    }
    targets = {"base": model}
    methods = [Method("prompt lookup", kind="lookup", tree_label=f"{PROMPT_LOOKUP_TOKENS} tokens")]
    if args.medusa2:
        targets["medusa2"] = merge_lora(load_target(args.model)[0], Path(args.medusa2) / "lora")
        loaded["medusa2"] = load_heads(Path(args.medusa2) / "head", target=targets["medusa2"])
    # the target (and plain decoding) stays fp32
    for name, heads in loaded.items() if args.int8_draft else ():
        quantize_draft(heads, targets["medusa2" if name == "medusa2" else "base"])
    for name, label, target in (("medusa1", "Medusa-1", "base"), ("medusa2", "Medusa-2", "medusa2")):
        if name in loaded:
            tree = [p for p in DEFAULT_TREES["tree16"] if len(p) <= loaded[name].config.num_heads]
            methods.append(Method(label, loaded[name], tree, target=target, tree_label="static tree16"))
    dynamic = tree_label(DEFAULT_EAGLE_TREE)
    if "eagle1" in loaded:
        methods.append(Method("EAGLE-1", loaded["eagle1"], DEFAULT_EAGLE_TREE, tree_label=dynamic))
    if "eagle3" in loaded:
        methods.append(Method("EAGLE-3 static", loaded["eagle3"], "tree8", tree_label=tree_label("tree8")))
        methods.append(Method("EAGLE-3 dynamic", loaded["eagle3"], DEFAULT_EAGLE_TREE, tree_label=dynamic))
        for depth, top_k, total in args.eagle3_tree or ():
            tree = DynamicTree(depth=depth, top_k=top_k, total_tokens=total)
            methods.append(
                Method(
                    f"EAGLE-3 dynamic {depth}/{top_k}/{total}",
                    loaded["eagle3"],
                    tree,
                    tree_label=tree_label(tree),
                )
            )
    return methods, loaded, targets


@torch.no_grad()  # a decorator, not set_grad_enabled(False): callers (tests) get their grad mode back
def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default=DEFAULT_TARGET)
    parser.add_argument("--eagle3", help="EAGLE-3 head folder")
    parser.add_argument("--eagle1", help="EAGLE-1 head folder")
    parser.add_argument("--medusa1", help="Medusa-1 head folder")
    parser.add_argument("--medusa2", help="Medusa-2 run folder (holding head/ and lora/)")
    parser.add_argument(
        "--eagle3-tree",
        type=int,
        nargs=3,
        action="append",
        metavar=("DEPTH", "TOP_K", "TOTAL"),
        help="one more EAGLE-3 dynamic tree to decode with (repeatable)",
    )
    parser.add_argument("--prompts", type=int, default=4, help="prompts per category")
    parser.add_argument("--calibration-prompts", type=int, default=4, help="chat prompts for --size-tree")
    parser.add_argument("--max-new-tokens", type=int, default=96)
    parser.add_argument("--temperatures", type=float, nargs="+", default=[0.0, 1.0])
    parser.add_argument(
        "--size-tree", action="store_true", help="add cost-model-sized trees (EAGLE-3, Medusa-1)"
    )
    parser.add_argument(
        "--medusa1-tree",
        type=int,
        action="append",
        metavar="NODES",
        help="one more Medusa-1 static tree: the NODES most probable nodes under the acceptance that "
        "--size-tree measured (repeatable; needs --size-tree)",
    )
    parser.add_argument("--repeats", type=int, default=3, help="timing repeats of the cost measurements")
    parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--no-pretranspose",
        action="store_true",
        help="keep the standard weight layout (decode/layout.py) for every method, plain included",
    )
    parser.add_argument(
        "--int8-draft",
        action="store_true",
        help="decode with int8 draft heads (decode/layout.py quantize_draft); the target stays fp32",
    )
    parser.add_argument("--out", type=Path, default=Path("results/bench"))
    args = parser.parse_args(argv)
    if args.medusa1_tree and not (args.size_tree and args.medusa1):
        parser.error(
            "--medusa1-tree needs --size-tree and --medusa1 (it builds trees from the measured acceptance)"
        )
    if args.threads:
        torch.set_num_threads(args.threads)
    args.out.mkdir(parents=True, exist_ok=True)
    model, tokenizer = load_target(args.model)
    methods, loaded, targets = build_methods(args, model)
    # the same layout for every method: plain decoding's 1-row passes are unchanged
    if not args.no_pretranspose:
        added = sum(pretranspose_linears(module) for module in (*targets.values(), *loaded.values()))
        print(
            f"pretransposed Linear weights for multi-token passes: +{added / 2**20:.0f} MiB", file=sys.stderr
        )
    prompts, calibration = load_prompts(args.prompts, args.calibration_prompts if args.size_tree else 0)
    results: dict = {
        "command": "python scripts/bench.py " + " ".join(argv if argv is not None else sys.argv[1:]),
        "model": args.model,
        "threads": torch.get_num_threads(),
        "max_new_tokens": args.max_new_tokens,
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "machine": platform.processor() or platform.machine(),
        "pretransposed": not args.no_pretranspose,
        "int8_draft": sorted(name for name, heads in loaded.items() if is_int8_draft(heads)),
        "rows": [],
        "sizing": {},
    }

    # 1. cost-model tree sizing on the calibration prompts (disjoint from the benchmark prompts)
    for name, label in (("eagle3", "EAGLE-3 sized"), ("medusa1", "Medusa-1 sized")) if args.size_tree else ():
        if name in loaded:
            print(
                f"sizing the {name} tree on {len(calibration)} calibration prompts ...",
                file=sys.stderr,
                flush=True,
            )
            sizing = calibrate(
                model,
                loaded[name],
                [prompt_ids(tokenizer, row) for row in calibration],
                max_new_tokens=args.max_new_tokens,
                verify_sizes=VERIFY_SIZES,
                repeats=args.repeats,
            )
            results["sizing"][name], method = sizing_record(sizing, methods, loaded[name], label)
            methods += [method] if method is not None else []
            for nodes in (args.medusa1_tree or []) if name == "medusa1" else []:
                _, paths = best_tree(sizing.acceptance, nodes, max_depth=loaded[name].config.num_heads)
                methods.append(
                    Method(
                        f"Medusa-1 {nodes} nodes",
                        loaded[name],
                        paths,
                        tree_label="measured acceptance: " + tree_label(paths),
                    )
                )

    # 2. the benchmark: per temperature, category and prompt, plain then every method in a rotating order
    tallies = run_benchmark(args, tokenizer, targets, methods, prompts)
    for (name, temperature, category), tally in tallies.items():
        method = next(m for m in methods if m.name == name)
        results["rows"].append(
            {
                "method": name,
                "tree": method.tree_label,
                "temperature": temperature,
                "category": category,
                **tally.summary(),
            }
        )
    report = render(results, args)
    (args.out / "bench.md").write_text(report)
    (args.out / "bench.json").write_text(json.dumps(results, indent=2) + "\n")
    results["plots"] = plots(results, args.out)
    print(report)
    print(f"wrote {args.out}/bench.md, bench.json" + "".join(f", {p}" for p in results["plots"]))
    return results


def run_method(
    targets: dict, method: Method, ids: torch.Tensor, max_new_tokens: int, temperature: float, seed: int
) -> dict:
    if method.kind == "lookup":
        return run_lookup(targets[method.target], ids, max_new_tokens, temperature, seed)
    return run_ours(targets[method.target], ids, method, max_new_tokens, temperature, seed)


def run_benchmark(args, tokenizer, targets: dict, methods: list[Method], prompts: dict) -> dict:
    """{(method, temperature, category or "all"): Tally}. One warm-up run per method first (not recorded)."""
    plains = [Method("plain (base)")] + (
        [Method("plain (medusa2)", target="medusa2")] if "medusa2" in targets else []
    )
    order = plains + methods
    warm_ids = prompt_ids(tokenizer, prompts["chat"][0])
    for method in order:
        run_method(targets, method, warm_ids, 8, 0.0, 0)
    tallies: dict[tuple[str, float, str], Tally] = {}
    total, done = len(args.temperatures) * sum(len(v) for v in prompts.values()), 0
    for temperature in args.temperatures:
        for category, rows in prompts.items():
            for index, row in enumerate(rows):
                ids, seed, shift = prompt_ids(tokenizer, row), args.seed + index, index % len(order)
                outputs = {
                    m.name: run_method(targets, m, ids, args.max_new_tokens, temperature, seed)
                    for m in order[shift:] + order[:shift]
                }
                for method in methods:
                    plain = outputs[f"plain ({method.target})"]
                    for key in ((method.name, temperature, category), (method.name, temperature, "all")):
                        tallies.setdefault(key, Tally()).add(outputs[method.name], plain)
                    if temperature == 0 and not torch.equal(
                        outputs[method.name]["sequences"], plain["sequences"]
                    ):
                        print(
                            f"WARNING: {method.name} on {row['id']} differs from plain greedy decoding",
                            file=sys.stderr,
                        )
                done += 1
                print(
                    f"[{done}/{total}] T={temperature:g} {category} {row['id']}: "
                    + ", ".join(
                        f"{m.name} {outputs[m.name]['tokens'] / outputs[m.name]['seconds']:.1f} tok/s"
                        for m in order
                    ),
                    file=sys.stderr,
                    flush=True,
                )
    return tallies


def render(results: dict, args) -> str:
    parts = [
        f"Command: `{results['command']}`\n",
        (
            f"Target {results['model']}, fp32, {results['threads']} threads, {results['max_new_tokens']} "
            f"new tokens at most, torch {results['torch']}, transformers {results['transformers']}, Linear "
            "weights "
            f"{'pretransposed for multi-token passes' if results['pretransposed'] else 'as loaded'}"
            ", "
            f"{'int8 draft heads (EAGLE fc in fp32)' if results.get('int8_draft') else 'fp32 draft heads'}. "
            "Cells: tau (tokens per target forward, bonus token included) / speedup (method tok/s over plain "
            "tok/s on the same prompts, pooled) (median of per-prompt speedups). Temperature 0: outputs "
            "compared token for token with plain greedy decoding (column `same as plain`); temperature > 0: "
            "the lossless rule."
        ),
    ]
    cats = ["chat", "instruction", "code", "all"]
    for temperature in args.temperatures:
        rows = [r for r in results["rows"] if r["temperature"] == temperature]
        table = []
        for name in dict.fromkeys(r["method"] for r in rows):
            cell = {r["category"]: r for r in rows if r["method"] == name}
            total = cell["all"]
            same = f"{total['identical_to_plain']}/{total['prompts']}" if temperature == 0 else "n/a"
            table.append(
                [name, total["tree"]]
                + [
                    f"{cell[c]['tau']:.2f} / {cell[c]['speedup']:.2f}x "
                    f"({cell[c]['speedup_median_of_prompts']:.2f}x)"
                    for c in cats
                    if c in cell
                ]
                + [
                    f"{total['tokens_per_second']:.1f}",
                    f"{total['plain_tokens_per_second']:.1f}",
                    " ".join(f"{a:.2f}" for a in total["acceptance_per_depth"]) or "n/a",
                    same,
                ]
            )
        parts.append(f"\n### Temperature {temperature:g}: tau / speedup per category\n")
        parts.append(
            markdown(
                [
                    "method",
                    "tree",
                    *cats,
                    "tok/s (all)",
                    "plain tok/s (all)",
                    "acceptance per depth (all)",
                    "same as plain",
                ],
                table,
            )
        )
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
        labelled = [(f"{name} (fixed default): {c['tree']}", c) for name, c in sizing["fixed_trees"].items()]
        labelled += [
            (("**chosen**: " if i == 0 else "") + c["tree"], c)
            for i, c in enumerate(sizing["candidates"][:6])
        ]
        parts.append(
            markdown(
                ["tree", "E[tokens]/step", "C_T(n+1) ms", "draft ms", "predicted speedup"],
                [
                    [
                        label,
                        f"{c['expected_tokens']:.2f}",
                        f"{c['verify_ms']:.1f}",
                        f"{c['propose_ms']:.1f}",
                        f"{c['predicted_speedup']:.2f}x",
                    ]
                    for label, c in labelled
                ],
            )
        )
    return "\n".join(parts) + "\n"


if __name__ == "__main__":
    main()
