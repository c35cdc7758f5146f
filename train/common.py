"""Pieces both recipes use: the accelerator for CPU/GPU/DeepSpeed/FSDP2, the frozen target, the datasets, the
per-epoch batches, the optimizer schedule, the NaN guard and the periodic simulated-tau evaluation. Plain
functions, no framework."""

from __future__ import annotations

import contextlib
import copy
import glob
import math
import os
import statistics
import time
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
from accelerate import Accelerator
from accelerate.state import PartialState
from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin, InitProcessGroupKwargs
from datasets import Dataset
from torch import nn
from torch.utils.data import DataLoader
from transformers import get_scheduler

from heads.target import load_target
from train.checkpoint import latest_state, load_state, saved_processes
from train.config import TORCH_DTYPES, DataConfig, ModelConfig, TrainConfig, save_config, to_dict
from train.data import build_dataset, collate, split_eval

# TEST-ONLY switch (tests/train/test_fsdp.py): accelerate 1.15 never selects FSDP without a GPU-like device,
# so on CPU processes launched with configs/accelerate/fsdp2.yaml it builds a gloo MULTI_CPU group. With this
# set to 1, make_accelerator then flips that group to accelerate's FSDP2 path (plugin from the launch config's
# FSDP_* variables) before anything is prepared. What it bypasses: only accelerate's choice of the distributed
# type; sharding, state dicts and resume states are accelerate's and torch's own FSDP2 code. GPU runs never
# need it (there accelerate picks FSDP from the same config by itself).
FSDP_ON_CPU_ENV = "SELFSPEC_TEST_FSDP_ON_CPU"


def make_accelerator(train: TrainConfig) -> Accelerator:
    """Accelerator for this machine: CPU processes join over gloo; DeepSpeed keeps its engine on CPU too.

    `cpu=True` is what makes 2 CUDA-less processes form one DDP group, but it silently drops DeepSpeed,
    which instead needs the gloo process-group backend (REFERENCE section 6). Mixed precision is autocast
    over fp32 trainable weights (accelerate's `mixed_precision`); fp16 needs CUDA for its grad scaler.

    Raises:
        ValueError: `train.mixed_precision=fp16` without CUDA (accelerate would silently train in fp32).
    """
    if train.mixed_precision == "fp16" and not torch.cuda.is_available():
        raise ValueError(
            "train.mixed_precision=fp16 needs a CUDA device: fp16 autocast and its gradient scaler "
            "do not run on the CPU (accelerate would silently train in float32); use bf16 or no"
        )
    if train.report_to == "wandb" and not os.environ.get("WANDB_API_KEY") and "WANDB_MODE" not in os.environ:
        os.environ["WANDB_MODE"] = "offline"  # no key: log locally instead of raising
    deepspeed = os.environ.get("ACCELERATE_USE_DEEPSPEED", "false").lower() == "true"
    kwargs = {
        "gradient_accumulation_steps": train.gradient_accumulation_steps,
        "mixed_precision": train.mixed_precision,
        "log_with": None if train.report_to == "none" else train.report_to,
        "project_dir": train.output_dir,
    }
    if not torch.cuda.is_available():
        if deepspeed:
            kwargs["kwargs_handlers"] = [InitProcessGroupKwargs(backend="gloo")]
        else:
            kwargs["cpu"] = True
    accelerator = Accelerator(**kwargs)
    fsdp_asked = os.environ.get("ACCELERATE_USE_FSDP", "false").lower() == "true"
    if os.environ.get(FSDP_ON_CPU_ENV) == "1" and accelerator.distributed_type == DistributedType.MULTI_CPU:
        accelerator.state.distributed_type = DistributedType.FSDP  # see FSDP_ON_CPU_ENV: test-only
        PartialState().distributed_type = DistributedType.FSDP
        accelerator.state.fsdp_plugin = FullyShardedDataParallelPlugin()
    if accelerator.distributed_type == DistributedType.FSDP and train.mixed_precision != "no":
        _fsdp2_fp32_reduction(accelerator.state.fsdp_plugin, train.mixed_precision)
    elif fsdp_asked and accelerator.distributed_type != DistributedType.FSDP:
        accelerator.print(
            f"WARNING: the accelerate config asks for FSDP, but without a GPU accelerate runs "
            f"{accelerator.distributed_type} instead: nothing is sharded"
        )
    if accelerator.distributed_type == DistributedType.DEEPSPEED:
        ds = accelerator.state.deepspeed_plugin.deepspeed_config
        ds["gradient_clipping"] = train.max_grad_norm  # "auto" would become 1.0, not our value
        ds["train_micro_batch_size_per_gpu"] = train.per_device_batch_size
        ds["gradient_accumulation_steps"] = train.gradient_accumulation_steps
        ds["train_batch_size"] = (
            train.per_device_batch_size * train.gradient_accumulation_steps * accelerator.num_processes
        )
    return accelerator


def _fsdp2_fp32_reduction(plugin: FullyShardedDataParallelPlugin, mixed_precision: str) -> None:
    """FSDP2 computes in half precision (sharded fp32 weights gathered as bf16/fp16) but reduce-scatters and
    accumulates gradients in fp32, as DDP does; accelerate's default policy would do both in half
    precision."""
    if plugin.fsdp_version != 2:
        return
    from torch.distributed.fsdp import MixedPrecisionPolicy

    half = {"bf16": torch.bfloat16, "fp16": torch.float16}[mixed_precision]
    plugin.mixed_precision_policy = MixedPrecisionPolicy(param_dtype=half, reduce_dtype=torch.float32)


def shard_fsdp2_units(
    accelerator: Accelerator, module: nn.Module, called_by_method: tuple[nn.Module, ...] = ()
) -> list[str]:
    """Under FSDP2 with size-based wrapping, give each submodule over `fsdp_min_num_params` its own shard
    unit, before `accelerator.prepare` (which then shards only the root, holding the rest).

    accelerate's own pass would also pick containers (an `nn.ModuleList` of heads or decoder layers: no
    `forward`, which `fully_shard` refuses) and split a tied embedding / lm_head across two units (which torch
    refuses). Here containers are skipped and a module holding a shared parameter stays in its parent's unit.
    FSDP gathers a unit's weights in hooks around its `forward`, so modules used through other methods
    (`called_by_method`: the heads, whose losses call `project_features`, `logits`, `head_logits`) never
    become units themselves (their submodules, called as modules, may).

    Returns:
        The names of the submodules given a unit (none outside FSDP2 size-based wrapping).
    """
    if accelerator.distributed_type != DistributedType.FSDP:
        return []
    plugin = accelerator.state.fsdp_plugin
    policy = getattr(plugin.auto_wrap_policy, "func", plugin.auto_wrap_policy)
    if plugin.fsdp_version != 2 or getattr(policy, "__name__", None) != "size_based_auto_wrap_policy":
        return []  # transformer-class wrapping (named classes) is accelerate's own and safe
    from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

    uses = Counter(id(p) for _, p in module.named_parameters(remove_duplicate=False))
    kwargs = {
        "reshard_after_forward": plugin.reshard_after_forward,
        "offload_policy": plugin.cpu_offload,
        "mp_policy": plugin.mixed_precision_policy or MixedPrecisionPolicy(),
    }
    in_unit, names = set(), []
    for name, sub in reversed(list(module.named_modules())[1:]):  # children before their parents
        params = list(sub.parameters())
        if (
            type(sub).forward is nn.Module.forward
            or isinstance(sub, FSDPModule)
            or any(sub is m for m in called_by_method)
            or any(uses[id(p)] > 1 for p in params)
        ):
            continue
        if sum(p.numel() for p in params if id(p) not in in_unit) > plugin.min_num_params:
            fully_shard(sub, **kwargs)
            in_unit |= {id(p) for p in sub.parameters()}  # the sharded parameters replace the old ones
            names.append(name)
    plugin.auto_wrap_policy = None  # done: accelerate shards the root alone
    accelerator.print(
        f"FSDP2: {len(names)} shard unit(s) over {plugin.min_num_params} parameters "
        f"({', '.join(names[:4])}{', ...' if len(names) > 4 else ''}) plus the root"
    )
    return names


def check_deepspeed_precision(accelerator: Accelerator, model: ModelConfig) -> None:
    """Under DeepSpeed, bf16/fp16 means the engine casts the trained module to that dtype and runs no
    autocast, so the frozen target (its embedding, its lm_head) must be stored in the same dtype.

    Raises:
        ValueError: DeepSpeed with half precision and a target of another dtype.
    """
    half = {"bf16": "bfloat16", "fp16": "float16"}.get(accelerator.mixed_precision)
    if accelerator.distributed_type == DistributedType.DEEPSPEED and half and model.dtype != half:
        raise ValueError(
            f"under DeepSpeed, train.mixed_precision={accelerator.mixed_precision} casts the head to "
            f"{half} with no autocast, so the frozen target must be {half} too: set "
            f"model.dtype={half} (got {model.dtype})"
        )


def shards_trained_weights(accelerator: Accelerator) -> bool:
    """True when no rank holds the trained module's whole weights (ZeRO-3, FSDP): anything that runs it on
    one process alone must use a gathered copy (`train.checkpoint.gather_head`)."""
    if accelerator.distributed_type == DistributedType.FSDP:
        return True
    return (
        accelerator.distributed_type == DistributedType.DEEPSPEED
        and accelerator.state.deepspeed_plugin.zero_stage == 3
    )


@contextmanager
def whole_parameters(params: list[nn.Parameter]) -> Iterator[list[torch.Tensor]]:
    """The parameters whole inside the block, also when ZeRO-3 initialisation partitioned them (a target
    loaded into the trained module, as Medusa-2's); read-only. Elsewhere they are whole already."""
    if not any(hasattr(p, "ds_id") for p in params):
        yield list(params)
        return
    import deepspeed  # lazy: only ZeRO-3 runs get here

    with deepspeed.zero.GatheredParameters(params, modifier_rank=None):
        yield list(params)


def load_frozen_target(model: ModelConfig, accelerator: Accelerator, whole: bool = True):
    """The target and tokenizer as `model` says (dtype, attention, hub revision), loaded straight onto this
    rank's device. `whole`: keep it unsharded on every rank even under ZeRO-3 (a frozen target is replicated;
    Medusa-2's LoRA-adapted target instead joins the trained module and may be sharded)."""
    with whole_on_every_rank(accelerator) if whole else contextlib.nullcontext():
        return load_target(
            model.target,
            dtype=TORCH_DTYPES[model.dtype],
            attn_implementation=model.attn_implementation,
            device=accelerator.device,
            revision=model.revision,
        )


@contextmanager
def whole_on_every_rank(accelerator: Accelerator) -> Iterator[None]:
    """Load the frozen target unsharded inside this block, also under ZeRO-3.

    Under ZeRO-3 accelerate registers its DeepSpeed config with transformers even with zero3_init_flag false,
    and `from_pretrained` then partitions every weight (zero.Init). The target never becomes a DeepSpeed
    engine, so its weights would stay empty tensors on every rank (IndexError at the first lookup).
    """
    deepspeed = accelerator.distributed_type == DistributedType.DEEPSPEED
    plugin = accelerator.state.deepspeed_plugin if deepspeed else None
    if plugin is None or plugin.zero_stage != 3:
        yield
        return
    from transformers.integrations import unset_hf_deepspeed_config  # lazy: only DeepSpeed runs need it

    unset_hf_deepspeed_config()
    try:
        yield
    finally:
        plugin.set_deepspeed_weakref()  # restore it: later HF calls see ZeRO-3 again


def expand_files(patterns: list[str]) -> list[str]:
    """Files named by paths or glob patterns (e.g. data/smollm2/regen/*.jsonl), sorted per pattern."""
    files = []
    for pattern in patterns:
        matches = sorted(glob.glob(pattern)) if glob.has_magic(pattern) else [pattern]
        if not matches:
            raise FileNotFoundError(f"data file pattern {pattern!r} matches no file")
        files += matches
    return files


def load_datasets(data: DataConfig, tokenizer, accelerator: Accelerator) -> tuple[Dataset, Dataset | None]:
    """(train, eval) datasets, rendered with the target's chat template and masked to assistant tokens."""
    with accelerator.main_process_first():
        train_set, report = build_dataset(
            expand_files(data.train_files), tokenizer, data.max_length, data.max_bad_fraction
        )
        accelerator.print(f"train data: {report}")
        eval_set = None
        if data.eval_files:
            eval_set, eval_report = build_dataset(
                expand_files(data.eval_files), tokenizer, data.max_length, data.max_bad_fraction
            )
            accelerator.print(f"eval data: {eval_report}")
        elif data.eval_fraction > 0:
            train_set, eval_set = split_eval(train_set, data.eval_fraction, data.shuffle_seed)
    if len(train_set) == 0:
        raise ValueError(f"no usable training rows in {data.train_files}")
    return train_set, eval_set


def steps_per_epoch(dataset: Dataset, train: TrainConfig, num_processes: int) -> int:
    """Optimizer steps in one pass over `dataset` (the last partial global batch is dropped)."""
    global_batch = train.per_device_batch_size * train.gradient_accumulation_steps * num_processes
    steps = len(dataset) // global_batch
    if steps == 0:
        raise ValueError(f"{len(dataset)} training rows are fewer than one global batch of {global_batch}")
    return steps


def epoch_loader(
    dataset: Dataset,
    train: TrainConfig,
    data: DataConfig,
    epoch: int,
    pad_id: int,
    accelerator: Accelerator,
    skip_batches: int = 0,
    collate_fn=None,
) -> DataLoader:
    """This epoch's batches: a seeded shuffle (same order on every rank and on resume), sharded by accelerate.
    `collate_fn` replaces the default padding collate (offline hidden states build their own batches)."""
    ordered = dataset.shuffle(seed=data.shuffle_seed + epoch)
    # Its own generator: each new iterator draws a base seed from `generator`, by default the global RNG,
    # and a resumed run starts one more iterator than an uninterrupted one: its noise would differ after it.
    loader = DataLoader(
        ordered,
        batch_size=train.per_device_batch_size,
        shuffle=False,
        drop_last=True,
        collate_fn=collate_fn or (lambda rows: collate(rows, pad_id)),
        generator=torch.Generator().manual_seed(data.shuffle_seed + epoch),
    )
    loader = accelerator.prepare_data_loader(loader)
    return accelerator.skip_first_batches(loader, skip_batches) if skip_batches else loader


def total_steps(train: TrainConfig, per_epoch: int) -> int:
    return train.max_steps if train.max_steps > 0 else per_epoch * train.num_epochs


class StepLogger:
    """Per-optimizer-step logging shared by the recipes: loss, lr, grad norm, tokens/s and the loss metrics
    (per-head / per-TTT-step top-1), to the progress bar and to `accelerator.log` every `every` steps."""

    def __init__(self, accelerator: Accelerator, progress, every: int) -> None:
        self.accelerator, self.progress, self.every = accelerator, progress, every
        self.tokens, self.started = 0, time.perf_counter()

    def count(self, batch: dict) -> None:
        self.tokens += int(batch["attention_mask"].sum())

    def step(self, step: int, last: bool, loss: torch.Tensor, lr: float, grad_norm, metrics: dict) -> None:
        self.progress.update()
        if step % self.every and not last:
            return
        elapsed = time.perf_counter() - self.started
        tokens = self.accelerator.gather(torch.tensor([self.tokens], device=loss.device)).sum().item()
        logs = {
            "loss": loss.item(),
            "lr": lr,
            "tokens_per_s": tokens / max(elapsed, 1e-9),
            **({"grad_norm": float(grad_norm)} if grad_norm is not None else {}),
            **{k: v.item() for k, v in metrics.items()},
        }
        self.progress.set_postfix(loss=f"{logs['loss']:.3f}", lr=f"{lr:.2e}")
        self.accelerator.log(logs, step=step)
        self.tokens, self.started = 0, time.perf_counter()


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


def _flat_config(tree: dict, prefix: str = "") -> dict:
    """{"train": {"seed": 0}} -> {"train.seed": 0}; lists and None become strings."""
    flat = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            flat.update(_flat_config(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value if isinstance(value, (int, float, str, bool)) else str(value)
    return flat


def start_or_resume(accelerator: Accelerator, cfg, output_dir: Path, num_steps: int) -> int:
    """Save the resolved config, start the trackers, and load the newest resume state if there is one.

    Returns:
        The optimizer step to start from (0 for a fresh run).
    """
    state = latest_state(output_dir)
    # before config.yaml is overwritten: it holds the settings the state was written with
    if state is not None:
        check_resume_settings(accelerator, cfg, output_dir, state)
    if accelerator.is_main_process:
        output_dir.mkdir(parents=True, exist_ok=True)
        save_config(cfg, output_dir / "config.yaml")
    if cfg.train.report_to != "none":  # trackers take flat scalar hyperparameters (tensorboard rejects lists)
        accelerator.init_trackers(output_dir.name, config=_flat_config(to_dict(cfg)))
    if state is None:
        return 0
    step = load_state(accelerator, state)
    accelerator.print(f"resumed from {state} at step {step}/{num_steps}")
    return step


# Settings that fix which examples each step sees: a resumed run that changes them would skip or repeat data.
DATA_ORDER_KEYS = (
    "data.train_files",
    "data.eval_files",
    "data.max_length",
    "data.eval_fraction",
    "data.shuffle_seed",
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


def check_resume_settings(accelerator: Accelerator, cfg, output_dir: Path, state: Path) -> None:
    """Refuse to resume `state` with another data order (files, split, batch size, processes, seed); warn
    when the schedule changes. The state's settings are the run folder's config.yaml and the process count
    its progress file records (states written before it was recorded are not checked for it)."""
    import yaml

    saved_file = output_dir / "config.yaml"
    if not saved_file.is_file():
        return
    saved, now = _flat_config(yaml.safe_load(saved_file.read_text()) or {}), _flat_config(to_dict(cfg))
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
    if changes:
        listed = "; ".join(f"{k}: {a!r} -> {b!r}" for k, (a, b) in changes.items())
        accelerator.print(
            f"WARNING: resuming {state.name} with another schedule ({listed}): the learning rate "
            f"follows the new schedule from step {state.name.split('-')[1]} on"
        )


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
    for i, batch in enumerate(epoch_loader(eval_set, cfg.train, cfg.data, 0, pad_id, accelerator)):
        if i >= max_batches:
            break
        losses.append(loss_fn(batch).detach().float())
    if not losses:
        return None
    return accelerator.gather(torch.stack(losses).mean()[None]).mean().item()


@torch.no_grad()
def simulated_tau(
    target: nn.Module, head: nn.Module, eval_set: Dataset | None, prompts: int, new_tokens: int
) -> float | None:
    """Median tau of greedy `decode.generate` with `head` on the first held-out prompts (one process).

    Each prompt is an eval row cut before its first assistant token (the head must continue a real chat).
    `head` must be whole on this process: under ZeRO-3 or FSDP pass `train.checkpoint.gather_head`'s copy.
    """
    from decode import generate  # train -> decode is an allowed import direction; lazy to keep start-up light

    if eval_set is None or prompts <= 0:
        return None
    was_training = head.training
    head.eval()
    head_dtype = next(head.parameters()).dtype
    if head_dtype != target.dtype:  # decode with the head in the target's dtype, as a user would load it
        head = copy.deepcopy(head).to(target.dtype)
    taus = []
    for row in eval_set.select(range(min(prompts, len(eval_set)))):
        first = row["loss_mask"].index(1) if 1 in row["loss_mask"] else len(row["input_ids"])
        ids = torch.tensor(row["input_ids"][:first], device=target.device)
        if ids.numel():
            taus.append(generate(target, ids, head, max_new_tokens=new_tokens).tau)
    head.train(was_training)
    return statistics.median(taus) if taus else None
