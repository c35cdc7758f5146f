"""Resume states and exports (docs/design.md, Checkpoints): resume = `accelerator.save_state`, never shipped;
export = `heads.save_heads` (config.json + model.safetensors). Resume states are written atomically: a killed
run leaves either the previous complete state or the new complete one, never a half-written one as "latest"; a
run resumes only with the data order its state was written with."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import torch
import yaml
from accelerate import Accelerator
from torch import nn

from heads.files import write_json
from heads.io import build_head, save_heads
from train.config import flatten, to_dict

STATE_DIR = "state"
EXPORT_DIR = "head"
BEST_DIR = "head_best"  # train.keep_best_tau: the export of the best simulated tau so far
PROGRESS_FILE = "progress.json"


def latest_state(output_dir: str | Path) -> Path | None:
    """The newest complete resume state under `output_dir/state`, or None."""
    root = Path(output_dir) / STATE_DIR
    done = [p for p in root.glob("step-*") if (p / PROGRESS_FILE).is_file()] if root.is_dir() else []
    return max(done, key=lambda p: int(p.name.split("-")[1]), default=None)


def save_state(
    accelerator: Accelerator,
    output_dir: str | Path,
    step: int,
    keep: int,
    rows: tuple[int, str] | None = None,
) -> Path:
    """Write the resume state of optimizer step `step` and keep the `keep` newest ones; `rows`: the training
    rows' count and `train.loader.rows_digest`, recorded for `check_resume_settings`.

    Every rank writes its part (accelerate), then the main process marks it complete with progress.json and
    renames it into place; the marker is written last, so `latest_state` never picks a partial state.
    """
    root = Path(output_dir) / STATE_DIR
    final, partial = root / f"step-{step}", root / f".step-{step}.partial"
    if accelerator.is_main_process:
        shutil.rmtree(partial, ignore_errors=True)
        root.mkdir(parents=True, exist_ok=True)
    accelerator.wait_for_everyone()
    accelerator.save_state(str(partial))
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        progress = {"step": step, "num_processes": accelerator.num_processes}
        if rows is not None:
            progress["rows"], progress["rows_digest"] = rows
        write_json(partial / PROGRESS_FILE, progress)
        # a state of this step already there (a finished run rerun) goes aside first and away last: a kill in
        # between leaves it complete (`latest_state` skips names not "step-*")
        aside = root / f".step-{step}.old"
        shutil.rmtree(aside, ignore_errors=True)
        if final.exists():
            os.replace(final, aside)
        os.replace(partial, final)
        shutil.rmtree(aside, ignore_errors=True)
        states = sorted(
            (p for p in root.glob("step-*") if (p / PROGRESS_FILE).is_file()),
            key=lambda p: int(p.name.split("-")[1]),
        )
        for old in states[: max(0, len(states) - max(1, keep))]:
            shutil.rmtree(old, ignore_errors=True)
    accelerator.wait_for_everyone()
    return final


def load_state(accelerator: Accelerator, state: Path) -> int:
    """Restore a resume state; returns the optimizer step it was taken at."""
    accelerator.load_state(str(state))
    return int(json.loads((state / PROGRESS_FILE).read_text())["step"])


def saved_processes(state: Path) -> int | None:
    """How many processes wrote a resume state (None for states written before this was recorded)."""
    return json.loads((state / PROGRESS_FILE).read_text()).get("num_processes")


def saved_rows(state: Path) -> tuple[int, str] | None:
    """The training rows' count and digest a resume state was written with (None for older states)."""
    progress = json.loads((state / PROGRESS_FILE).read_text())
    return (progress["rows"], progress["rows_digest"]) if "rows_digest" in progress else None


# Settings that fix which examples each step sees: a resumed run that changes them would skip or repeat data.
DATA_ORDER_KEYS = (
    "model.target",  # its tokenizer and template make the rows' tokens
    "model.revision",
    "data.train_files",
    "data.sources",
    "data.trim_loops",
    "data.eval_files",
    "data.max_length",
    "data.eval_fraction",
    "data.shuffle_seed",
    "data.group_by_length",
    "train.per_device_batch_size",
    "train.gradient_accumulation_steps",
    "train.seed",
)


# Settings of the learning-rate schedule: changing them on resume (e.g. more max_steps) re-stretches it.
SCHEDULE_KEYS = (
    "train.max_steps",
    "train.num_epochs",
    "train.learning_rate",
    "train.warmup_ratio",
    "train.lr_scheduler",
)


def check_resume_settings(
    accelerator: Accelerator, cfg, output_dir: Path, state: Path, rows: tuple[int, str] | None = None
) -> None:
    """Refuse to resume `state` with another data order (files, split, batch size, processes, seed, or
    other training rows under the same settings: `rows`, their count and digest); warn when the schedule
    changes. The state's settings are the run folder's config.yaml, and the process count and rows its
    progress file records (states written before they were recorded are not checked for them)."""
    saved_file = output_dir / "config.yaml"
    if not saved_file.is_file():
        _check_rows(output_dir, state, rows)
        return
    saved, now = flatten(yaml.safe_load(saved_file.read_text()) or {}), flatten(to_dict(cfg))
    changes = {
        key: (saved.get(key), now.get(key))
        for key in (*DATA_ORDER_KEYS, *SCHEDULE_KEYS)
        if key in saved and saved.get(key) != now.get(key)
    }
    processes = saved_processes(state)
    if processes is not None and processes != accelerator.num_processes:
        changes["processes"] = (processes, accelerator.num_processes)
    order = {k: v for k, v in changes.items() if k not in SCHEDULE_KEYS}
    if order:
        listed = "; ".join(f"{k}: {a!r} -> {b!r}" for k, (a, b) in order.items())
        raise ValueError(
            f"{output_dir}: cannot resume {state.name} with another data order ({listed}); "
            f"rerun with the saved settings ({saved_file}) or use a new train.output_dir"
        )
    _check_rows(output_dir, state, rows)
    if changes:
        listed = "; ".join(f"{k}: {a!r} -> {b!r}" for k, (a, b) in changes.items())
        accelerator.print(
            f"WARNING: resuming {state.name} with another schedule ({listed}): the learning rate "
            f"follows the new schedule from step {state.name.split('-')[1]} on"
        )


def _check_rows(output_dir: Path, state: Path, rows: tuple[int, str] | None) -> None:
    """Refuse other training rows than those `state` was written with, where both are known."""
    saved = saved_rows(state)
    if rows is not None and saved is not None and tuple(saved) != tuple(rows):
        raise ValueError(
            f"{output_dir}: cannot resume {state.name} with other training rows under the same settings "
            f"(expected {saved[0]} rows with digest {saved[1]}, found {rows[0]} rows with digest {rows[1]}): "
            "a file under data.train_files was added, extended or rewritten since; restore the data it was "
            "written with or use a new train.output_dir"
        )


def gather_head(accelerator: Accelerator, wrapper: nn.Module, attr: str = "head") -> nn.Module | None:
    """A whole, unsharded float32 copy of the trained head on the main process; None on the other ranks.

    Collective under ZeRO-3 and FSDP (every rank must call it): the full state dict is gathered from the
    shards.

    Args:
        accelerator: the run's accelerator.
        wrapper: the prepared training module; its attribute `attr` is the head.
        attr: name of that attribute ("head" for EAGLE, "heads" for Medusa).
    """
    return head_from_state(accelerator, wrapper, accelerator.get_state_dict(wrapper), attr)


def head_from_state(
    accelerator: Accelerator, wrapper: nn.Module, state: dict | None, attr: str = "head"
) -> nn.Module | None:
    """`gather_head` for a state dict the caller gathered already (`accelerator.get_state_dict(wrapper)`,
    which ZeRO-3 returns on the main process only)."""
    if not accelerator.is_main_process:
        return None
    head = getattr(accelerator.unwrap_model(wrapper), attr)
    # Its random init must not draw from the training RNG: a resumed run restores the RNG as saved before an
    # export (and only the main process builds this), so eagle1's feature noise would diverge from an
    # uninterrupted run's.
    with torch.random.fork_rng(devices=[]):
        fresh = build_head(head.head_type, head.config.to_dict())
    prefix = f"{attr}."
    fresh.load_state_dict({k[len(prefix) :]: v for k, v in state.items() if k.startswith(prefix)})
    return fresh.to(accelerator.device).eval()


_GATHER = object()  # export_head's default: gather the state dict itself


def export_head(
    accelerator: Accelerator,
    wrapper: nn.Module,
    output_dir: str | Path,
    attr: str = "head",
    state: dict | None = _GATHER,
    name: str = EXPORT_DIR,
    **save_kwargs,
) -> Path:
    """Write the head-only export `output_dir/<name>` from the main process (collective: see `gather_head`).

    Args:
        accelerator: the run's accelerator.
        wrapper: the prepared training module; its attribute `attr` is the head.
        output_dir: run folder.
        attr: name of that attribute ("head" for EAGLE, "heads" for Medusa).
        state: what `accelerator.get_state_dict(wrapper)` returned on this rank, when the caller gathered it
            already (ZeRO-3 returns None off the main process); by default it is gathered here.
        name: the export's folder in `output_dir`: EXPORT_DIR, or BEST_DIR for the best simulated tau.
        save_kwargs: passed to `heads.save_heads` (base_model, base_revision, target, extra).
    """
    path = Path(output_dir) / name
    state = accelerator.get_state_dict(wrapper) if state is _GATHER else state
    head = head_from_state(accelerator, wrapper, state, attr)
    if head is not None:
        save_heads(head, path, **save_kwargs)
    accelerator.wait_for_everyone()
    return path


def best_tau(output_dir: str | Path) -> float | None:
    """The simulated tau recorded in `output_dir/head_best` (None when there is none yet)."""
    config = Path(output_dir) / BEST_DIR / "config.json"
    return json.loads(config.read_text()).get("eval_tau") if config.is_file() else None
