"""Periodic evaluation of a run: the held-out loss on every rank, and the simulated tau (the median, over
held-out prompts, of a real greedy `decode.generate`'s tokens per target pass) on the main process."""

from __future__ import annotations

import copy
import statistics
from collections.abc import Callable

import torch
from accelerate import Accelerator
from datasets import Dataset
from torch import Tensor, nn

from train.loader import epoch_loader


@torch.no_grad()
def evaluate(
    accelerator: Accelerator,
    step_module: nn.Module,
    eval_set: Dataset | None,
    cfg,
    pad_id: int,
    step: int,
    loss_of: Callable[[dict], Tensor],
    tau: Callable[[], float | None],
) -> dict[str, float]:
    """Evaluate after optimizer step `step`; every rank calls it (its collectives keep a sharded run in step).

    Args:
        accelerator: the run's accelerator.
        step_module: the prepared training module, in eval mode during the held-out loss (no feature noise,
            no dropout) and back in train mode after.
        eval_set: the held-out set, or None (then nothing is evaluated).
        cfg: the run config (its `train` and `data` sections).
        pad_id: padding token id of the eval batches.
        step: the optimizer step the logs are recorded at.
        loss_of: the recipe's held-out loss of one batch.
        tau: the recipe's simulated tau, called on every rank when `train.eval_tau_prompts` > 0 (collective:
            it gathers the trained weights); None off the main process.
    Returns:
        What was logged: eval_loss and eval_tau where measured.
    """
    step_module.eval()
    logs = {"eval_loss": eval_loss(accelerator, eval_set, cfg, pad_id, loss_of)}
    step_module.train()
    if eval_set is not None and cfg.train.eval_tau_prompts > 0:
        logs["eval_tau"] = tau()
    logs = {k: v for k, v in logs.items() if v is not None}
    if logs:
        accelerator.print(f"step {step}: " + ", ".join(f"{k} {v:.4f}" for k, v in logs.items()))
        accelerator.log(logs, step=step)
    accelerator.wait_for_everyone()
    return logs


@torch.no_grad()
def eval_loss(
    accelerator: Accelerator, eval_set: Dataset | None, cfg, pad_id: int, loss_fn, max_batches: int = 20
) -> float | None:
    """Mean of `loss_fn(batch)` over (up to `max_batches` per rank of) the held-out set, averaged across
    ranks.

    Every rank runs the same number of batches (accelerate deals the eval set evenly), so a sharded module's
    collectives (ZeRO-3, FSDP) stay in step.
    """
    if eval_set is None:
        return None
    losses = []
    loader = epoch_loader(eval_set, cfg.train, cfg.data, 0, pad_id, accelerator)
    device = accelerator.device
    # The losses that sample (DFlash's anchors, P-EAGLE's chains; EAGLE-1's feature noise is off in eval mode)
    # draw from a forked RNG seeded alike at every evaluation: the same draws each time (losses comparable
    # across steps) and the training RNG untouched (how often a run evaluates does not change what it trains
    # on).
    forked = [] if device.type == "cpu" else [0 if device.index is None else device.index]
    try:
        with torch.random.fork_rng(devices=forked, device_type=device.type):
            torch.manual_seed(cfg.train.seed)
            for i, batch in enumerate(loader):
                if i >= max_batches:
                    break
                losses.append(loss_fn(batch).detach().float())
    finally:
        # A loader left early stays the accelerator's active one: had it just dealt its last batch, every
        # training micro-batch after this would read "end of data" and step the optimizer (no accumulation).
        loader.end()
    if not losses:
        return None
    return accelerator.gather(torch.stack(losses).mean()[None]).mean().item()


@torch.no_grad()
def check_tau_target(target: nn.Module, prompts: int) -> None:
    """Refuse, before training starts, a simulated-tau evaluation (`prompts` > 0) on a target that
    `decode.generate` cannot decode (chunked attention, other cache kinds: `decode.inputs.attention_windows`);
    heads train on such a target's hidden states without it."""
    from decode.inputs import attention_windows  # train -> decode, lazy as in `simulated_tau`

    if prompts > 0:
        try:
            attention_windows(target)
        except ValueError as err:
            raise ValueError(
                f"{err}. train.eval_tau_prompts={prompts} would decode it: set train.eval_tau_prompts=0 "
                "to train without the simulated tau"
            ) from err


def simulated_tau(
    target: nn.Module,
    head: nn.Module,
    eval_set: Dataset | None,
    prompts: int,
    new_tokens: int,
    batch_size: int = 1,
    pad_token_id: int = 0,
) -> float | None:
    """Median tau of greedy `decode.generate` with `head` on the first held-out prompts (one process),
    `batch_size` prompts decoded together (`decode.generate.decode_prompts`: the same tokens and steps).

    Each prompt is an eval row cut before its first assistant token (the head must continue a real chat).
    `head` must be whole on this process: under ZeRO-3 or FSDP pass `train.checkpoint.gather_head`'s copy.
    """
    from decode.generate import decode_prompts  # train -> decode: an allowed direction; lazy (start-up)

    if eval_set is None or prompts <= 0:
        return None
    was_training = head.training
    head.eval()
    head_dtype = next(head.parameters()).dtype
    if head_dtype != target.dtype:  # decode with the head in the target's dtype, as a user would load it
        head = copy.deepcopy(head).to(target.dtype)
    ids = []
    for row in eval_set.select(range(min(prompts, len(eval_set)))):
        first = row["loss_mask"].index(1) if 1 in row["loss_mask"] else len(row["input_ids"])
        if first:
            ids.append(torch.tensor(row["input_ids"][:first], device=target.device))
    results = decode_prompts(
        target, ids, head, max_new_tokens=new_tokens, batch_size=batch_size, pad_token_id=pad_token_id
    )
    head.train(was_training)
    return statistics.median(r.tau for r in results) if results else None
