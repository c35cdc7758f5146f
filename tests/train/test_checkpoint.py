"""Resume states (train/checkpoint.py): only complete states count, and a run resumes only with the data
order its state was written with (another schedule is allowed, and said)."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest

from train.checkpoint import PROGRESS_FILE, check_resume_settings, latest_state
from train.config import EagleRunConfig, load_config, save_config

TINY_YAML = Path(__file__).resolve().parents[2] / "configs" / "tiny_test.yaml"


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


def saved_run(tmp_path: Path, overrides, processes: int = 1) -> tuple[Path, Path]:
    """A run folder as a 2-step run leaves it: config.yaml and the complete state of step 2."""
    out = tmp_path / "run"
    save_config(load_config(EagleRunConfig, TINY_YAML, overrides(out)), out / "config.yaml")
    state = out / "state" / "step-2"
    state.mkdir(parents=True)
    (state / PROGRESS_FILE).write_text(json.dumps({"step": 2, "num_processes": processes}))
    return out, state


def accelerator(num_processes: int = 1) -> SimpleNamespace:
    printed = []
    return SimpleNamespace(num_processes=num_processes, print=printed.append, printed=printed)


@pytest.mark.parametrize(
    "change, listed",
    [
        ("train.per_device_batch_size=3", "train.per_device_batch_size: 2 -> 3"),
        ("data.shuffle_seed=1", "data.shuffle_seed: 0 -> 1"),
        ("data.eval_fraction=0.5", "data.eval_fraction: 0.25 -> 0.5"),
        # these change which rows exist or their tokens: they were resumed without a word
        ("data.sources=[sharegpt]", r"data.sources: '\[\]' -> \"\['sharegpt'\]\""),
        ("data.trim_loops=2", "data.trim_loops: 0 -> 2"),
        ("model.revision=abc", "model.revision: 'None' -> 'abc'"),
    ],
)
def test_another_data_order_is_refused(change, listed, tmp_path, overrides):
    out, state = saved_run(tmp_path, overrides)
    cfg = load_config(EagleRunConfig, TINY_YAML, overrides(out, change))
    with pytest.raises(ValueError, match=rf"cannot resume step-2 with another data order \({listed}\)"):
        check_resume_settings(accelerator(), cfg, out, state)


def test_another_process_count_is_refused(tmp_path, overrides):
    out, state = saved_run(tmp_path, overrides, processes=2)
    cfg = load_config(EagleRunConfig, TINY_YAML, overrides(out))
    with pytest.raises(ValueError, match=r"another data order \(processes: 2 -> 1\)"):
        check_resume_settings(accelerator(1), cfg, out, state)
    check_resume_settings(accelerator(2), cfg, out, state)


def test_another_schedule_is_said_and_the_same_settings_are_silent(tmp_path, overrides):
    out, state = saved_run(tmp_path, overrides)
    same, longer = accelerator(), accelerator()
    check_resume_settings(same, load_config(EagleRunConfig, TINY_YAML, overrides(out)), out, state)
    assert same.printed == []
    cfg = load_config(
        EagleRunConfig, TINY_YAML, overrides(out, "train.max_steps=4", "train.learning_rate=1e-4")
    )
    check_resume_settings(longer, cfg, out, state)
    assert len(longer.printed) == 1
    listed = "train.max_steps: 2 -> 4; train.learning_rate: 0.001 -> 0.0001"
    assert f"resuming step-2 with another schedule ({listed})" in longer.printed[0]
    assert "from step 2 on" in longer.printed[0]
