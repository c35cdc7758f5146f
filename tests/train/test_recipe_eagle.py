"""train/eagle.py end to end on a tiny target (conftest.py): the export and its round trip through
`load_heads` and `decode.generate`, resume (and that a resumed run equals an uninterrupted one), SIGKILL
mid-run, the NaN guard, and config / data errors that stop a run early."""

from __future__ import annotations

import json
import math
import re
import runpy
import signal
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import train.eagle
from decode import generate
from heads import load_heads
from heads.target import load_target
from train.checkpoint import PROGRESS_FILE, latest_state
from train.config import ConfigError, EagleRunConfig, load_config, to_dict

ROOT = Path(__file__).resolve().parents[2]
TINY_YAML = ROOT / "configs" / "tiny_test.yaml"
FAST = ["train.eval_tau_prompts=0", "eagle.draft_vocab_size=256"]  # cheap steps: no generate, small lm_head


def head_weights(run: Path) -> dict[str, torch.Tensor]:
    return load_file(run / "head" / "model.safetensors")


def assert_same_weights(actual: dict, expected: dict, atol: float = 0.0) -> None:
    assert sorted(actual) == sorted(expected)
    for key, value in expected.items():
        torch.testing.assert_close(actual[key], value, rtol=0, atol=atol, msg=lambda m, k=key: f"{k}: {m}")


def state_step(state: Path) -> int:
    return json.loads((state / PROGRESS_FILE).read_text())["step"]


@pytest.mark.parametrize(
    "head_type, extra",
    [
        ("eagle3", ["eagle.aux_layer_ids=[0,2,3]", "eagle.draft_vocab_size=512"]),
        ("eagle1", []),
    ],
)
def test_smoke_export_round_trips_and_decodes_losslessly(
    head_type, extra, tmp_path, overrides, run_recipe, tiny_target_dir
):
    out = tmp_path / "run"
    args = overrides(out, f"eagle.head_type={head_type}", *extra)  # tiny_test: 2 steps, eval + tau every step
    run_recipe(args)
    cfg = load_config(EagleRunConfig, TINY_YAML, args)

    export = out / "head"
    assert sorted(p.name for p in export.iterdir()) == ["config.json", "model.safetensors"]
    config = json.loads((export / "config.json").read_text())
    assert config["head_type"] == head_type
    assert config["base_model"] == str(tiny_target_dir)
    assert (config["hidden_size"], config["vocab_size"]) == (32, 49152)
    assert config["head_config"]["target_hidden_size"] == 32
    assert (config["base_model_type"], config["base_num_hidden_layers"]) == ("llama", 4)
    if head_type == "eagle3":
        assert config["head_config"]["aux_layer_ids"] == [0, 2, 3]
        assert config["head_config"]["draft_vocab_size"] == 512
    else:
        assert config["head_config"]["aux_layer_ids"] is None
    assert config["train_step"] == 2
    assert config["training"] == to_dict(cfg)
    assert load_config(EagleRunConfig, out / "config.yaml") == cfg  # the resolved config is saved

    # resume state: keep_checkpoints=1 leaves only the last one; it holds the exported weights
    assert sorted(p.name for p in (out / "state").iterdir()) == ["step-2"]
    state = latest_state(out)
    assert state == out / "state" / "step-2" and state_step(state) == 2
    in_state = load_file(state / "model.safetensors")
    assert all(key.startswith("head.") for key in in_state)  # the frozen target is never saved with the head
    exported = head_weights(out)
    assert_same_weights({k.removeprefix("head."): v for k, v in in_state.items()}, exported)

    target, tokenizer = load_target(str(tiny_target_dir))
    head = load_heads(export, target=target)
    assert_same_weights(head.state_dict(), exported)
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Question 3: what is 3 plus 3?"}],
        add_generation_prompt=True,
        tokenize=False,
    )
    prompt = tokenizer(text, return_tensors="pt").input_ids
    plain = generate(target, prompt, None, max_new_tokens=12, eos_token_id=[])
    drafted = generate(target, prompt, head, max_new_tokens=12, eos_token_id=[])
    assert plain.new_tokens == 12
    assert drafted.sequences.tolist() == plain.sequences.tolist()


def test_resume_continues_and_equals_an_uninterrupted_run(tmp_path, overrides, run_recipe, capsys):
    # eagle1: its feature noise draws from the global RNG, so equality also needs the RNG state restored
    common = ["eagle.head_type=eagle1", "train.save_every_steps=1", "train.eval_tau_prompts=0"]
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    run_recipe(overrides(straight, *common, "train.max_steps=4"))
    run_recipe(overrides(resumed, *common, "train.max_steps=2"))
    after_two = head_weights(resumed)
    capsys.readouterr()

    run_recipe(overrides(resumed, *common, "train.max_steps=4"))  # the same command, 2 more steps
    log = capsys.readouterr().out
    assert f"resumed from {resumed / 'state' / 'step-2'} at step 2/4" in log
    assert "resuming step-2 with another schedule (train.max_steps: 2 -> 4)" in log  # said, not silent
    assert "step 3: eval_loss" in log and "step 1: eval_loss" not in log  # continued, not restarted
    assert state_step(latest_state(resumed)) == 4
    assert json.loads((resumed / "head" / "config.json").read_text())["train_step"] == 4
    assert not torch.equal(head_weights(resumed)["fc.weight"], after_two["fc.weight"])  # it trained on
    assert_same_weights(head_weights(resumed), head_weights(straight))


def test_resume_with_another_data_order_is_refused(tmp_path, overrides, run_recipe):
    """Another batch size (or files, split, seed, process count) would skip or repeat examples on resume."""
    common = [
        "eagle.head_type=eagle1",
        "train.save_every_steps=1",
        "train.eval_tau_prompts=0",
        "train.max_steps=2",
    ]
    run_recipe(overrides(tmp_path / "run", *common))
    with pytest.raises(
        ValueError,
        match=r"cannot resume step-2 with another data order "
        r"\(train.per_device_batch_size: 2 -> 3\)",
    ):
        run_recipe(overrides(tmp_path / "run", *common, "train.per_device_batch_size=3", "train.max_steps=3"))
    assert "per_device_batch_size: 2" in (tmp_path / "run" / "config.yaml").read_text()  # the saved one stays


def test_init_from_starts_at_an_exported_head_and_keeps_its_draft_vocab(tmp_path, overrides, run_recipe):
    first, second = tmp_path / "first", tmp_path / "second"
    run_recipe(overrides(first, *FAST, "train.max_steps=2"))
    # lr 1e-12: one Adam step moves each weight by ~1e-12, so the export must equal the head it started from;
    # draft_vocab_size=512 is overridden by the loaded head's own vocabulary (256)
    run_recipe(
        overrides(
            second,
            *FAST,
            "eagle.draft_vocab_size=512",
            f"eagle.init_from='{first / 'head'}'",
            "train.max_steps=1",
            "train.learning_rate=1e-12",
        )
    )
    config = json.loads((second / "head" / "config.json").read_text())
    assert config["head_config"]["draft_vocab_size"] == 256
    assert_same_weights(head_weights(second), head_weights(first), atol=1e-8)

    with pytest.raises(ValueError, match=r"holds a eagle3 head, but eagle.head_type is eagle1"):
        run_recipe(
            overrides(
                tmp_path / "third",
                "train.eval_tau_prompts=0",
                "eagle.head_type=eagle1",
                f"eagle.init_from='{first / 'head'}'",
                "train.max_steps=1",
            )
        )


def test_latest_state_ignores_partial_states(tmp_path):
    root = tmp_path / "state"
    for step in (1, 3):
        (root / f"step-{step}").mkdir(parents=True)
        (root / f"step-{step}" / PROGRESS_FILE).write_text(json.dumps({"step": step}))
    (root / ".step-4.partial").mkdir()  # killed inside accelerator.save_state
    (root / ".step-4.partial" / "model.safetensors").write_bytes(b"torn")
    (root / "step-5").mkdir()  # no completion marker
    assert latest_state(tmp_path) == root / "step-3"
    assert latest_state(tmp_path / "no-run-here") is None


def test_sigkill_mid_run_then_rerun_equals_an_uninterrupted_run(tmp_path, overrides, run_recipe, cli):
    # full 49k draft vocabulary: ~1 s per step, so the kill lands well before step 6
    # cosine with warmup: equality also needs the scheduler's state restored
    common = [
        "train.max_steps=6",
        "train.save_every_steps=1",
        "train.eval_tau_prompts=0",
        "data.eval_fraction=0",
        "train.lr_scheduler=cosine",
        "train.warmup_ratio=0.34",
    ]
    killed = tmp_path / "killed"
    command = cli.command("train/eagle.py", overrides(killed, *common))
    process = cli.start(command, tmp_path / "killed.log")
    try:
        deadline = time.monotonic() + 300
        while (state := latest_state(killed)) is None or state_step(state) < 2:
            log = (tmp_path / "killed.log").read_text()
            assert process.poll() is None, f"exited {process.returncode} before step 2:\n{log[-3000:]}"
            assert time.monotonic() < deadline, "no resume state of step >= 2 within 300 s"
            time.sleep(0.02)
        process.send_signal(signal.SIGKILL)
    finally:
        cli.stop(process)
    assert process.returncode == -signal.SIGKILL
    at_kill = state_step(latest_state(killed))
    assert 2 <= at_kill < 6, f"killed too late to test anything (state of step {at_kill})"
    print(f"killed with the state of step {at_kill} on disk")

    log = cli.run(command, tmp_path / "rerun.log", timeout=300)
    assert re.search(rf"resumed from \S+step-{at_kill} at step {at_kill}/6", log), log[-3000:]
    assert state_step(latest_state(killed)) == 6

    straight = tmp_path / "straight"
    run_recipe(overrides(straight, *common))
    assert_same_weights(head_weights(killed), head_weights(straight), atol=1e-6)


def test_nan_loss_stops_and_keeps_the_last_good_state(tmp_path, overrides, run_recipe, monkeypatch, capsys):
    real_loss, calls = train.eagle.eagle3_ttt_loss, []

    def nan_at_step_2(*args, **kwargs):
        loss, metrics = real_loss(*args, **kwargs)
        if torch.is_grad_enabled():  # training forwards only; eval runs under no_grad
            calls.append(1)
            if len(calls) == 2:
                loss = loss * math.nan
        return loss, metrics

    monkeypatch.setattr(train.eagle, "eagle3_ttt_loss", nan_at_step_2)
    out = tmp_path / "run"
    args = overrides(out, *FAST, "train.max_steps=3")
    with pytest.raises(FloatingPointError, match=r"loss is nan .*at optimizer step 2\b.*step-1, is kept"):
        run_recipe(args)
    assert sorted(p.name for p in (out / "state").iterdir()) == ["step-1"]
    assert state_step(latest_state(out)) == 1

    monkeypatch.setattr(train.eagle, "eagle3_ttt_loss", real_loss)
    capsys.readouterr()
    run_recipe(args)  # the same command: the kept state loads and the run finishes
    assert f"resumed from {out / 'state' / 'step-1'} at step 1/3" in capsys.readouterr().out
    assert json.loads((out / "head" / "config.json").read_text())["train_step"] == 3


def test_unknown_override_fails_before_any_model_loads(tmp_path, overrides, monkeypatch):
    def no_model(*args, **kwargs):
        raise AssertionError("a model was loaded before the config was checked")

    monkeypatch.setattr("heads.target.load_target", no_model)  # what train/eagle.py imports when it runs
    out = tmp_path / "run"
    monkeypatch.setattr(
        sys, "argv", ["train/eagle.py", str(TINY_YAML), *overrides(out), "train.lerning_rate=1e-3"]
    )
    started = time.perf_counter()
    with pytest.raises(ConfigError, match=r"unknown key train\.lerning_rate in override 'train\.lerning_"):
        runpy.run_path(str(ROOT / "train" / "eagle.py"), run_name="__main__")  # its `if __name__` block
    assert time.perf_counter() - started < 5
    assert not out.exists()


def test_mostly_bad_training_file_fails_naming_it(tmp_path, overrides, run_recipe):
    good = {"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello there."}]}
    no_reply = {"messages": [{"role": "user", "content": "Hi"}]}
    lines = [json.dumps(good)] * 10 + ["{not json"] * 15 + [json.dumps(no_reply)] * 15
    bad = tmp_path / "mostly_bad.jsonl"
    bad.write_text("\n".join(lines) + "\n")
    out = tmp_path / "run"
    with pytest.raises(ValueError, match=re.escape(f"{bad}: 30 of 40 rows skipped")):
        run_recipe(overrides(out, train_file=bad))  # tiny_test tolerates max_bad_fraction=0.5
    assert not (out / "state").exists() and not (out / "head").exists()


def test_tensorboard_tracker_receives_the_training_metrics(tmp_path, overrides, run_recipe):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    out = tmp_path / "tb"
    run_recipe(overrides(out, *FAST, "train.report_to=tensorboard"))
    events = list(out.rglob("events.out.tfevents.*"))
    assert events, f"no tensorboard event file under {out}"
    scalars = set()
    for event in events:
        accumulator = EventAccumulator(str(event))
        accumulator.Reload()
        scalars |= set(accumulator.Tags()["scalars"])
    for tag in ("loss", "lr", "tokens_per_s", "grad_norm", "top1_step0", "eval_loss"):
        assert any(t.split("/")[-1] == tag for t in scalars), f"{tag} not logged: {sorted(scalars)}"


def test_wandb_without_a_key_logs_offline(tmp_path, overrides, run_recipe, monkeypatch):
    pytest.importorskip("wandb")
    for name in ("WANDB_API_KEY", "WANDB_MODE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    monkeypatch.setenv("WANDB_SILENT", "true")
    out = tmp_path / "wb"
    run_recipe(overrides(out, *FAST, "train.report_to=wandb"))
    runs = list(tmp_path.rglob("offline-run-*"))
    assert runs, "no offline wandb run was written"
    assert (out / "head" / "model.safetensors").is_file()
