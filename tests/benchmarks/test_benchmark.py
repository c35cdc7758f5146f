"""benchmarks/benchmark.py without a benchmark run: pooled tallies, prompt-lookup counting, the rotating run
order, the methods built from head folders and their order, the prompt split, and bench.md rendered from a
known record."""

import json

import pytest
import torch

from benchmarks.benchmark import (
    Method,
    Tally,
    as_tree,
    build_methods,
    lookup_counts,
    result_rows,
    rotated,
    run_benchmark,
)
from benchmarks.prompts import SEEN_SOURCES, at_lengths, load_prompts, load_seen_prompts, loops, pooled_labels
from benchmarks.report import columns, plots, render
from decode import DEFAULT_EAGLE_TREE, DEFAULT_TREES, DynamicTree
from heads import EagleConfig, EagleHead, MedusaConfig, MedusaHeads, save_heads


def run(tokens: int, seconds: float, steps: int, per_depth: list[int], nodes, sequence: list[int]) -> dict:
    return {
        "tokens": tokens,
        "seconds": seconds,
        "steps": steps,
        "emitted": tokens - 1,
        "per_depth": per_depth,
        "draft_nodes": nodes,
        "sequences": torch.tensor([sequence]),
    }


def test_tally_pools_tokens_and_time_over_prompts_and_takes_the_median_of_per_prompt_speedups():
    tally = Tally()
    # prompt 1: 9 tokens in 1 s (plain: 9 tokens in 3 s), 4 steps, depth 1 accepted 3 times, depth 2 once
    tally.add(run(9, 1.0, 4, [3, 1], 12, [1, 2, 3]), run(9, 3.0, 8, [], 0, [1, 2, 3]))
    # prompt 2: 5 tokens in 1 s (plain: 5 tokens in 1 s), 4 steps, depth 1 accepted twice, a different output
    tally.add(run(5, 1.0, 4, [2], 8, [1, 2, 4]), run(5, 1.0, 4, [], 0, [1, 2, 3]))
    summary = tally.summary()
    assert summary["tau"] == (8 + 4) / 8  # emitted tokens over steps, pooled (not a mean of per-prompt taus)
    assert summary["acceptance_per_depth"] == [5 / 8, 1 / 5]  # P(d | d - 1), pooled counts
    assert summary["tokens_per_second"] == 14 / 2 and summary["plain_tokens_per_second"] == 14 / 4
    assert summary["speedup"] == 2.0  # pooled: (14 / 2) / (14 / 4)
    assert summary["speedup_median_of_prompts"] == pytest.approx((3.0 + 1.0) / 2)
    assert summary["draft_nodes_per_step"] == 20 / 8
    assert summary["tokens"] == 14 and summary["prompts"] == 2 and summary["identical_to_plain"] == 1
    tally.add(run(5, 1.0, 2, [], None, [1]), run(5, 1.0, 5, [], 0, [1]))  # prompt lookup: nodes unknown
    assert tally.summary()["draft_nodes_per_step"] is None
    assert tally.summary()["fp32_ties"] == 0
    tally.add(run(5, 1.0, 4, [2], None, [1, 2, 4]), run(5, 1.0, 4, [], 0, [1, 2, 3]), tie=True)
    assert tally.summary()["fp32_ties"] == 1 and tally.summary()["identical_to_plain"] == 2


def test_lookup_counts_leave_out_the_prompt_and_the_prefill_pass():
    # puts: the 20-token prompt, the prefill pass (2 tokens: one accepted n-gram draft), then three passes
    counts = lookup_counts([20, 2, 3, 1, 2])
    assert counts == {
        "steps": 3,
        "emitted": 6,
        "per_depth": [2, 1],
    }  # passes 3, 1, 2: 2, 0, 1 drafts accepted
    assert lookup_counts([20, 1]) == {"steps": 0, "emitted": 0, "per_depth": []}


def test_rotated_order_puts_every_method_first_once_and_keeps_the_cycle():
    order = ["plain", "a", "b", "c"]
    runs = [rotated(order, index) for index in range(8)]
    assert [r[0] for r in runs[:4]] == order and runs[4:] == runs[:4]
    for r in runs:
        start = order.index(r[0])
        assert r == order[start:] + order[:start]


def test_as_tree_resolves_names_and_keeps_dynamic_trees():
    assert as_tree("tree8") == [tuple(p) for p in DEFAULT_TREES["tree8"]]
    assert as_tree([[0], [0, 0]]) == [(0,), (0, 0)]
    assert as_tree(DEFAULT_EAGLE_TREE) is DEFAULT_EAGLE_TREE


def test_build_methods_in_report_order(build_target, tmp_path):
    model = build_target("llama")
    config = model.config
    medusa = MedusaHeads(MedusaConfig(config.hidden_size, config.vocab_size, num_heads=2))
    save_heads(medusa, tmp_path / "medusa1", base_model="tiny", target=model)
    for kind in ("eagle1", "eagle3"):
        save_heads(
            EagleHead(EagleConfig.from_target(config, kind)), tmp_path / kind, base_model="tiny", target=model
        )
    paths = {name: tmp_path / name for name in ("medusa1", "eagle1", "eagle3")} | {"medusa2": None}
    methods, loaded, targets = build_methods(model, "tiny", paths, [(3, 2, 5)])
    assert [m.name for m in methods] == [
        "prompt lookup",
        "prompt lookup (transformers)",
        "Medusa-1",
        "EAGLE-1",
        "EAGLE-3 static",
        "EAGLE-3 dynamic",
        "EAGLE-3 dynamic 3/2/5",
        "EAGLE-3 + lookup",
    ]
    assert list(loaded) == ["medusa1", "eagle1", "eagle3"] and targets == {"base": model}
    assert methods[1].kind == "lookup" and methods[1].heads is None  # transformers' implementation
    assert methods[0].kind == "ours" and type(methods[0].heads).__name__ == "Ngram"  # ours (decode.drafters)
    assert methods[2].tree == [p for p in DEFAULT_TREES["tree16"] if len(p) <= 2]  # cut to the heads' depth
    assert methods[6].tree == DynamicTree(depth=3, top_k=2, total_tokens=5)
    assert methods[6].tree_label == "dynamic(depth=3, top_k=2, total=5)"
    assert [type(p).__name__ for p in methods[7].heads.parts] == ["EagleHead", "Ngram"]  # EAGLE-3 + lookup


def test_a_block_drafters_whole_block_is_one_chain_method_and_names_are_unique(build_target, tmp_path):
    """`--chain N` for a P-EAGLE head that drafts N deep named a second "P-EAGLE chain N" beside its own
    block chain: outputs are keyed by name, so one run stood for both and every prompt tallied twice."""
    from heads.peagle import PEagleConfig, PEagleHead

    model = build_target("llama")
    head = PEagleHead(PEagleConfig.from_target(model.config, mask_token_id=3, parallel_depths=3))
    save_heads(head, tmp_path / "peagle", base_model="tiny", target=model)
    methods, _, _ = build_methods(model, "tiny", {"peagle": tmp_path / "peagle"}, chains=(2, 3))
    names = [m.name for m in methods if m.name.startswith("P-EAGLE")]
    assert names == ["P-EAGLE chain 3", "P-EAGLE chain 2"]
    twice = [Method("M", tree=[(0,)]), Method("M", tree=[(0,), (0, 0)])]
    with pytest.raises(ValueError, match="two methods named M: name each method once"):
        run_benchmark(
            None,
            {"base": model},
            twice,
            {"chat": []},
            temperatures=[0.0],
            max_new_tokens=2,
            seed=0,
            layout={},
        )


def test_load_prompts_splits_categories_and_keeps_calibration_apart(tmp_path):
    rows = [{"id": f"c{i}", "source": "chitchat", "messages": []} for i in range(5)]
    rows += [{"id": f"i{i}", "source": "alpaca_en_demo", "messages": []} for i in range(3)]
    (tmp_path / "prompts_eval.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    code = [{"id": f"HumanEval/{i}", "source": "humaneval", "messages": []} for i in range(3)]
    (tmp_path / "prompts_code_eval.jsonl").write_text("".join(json.dumps(r) + "\n" for r in code))
    prompts, calibration = load_prompts(tmp_path, 2, 2)
    assert {k: [r["id"] for r in v] for k, v in prompts.items()} == {
        "chat": ["c0", "c1"],
        "instruction": ["i0", "i1"],
        "code": ["HumanEval/0", "HumanEval/1"],
    }
    assert [r["id"] for r in calibration] == ["c3", "c4"]
    with pytest.raises(SystemExit, match="--prompts 4 \\+ --calibration-prompts 2 exceed the 5 chat prompts"):
        load_prompts(tmp_path, 4, 2)
    # rows that a run of 2 prompts without skip never shows; the calibration rows stay where they were
    skipped, calibration = load_prompts(tmp_path, 1, 2, skip=2)
    assert {k: [r["id"] for r in v] for k, v in skipped.items()} == {
        "chat": ["c2"],
        "instruction": ["i2"],
        "code": ["HumanEval/2"],
    }
    assert [r["id"] for r in calibration] == ["c3", "c4"]
    with pytest.raises(SystemExit, match="--skip-prompts 2 \\+ --prompts 2 exceed the 3 instruction prompts"):
        load_prompts(tmp_path, 2, 0, skip=2)
    with pytest.raises(SystemExit, match="--skip-prompts 2 \\+ --prompts 2 \\+ --calibration-prompts 2"):
        load_prompts(tmp_path, 2, 2, skip=2)


def test_seen_prompts_are_the_training_chats_of_each_held_out_kind_without_their_reply(tmp_path):
    """Drawn per kind from its training counterpart, seeded, the reply the head learnt from left out; a
    source with too few chats is named with the files read."""

    def chat(source: str, i: int) -> dict:
        turns = [{"role": "user", "content": f"{source} {i}"}, {"role": "assistant", "content": "reply"}]
        return {"id": f"{source}/{i}", "source": source, "messages": turns}

    chats = [chat(source, i) for source in SEEN_SOURCES.values() for i in range(4)]
    chats += [chat("regen_chat", i) for i in range(4)]  # not a held-out kind's counterpart: never drawn
    chats += [{**chat("broad_summary", 9), "messages": chat("broad_summary", 9)["messages"][:1]}]  # no reply
    files = [tmp_path / "shard-00000.jsonl", tmp_path / "shard-00001.jsonl"]
    files[0].write_text("".join(json.dumps(c) + "\n" for c in chats[::2]))
    files[1].write_text("".join(json.dumps(c) + "\n" for c in chats[1::2]))
    seen = load_seen_prompts(files, 3)
    assert list(seen) == [f"seen_{kind}" for kind in SEEN_SOURCES]
    for kind, source in SEEN_SOURCES.items():
        rows = seen[f"seen_{kind}"]
        assert len({r["id"] for r in rows}) == 3 and all(r["source"] == source for r in rows)
        assert all(r["messages"] == [{"role": "user", "content": r["id"].replace("/", " ")}] for r in rows)
    assert load_seen_prompts(files[::-1], 3) == seen  # the same draw whatever order the files come in
    assert load_seen_prompts(files, 3, seed=1) != seen
    with pytest.raises(
        ValueError, match="5 'broad_summary' chats wanted for seen_summary, found 4 in .*shard"
    ):
        load_seen_prompts(files, 5)


def summary(tau: float, speedup: float, identical: int) -> dict:
    return {
        "tau": tau,
        "acceptance_per_depth": [0.5, 0.25],
        "tokens_per_second": 20.0,
        "plain_tokens_per_second": 10.0,
        "speedup": speedup,
        "speedup_median_of_prompts": speedup,
        "draft_nodes_per_step": 4.0,
        "tokens": 40,
        "prompts": 2,
        "identical_to_plain": identical,
    }


RECORD = {
    "command": "python scripts/bench.py --prompts 2",
    "model": "tiny",
    "threads": 2,
    "max_new_tokens": 16,
    "torch": "2.x",
    "transformers": "5.x",
    "machine": "x86_64",
    "pretransposed": True,
    "int8_draft": ["eagle3"],
    "rows": [
        {
            "method": "EAGLE-3 dynamic",
            "tree": "dyn",
            "temperature": 1.0,
            "category": c,
            **summary(2.5, 1.5, 0),
        }
        for c in ("chat", "all")
    ]
    + [
        {
            "method": "EAGLE-3 dynamic",
            "tree": "dyn",
            "temperature": 0.0,
            "category": c,
            **summary(3.0, 2.0, 2),
        }
        for c in ("chat", "all")
    ],
    "sizing": {
        "eagle3": {
            "acceptance_per_rank": [[0.6, 0.2], [0.4]],
            "verify_ms": {"1": 10.0, "8": 20.0},
            "fixed_trees": {
                "EAGLE-3 dynamic": {
                    "tree": "dyn",
                    "expected_tokens": 2.0,
                    "verify_ms": 15.0,
                    "propose_ms": 3.0,
                    "predicted_speedup": 1.1,
                }
            },
            "candidates": [
                {
                    "tree": "best",
                    "draft_nodes": 4,
                    "expected_tokens": 2.5,
                    "verify_ms": 14.0,
                    "propose_ms": 2.0,
                    "predicted_speedup": 1.56,
                }
            ],
            "chosen": "best",
        }
    },
}


def test_render_of_a_known_record():
    text = render(RECORD)
    assert text.startswith(
        "Command: `python scripts/bench.py --prompts 2`\n\nTarget tiny, fp32, 2 threads, 16 new"
    )
    assert "Linear weights pretransposed for multi-token passes, int8 draft heads (EAGLE fc in fp32)." in text
    t1, t0 = text.index("### Temperature 1: tau / speedup"), text.index("### Temperature 0: tau / speedup")
    assert t1 < t0  # tables in the order of the rows (the order of --temperatures)
    header = (
        "| method | tree | chat | all | tok/s (all) | plain tok/s (all) | "
        "acceptance per depth (all) | same as plain |"
    )
    assert text.count(header) == 2
    lines = text.splitlines()
    cells = "| EAGLE-3 dynamic | dyn | {0} | {0} | 20.0 | 10.0 | 0.50 0.25 | {1} |"
    assert cells.format("3.00 / 2.00x (2.00x)", "2/2") in lines  # T=0: outputs compared with plain
    assert cells.format("2.50 / 1.50x (1.50x)", "n/a") in lines
    assert "Verify cost C_T(n) ms: n=1: 10.0, n=8: 20.0" in text
    assert "Acceptance per (depth, rank), calibration prompts: d1: 0.60 0.20; d2: 0.40" in text
    assert "Chosen tree: **best**" in text
    assert "| EAGLE-3 dynamic (fixed default): dyn | 2.00 | 15.0 | 3.0 | 1.10x |" in lines
    assert "| **chosen**: best | 2.50 | 14.0 | 2.0 | 1.56x |" in lines
    tied = [
        {**r, "identical_to_plain": 1, "fp32_ties": 1} if r["temperature"] == 0 else r for r in RECORD["rows"]
    ]
    assert (
        cells.format("3.00 / 2.00x (2.00x)", "1/2 (1 fp32 tie)")
        in render({**RECORD, "rows": tied}).splitlines()
    )
    fp32 = render({**RECORD, "pretransposed": False, "int8_draft": [], "sizing": {}})
    assert "Linear weights as loaded, fp32 draft heads." in fp32 and "Cost-model" not in fp32
    onednn = render({**RECORD, "onednn": True})
    assert "Linear weights in oneDNN's reordered layout for every pass, plain decoding included" in onednn


def test_result_rows_follow_the_tallies_and_carry_the_tree_labels():
    tally = Tally()
    tally.add(run(3, 1.0, 2, [1], 2, [1]), run(3, 1.0, 3, [], 0, [1]))
    methods = [Method("b", tree_label="tree b"), Method("a", tree_label="tree a")]
    rows = result_rows({("a", 0.0, "chat"): tally, ("b", 0.0, "all"): tally}, methods)
    assert [(r["method"], r["tree"], r["category"]) for r in rows] == [
        ("a", "tree a", "chat"),
        ("b", "tree b", "all"),
    ]
    assert rows[0]["tau"] == 1.0 and rows[0]["temperature"] == 0.0


def test_plots_are_written(tmp_path):
    pytest.importorskip("matplotlib")
    assert plots(RECORD, tmp_path) == ["acceptance.png", "speedup_vs_tree.png"]
    assert all((tmp_path / name).stat().st_size > 0 for name in ("acceptance.png", "speedup_vs_tree.png"))


def test_columns_group_each_length_with_its_pooled_kinds():
    """In-source and held-out-source categories side by side at each length, each kind pooled after them, and
    all of them last, each length apart: a reply of 256 tokens is not pooled into the 64-token table."""
    labels = ["chat", "summary", "in-source", "held-out", "all", "chat@64", "summary@64", "in-source@64"]
    labels += ["held-out@64", "all@64"]
    rows = [{"category": c} for c in labels]
    assert columns(rows) == {
        "": ["chat", "summary", "in-source", "held-out", "all"],
        "64": ["chat@64", "summary@64", "in-source@64", "held-out@64", "all@64"],
    }
    assert pooled_labels("summary@64") == ["held-out@64", "all@64"]
    assert pooled_labels("code") == ["in-source", "all"]
    # a record from before per-length pooling: its one "all" row spans both lengths, and is shown nowhere
    old = [{"category": c} for c in labels if c != "all@64"]
    assert columns(old) == {
        "": ["chat", "summary", "in-source", "held-out"],
        "64": ["chat@64", "summary@64", "in-source@64", "held-out@64"],
    }


def test_each_lengths_table_totals_its_own_rows():
    """The totals of the table at 256 tokens (tok/s, acceptance, same as plain) are its own rows': a 64-token
    and a 256-token tally of one method give two tables with their own figures."""

    def row(category, tau, speedup, tps, identical):
        figures = {"tau": tau, "speedup": speedup, "speedup_median_of_prompts": speedup}
        figures |= {"tokens_per_second": tps, "plain_tokens_per_second": tps / speedup}
        figures |= {"acceptance_per_depth": [tau / 10], "prompts": 1, "identical_to_plain": identical}
        return {"method": "M", "tree": "t", "temperature": 0.0, "category": category} | figures

    rows = [row("chat", 3.0, 2.0, 20.0, 1), row("all", 3.0, 2.0, 20.0, 1)]
    rows += [row("chat@256", 5.0, 8.0, 256.0, 0), row("all@256", 5.0, 8.0, 256.0, 0)]
    text = render({**RECORD, "rows": rows, "sizing": {}, "best_first_sizing": {}})
    short, long = [line for line in text.splitlines() if line.startswith("| M |")]
    assert short.split(" | ")[2:6] == ["3.00 / 2.00x (2.00x)", "3.00 / 2.00x (2.00x)", "20.0", "10.0"]
    assert short.endswith("| 0.30 | 1/1 |") and long.endswith("| 0.50 | 0/1 |")
    assert long.split(" | ")[2:6] == ["5.00 / 8.00x (8.00x)", "5.00 / 8.00x (8.00x)", "256.0", "32.0"]


def test_at_lengths_adds_a_column_per_category_at_each_later_length():
    prompts = {"chat": [{"id": i} for i in range(4)], "summary": [{"id": i} for i in range(4)]}
    columns = at_lengths(prompts, [64, 256], long_prompts=2)
    assert {label: (len(rows), n) for label, (rows, n) in columns.items()} == {
        "chat": (4, 64),
        "summary": (4, 64),
        "chat@256": (2, 256),
        "summary@256": (2, 256),
    }


def test_loops_finds_a_reply_that_ends_repeating_itself():
    assert loops(list(range(40)) + [1, 2, 3] * 30)  # a 3-token loop fills the second half
    assert not loops(list(range(200)))
    assert not loops([5, 6, 7])  # too short to tell


def test_the_batch_tables_tau_pools_the_rows_as_bench_md_does():
    """A row of 21 tokens in 5 passes (tau 4) and one of 51 in 50 (tau 1): 70 tokens over 55 passes, 1.27,
    not the mean of the two rows' taus (2.5)."""
    from benchmarks.batch import pooled_tau

    assert pooled_tau([21, 51], [5, 50]) == pytest.approx(70 / 55)
    assert pooled_tau([1], [0]) == 1.0  # a reply of one token: no verify pass, as `generate` counts it
