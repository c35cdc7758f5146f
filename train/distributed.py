"""How a run spreads over processes: the accelerator for CPU/GPU, DDP, DeepSpeed and FSDP2, FSDP2's shard
units, the precision DeepSpeed needs, and what must stay whole on every rank (a frozen target, the weights
read on the main process alone)."""

from __future__ import annotations

import os
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager

import torch
from accelerate import Accelerator
from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin, InitProcessGroupKwargs
from torch import nn

from train.config import HALF_PRECISIONS, TORCH_DTYPES, ModelConfig, TrainConfig


def native_cpu_bf16() -> bool:
    """Whether this CPU computes bf16 matmuls in oneDNN kernels (AVX512 with BF16 or emulated in AVX512 vector
    units, AMX). Without them (AVX2: AMD Zen 3 and older, most laptops) torch falls back to a reference bf16
    path: a 2048 x 576 by 576 x 1536 product took 3.1 s against 31 ms in fp32 on an AVX2 AMD EPYC."""
    try:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):  # a build without oneDNN
        return False


def resolve_cpu_precision(train: TrainConfig, model_dtype: str, deepspeed: bool) -> str | None:
    """Apply `train.cpu_bf16`: on a CPU-only machine without native bf16, `mixed_precision=bf16` over an
    fp32 target (not under DeepSpeed, which casts the head itself) becomes "no" in `train` (so the run's
    config.yaml records what ran). Returns the warning to print, or None when nothing is amiss."""
    if train.mixed_precision != "bf16" or torch.cuda.is_available() or native_cpu_bf16():
        return None
    capability = torch.backends.cpu.get_cpu_capability()
    slow = (
        f"this CPU ({capability}) has no bf16 kernels: bf16 matmuls run on a reference path, about 100x "
        f"slower than fp32"
    )
    if train.cpu_bf16 == "always" or deepspeed or model_dtype != "float32":
        other = "DeepSpeed" if deepspeed else f"model.dtype={model_dtype}"
        why = "train.cpu_bf16=always" if train.cpu_bf16 == "always" else other
        return f"WARNING: train.mixed_precision=bf16 kept ({why}), but {slow}"
    train.mixed_precision = "no"
    return (
        f"WARNING: train.mixed_precision=bf16 -> no: {slow}; the run computes in fp32 (config.yaml records "
        f"it). Set train.cpu_bf16=always to keep bf16 anyway"
    )


def make_accelerator(train: TrainConfig, model_dtype: str = "float32") -> Accelerator:
    """Accelerator for this machine: CPU processes join over gloo; DeepSpeed keeps its engine on CPU too.

    `cpu=True` is what makes 2 CUDA-less processes form one DDP group, but it silently drops DeepSpeed, which
    instead needs the gloo process-group backend (docs/design.md, accelerate on a machine without CUDA). Mixed
    precision is autocast over fp32 trainable weights (accelerate's `mixed_precision`); fp16 needs CUDA for
    its grad scaler. bf16 on a CPU without bf16 kernels: `resolve_cpu_precision` (`train.cpu_bf16`).

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
    warning = resolve_cpu_precision(train, model_dtype, deepspeed)
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
    if warning:
        accelerator.print(warning)
    fsdp_asked = os.environ.get("ACCELERATE_USE_FSDP", "false").lower() == "true"
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

    half = TORCH_DTYPES[HALF_PRECISIONS[mixed_precision]]
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
    half = HALF_PRECISIONS.get(accelerator.mixed_precision)
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
