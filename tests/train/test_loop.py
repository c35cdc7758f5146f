"""The recipe loop (train/loop.py): on its own with a toy module, when it evaluates, checkpoints, exports and
drops idle gradients; through the EAGLE recipe on a tiny target, resume (a resumed run equals an
uninterrupted one, also after SIGKILL), refusing another data order, the NaN guard and the trackers."""

from __future__ import annotations

import json
import math
import re
import signal
import time
from pathlib import Path

import pytest
import torch
from datasets import Dataset
from torch import nn

import train.eagle
from train.checkpoint import BEST_DIR, EXPORT_DIR, best_tau, latest_state
from train.config import EagleRunConfig, TrainConfig, load_config
from train.distributed import make_accelerator
from train.loop import make_optimizer, prepare_run, train_loop

ROOT = Path(__file__).resolve().parents[2]
TINY_YAML = ROOT / "configs" / "tiny_test.yaml"
FAST = ["train.eval_tau_prompts=0", "eagle.draft_vocab_size=256"]  # cheap steps: no generate, small lm_head


class ToyStep(nn.Module):
    """A recipe's step module in miniature: embedding, linear layer, loss = masked mean square output."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(16, 4)
        self.out = nn.Linear(4, 1)

    def forward(self, input_ids, loss_mask):
        values = self.out(self.embed(input_ids)).squeeze(-1).square()  # (B, T)
        loss = (values * loss_mask).sum() / loss_mask.sum()
        return loss, {"top1_step0": loss.detach()}


def toy_rows(count: int) -> Dataset:
    return Dataset.from_dict(
        {
            "input_ids": [[(i + t) % 16 for t in range(6)] for i in range(count)],
            "loss_mask": [[1] * 6] * count,
        }
    )


def test_loop_evaluates_checkpoints_exports_and_drops_idle_gradients(
    tmp_path, overrides, fresh_accelerate, capsys
):
    """5 steps of 2 rows, evaluating and saving every 2: eval and export at steps 2, 4 and 5 (the end), resume
    states of each; the held-out loss runs in eval mode; the idle parameter does not move in its step."""
    out = tmp_path / "run"
    args = [
        "train.max_steps=5",
        "train.eval_every_steps=2",
        "train.save_every_steps=2",
        "train.keep_checkpoints=5",
    ]
    cfg = load_config(EagleRunConfig, TINY_YAML, overrides(out, *args))
    accelerator = make_accelerator(cfg.train)
    torch.manual_seed(0)
    toy = ToyStep()
    run = prepare_run(accelerator, cfg, toy, toy.parameters(), toy_rows(12))
    assert (run.per_epoch, run.num_steps, run.start_step) == (6, 5, 0)
    seen = {"loss_steps": [], "eval_training": [], "tau_calls": 0, "exports": []}
    start = {name: p.detach().clone() for name, p in toy.named_parameters()}

    def loss(batch, step):
        seen["loss_steps"].append(step)
        if step == 1:  # after the first optimizer step, in which the embedding was idle
            seen["moved_after_one"] = {n: not torch.equal(p, start[n]) for n, p in toy.named_parameters()}
        return run.module(batch["input_ids"], batch["loss_mask"])

    def eval_loss(batch):
        seen["eval_training"].append(run.module.training)
        return run.module(batch["input_ids"], batch["loss_mask"])[0]

    def eval_tau():
        seen["tau_calls"] += 1
        return 1.5

    def export(step, eval_tau=None):
        seen["exports"].append((step, eval_tau))
        return out / f"export-{step}"

    path = train_loop(
        run,
        toy_rows(12),
        toy_rows(4),
        pad_id=0,
        loss=loss,
        eval_loss=eval_loss,
        eval_tau=eval_tau,
        export=export,
        idle_params=lambda step: [toy.embed.weight] if step == 0 else None,
    )
    log = capsys.readouterr().out
    assert path == out / "export-5" and f"exported {path}" in log
    assert seen["loss_steps"] == [0, 1, 2, 3, 4]  # one batch per optimizer step
    assert seen["exports"] == [(2, None), (4, None), (5, 1.5)]  # the final export records the last eval's tau
    assert sorted(p.name for p in (out / "state").iterdir()) == ["step-2", "step-4", "step-5"]
    assert [line.split(":")[0] for line in log.splitlines() if "eval_loss" in line] == [
        "step 2",
        "step 4",
        "step 5",
    ]
    assert "eval_tau 1.5000" in log and seen["tau_calls"] == 3
    assert seen["eval_training"] and not any(seen["eval_training"]) and toy.training
    assert seen["moved_after_one"] == {"embed.weight": False, "out.weight": True, "out.bias": True}
    assert not torch.equal(toy.embed.weight, start["embed.weight"])  # it trained in the later steps


def accumulating_toy_run(tmp_path, overrides, steps: int, eval_every: int, rows: int, eval_set, on_loss):
    """The loop on `ToyStep` with two micro-batches of one row per optimizer step; `on_loss(step, value)`
    sees every micro-batch's loss. Returns the accelerator."""
    args = [
        f"train.max_steps={steps}",
        "train.gradient_accumulation_steps=2",
        "train.per_device_batch_size=1",
    ]
    args += [f"train.eval_every_steps={eval_every}", "train.save_every_steps=0", "train.eval_tau_prompts=0"]
    cfg = load_config(EagleRunConfig, TINY_YAML, overrides(tmp_path / "run", *args))
    accelerator = make_accelerator(cfg.train)
    torch.manual_seed(0)
    toy = ToyStep()
    run = prepare_run(accelerator, cfg, toy, toy.parameters(), toy_rows(rows))

    def loss(batch, step):
        value, metrics = run.module(batch["input_ids"], batch["loss_mask"])
        on_loss(step, value.item())
        return value, metrics

    train_loop(
        run,
        toy_rows(rows),
        eval_set,
        pad_id=0,
        loss=loss,
        eval_loss=lambda batch: run.module(batch["input_ids"], batch["loss_mask"])[0],
        eval_tau=lambda: None,
        export=lambda step, eval_tau=None: tmp_path / f"export-{step}",
    )
    return accelerator


@pytest.mark.parametrize("eval_rows", [20, 21, 22])
def test_accumulation_holds_after_an_evaluation_that_stops_at_its_last_batch(
    eval_rows, tmp_path, overrides, fresh_accelerate
):
    """Two micro-batches per optimizer step, evaluating every step on up to 20 batches (`eval_loss` stops
    early): with 21 held-out rows its 21st batch was the loader's last, the stopped loader stayed the
    accelerator's active one, and every later micro-batch read "end of data" and stepped alone."""
    steps = []
    accumulating_toy_run(
        tmp_path, overrides, 4, 1, 20, toy_rows(eval_rows), lambda step, _: steps.append(step)
    )
    assert steps == [0, 0, 1, 1, 2, 2, 3, 3]  # the optimizer step each micro-batch belongs to


def test_the_logged_loss_is_the_steps_mean_over_its_micro_batches(
    tmp_path, overrides, fresh_accelerate, monkeypatch
):
    """Two micro-batches per step: the loss and metrics logged are their mean (they were the last one's)."""
    micro, logged = [], []
    monkeypatch.setattr(
        "accelerate.Accelerator.log",
        lambda self, logs, step: logged.append((step, logs["loss"], logs["top1_step0"])),
    )
    accumulating_toy_run(tmp_path, overrides, 3, 0, 12, None, lambda _, value: micro.append(value))
    assert len(micro) == 6 and len(set(micro)) == 6  # six different micro-batch losses
    means = [pytest.approx((micro[i] + micro[i + 1]) / 2, rel=1e-6) for i in (0, 2, 4)]
    assert logged == [(s, m, m) for s, m in zip((1, 2, 3), means)]  # the toy's metric is its loss


def test_loop_keeps_the_export_of_the_best_simulated_tau(tmp_path, overrides, fresh_accelerate, capsys):
    """keep_best_tau: evaluations at steps 2, 4, 6 measure tau 1.2, 1.5, 1.4; head_best/ gets steps 2 and 4
    (each better than all before), not 6; a run resumed over a recorded best of 1.6 exports nothing there."""
    out = tmp_path / "run"
    args = [
        "train.max_steps=6",
        "train.eval_every_steps=2",
        "train.eval_tau_prompts=1",
        "train.save_every_steps=0",
    ]
    cfg = load_config(EagleRunConfig, TINY_YAML, overrides(out, *args, "train.keep_best_tau=true"))
    taus, exports = iter([1.2, 1.5, 1.4, 1.3, 1.5, 1.7]), []

    def export(step, name=EXPORT_DIR, eval_tau=None):
        exports.append((step, name, eval_tau))
        if name == BEST_DIR:
            (out / name).mkdir(parents=True, exist_ok=True)
            (out / name / "config.json").write_text(json.dumps({"eval_tau": eval_tau}))
        return out / name

    def run_once():
        toy = ToyStep()
        run = prepare_run(make_accelerator(cfg.train), cfg, toy, toy.parameters(), toy_rows(12))
        return train_loop(
            run,
            toy_rows(12),
            toy_rows(4),
            pad_id=0,
            loss=lambda batch, step: run.module(batch["input_ids"], batch["loss_mask"]),
            eval_loss=lambda batch: run.module(batch["input_ids"], batch["loss_mask"])[0],
            eval_tau=lambda: next(taus),
            export=export,
        )

    (out / BEST_DIR).mkdir(parents=True)  # left by another run in this folder: a fresh run ignores it
    (out / BEST_DIR / "config.json").write_text(json.dumps({"eval_tau": 9.0}))
    torch.manual_seed(0)
    run_once()
    # the final export records the last evaluation's tau (1.4), not the best
    assert exports == [(2, BEST_DIR, 1.2), (4, BEST_DIR, 1.5), (6, EXPORT_DIR, 1.4)]
    assert best_tau(out) == 1.5 and "best simulated tau 1.5000" in capsys.readouterr().out
    (out / BEST_DIR / "config.json").write_text(json.dumps({"eval_tau": 1.6}))  # as if from before a resume
    cfg.train.max_steps = 12  # the same run, resumed from its step-6 state for 6 more steps
    exports.clear()
    run_once()
    assert exports == [(12, BEST_DIR, 1.7), (12, EXPORT_DIR, 1.7)]  # 1.3 and 1.5 did not beat 1.6
    with pytest.raises(ValueError, match="eval_tau_prompts > 0"):
        TrainConfig(output_dir=str(tmp_path), keep_best_tau=True)


def test_eagle_recipe_exports_the_best_head_with_its_tau(tmp_path, overrides, run_recipe):
    out = tmp_path / "run"
    args = ["train.max_steps=2", "train.eval_every_steps=1", "train.eval_tau_prompts=1"]
    run_recipe(overrides(out, *args, "train.eval_tau_new_tokens=4", "train.keep_best_tau=true"))
    best = json.loads((out / BEST_DIR / "config.json").read_text())
    assert best["train_step"] in (1, 2) and best["eval_tau"] >= 1.0 and best_tau(out) == best["eval_tau"]
    last = json.loads((out / EXPORT_DIR / "config.json").read_text())  # the step-2 evaluation's tau
    assert last["train_step"] == 2 and last["eval_tau"] >= 1.0
    assert best["train_step"] == 1 or best["eval_tau"] == last["eval_tau"]
    assert sorted(p.name for p in (out / BEST_DIR).iterdir()) == ["config.json", "model.safetensors"]


def test_optimizer_warms_up_then_follows_the_schedule(tmp_path):
    train = TrainConfig(
        output_dir=str(tmp_path), learning_rate=1.0, warmup_ratio=0.25, lr_scheduler="constant"
    )
    optimizer, scheduler = make_optimizer([nn.Parameter(torch.zeros(1))], train, num_steps=8)
    lrs = []
    for _ in range(4):
        lrs.append(scheduler.get_last_lr()[0])
        optimizer.step()
        scheduler.step()
    assert lrs == [0.0, 0.5, 1.0, 1.0]  # ceil(0.25 x 8) = 2 warmup steps
    assert (optimizer.defaults["betas"], optimizer.defaults["weight_decay"]) == ((0.9, 0.95), 0.0)


def test_resume_continues_and_equals_an_uninterrupted_run(tmp_path, overrides, run_recipe, capsys, ckpt):
    # eagle1: its feature noise draws from the global RNG, so equality also needs the RNG state restored
    common = ["eagle.head_type=eagle1", "train.save_every_steps=1", "train.eval_tau_prompts=0"]
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    run_recipe(overrides(straight, *common, "train.max_steps=4"))
    run_recipe(overrides(resumed, *common, "train.max_steps=2"))
    after_two = ckpt.head_weights(resumed)
    capsys.readouterr()

    run_recipe(overrides(resumed, *common, "train.max_steps=4"))  # the same command, 2 more steps
    log = capsys.readouterr().out
    assert f"resumed from {resumed / 'state' / 'step-2'} at step 2/4" in log
    assert "resuming step-2 with another schedule (train.max_steps: 2 -> 4)" in log  # said, not silent
    assert "step 3: eval_loss" in log and "step 1: eval_loss" not in log  # continued, not restarted
    assert ckpt.state_step(latest_state(resumed)) == 4
    assert json.loads((resumed / "head" / "config.json").read_text())["train_step"] == 4
    assert not torch.equal(ckpt.head_weights(resumed)["fc.weight"], after_two["fc.weight"])  # it trained on
    ckpt.assert_same_weights(ckpt.head_weights(resumed), ckpt.head_weights(straight))


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


def test_resume_with_other_rows_under_the_same_settings_is_refused(
    tmp_path, overrides, run_recipe, chat_file
):
    """A shard added under the glob (or rows appended, a file rewritten) changes no setting but which rows
    each step reads: the state records the rows' count and digest, and the resume is refused naming both."""
    shards = tmp_path / "shards"
    shards.mkdir()
    (shards / "a.jsonl").write_text(chat_file.read_text())
    common = ["eagle.head_type=eagle1", "train.save_every_steps=1", "train.eval_tau_prompts=0"]
    args = overrides(tmp_path / "run", *common, "train.max_steps=2", train_file=shards / "*.jsonl")
    run_recipe(args)
    progress = json.loads((tmp_path / "run" / "state" / "step-2" / "progress.json").read_text())
    assert progress["rows"] == 30  # 40 chats less the held-out quarter
    run_recipe([*args, "train.max_steps=3"])  # the same rows: resumes (only the schedule changed)
    (shards / "b.jsonl").write_text(chat_file.read_text())
    with pytest.raises(
        ValueError,
        match=r"cannot resume step-3 with other training rows .*\(expected 30 rows "
        r"with digest [0-9a-f]{16}, found 60 rows with digest [0-9a-f]{16}\)",
    ):
        run_recipe([*args, "train.max_steps=4"])
    (shards / "b.jsonl").unlink()
    run_recipe([*args, "train.max_steps=4"])  # the data restored: resumes
    assert json.loads((tmp_path / "run" / "head" / "config.json").read_text())["train_step"] == 4


def test_sigkill_mid_run_then_rerun_equals_an_uninterrupted_run(tmp_path, overrides, run_recipe, cli, ckpt):
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
        while (state := latest_state(killed)) is None or ckpt.state_step(state) < 2:
            log = (tmp_path / "killed.log").read_text()
            assert process.poll() is None, f"exited {process.returncode} before step 2:\n{log[-3000:]}"
            assert time.monotonic() < deadline, "no resume state of step >= 2 within 300 s"
            time.sleep(0.02)
        process.send_signal(signal.SIGKILL)
    finally:
        cli.stop(process)
    assert process.returncode == -signal.SIGKILL
    at_kill = ckpt.state_step(latest_state(killed))
    assert 2 <= at_kill < 6, f"killed too late to test anything (state of step {at_kill})"
    print(f"killed with the state of step {at_kill} on disk")

    log = cli.run(command, tmp_path / "rerun.log", timeout=300)
    assert re.search(rf"resumed from \S+step-{at_kill} at step {at_kill}/6", log), log[-3000:]
    assert ckpt.state_step(latest_state(killed)) == 6

    straight = tmp_path / "straight"
    run_recipe(overrides(straight, *common))
    ckpt.assert_same_weights(ckpt.head_weights(killed), ckpt.head_weights(straight), atol=1e-6)


def test_nan_loss_stops_and_keeps_the_last_good_state(
    tmp_path, overrides, run_recipe, monkeypatch, capsys, ckpt
):
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
    assert ckpt.state_step(latest_state(out)) == 1

    monkeypatch.setattr(train.eagle, "eagle3_ttt_loss", real_loss)
    capsys.readouterr()
    run_recipe(args)  # the same command: the kept state loads and the run finishes
    assert f"resumed from {out / 'state' / 'step-1'} at step 1/3" in capsys.readouterr().out
    assert json.loads((out / "head" / "config.json").read_text())["train_step"] == 3


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
