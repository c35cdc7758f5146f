"""The training loop both recipes run: optimizer and schedule, start or resume, then epochs of seeded batches
with gradient accumulation, clipping, a NaN guard, per-step logs, evaluation and checkpoints every N steps,
and the final resume state and export. The recipe supplies only what differs: its module, its loss of a
batch, its evaluation and its export."""

from __future__ import annotations

import math
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from accelerate import Accelerator
from accelerate.utils import broadcast_object_list
from datasets import Dataset
from torch import Tensor, nn
from tqdm.auto import tqdm
from transformers import get_scheduler

from train.checkpoint import BEST_DIR, best_tau, check_resume_settings, latest_state, load_state, save_state
from train.config import TrainConfig, flatten, save_config, to_dict
from train.evaluate import evaluate
from train.loader import epoch_loader, rows_digest, steps_per_epoch, total_steps


@dataclass(frozen=True)
class Run:
    """A run after `accelerator.prepare`: what `train_loop` steps, how far, and from where."""

    accelerator: Accelerator
    cfg: object  # EagleRunConfig or MedusaRunConfig: its train and data sections drive the loop
    module: nn.Module  # the prepared step module (its forward returns the loss and its metrics)
    optimizer: torch.optim.Optimizer  # prepared; steps once per `train.gradient_accumulation_steps` batches
    scheduler: object  # learning-rate schedule, stepped by hand once per optimizer step
    per_epoch: int  # optimizer steps in one pass over the training set
    num_steps: int  # optimizer steps of the whole run
    start_step: int  # optimizer steps done before this launch: 0, or the resumed state's step
    output_dir: Path  # train.output_dir
    rows: tuple[int, str] | None = None  # the training rows' count and digest (recorded in resume states)


def prepare_run(
    accelerator: Accelerator, cfg, step_module: nn.Module, param_groups, train_set: Dataset
) -> Run:
    """Optimizer and schedule over `param_groups`, `accelerator.prepare`, then start or resume the run.

    Args:
        accelerator: from `train.distributed.make_accelerator`.
        cfg: the run config.
        step_module: the trainable module (head and loss), FSDP2 units already made.
        param_groups: what AdamW trains (parameters, or groups with their own lr).
        train_set: the training set, whose length fixes the steps per epoch.
    """
    per_epoch = steps_per_epoch(train_set, cfg.train, accelerator.num_processes)
    num_steps = total_steps(cfg.train, per_epoch)
    optimizer, scheduler = make_optimizer(param_groups, cfg.train, num_steps)
    module, optimizer = accelerator.prepare(step_module, optimizer)
    accelerator.register_for_checkpointing(scheduler)  # stepped by hand, so accelerate saves it only if told
    output_dir = Path(cfg.train.output_dir)
    rows = (len(train_set), rows_digest(train_set))
    step = start_or_resume(accelerator, cfg, output_dir, num_steps, rows)
    return Run(accelerator, cfg, module, optimizer, scheduler, per_epoch, num_steps, step, output_dir, rows)


def train_loop(
    run: Run,
    rows: Dataset,
    eval_set: Dataset | None,
    pad_id: int,
    *,
    loss: Callable[[dict, int], tuple[Tensor, dict[str, Tensor]]],
    eval_loss: Callable[[dict], Tensor],
    eval_tau: Callable[[], float | None],
    export: Callable[..., Path],
    collate_fn: Callable[[list[dict]], dict] | None = None,
    idle_params: Callable[[int], list[nn.Parameter] | None] | None = None,
) -> Path:
    """Train from `run.start_step` to `run.num_steps`; every rank runs it. Returns the final export's path.

    Evaluates every `train.eval_every_steps` and at the end; writes a resume state and an export every
    `train.save_every_steps` and at the end. With `train.keep_best_tau`, an evaluation whose simulated tau
    beats every earlier one (also those before a resume) exports to `head_best/` as well. A NaN/inf loss on
    any rank stops every rank before its step.

    Args:
        run: from `prepare_run`.
        rows: what the epochs shuffle and batch (the training set, or indices into an offline dump).
        eval_set: the held-out set, or None.
        pad_id: padding token id.
        loss: (batch, optimizer steps done) -> (loss, metrics) of one training micro-batch.
        eval_loss: the held-out loss of one batch (in eval mode, without gradients).
        eval_tau: the simulated tau (collective; None off the main process).
        export: `export(step, name=EXPORT_DIR, eval_tau=None)` writes the export of optimizer step `step` to
            the run's folder `name` (collective), recording `eval_tau` when given, and returns that folder.
        collate_fn: builds batches from `rows`; None pads tokenised rows (`train.data.collate`).
        idle_params: parameters whose gradients are dropped at a step (idle in it), or None.
    """
    accelerator, train, module, optimizer = run.accelerator, run.cfg.train, run.module, run.optimizer
    step, num_steps, per_epoch = run.start_step, run.num_steps, run.per_epoch
    best = best_tau(run.output_dir) if step > 0 else None  # a resumed run keeps the best of its earlier part
    if step == 0 and train.keep_best_tau and accelerator.is_main_process:
        for stale in (BEST_DIR, BEST_DIR.replace("head", "lora")):  # a fresh run in a reused folder
            shutil.rmtree(run.output_dir / stale, ignore_errors=True)
    accelerator.wait_for_everyone()
    final_tau = None  # the simulated tau of the last step (main process), recorded in the final export
    progress = tqdm(total=num_steps, initial=step, disable=not accelerator.is_main_process, desc="train")
    logger = StepLogger(accelerator, progress, train.log_every_steps)
    while step < num_steps:
        epoch, done = divmod(step, per_epoch)
        loader = epoch_loader(
            rows,
            train,
            run.cfg.data,
            epoch,
            pad_id,
            accelerator,
            skip_batches=done * train.gradient_accumulation_steps,
            collate_fn=collate_fn,
        )
        for batch in loader:
            with accelerator.accumulate(module):
                value, metrics = loss(batch, step)
                check_finite(accelerator, value, step, run.output_dir)
                logger.add(value, metrics)
                idle = idle_params(step) if idle_params is not None else None
                grad_norm = backward_and_clip(accelerator, value, module, train.max_grad_norm, idle)
                optimizer.step()
                optimizer.zero_grad()
            logger.count(batch)
            if not accelerator.sync_gradients:
                continue
            run.scheduler.step()
            step += 1
            logger.step(step, step == num_steps, run.scheduler.get_last_lr()[0], grad_norm)
            if (train.eval_every_steps and step % train.eval_every_steps == 0) or step == num_steps:
                logs = evaluate(accelerator, module, eval_set, run.cfg, pad_id, step, eval_loss, eval_tau)
                final_tau = logs.get("eval_tau") if step == num_steps else None
                if train.keep_best_tau:
                    best = keep_best(accelerator, logs.get("eval_tau"), best, step, export)
            if train.save_every_steps and step % train.save_every_steps == 0 and step < num_steps:
                save_state(accelerator, run.output_dir, step, train.keep_checkpoints, run.rows)
                export(step)
            if step >= num_steps or step % per_epoch == 0:
                break
    progress.close()
    save_state(accelerator, run.output_dir, step, train.keep_checkpoints, run.rows)
    path = export(step, eval_tau=final_tau)  # the last step's simulated tau, if measured, in its config.json
    accelerator.print(f"exported {path}")
    if train.keep_best_tau and best is not None:
        accelerator.print(f"best simulated tau {best:.4f}: {run.output_dir / BEST_DIR}")
    return path


def keep_best(
    accelerator: Accelerator, tau: float | None, best: float | None, step: int, export: Callable[..., Path]
) -> float | None:
    """Export step `step` to BEST_DIR when its simulated tau `tau` (known on the main process) beats `best`;
    every rank calls it and learns the main process's decision. Returns the best tau now."""
    decision = [tau is not None and (best is None or tau > best), tau]
    decision = broadcast_object_list(decision)  # one choice for every rank: the export is collective
    if not decision[0]:
        return best
    export(step, BEST_DIR, eval_tau=decision[1])
    accelerator.print(f"step {step}: simulated tau {decision[1]:.4f}, the best so far: exported {BEST_DIR}/")
    return decision[1]


def make_optimizer(param_groups, train: TrainConfig, num_steps: int):
    """AdamW and the warmup + decay schedule, in optimizer steps."""
    optimizer = torch.optim.AdamW(
        param_groups,
        lr=train.learning_rate,
        weight_decay=train.weight_decay,
        betas=(train.adam_beta1, train.adam_beta2),
    )
    warmup = math.ceil(train.warmup_ratio * num_steps)
    name = {"cosine": "cosine", "linear": "linear", "constant": "constant_with_warmup"}[train.lr_scheduler]
    return optimizer, get_scheduler(name, optimizer, num_warmup_steps=warmup, num_training_steps=num_steps)


class StepLogger:
    """Per-optimizer-step logging shared by the recipes: loss, lr, grad norm, tokens/s and the loss metrics
    (per-head / per-TTT-step top-1), to the progress bar and to `accelerator.log` every `every` steps. The
    loss and metrics logged are the step's: the mean over its micro-batches (gradient accumulation) and its
    ranks, not the main process's last micro-batch."""

    def __init__(self, accelerator: Accelerator, progress, every: int) -> None:
        self.accelerator, self.progress, self.every = accelerator, progress, every
        self.tokens, self.started = 0, time.perf_counter()
        self.sums: dict[str, torch.Tensor] = {}  # this step's micro-batch values, summed on the device
        self.micro = 0

    def count(self, batch: dict) -> None:
        self.tokens += int(batch["attention_mask"].sum())

    def add(self, loss: torch.Tensor, metrics: dict) -> None:
        """One micro-batch's loss and metrics (no host synchronization)."""
        for key, value in {"loss": loss, **metrics}.items():
            value = value.detach().float()
            self.sums[key] = self.sums[key] + value if key in self.sums else value
        self.micro += 1

    def step(self, step: int, last: bool, lr: float, grad_norm) -> None:
        self.progress.update()
        sums, micro = self.sums, max(self.micro, 1)
        self.sums, self.micro = {}, 0
        if step % self.every and not last:
            return
        elapsed = time.perf_counter() - self.started
        keys = list(sums)
        means = torch.stack([sums[key] for key in keys]) / micro
        means = self.accelerator.reduce(means, reduction="mean").tolist()  # every rank logs the same
        tokens = (
            self.accelerator.gather(torch.tensor([self.tokens], device=self.accelerator.device)).sum().item()
        )
        values = dict(zip(keys, means, strict=True))
        logs = {
            "loss": values.pop("loss"),
            "lr": lr,
            "tokens_per_s": tokens / max(elapsed, 1e-9),
            **({"grad_norm": float(grad_norm)} if grad_norm is not None else {}),
            **values,
        }
        self.progress.set_postfix(loss=f"{logs['loss']:.3f}", lr=f"{lr:.2e}")
        self.accelerator.log(logs, step=step)
        self.tokens, self.started = 0, time.perf_counter()


def start_or_resume(
    accelerator: Accelerator, cfg, output_dir: Path, num_steps: int, rows: tuple[int, str] | None = None
) -> int:
    """Save the resolved config, start the trackers, and load the newest resume state if there is one
    (`rows`: the training rows' count and digest, checked against the state's).

    Returns:
        The optimizer step to start from (0 for a fresh run).
    """
    state = latest_state(output_dir)
    # before config.yaml is overwritten: it holds the settings the state was written with
    if state is not None:
        check_resume_settings(accelerator, cfg, output_dir, state, rows)
    if accelerator.is_main_process:
        output_dir.mkdir(parents=True, exist_ok=True)
        save_config(cfg, output_dir / "config.yaml")
    if cfg.train.report_to != "none":
        accelerator.init_trackers(output_dir.name, config=flatten(to_dict(cfg)))
    if state is None:
        return 0
    step = load_state(accelerator, state)
    accelerator.print(f"resumed from {state} at step {step}/{num_steps}")
    return step


def backward_and_clip(
    accelerator: Accelerator,
    loss: torch.Tensor,
    module: nn.Module,
    max_grad_norm: float,
    drop_grads: list | None = None,
):
    """Backward, drop the gradients of `drop_grads` (parameters idle this step), and clip on optimizer steps.

    Returns:
        The pre-clip global grad norm on optimizer steps with clipping, else None.
    """
    accelerator.backward(loss)
    for param in drop_grads or ():
        param.grad = None
    if accelerator.sync_gradients and max_grad_norm > 0:
        norm = accelerator.clip_grad_norm_(module.parameters(), max_grad_norm)
        return norm.full_tensor() if hasattr(norm, "full_tensor") else norm  # FSDP2: a replicated DTensor
    return None


def check_finite(
    accelerator: Accelerator, loss: torch.Tensor, completed_steps: int, output_dir: str | Path
) -> None:
    """Stop on a NaN/inf loss of optimizer step `completed_steps + 1` on ANY rank (all ranks stop together,
    none is left waiting in a collective); the last good resume state stays."""
    bad = accelerator.gather((~torch.isfinite(loss.detach())).any().float()[None]).sum() > 0
    if bad:
        state = latest_state(output_dir)
        kept = f"The last good resume state, {state}, is kept" if state else "No resume state was written yet"
        raise FloatingPointError(
            f"loss is {loss.item()} on this rank, non-finite on at least one rank, at "
            f"optimizer step {completed_steps + 1}: stopping. "
            f"{kept}; lower the learning rate or check the data, then rerun the same "
            f"command to resume"
        )
