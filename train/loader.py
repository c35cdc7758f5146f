"""What a run loads: the target (whole on every rank unless it trains), the train and eval sets, and each
epoch's batches in a seeded order that a resumed run repeats."""

from __future__ import annotations

import contextlib
import glob
import hashlib
from pathlib import Path

import pyarrow as pa
import torch
from accelerate import Accelerator
from datasets import Dataset
from torch.utils.data import DataLoader

from decode.layout import onednn_linears
from targets import load_target
from train.config import TORCH_DTYPES, DataConfig, ModelConfig, TrainConfig
from train.data import build_dataset, collate, length_grouped_order, split_eval
from train.distributed import whole_on_every_rank


def rows_digest(rows: Dataset) -> str:
    """A digest of the training rows as a run reads them: their count, order and every value of every column
    (a resume checks it: a shard added under a glob, rows appended to a file or a file rewritten would skip
    or repeat examples, move rows between the training and held-out slices, or, for DFlash and P-EAGLE,
    change the mask token drawn from the data's token counts, while every setting still read the same)."""
    table = rows.with_format("arrow")[:]
    digest = hashlib.sha256(f"{len(rows)} rows".encode())
    for name in sorted(table.column_names):
        column = table.column(name).combine_chunks()
        digest.update(f"|{name}:{column.type}|".encode())
        if pa.types.is_list(column.type) or pa.types.is_large_list(column.type):
            digest.update(column.value_lengths().fill_null(-1).to_numpy(zero_copy_only=False).tobytes())
            digest.update(column.flatten().to_numpy(zero_copy_only=False).tobytes())
        else:
            digest.update(repr(column.to_pylist()).encode())
    return digest.hexdigest()[:16]


def load_frozen_target(model: ModelConfig, accelerator: Accelerator, whole: bool = True):
    """The target and tokenizer as `model` says (dtype, attention, hub revision), loaded straight onto this
    rank's device. `whole`: keep it unsharded on every rank even under ZeRO-3 (a frozen target is replicated;
    Medusa-2's LoRA-adapted target instead joins the trained module and may be sharded).

    A whole fp32 target on a CPU gets oneDNN's reordered weights (`decode.layout.onednn_linears`): its
    no-grad forwards (online features, the offline dump, simulated tau) get cheaper on CPUs where MKL's fp32
    sgemm is slow, at every row count, training's long batches included (measured: docs/cpu.md, oneDNN
    weights in training). Passes
    that autograd records (a shared lm_head under a trained head) run `F.linear` as before, and so do passes
    under bf16 autocast (online features of a `mixed_precision: bf16` run use autocast's bf16 kernels; the
    copies, as much memory again as the target's Linear weights, then serve simulated tau only)."""
    with whole_on_every_rank(accelerator) if whole else contextlib.nullcontext():
        target, tokenizer = load_target(
            model.target,
            dtype=TORCH_DTYPES[model.dtype],
            attn_implementation=model.attn_implementation,
            device=accelerator.device,
            revision=model.revision,
        )
    if whole and target.device.type == "cpu" and target.dtype == torch.float32:
        onednn_linears(target)
    return target, tokenizer


def expand_files(patterns: list[str]) -> list[str]:
    """Files named by paths or glob patterns (e.g. data/smollm2/regen/*.jsonl), sorted per pattern."""
    files, named = [], {}  # resolved path -> the pattern that named it first
    for pattern in patterns:
        matches = sorted(glob.glob(pattern)) if glob.has_magic(pattern) else [pattern]
        if not matches:
            raise FileNotFoundError(f"data file pattern {pattern!r} matches no file")
        for match in matches:
            key = str(Path(match).resolve())
            if key in named:  # read twice, its rows would count twice (and may sit on both sides of a split)
                raise ValueError(f"data file {match} is named twice: by {named[key]!r} and by {pattern!r}")
            named[key] = pattern
        files += matches
    return files


def load_datasets(data: DataConfig, tokenizer, accelerator: Accelerator) -> tuple[Dataset, Dataset | None]:
    """(train, eval) datasets, rendered with the target's chat template and masked to assistant tokens."""
    train_files, eval_files = expand_files(data.train_files), expand_files(data.eval_files)
    both = {str(Path(f).resolve()) for f in train_files} & {str(Path(f).resolve()) for f in eval_files}
    if both:  # the eval loss would be measured on rows the head trains on
        raise ValueError(f"data.eval_files and data.train_files both name {sorted(both)}")
    rows = (tokenizer, data.max_length, data.max_bad_fraction, data.trim_loops, data.sources)
    with accelerator.main_process_first():
        train_set, report = build_dataset(train_files, *rows)
        accelerator.print(f"train data: {report}")
        eval_set = None
        if eval_files:
            eval_set, eval_report = build_dataset(eval_files, *rows)
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


def total_steps(train: TrainConfig, per_epoch: int) -> int:
    """Optimizer steps of the whole run: `train.max_steps`, or `train.num_epochs` epochs of `per_epoch`."""
    return train.max_steps if train.max_steps > 0 else per_epoch * train.num_epochs


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
    if data.group_by_length:  # global batches of similar lengths: each rank's batch is a slice of one
        lengths = [len(mask) for mask in ordered["loss_mask"]]
        global_batch = train.per_device_batch_size * accelerator.num_processes
        ordered = ordered.select(length_grouped_order(lengths, global_batch, data.shuffle_seed + epoch))
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
