"""End-to-end decoding benchmark (`scripts/bench.py`): every head type against plain decoding and
transformers' prompt-lookup decoding on held-out prompts, pooled per (method, temperature, category), rendered
as markdown and plots. Metrics as in docs/design.md, Metrics: tau includes the bonus token; speedup is over
plain decoding.
"""

from __future__ import annotations

import platform
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
import transformers

from benchmarks.agreement import first_difference
from benchmarks.prompts import loops, pooled_labels, prompt_ids
from decode import (
    DEFAULT_EAGLE_TREE,
    DEFAULT_TREES,
    BestFirstTree,
    Calibration,
    DynamicTree,
    best_tree,
    calibrate,
    generate,
    is_int8_draft,
    prepare,
    size_best_first,
    tree_label,
)
from decode.drafters.composite import Composite
from decode.drafters.model import DraftModel
from decode.drafters.ngram import Ngram
from decode.layout import is_onednn, is_pretransposed
from decode.timing import synchronize
from decode.tree import chain
from heads import load_heads
from targets import load_target, merge_lora
from targets.layer_draft import layer_draft

BLOCK_LABELS = {"dflash": "DFlash", "peagle": "P-EAGLE"}  # block drafters: every depth from one forward
VERIFY_SIZES = (1, 2, 4, 8, 12, 16, 24, 32, 48)  # tree sizes whose verify cost the sizing measures
PROMPT_LOOKUP_TOKENS = 10  # transformers' documented starting point for prompt_lookup_num_tokens
# EAGLE-3 + lookup: the n-gram part speaks where the last 3 tokens occurred before (1-grams everywhere cost
# chat tau: docs/benchmark.md, "EAGLE-3 plus lookup")
LOOKUP_MIN_NGRAM = 3
# our prompt lookup (`decode.drafters.ngram`): a chain of up to as many tokens, drafted while the copy is sure
# (a node without any match scores about 1/V: the chain stops there, and a step without a match is plain)
LOOKUP_TREE = DynamicTree(
    depth=PROMPT_LOOKUP_TOKENS, top_k=1, total_tokens=PROMPT_LOOKUP_TOKENS, min_prob=0.05
)
LOOKUP = "prompt lookup (transformers)"  # transformers' implementation: an outside reference row


@dataclass
class Method:
    name: str
    heads: object = None  # a draft source (`decode.generate`'s `heads`); None: plain or transformers' lookup
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
    draft_nodes: int | None = 0  # None: unknown (transformers' prompt lookup)
    plain_tokens: int = 0
    plain_seconds: float = 0.0
    ratios: list[float] = field(default_factory=list)  # per-prompt speedups
    identical: list[bool] = field(default_factory=list)  # per prompt: same tokens as plain decoding
    ties: int = 0  # prompts that differ from plain decoding first at an fp32 tie (benchmarks.agreement)
    looped: int = 0  # prompts whose plain reply ends in a repetition loop (`loops`)

    def add(self, result: dict, plain: dict, tie: bool = False) -> None:
        """One prompt's run of the method (`result`) and of plain decoding on the same target (`plain`);
        `tie`: their outputs part first at an fp32 tie."""
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
        self.ties += tie
        self.looped += loops(plain["sequences"][0, plain["sequences"].shape[1] - plain["tokens"] :].tolist())

    def summary(self) -> dict:
        """Pooled metrics: tau, acceptance per depth, tokens/s, speedups, agreement with plain decoding."""
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
            "fp32_ties": self.ties,
            "plain_looped": self.looped,
        }


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


def lookup_counts(puts: list[int]) -> dict:
    """Steps, emitted tokens and accepted drafts per depth of one prompt-lookup run, from its streamer's puts
    (the prompt, then the tokens of each forward pass). As for ours, the prefill pass is left out."""
    passes = puts[2:]  # drop the prompt and the prefill pass
    per_depth: list[int] = []
    for emitted in passes:
        for depth in range(emitted - 1):  # emitted - 1 drafts were accepted in that pass
            per_depth += [0] * (depth + 1 - len(per_depth))
            per_depth[depth] += 1
    return {"steps": len(passes), "emitted": sum(passes), "per_depth": per_depth}


def run_lookup(model, ids: torch.Tensor, max_new_tokens: int, temperature: float, seed: int) -> dict:
    """transformers' prompt-lookup decoding; sampling draws from the pure-temperature target distribution."""
    sampling = {"do_sample": True, "temperature": temperature, "top_p": 1.0, "top_k": 0}
    counter = PassCounter()
    torch.manual_seed(seed)
    synchronize(model.device)
    start = time.perf_counter()
    out = model.generate(
        ids,
        attention_mask=torch.ones_like(ids),
        max_new_tokens=max_new_tokens,
        prompt_lookup_num_tokens=PROMPT_LOOKUP_TOKENS,
        streamer=counter,
        **(sampling if temperature > 0 else {"do_sample": False}),
    )
    synchronize(model.device)
    seconds = time.perf_counter() - start
    return {
        "sequences": out.cpu(),
        "tokens": out.shape[1] - ids.shape[1],
        "seconds": seconds,
        **lookup_counts(counter.puts),
        "draft_nodes": None,
    }


def run_ours(
    model, ids: torch.Tensor, method: Method, max_new_tokens: int, temperature: float, seed: int, layout: dict
) -> dict:
    """`decode.generate` after `decode.prepare(model, heads, tree, **layout)` (untimed: it re-packs the
    weights for this method's tree, keeping the copies that still hold their weights: nothing writes weights
    here); `seconds` are timed by `generate` between device synchronisations."""
    prepare(model, method.heads, method.tree, **layout, refresh=False)
    out = generate(
        model,
        ids,
        method.heads,
        max_new_tokens=max_new_tokens,
        temperature=temperature,
        tree=method.tree,
        seed=seed,
    ).one
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

    fixed = {  # not a min_prob tree: its size changes step by step, which the cost model does not model
        m.name: entry(as_tree(m.tree), calibration.predict(as_tree(m.tree)))
        for m in methods
        if m.heads is heads and not getattr(as_tree(m.tree), "min_prob", 0)
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


def build_methods(
    model,
    model_name: str,
    paths: dict[str, str | None],
    eagle3_trees=(),
    medusa1_trees=(),
    draft_layers=(),
    block_budgets=(),
    chains=(),
) -> tuple[list[Method], dict, dict]:
    """The methods to compare, in report order, the loaded heads by name, and the targets by name.

    Args:
        model: the target ("base").
        model_name: its name or folder (loaded again and LoRA-merged for Medusa-2).
        paths: head folders by name ("medusa1", "eagle1", "eagle3"; "medusa2": a run folder holding head/
            and lora/); None or absent: left out.
        eagle3_trees: (depth, top_k, total_tokens) or (depth, top_k, total_tokens, min_prob) of more EAGLE-3
            dynamic trees.
        medusa1_trees: the same, of Medusa-1 dynamic trees (depth at most its heads).
        draft_layers: layer counts N of drafts made of the target's first N layers (`targets.layer_draft`),
            each a separate draft model (`decode.drafters.model.DraftModel`) with the default dynamic tree.
        block_budgets: `BestFirstTree` budgets the block drafters (`BLOCK_LABELS`: "dflash", "peagle")
            decode with, beside the chain of all their depths (what vLLM drafts with them).
        chains: chain lengths every head also decodes with (what vLLM serves: `num_speculative_tokens`
            drafts in a chain).
    """
    loaded = {
        name: load_heads(paths[name], target=model)
        for name in ("medusa1", "eagle1", "eagle3", *BLOCK_LABELS)
        if paths.get(name)
    }
    targets = {"base": model}
    methods = [
        Method("prompt lookup", Ngram(), LOOKUP_TREE, tree_label=tree_label(LOOKUP_TREE)),
        Method(LOOKUP, kind="lookup", tree_label=f"{PROMPT_LOOKUP_TOKENS} tokens"),
    ]
    if paths.get("medusa2"):
        targets["medusa2"] = merge_lora(load_target(model_name)[0], Path(paths["medusa2"]) / "lora")
        loaded["medusa2"] = load_heads(Path(paths["medusa2"]) / "head", target=targets["medusa2"])
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
        methods += dynamic_methods("EAGLE-3", loaded["eagle3"], eagle3_trees)
        both = Composite([loaded["eagle3"], Ngram(min_ngram=LOOKUP_MIN_NGRAM)])  # 1:1, where lookup matches
        methods.append(Method("EAGLE-3 + lookup", both, DEFAULT_EAGLE_TREE, tree_label=dynamic))
    for layers in draft_layers:
        draft = DraftModel(layer_draft(model, layers))
        methods.append(
            Method(f"draft model ({layers} layers)", draft, DEFAULT_EAGLE_TREE, tree_label=dynamic)
        )
    if "medusa1" in loaded:
        methods += dynamic_methods("Medusa-1", loaded["medusa1"], medusa1_trees)
    for name, label in BLOCK_LABELS.items():
        if name not in loaded:
            continue
        head = loaded[name]
        depths = head.draft_depths
        block = chain(depths)  # what vLLM drafts with it: every depth of one forward, a chain
        methods.append(Method(f"{label} chain {depths}", head, block, tree_label=tree_label(block)))
        for budget in block_budgets:
            tree = BestFirstTree(budget)
            methods.append(Method(f"{label} best-first {budget}", head, tree, tree_label=tree_label(tree)))
    labels = {"medusa1": "Medusa-1", "eagle1": "EAGLE-1", "eagle3": "EAGLE-3", **BLOCK_LABELS}
    for name, label in labels.items():
        for n in chains if name in loaded else ():
            depth = loaded[name].draft_depths if name in BLOCK_LABELS else None
            if name == "medusa1":
                depth = loaded[name].config.num_heads
            if depth is not None and n > depth or (name in BLOCK_LABELS and n == depth):
                continue  # (deeper than it drafts; a block drafter's whole block is its chain already)
            methods.append(
                Method(f"{label} chain {n}", loaded[name], chain(n), tree_label=tree_label(chain(n)))
            )
    return methods, loaded, targets


def dynamic_methods(label: str, heads, specs) -> list[Method]:
    """One method per (depth, top_k, total_tokens[, min_prob]) spec, named by it."""
    methods = []
    for spec in specs:
        tree = DynamicTree(*spec)
        bound = f" p>={tree.min_prob:g}" if tree.min_prob > 0 else ""
        name = f"{label} dynamic {tree.depth}/{tree.top_k}/{tree.total_tokens}{bound}"
        methods.append(Method(name, heads, tree, tree_label=tree_label(tree)))
    return methods


def rotated(order: list, index: int) -> list:
    """The run order for prompt `index`: `order` rotated by `index`, so that over len(order) prompts every
    method runs first once (machine drift hits all alike)."""
    shift = index % len(order)
    return order[shift:] + order[:shift]


def run_benchmark(
    tokenizer,
    targets: dict,
    methods: list[Method],
    prompts: dict[str, list[dict]],
    *,
    temperatures,
    max_new_tokens: int,
    seed: int,
    layout: dict,
    lengths: dict[str, int] | None = None,
) -> dict[tuple[str, float, str], Tally]:
    """{(method, temperature, column): Tally}: a column is a category (or "<category>@N" at N new tokens),
    its pooled kind ("in-source", "held-out") or "all", at that length. Per temperature, category and prompt,
    plain decoding of each target and every method run back to back in a rotating order; one untimed warm-up
    run of each first. At temperature 0 a method whose output differs from plain greedy decoding is named on
    stderr, with where and whether the target's logits tie there (`benchmarks.agreement`).

    Args:
        layout: keyword arguments of `decode.prepare` (pretranspose, int8_draft), the same for every method.
        lengths: new tokens per category label (`at_lengths`); absent ones decode `max_new_tokens`.
    """
    lengths = lengths or {}
    plains = [Method("plain (base)")] + (
        [Method("plain (medusa2)", target="medusa2")] if "medusa2" in targets else []
    )
    order = plains + methods
    repeated = sorted({m.name for m in order if [o.name for o in order].count(m.name) > 1})
    if repeated:  # outputs are keyed by name: one run would stand for both, and tally twice
        raise ValueError(f"two methods named {', '.join(repeated)}: name each method once")

    def run(method: Method, ids: torch.Tensor, new_tokens: int, temperature: float, seed: int) -> dict:
        if method.kind == "lookup":
            return run_lookup(targets[method.target], ids, new_tokens, temperature, seed)
        return run_ours(targets[method.target], ids, method, new_tokens, temperature, seed, layout)

    warm_ids = prompt_ids(tokenizer, prompts["chat"][0])
    for method in order:
        run(method, warm_ids, 8, 0.0, 0)
    tallies: dict[tuple[str, float, str], Tally] = {}
    total, done = len(temperatures) * sum(len(v) for v in prompts.values()), 0
    for temperature in temperatures:
        for category, rows in prompts.items():
            new_tokens = lengths.get(category, max_new_tokens)
            for index, row in enumerate(rows):
                ids = prompt_ids(tokenizer, row)
                outputs = {
                    m.name: run(m, ids, new_tokens, temperature, seed + index) for m in rotated(order, index)
                }
                for method in methods:
                    plain = outputs[f"plain ({method.target})"]
                    difference = None
                    if temperature == 0:
                        ours = outputs[method.name]["sequences"]
                        difference = first_difference(targets[method.target], plain["sequences"], ours)
                    if difference is not None:
                        print(
                            f"WARNING: {method.name} on {row['id']} differs from plain greedy decoding at "
                            f"{difference}",
                            file=sys.stderr,
                        )
                    tie = difference is not None and difference.tie
                    for key in [(method.name, temperature, c) for c in (category, *pooled_labels(category))]:
                        tallies.setdefault(key, Tally()).add(outputs[method.name], plain, tie)
                done += 1
                rates = ", ".join(
                    f"{m.name} {outputs[m.name]['tokens'] / outputs[m.name]['seconds']:.1f} tok/s"
                    for m in order
                )
                print(
                    f"[{done}/{total}] T={temperature:g} {category} {row['id']}: {rates}",
                    file=sys.stderr,
                    flush=True,
                )
    return tallies


def result_rows(tallies: dict[tuple[str, float, str], Tally], methods: list[Method]) -> list[dict]:
    """One bench.json row per tally: method, tree label, temperature, category and the pooled summary."""
    trees = {m.name: m.tree_label for m in methods}
    return [
        {
            "method": name,
            "tree": trees[name],
            "temperature": temperature,
            "category": category,
            **tally.summary(),
        }
        for (name, temperature, category), tally in tallies.items()
    ]


def benchmark(
    model,
    tokenizer,
    model_name: str,
    paths: dict[str, str | None],
    prompts: dict[str, list[dict]],
    calibration_rows: list[dict],
    *,
    temperatures=(0.0, 1.0),
    max_new_tokens: int = 96,
    repeats: int = 3,
    seed: int = 0,
    size_tree: bool = False,
    eagle3_trees=(),
    medusa1_trees=(),
    medusa1_nodes=(),
    draft_layers=(),
    block_budgets=(),
    chains=(),
    lengths: dict[str, int] | None = None,
    only=(),
    pretranspose: bool | None = None,
    int8_draft: bool | None = None,
    onednn: bool | None = None,
) -> dict:
    """The whole benchmark (`scripts/bench.py`): build the methods, size the EAGLE-3 and Medusa-1 trees on the
    calibration prompts (`size_tree`; for Medusa-1 also the best static tree of each of `medusa1_nodes` nodes
    under the measured acceptance), decode every prompt with every method; returns bench.json's record.

    Args:
        model, tokenizer, model_name: the target, its tokenizer, and its name or folder.
        paths: head folders by name, as `build_methods` takes them.
        prompts, calibration_rows: from `load_prompts` (the columns of `at_lengths`, with `lengths`).
        only: method names to keep (the sized ones are added after); empty: all.
        pretranspose, int8_draft, onednn: `decode.prepare`'s options, the same for every method, plain
            decoding included (None: where they help on this device).
    """
    methods, loaded, targets = build_methods(
        model, model_name, paths, eagle3_trees, medusa1_trees, draft_layers, block_budgets, chains
    )
    if only:  # the methods named (exactly) and the cost-model sized ones, plain decoding always
        unknown = sorted(set(only) - {m.name for m in methods})
        if unknown:
            raise SystemExit(f"--only {unknown}: no such method; known: {[m.name for m in methods]}")
        methods = [m for m in methods if m.name in only]
    layout = {"pretranspose": pretranspose, "int8_draft": int8_draft, "onednn": onednn}
    results: dict = {
        "model": model_name,
        "threads": torch.get_num_threads(),
        "max_new_tokens": max_new_tokens,
        "lengths": lengths or {},
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "machine": platform.processor() or platform.machine(),
        "pretransposed": False,  # filled in below: the layout decode.prepare gave the target
        "onednn": False,
        "int8_draft": [],  # filled in below: the heads decode.prepare made int8
        "rows": [],
        "sizing": {},
        "best_first_sizing": {},  # per block drafter, its best-first budgets' records, when sized
    }
    # 1. cost-model tree sizing on the calibration prompts (disjoint from the benchmark prompts); the heads
    # are prepared first, as the benchmark decodes with them
    for name, label in (("eagle3", "EAGLE-3 sized"), ("medusa1", "Medusa-1 sized")) if size_tree else ():
        if name not in loaded:
            continue
        rows = [prompt_ids(tokenizer, row) for row in calibration_rows]
        print(f"sizing the {name} tree on {len(rows)} calibration prompts ...", file=sys.stderr, flush=True)
        prepare(model, loaded[name], None, **layout)
        sizing = calibrate(
            model,
            loaded[name],
            rows,
            max_new_tokens=max_new_tokens,
            verify_sizes=VERIFY_SIZES,
            repeats=repeats,
        )
        results["sizing"][name], method = sizing_record(sizing, methods, loaded[name], label)
        methods += [method] if method is not None else []
        for nodes in medusa1_nodes if name == "medusa1" else ():
            _, best = best_tree(sizing.acceptance, nodes, max_depth=loaded[name].config.num_heads)
            tree = "measured acceptance: " + tree_label(best)
            methods.append(Method(f"Medusa-1 {nodes} nodes", loaded[name], best, tree_label=tree))
    for name, label in BLOCK_LABELS.items() if size_tree else ():  # best-first budgets: tau measured each
        if name not in loaded:
            continue
        rows = [prompt_ids(tokenizer, row) for row in calibration_rows]
        print(f"sizing the {name} budget on {len(rows)} calibration prompts ...", file=sys.stderr, flush=True)
        prepare(model, loaded[name], None, **layout)
        choices = size_best_first(model, loaded[name], rows, max_new_tokens=max_new_tokens, repeats=repeats)
        results["best_first_sizing"][name] = [
            {
                "budget": c.budget,
                "tau": c.tau,
                "verify_ms": 1e3 * c.verify_seconds,
                "propose_ms": 1e3 * c.propose_seconds,
                "predicted_speedup": c.predicted_speedup,
            }
            for c in choices
        ]
        tree = BestFirstTree(choices[0].budget)
        methods.append(
            Method(f"{label} sized", loaded[name], tree, tree_label=f"cost model: {tree_label(tree)}")
        )
    # 2. per temperature, category and prompt: plain, then every method in a rotating order
    tallies = run_benchmark(
        tokenizer,
        targets,
        methods,
        prompts,
        temperatures=temperatures,
        max_new_tokens=max_new_tokens,
        seed=seed,
        layout=layout,
        lengths=lengths,
    )
    results["int8_draft"] = sorted(name for name, heads in loaded.items() if is_int8_draft(heads))
    results["pretransposed"], results["onednn"] = is_pretransposed(model), is_onednn(model)
    results["rows"] = result_rows(tallies, methods)
    return results
