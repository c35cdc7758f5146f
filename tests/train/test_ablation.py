"""train/ablation.py and scripts/ablate.py: the spec's checks, each arm's command, runs that resume (a
finished arm is skipped, a failed one names its log), greedy tau per category, and the table; end to end on
the tiny target with two arms of two steps."""

from __future__ import annotations

import glob
import json
import runpy
from dataclasses import replace
from pathlib import Path

import pytest
import yaml

from benchmarks.prompts import load_seen_prompts, prompt_ids
from decode import generate
from heads import load_heads, save_heads
from heads.eagle import with_draft_vocab
from heads.files import write_json
from targets import load_target
from train.ablation import (
    DONE,
    DUMPED,
    SPENT,
    AblationSpec,
    arm_command,
    dump_command,
    dump_states,
    evaluate_arm,
    judge_arm,
    load_spec,
    pooled_kinds,
    reference_record,
    render,
    run_arm,
    write_results,
)
from train.checkpoint import BEST_DIR
from train.config import EagleRunConfig, load_config

ROOT = Path(__file__).resolve().parents[2]
TINY_YAML = ROOT / "configs" / "tiny_test.yaml"


def _spec_file(tmp_path, **fields) -> Path:
    spec = {"recipe": "eagle", "base": str(TINY_YAML), "output_dir": str(tmp_path / "out"), "arms": {"a": []}}
    path = tmp_path / "spec.yaml"
    path.write_text(yaml.safe_dump(spec | fields))
    return path


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"steps": 3}, r"unknown key\(s\) \['steps'\]"),
        ({"recipe": "lookahead"}, "recipe 'lookahead', expected one of"),
        ({"hidden_states": "disk"}, "hidden_states 'disk', expected one of"),
        ({"hidden_states": "offline", "recipe": "medusa"}, "offline needs recipe eagle"),
        ({"arms": {}}, "arms must be a non-empty mapping"),
        ({"arms": {"a": "eagle.ttt_steps=5"}}, "arm 'a' must list 'section.key=value' overrides"),
        ({"arms": {"a": ["eagle.ttt_steps"]}}, "arm 'a' must list"),
        ({"arms": {"a": ["train.output_dir=x"]}}, "its folder is output_dir/<name>"),
        ({"prompts": 0}, "prompts must be a positive integer"),
        ({"chain": 0}, "chain must be a positive integer, found 0"),
        ({"chain": True}, "chain must be a positive integer, found True"),
        ({"references": {"a": "pretrained/x"}}, r"reference\(s\) \['a'\] named like arms"),
        ({"references": ["pretrained/x"]}, "references must map names to head folders"),
        ({"heldout": True, "seen": "data/x/*.jsonl"}, "seen must list globs of training chats"),
        ({"seen": ["data/x/*.jsonl"]}, "seen needs heldout: true"),
    ],
)
def test_spec_errors_name_the_file_and_the_key(tmp_path, fields, message):
    path = _spec_file(tmp_path, **fields)
    with pytest.raises(ValueError, match=message) as info:
        load_spec(path)
    assert str(path) in str(info.value)


def test_spec_heldout_must_be_a_boolean(tmp_path):
    path = _spec_file(tmp_path, heldout="yes")
    with pytest.raises(TypeError, match="heldout must be true or false, found 'yes'"):
        load_spec(path)
    assert load_spec(_spec_file(tmp_path, heldout=True)).heldout


def test_spec_seen_files_expand_each_glob_once_and_name_one_that_matches_nothing(tmp_path):
    broad = "data/smollm2/regen_broad/shard-*.jsonl"
    spec = load_spec(
        _spec_file(tmp_path, heldout=True, seen=[broad, "data/smollm2/regen_broad/shard-00000.jsonl"])
    )
    assert spec.seen_files == sorted(ROOT.glob(broad)) and len(spec.seen_files) > 1
    empty = load_spec(_spec_file(tmp_path, heldout=True, seen=[broad, "data/nowhere/*.jsonl"]))
    with pytest.raises(ValueError, match=r"seen glob 'data/nowhere/\*.jsonl' matches no file"):
        _ = empty.seen_files


def test_pooled_kinds_pool_each_kind_over_its_prompts_and_give_their_ratio():
    """Pooled as the benchmark pools: emitted tokens over verify steps of every prompt of the kind."""

    def record(emitted, steps, taus):
        return {"tau": emitted / steps, "tau_median": 0.0, "prompts": len(taus), "emitted": emitted} | {
            "steps": steps,
            "taus": taus,
        }

    taus = {
        "chat": record(30, 10, [3.0, 3.0]),
        "code": record(10, 10, [1.0]),
        "summary": record(20, 10, [2.0]),
    }
    pooled = pooled_kinds(taus)
    assert pooled["in-source"]["tau"] == 2.0 and pooled["in-source"]["taus"] == [3.0, 3.0, 1.0]
    assert pooled["held-out"]["tau"] == 2.0 and pooled["held-out / in-source"]["tau"] == 1.0
    # the bracket: the ratio of the medians of prompts (2 over 3), not the pooled ratio again
    assert pooled["held-out / in-source"]["tau_median"] == pytest.approx(2 / 3)
    assert pooled_kinds({"chat": taus["chat"]}) == {"chat": taus["chat"]}  # no held-out category: as it was
    assert "seen" not in pooled and "held-out / seen" not in pooled
    seen = pooled_kinds(taus | {"seen_summary": record(30, 10, [3.0]), "seen_system": record(10, 10, [1.0])})
    assert seen["seen"]["tau"] == 2.0 and seen["seen"]["taus"] == [3.0, 1.0]
    assert seen["held-out / seen"]["tau"] == 1.0 and seen["held-out"] == pooled["held-out"]
    counted = {c: r | {"tokens": 40, "outside": i} for i, (c, r) in enumerate(taus.items())}
    pooled = pooled_kinds(counted)
    assert (pooled["in-source"]["tokens"], pooled["in-source"]["outside"]) == (80, 1)  # chat 0, code 1
    assert (pooled["held-out"]["tokens"], pooled["held-out"]["outside"]) == (40, 2)
    assert (
        "outside" not in pooled_kinds(counted | {"code": taus["code"]})["in-source"]
    )  # unless every part has it
    spec = AblationSpec(recipe="eagle", base=Path("b.yaml"), output_dir=Path("out"), arms={"a": []})
    row = {"arm": "a", "overrides": [], "seconds": 1.0, "tau": pooled}
    text = render(spec, [row])
    assert "| in-source outside vocab | held-out outside vocab |" in text and "| 1.2% | 5.0% |" in text
    assert "outside vocab" not in render(spec, [row | {"tau": pooled_kinds(taus)}])


def test_the_committed_generalisation_spec_judges_held_out_sources():
    spec = load_spec(ROOT / "configs" / "ablation" / "generalise.yaml")
    assert spec.heldout and spec.chain == 3 and next(iter(spec.arms)) == "baseline"
    assert {len(rows) for rows in load_seen_prompts(spec.seen_files, spec.prompts).values()} == {spec.prompts}
    assert (spec.references["shipped"] / "config.json").is_file()  # the shipped head: training length
    for name in spec.arms:
        cfg = load_config(EagleRunConfig, ROOT / spec.base, arm_command(spec, name)[3:])
        assert cfg.train.max_steps == 600
    broad = load_config(EagleRunConfig, ROOT / spec.base, arm_command(spec, "broad_long")[3:])
    assert any("regen_broad" in f for f in broad.data.train_files) and broad.data.max_length == 1024


def test_the_committed_sixth_pool_spec_differs_between_arms_in_the_data_alone():
    """configs/ablation/varied.yaml: 600 more steps from the shipped head (stage 5) on five pools, six (the
    sixth: regen_varied), or the two newest; every pool it reads is committed."""
    spec = load_spec(ROOT / "configs" / "ablation" / "varied.yaml")
    assert spec.heldout and spec.chain == 3 and spec.seen_files
    configs = {n: load_config(EagleRunConfig, ROOT / spec.base, arm_command(spec, n)[3:]) for n in spec.arms}
    assert ROOT / configs["more"].eagle.init_from == spec.references["stage5"]
    pools = {n: {f.split("/")[2] for f in c.data.train_files} for n, c in configs.items()}
    assert pools["varied"] == pools["more"] | {"regen_varied"} and len(pools["more"]) == 5
    assert pools["recent"] == {"regen_wide", "regen_varied"}
    for name, cfg in configs.items():
        assert cfg.train.max_steps == 600 and cfg.eagle == configs["more"].eagle, name
        assert replace(cfg.train, output_dir="") == replace(configs["more"].train, output_dir=""), name
        assert all(glob.glob(str(ROOT / pattern)) for pattern in cfg.data.train_files), name


def test_the_committed_vocabulary_spec_differs_between_arms_in_the_vocabulary_alone():
    spec = load_spec(ROOT / "configs" / "ablation" / "vocab.yaml")
    assert spec.heldout and spec.chain == 3 and spec.seen_files
    configs = {n: load_config(EagleRunConfig, ROOT / spec.base, arm_command(spec, n)[3:]) for n in spec.arms}
    start = ROOT / configs["more"].eagle.init_from
    assert start == spec.references["stage4"] and (start / "config.json").is_file()
    assert {(c.eagle.redraw_vocab, c.eagle.draft_vocab_size) for c in configs.values()} == {
        (False, 8192),
        (True, 8192),
        (True, 16384),
    }
    for cfg in configs.values():
        assert cfg.train.max_steps == 600 and cfg.data.train_files == configs["more"].data.train_files


def test_spec_file_must_hold_every_required_key_and_a_mapping(tmp_path):
    path = tmp_path / "spec.yaml"
    path.write_text("recipe: eagle\narms: {a: []}\n")
    with pytest.raises(ValueError, match=r"missing key\(s\) \['base', 'output_dir'\]"):
        load_spec(path)
    path.write_text("- a list\n")
    with pytest.raises(TypeError, match="expected a mapping"):
        load_spec(path)


def test_spec_output_dir_expands_the_home_folder(tmp_path):
    assert load_spec(_spec_file(tmp_path, output_dir="~/abl")).output_dir == Path.home() / "abl"


def test_a_finished_arm_is_reused_only_for_the_settings_that_made_it(tmp_path):
    """An arm's done-file records the base config and overrides it was trained with; a spec whose common
    overrides (or base, or arm) changed since is refused by name instead of tabling the old head beside the
    new settings. A done-file without that record (written before it was kept) is refused as well."""
    spec = load_spec(_spec_file(tmp_path, overrides=["train.max_steps=5"], arms={"a": ["eagle.ttt_steps=2"]}))
    done = spec.output_dir / "a" / DONE
    done.parent.mkdir(parents=True)
    record = {"arm": "a", "overrides": ["eagle.ttt_steps=2"], "seconds": 3.0}
    write_json(done, record | {"args": arm_command(spec, "a")[2:]})
    logs = []
    assert run_arm(spec, "a", log=logs.append)["seconds"] == 3.0 and "done before" in logs[-1]
    changed = load_spec(
        _spec_file(tmp_path, overrides=["train.max_steps=9"], arms={"a": ["eagle.ttt_steps=2"]})
    )
    with pytest.raises(ValueError, match=r"arm 'a' in .* was made by .*max_steps=5.*now runs .*max_steps=9"):
        run_arm(changed, "a")
    write_json(done, record)
    with pytest.raises(ValueError, match=r"was made by None, but the spec now runs"):
        run_arm(spec, "a")


def test_arm_command_puts_the_arm_after_the_common_overrides(tmp_path):
    spec = load_spec(_spec_file(tmp_path, overrides=["train.max_steps=3"], arms={"b": ["train.max_steps=5"]}))
    command = arm_command(spec, "b")
    assert command[1:] == [
        str(ROOT / "train" / "eagle.py"),
        str(TINY_YAML),
        "train.max_steps=3",
        "train.max_steps=5",  # later wins: the arm's own value
        f"train.output_dir={tmp_path / 'out' / 'b'}",
    ]


def test_two_arms_train_resume_evaluate_and_tabulate(tmp_path, tiny_target_dir, chat_file):
    common = [
        f"model.target={tiny_target_dir}",
        f"data.train_files=[{chat_file}]",
        "train.eval_tau_prompts=1",
        "train.eval_tau_new_tokens=4",
        "train.eval_every_steps=0",  # at the end only
        "eagle.draft_vocab_size=256",  # a draft vocabulary of its own: the judge counts tokens outside it
    ]
    best = ["train.keep_best_tau=true", "train.eval_every_steps=1"]
    arms = {"reference": best, "ttt1": ["eagle.ttt_steps=1"], "broken": ["eagle.ttt_steps=0"]}
    # a reference: a head trained elsewhere (here the reference arm's own, once trained), judged as it is
    again = {"again": str(tmp_path / "out" / "reference" / "head")}
    spec = load_spec(
        _spec_file(tmp_path, overrides=common, arms=arms, prompts=2, new_tokens=6, chain=2, references=again)
    )
    with pytest.raises(FileNotFoundError, match=r"reference 'again': no head in .*reference/head"):
        reference_record(spec, "again")
    logs = []
    # "ttt1" interrupted after one step: a first launch that stops there, then the arm resumes from step 1
    first = load_spec(
        _spec_file(tmp_path, overrides=common, arms={"ttt1": ["eagle.ttt_steps=1", "train.max_steps=1"]})
    )
    run_arm(first, "ttt1", log=logs.append)
    (spec.output_dir / "ttt1" / DONE).unlink()
    spent = json.loads((spec.output_dir / "ttt1" / SPENT).read_text())["seconds"]
    records = [run_arm(spec, name, log=logs.append) for name in ("reference", "ttt1")]
    assert "resum" in (spec.output_dir / "ttt1" / "train.log").read_text().lower()
    assert records[1]["seconds"] > spent  # both launches counted
    assert all((spec.output_dir / n / "head" / "config.json").is_file() for n in ("reference", "ttt1"))
    assert json.loads((spec.output_dir / "ttt1" / DONE).read_text())["overrides"] == ["eagle.ttt_steps=1"]
    trained = json.loads((spec.output_dir / "ttt1" / "head" / "config.json").read_text())["training"]
    assert trained["eagle"]["ttt_steps"] == 1 and trained["train"]["max_steps"] == 2
    assert run_arm(spec, "ttt1", log=logs.append) == records[1] and "done before" in logs[-1]  # skipped
    # an arm whose config is refused fails here, before a process is launched for it
    with pytest.raises(
        ValueError, match=r"arm 'broken' \(\['eagle.ttt_steps=0'\]\): .*ttt_steps must be >= 1"
    ):
        run_arm(spec, "broken", log=logs.append)
    assert not (spec.output_dir / "broken").exists()

    model, tokenizer = load_target(str(tiny_target_dir))
    chats = [{"messages": [{"role": "user", "content": f"Say {word} twice."}]} for word in ("one", "two")]
    prompts = {"chat": chats, "code": chats[:1]}
    records.append(reference_record(spec, "again"))
    results = [result for r in records for result in judge_arm(model, tokenizer, spec, r, prompts)]
    # the reference arm kept its best checkpoint too: judged twice; ttt1 by its last step only
    assert [(r["arm"], r["head"]) for r in results] == [
        ("reference", "head"),
        ("reference", BEST_DIR),
        ("ttt1", "head"),
        ("again", "head"),
    ]
    # the reference is the reference arm's last head: the same acceptance, no training seconds
    assert results[3]["tau"] == results[0]["tau"] and results[3]["chain_tau"] == results[0]["chain_tau"]
    assert results[3]["seconds"] is None
    for result in results:
        assert [c for c in result["tau"]] == ["chat", "code"] == list(result["chain_tau"])
        # a chain of 2 drafts: at most 3 tokens per verify pass
        assert all(1.0 <= t["tau"] <= 3.0 for t in result["chain_tau"].values())
        assert result["tau"]["chat"]["prompts"] == 2 and result["tau"]["code"]["prompts"] == 1
        assert all(t["tau"] >= 1.0 and t["tau_median"] >= 1.0 for t in result["tau"].values())
        folder = Path(result.get("head_dir") or spec.output_dir / result["arm"] / result["head"])
        config = json.loads((folder / "config.json").read_text())
        assert result["eval_tau"] == config["eval_tau"] >= 1.0  # what the run recorded for that head
        assert result["draft_ms"] > 0
    assert results[0]["tau"] == evaluate_arm(
        model, tokenizer, spec.output_dir / "reference" / "head", prompts, 6
    )
    assert results[0]["chain_tau"] == evaluate_arm(
        model, tokenizer, spec.output_dir / "reference" / "head", prompts, 6, tree=[(0,), (0, 0)]
    )
    # the reply tokens outside a head's draft vocabulary, as counted on plain greedy replies: the trained
    # heads', and a copy of one whose vocabulary leaves out the first token of every reply
    ids = {c: [prompt_ids(tokenizer, row) for row in rows] for c, rows in prompts.items()}
    plain = {
        c: [generate(model, i, None, max_new_tokens=6).one.sequence[i.shape[-1] :] for i in p]
        for c, p in ids.items()
    }
    trained = load_heads(spec.output_dir / "reference" / "head", model)
    firsts = {int(r[0]) for replies in plain.values() for r in replies}
    vocab = [t for t in range(trained.config.vocab_size) if t not in firsts][:256]
    save_heads(with_draft_vocab(trained, vocab, model.lm_head.weight), tmp_path / "narrow", base_model="tiny")
    judged = [(Path(r.get("head_dir") or spec.output_dir / r["arm"] / r["head"]), r["tau"]) for r in results]
    judged.append((tmp_path / "narrow", evaluate_arm(model, tokenizer, tmp_path / "narrow", prompts, 6)))
    for folder, taus in judged:
        t2d = load_heads(folder, model).t2d
        for category, replies in plain.items():
            record = taus[category]
            assert record["tokens"] == sum(len(r) for r in replies) == record["emitted"] + record["prompts"]
            assert record["outside"] == sum(int((~t2d[r]).sum()) for r in replies)
    assert all(judged[-1][1][c]["outside"] >= len(r) for c, r in plain.items())  # each first token at least
    data, table = write_results(spec, results)
    text = table.read_text()
    assert text == render(spec, results) and "| ttt1 | `eagle.ttt_steps=1` |" in text
    assert "| reference | `train.keep_best_tau=true` `train.eval_every_steps=1` |" in text
    assert f"| {BEST_DIR} | {results[1]['eval_tau']:.2f} | {results[1]['draft_ms']:.1f} |" in text
    chat = results[2]["chain_tau"]["chat"]
    assert "| chain-2 chat tau |" in text and f"| {chat['tau']:.2f} ({chat['tau_median']:.2f}) |\n" in text
    assert f"| again | head `{again['again']}` | - | head |" in text
    assert text.count("\n| ") == 5  # header + 4 judged heads
    assert "outside vocab" not in text  # no held-out categories: no pooled kinds to give it for
    arms_judged = [r["arm"] for r in json.loads(data.read_text())["results"]]
    assert arms_judged == ["reference", "reference", "ttt1", "again"]


def test_results_of_references_alone_make_the_output_folder(tmp_path):
    """Judging only references (`--no-train --arms shipped`) writes into an output folder no arm made."""
    out = tmp_path / "never" / "made"
    spec = load_spec(_spec_file(tmp_path, output_dir=str(out), references={"shipped": "pretrained/x"}))
    tau = {"chat": {"tau": 2.5, "tau_median": 2.25, "prompts": 2}}
    record = {"arm": "shipped", "overrides": [], "head_dir": str(tmp_path / "x"), "seconds": None}
    data, table = write_results(spec, [record | {"head": "x", "eval_tau": None, "draft_ms": 9.5, "tau": tau}])
    assert data.parent == out and json.loads(data.read_text())["results"][0]["arm"] == "shipped"
    assert "| shipped | head `" in table.read_text() and "| 2.50 (2.25) |" in table.read_text()


def test_an_offline_spec_dumps_the_states_once_and_every_arm_reads_them(tmp_path, tiny_target_dir, chat_file):
    common = [
        f"model.target={tiny_target_dir}",
        f"data.train_files=[{chat_file}]",
        "train.eval_tau_prompts=0",
    ]
    arms = {"reference": [], "ttt1": ["eagle.ttt_steps=1"], "longer": ["data.max_length=96"]}
    spec = load_spec(_spec_file(tmp_path, overrides=common, arms=arms, hidden_states="offline"))
    states = tmp_path / "out" / "states"
    assert spec.states_dir == states
    assert arm_command(spec, "ttt1")[3:] == [
        *common,
        "data.hidden_states=offline",
        f"data.offline_dir={states}",
        "eagle.ttt_steps=1",
        f"train.output_dir={tmp_path / 'out' / 'ttt1'}",
    ]
    assert dump_command(spec)[2:] == [str(TINY_YAML), *common, f"data.offline_dir={states}"]
    logs = []
    seconds = dump_states(spec, log=logs.append)
    assert seconds > 0 and (states / DUMPED).is_file() and any(states.glob("*.safetensors"))
    assert dump_states(spec, log=logs.append) == seconds and "dumped before" in logs[-1]
    for name in ("reference", "ttt1"):
        run_arm(spec, name, log=logs.append)
        assert (spec.output_dir / name / "head" / "config.json").is_file()
    # an arm whose data differ from the dump's is refused by the recipe, and the error says why
    with pytest.raises(
        RuntimeError, match=r"(?s)arm 'longer' failed .*holds other tokens than the training set's"
    ):
        run_arm(spec, "longer", log=logs.append)
    assert "Offline: every arm read" in render(spec, [], seconds)
    assert "Offline" not in render(load_spec(_spec_file(tmp_path)), [])
    with pytest.raises(ValueError, match="trains online"):
        dump_command(load_spec(_spec_file(tmp_path)))


def test_script_refuses_an_unknown_arm(tmp_path, capsys):
    main = runpy.run_path(str(ROOT / "scripts" / "ablate.py"))["main"]
    with pytest.raises(SystemExit, match=r"no arm\(s\) \['nope'\]"):
        main([str(_spec_file(tmp_path)), "--arms", "nope"])


def test_train_only_trains_the_arms_named_and_judges_none(tmp_path, capsys):
    """--train-only (one lane of two on a 2-core CPU): the arms train, nothing loads the target or judges."""
    main = runpy.run_path(str(ROOT / "scripts" / "ablate.py"))["main"]
    trained = []

    def run_arm(spec, name):
        trained.append(name)
        return {"arm": name, "overrides": spec.arms[name], "seconds": 1.0}

    def refuse(*args, **kwargs):
        raise AssertionError("judged or loaded the target")

    main.__globals__.update(run_arm=run_arm, judge_arm=refuse, load_target=refuse)
    spec = _spec_file(tmp_path, arms={"a": [], "b": ["eagle.ttt_steps=1"], "c": []})
    main([str(spec), "--arms", "b", "a", "--train-only"])
    assert trained == ["b", "a"] and "trained: b, a" in capsys.readouterr().out
    with pytest.raises(SystemExit, match="exclude each other"):
        main([str(spec), "--train-only", "--no-train"])
    # every arm's config is checked before the first one trains: a bad arm last stops the run at once
    trained.clear()
    bad = _spec_file(tmp_path, arms={"a": [], "b": ["eagle.ttt_steps=0"]})
    with pytest.raises(SystemExit, match=r"spec.yaml: arm 'b' \(\['eagle.ttt_steps=0'\]\): .*must be >= 1"):
        main([str(bad), "--train-only"])
    assert trained == []
    # a reference has nothing to train: --train-only leaves it out; a missing one stops the judging by name
    trained.clear()
    spec = _spec_file(tmp_path, arms={"a": []}, references={"shipped": str(tmp_path / "none")})
    main([str(spec), "--train-only"])
    assert trained == ["a"]
    with pytest.raises(SystemExit, match=r"reference 'shipped': no head in .*none"):
        main([str(spec)])


def test_the_committed_spec_loads_and_every_arm_is_a_valid_run_config():
    spec = load_spec(ROOT / "configs" / "ablation" / "smollm2.yaml")
    assert next(iter(spec.arms)) == "baseline" and len(spec.arms) >= 8
    for name in spec.arms:
        cfg = load_config(EagleRunConfig, ROOT / spec.base, arm_command(spec, name)[3:])
        assert cfg.train.max_steps == 600 and cfg.train.output_dir == str(spec.output_dir / name)
