"""scripts/bench.py end to end on a tiny target with the real tokenizer: every method (plain, prompt lookup,
Medusa-1, Medusa-2 on its LoRA-merged target, EAGLE-1, EAGLE-3 static / dynamic / cost-model sized) at T=0 and
T=1 on the three prompt categories; tables, JSON and plots are written and the numbers hang together."""

import json
import runpy
from pathlib import Path

import pytest
import torch

from decode.layout import can_onednn
from heads import EagleConfig, EagleHead, MedusaConfig, MedusaHeads, save_heads
from heads.dflash import DFlashConfig, DFlashHead
from heads.peagle import PEagleConfig, PEagleHead
from targets import load_target

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "bench.py"
X86_INT8 = bool({"x86", "fbgemm"} & set(torch.backends.quantized.supported_engines))  # decode.prepare's int8


@pytest.fixture(scope="module")
def head_dirs(tiny_target_dir, tmp_path_factory):
    """Random heads for the tiny target (Medusa initialised from its lm_head, so loops of one token are
    drafted right) and a Medusa-2 run folder with a LoRA adapter."""
    from peft import LoraConfig, get_peft_model

    root = tmp_path_factory.mktemp("heads")
    model, _ = load_target(str(tiny_target_dir))
    torch.manual_seed(0)
    medusa = MedusaHeads(MedusaConfig(32, model.config.vocab_size, num_heads=3)).eval()
    medusa.init_from_lm_head(model.get_output_embeddings().weight)
    save_heads(medusa, root / "medusa1", base_model=str(tiny_target_dir))
    save_heads(medusa, root / "medusa2" / "head", base_model=str(tiny_target_dir))
    lora = get_peft_model(load_target(str(tiny_target_dir))[0], LoraConfig(r=2, target_modules=["q_proj"]))
    lora.save_pretrained(root / "medusa2" / "lora", safe_serialization=True)
    for kind in ("eagle1", "eagle3"):
        extra = {"draft_vocab_size": 512} if kind == "eagle3" else {}
        head = EagleHead(EagleConfig.from_target(model.config, kind, **extra)).eval()
        if kind == "eagle3":
            head.set_draft_vocab(torch.arange(512))
        save_heads(head, root / kind, base_model=str(tiny_target_dir))
    dflash = DFlashHead(DFlashConfig.from_target(model.config, 7, num_hidden_layers=1, draft_vocab_size=512))
    dflash.set_draft_vocab(torch.arange(512))
    save_heads(dflash.eval(), root / "dflash", base_model=str(tiny_target_dir))
    config = PEagleConfig.from_target(model.config, mask_token_id=7, parallel_depths=3, draft_vocab_size=512)
    peagle = PEagleHead(config)
    peagle.set_draft_vocab(torch.arange(512))
    save_heads(peagle.eval(), root / "peagle", base_model=str(tiny_target_dir))
    return root


def test_bench_runs_every_method_and_writes_reports(tmp_path, tiny_target_dir, head_dirs, capsys):
    bench = runpy.run_path(str(SCRIPT))
    out = tmp_path / "out"
    results = bench["main"](
        [
            "--model",
            str(tiny_target_dir),
            "--eagle3",
            str(head_dirs / "eagle3"),
            "--eagle1",
            str(head_dirs / "eagle1"),
            "--medusa1",
            str(head_dirs / "medusa1"),
            "--medusa2",
            str(head_dirs / "medusa2"),
            "--prompts",
            "1",
            "--calibration-prompts",
            "1",
            "--max-new-tokens",
            "12",
            "--temperatures",
            "0",
            "1",
            "--size-tree",
            "--repeats",
            "1",
            "--threads",
            "1",
            "--eagle3-tree",
            "3",
            "2",
            "5",
            "--eagle3-tree",
            "3",
            "2",
            "5",
            "0.3",
            "--medusa1-dynamic",
            "3",
            "3",
            "6",
            "0.05",
            "--medusa1-tree",
            "6",
            "--draft-layers",
            "1",
            "--dflash",
            str(head_dirs / "dflash"),
            "--peagle",
            str(head_dirs / "peagle"),
            "--dflash-budget",
            "4",
            "--out",
            str(out),
        ]
    )
    assert torch.is_grad_enabled()  # the benchmark leaves the caller's grad mode alone
    printed = capsys.readouterr().out
    assert "### Temperature 0: tau / speedup per category" in printed and "### Temperature 1" in printed
    assert sorted(p.name for p in out.iterdir()) == [
        "acceptance.png",
        "bench.json",
        "bench.md",
        "speedup_vs_tree.png",
    ]
    assert json.loads((out / "bench.json").read_text())["rows"] == results["rows"]
    if can_onednn():  # the default layout, plain decoding included
        assert results["onednn"] and not results["pretransposed"] and "oneDNN's reordered layout" in printed
    else:
        assert results["pretransposed"] and "Linear weights pretransposed" in printed
    # the default
    int8 = ["dflash", "eagle1", "eagle3", "medusa1", "medusa2", "peagle"]
    assert results["int8_draft"] == (int8 if X86_INT8 else [])
    methods = {r["method"] for r in results["rows"]}
    assert {
        "prompt lookup",
        "prompt lookup (transformers)",
        "EAGLE-3 + lookup",
        "draft model (1 layers)",
        "Medusa-1",
        "Medusa-2",
        "EAGLE-1",
        "EAGLE-3 static",
        "EAGLE-3 dynamic",
        "EAGLE-3 dynamic 3/2/5",
        "DFlash chain 7",  # the whole block: what vLLM's dflash method drafts
        "DFlash best-first 4",
        "DFlash sized",
        "P-EAGLE chain 3",  # every depth of one forward: what vLLM's parallel drafting drafts
        "P-EAGLE best-first 4",
        "P-EAGLE sized",
    } <= methods
    sized = next(r for r in results["rows"] if r["method"] == "DFlash sized")
    assert sized["tree"].startswith("cost model: best-first(budget=")
    assert sorted(results["best_first_sizing"]) == ["dflash", "peagle"]
    for name, label in (("dflash", "DFlash"), ("peagle", "P-EAGLE")):
        budgets = results["best_first_sizing"][name]
        assert [b["predicted_speedup"] for b in budgets] == sorted(
            (b["predicted_speedup"] for b in budgets), reverse=True
        )
        sized = next(r for r in results["rows"] if r["method"] == f"{label} sized")
        assert sized["tree"] == f"cost model: best-first(budget={budgets[0]['budget']})"
        assert f"Cost-model budget of the {label} best-first tree" in printed
    wide = next(r for r in results["rows"] if r["method"] == "Medusa-1 6 nodes")
    assert wide["tree"].startswith("measured acceptance: static, ") and wide["draft_nodes_per_step"] <= 6
    extra = next(r for r in results["rows"] if r["method"] == "EAGLE-3 dynamic 3/2/5")
    assert extra["tree"] == "dynamic(depth=3, top_k=2, total=5)" and extra["draft_nodes_per_step"] <= 5
    medusa = next(r for r in results["rows"] if r["method"] == "Medusa-1 dynamic 3/3/6 p>=0.05")
    assert medusa["tree"] == "dynamic(depth=3, top_k=3, total=6, min_prob=0.05)"
    assert medusa["draft_nodes_per_step"] <= 6
    bounded = next(r for r in results["rows"] if r["method"] == "EAGLE-3 dynamic 3/2/5 p>=0.3")
    assert bounded["tree"] == "dynamic(depth=3, top_k=2, total=5, min_prob=0.3)"
    assert (
        bounded["draft_nodes_per_step"] < extra["draft_nodes_per_step"]
    )  # a random head is rarely that sure
    # the cost model prices fixed sizes only: no prediction for the bounded tree
    assert set(results["sizing"]["eagle3"]["fixed_trees"]) == {
        "EAGLE-3 static",
        "EAGLE-3 dynamic",
        "EAGLE-3 dynamic 3/2/5",
    }
    for row in results["rows"]:
        assert row["temperature"] in (0.0, 1.0)
        assert row["category"] in ("chat", "instruction", "code", "in-source", "all")
        assert row["tau"] >= 1.0 and row["speedup"] > 0 and row["tokens_per_second"] > 0
        assert all(0.0 <= a <= 1.0 for a in row["acceptance_per_depth"])
        # ours: exactly plain greedy decoding
        if row["temperature"] == 0 and row["method"] != "prompt lookup (transformers)":
            assert row["identical_to_plain"] == row["prompts"]
        if row["method"] == "prompt lookup (transformers)":
            assert row["draft_nodes_per_step"] is None  # transformers does not say how many it drafted
        elif (
            "min_prob" not in row["tree"] and row["method"] != "prompt lookup"
        ):  # a bounded tree may draft nothing on steps where nothing is sure
            assert row["draft_nodes_per_step"] > 0
    cells = {(r["method"], r["temperature"], r["category"]) for r in results["rows"]}
    assert len(cells) == len(results["rows"])  # one row per method, temperature and category
    assert {c for (_, _, c) in cells} == {"chat", "instruction", "code", "in-source", "all"}
    for name in ("eagle3", "medusa1"):
        sizing = results["sizing"][name]
        assert set(sizing["verify_ms"]) and all(ms > 0 for ms in sizing["verify_ms"].values())
        speeds = [c["predicted_speedup"] for c in sizing["candidates"]]
        assert speeds == sorted(speeds, reverse=True)
        assert sizing["chosen"] in printed


@pytest.mark.skipif(
    not X86_INT8, reason="decode.prepare makes drafts int8 only where fbgemm's x86 kernels exist"
)
@pytest.mark.parametrize("flag", ["--int8-draft", "--no-int8-draft"])
def test_bench_int8_drafts_by_default_stay_lossless_and_are_reported(
    tmp_path, tiny_target_dir, head_dirs, capsys, flag
):
    bench = runpy.run_path(str(SCRIPT))
    argv = ["--model", str(tiny_target_dir), "--eagle3", str(head_dirs / "eagle3"), "--eagle1"]
    argv += [str(head_dirs / "eagle1"), "--medusa2", str(head_dirs / "medusa2"), "--prompts", "1"]
    argv += [
        "--max-new-tokens",
        "12",
        "--temperatures",
        "0",
        "--threads",
        "1",
        "--out",
        str(tmp_path / "out"),
    ]
    results = bench["main"](argv + [flag])
    printed = capsys.readouterr().out
    if flag == "--no-int8-draft":  # the fp32 drafts decode.prepare leaves alone when told
        assert results["int8_draft"] == [] and "fp32 draft heads" in printed
    else:  # --int8-draft: the default (test above), still accepted
        assert results["int8_draft"] == ["eagle1", "eagle3", "medusa2"]
        assert "int8 draft heads (EAGLE fc in fp32)" in printed
    assert json.loads((tmp_path / "out" / "bench.json").read_text())["int8_draft"] == results["int8_draft"]
    rows = [r for r in results["rows"] if r["method"] != "prompt lookup (transformers)"]
    assert {r["method"] for r in rows} == {
        "prompt lookup",
        "Medusa-2",
        "EAGLE-1",
        "EAGLE-3 static",
        "EAGLE-3 dynamic",
        "EAGLE-3 + lookup",
    }
    assert all(r["identical_to_plain"] == r["prompts"] for r in rows)


def test_bench_reports_held_out_sources_at_two_lengths_and_chains(
    tmp_path, tiny_target_dir, head_dirs, capsys
):
    """--heldout adds the held-out-source categories; two --max-new-tokens decode every category at each,
    pooled per kind (in-source, held-out); --chain adds each head's chain of N drafts."""
    bench = runpy.run_path(str(SCRIPT))
    argv = ["--model", str(tiny_target_dir), "--eagle3", str(head_dirs / "eagle3"), "--peagle"]
    argv += [str(head_dirs / "peagle"), "--prompts", "1", "--heldout", "--max-new-tokens", "6", "10"]
    argv += ["--long-prompts", "1", "--chain", "2", "--temperatures", "0", "--threads", "1", "--only"]
    argv += ["EAGLE-3 dynamic", "EAGLE-3 chain 2", "P-EAGLE chain 2"]
    results = bench["main"]([*argv, "--out", str(tmp_path / "out")])
    printed = capsys.readouterr().out
    categories = ("chat", "instruction", "code", "summary", "open_qa", "creative", "system", "followup")
    pooled = ("in-source", "held-out")
    expected = {*categories, *pooled, "all"} | {f"{c}@10" for c in (*categories, *pooled, "all")}
    assert {r["category"] for r in results["rows"]} == expected
    assert {r["method"] for r in results["rows"]} == {"EAGLE-3 dynamic", "EAGLE-3 chain 2", "P-EAGLE chain 2"}
    for row in results["rows"]:
        assert row["identical_to_plain"] == row["prompts"] or row["method"] == "prompt lookup (transformers)"
        if row["method"] == "EAGLE-3 chain 2":
            assert row["draft_nodes_per_step"] <= 2
        if row["category"] == "held-out@10":  # one prompt of each of the five categories, 10 tokens each
            assert row["prompts"] == 5 and row["tokens"] <= 50
    assert results["lengths"]["summary@10"] == 10 and results["lengths"]["summary"] == 6
    assert "### Temperature 0, 10 new tokens: tau / speedup per category" in printed
    assert "| summary | open_qa | creative | system | followup | in-source | held-out | all |" in printed
    assert (
        "Plain replies ending in a repetition loop (most 8-token runs of their second half repeat): chat "
        in printed
    )
    assert all(0 <= r["plain_looped"] <= r["prompts"] for r in results["rows"])


def test_bench_medusa1_tree_needs_the_sizing(tmp_path, head_dirs, capsys):
    bench = runpy.run_path(str(SCRIPT))
    with pytest.raises(SystemExit):
        bench["main"](
            ["--medusa1", str(head_dirs / "medusa1"), "--medusa1-tree", "8", "--out", str(tmp_path)]
        )
    assert "--medusa1-tree needs --size-tree and --medusa1" in capsys.readouterr().err


def test_bench_batch_sizes_compares_plain_tree_and_policy_per_batch(
    tmp_path, tiny_target_dir, head_dirs, capsys
):
    """--batch-sizes: the same 4 chat prompts decoded in groups of B = 1 and 3 (3 + 1), plain vs a fixed tree
    vs the calibrated and the adaptive policy (and rows drafting alone): a table, JSON and the plot; every
    greedy reply equals plain decoding's."""
    bench = runpy.run_path(str(SCRIPT))
    out = tmp_path / "batch"
    args = [
        "--model",
        str(tiny_target_dir),
        "--medusa1",
        str(head_dirs / "medusa1"),
        "--batch-sizes",
        "1",
        "3",
    ]
    args += ["--max-new-tokens", "8", "--repeats", "1", "--calibration-prompts", "1", "--threads", "1"]
    args += ["--batch-prompts", "4", "--batch-rowwise"]
    results = bench["main"]([*args, "--out", str(out)])
    records = results["batches"]
    assert [r["batch"] for r in records] == [1, 3] and all(r["identical"] for r in records)
    assert all(r["prompts"] == 4 for r in records)
    speeds = ("plain_tok_s", "tree_tok_s", "policy_tok_s", "adaptive_tok_s", "rowwise_tok_s")
    assert all(r[name] > 0 for r in records for name in speeds)
    assert all(r["policy"] == "plain" or r["policy"].startswith("static(") for r in records)
    assert all(0 <= r["adaptive_speculated"] <= 1 for r in records)
    for r in records:  # a factor per kind of step the adaptive policy took (None: it took none)
        spec_steps = r["adaptive_speculated"] > 0
        assert (r["adaptive_time_spec"] is not None) == spec_steps
        assert (r["adaptive_time_plain"] is not None) == (r["adaptive_speculated"] < 1)
        assert all(r[f"adaptive_time_{k}"] is None or r[f"adaptive_time_{k}"] > 0 for k in ("plain", "spec"))
    saved = json.loads((out / "batch.json").read_text())
    assert saved["batches"] == records and "--batch-sizes 1 3" in saved["command"]
    assert (out / "speedup_vs_batch.png").stat().st_size > 1000
    printed = capsys.readouterr()
    assert "| 3 |" in (out / "batch.md").read_text() and "| 3 |" in printed.out
    assert "calibrating the batch policies on 1 prompts" in printed.err  # progress, on stderr
    assert "batch 3, round 1/1, adaptive:" in printed.err
    with pytest.raises(SystemExit):
        bench["main"](["--model", str(tiny_target_dir), "--batch-sizes", "2", "--out", str(out)])


@pytest.mark.parametrize(
    "values, message",
    [
        (["3", "2"], "2 values; expected DEPTH TOP_K TOTAL [MIN_PROB]"),
        (["3", "2", "5", "1.5"], "DynamicTree.min_prob must be in [0, 1), got 1.5"),
        (["3", "2", "x"], "invalid literal for int() with base 10: 'x'"),
        (["3", "0", "5"], "DynamicTree.top_k must be >= 1, got 0"),
    ],
)
def test_bench_dynamic_trees_name_what_is_wrong(tmp_path, head_dirs, capsys, values, message):
    bench = runpy.run_path(str(SCRIPT))
    for option in ("--eagle3-tree", "--medusa1-dynamic"):
        with pytest.raises(SystemExit):
            bench["main"](["--eagle3", str(head_dirs / "eagle3"), option, *values, "--out", str(tmp_path)])
        assert f"{option} {' '.join(values)}: {message}" in capsys.readouterr().err


def test_bench_only_names_an_unknown_method(tmp_path, tiny_target_dir, head_dirs):
    bench = runpy.run_path(str(SCRIPT))
    argv = ["--model", str(tiny_target_dir), "--eagle3", str(head_dirs / "eagle3"), "--prompts", "1"]
    argv += ["--temperatures", "0", "--only", "EAGLE-3 dynamc", "--out", str(tmp_path / "out")]
    with pytest.raises(
        SystemExit, match=r"--only \['EAGLE-3 dynamc'\]: no such method; known: .*EAGLE-3 dynamic"
    ):
        bench["main"](argv)
