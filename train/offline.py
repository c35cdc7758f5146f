"""Offline hidden states: run the frozen target once over the training data (batched, the shards shared among
the processes) and store, per example, only what the head needs (its tapped features and the final hidden
state, from which the target's logits are recomputed with its lm_head), as sharded safetensors in the
target's dtype. Training then reads shards instead of running the target (SpecForge/EAGLE "offline" mode):
cheaper steps, at the cost of disk."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import torch
from accelerate import Accelerator
from datasets import Dataset
from safetensors import safe_open
from safetensors.torch import save_file
from torch import Tensor, nn
from tqdm.auto import tqdm

from heads.eagle import EagleConfig
from heads.features import LAST, FeatureCapture
from heads.files import atomic_write, write_json
from train.config import TORCH_DTYPES, EagleRunConfig
from train.data import collate
from train.distributed import make_accelerator
from train.loader import load_datasets, load_frozen_target

INDEX_FILE = "index.json"
RESUME_KEYS = ("examples", "shard_size", "layer_ids", "hidden_size", "dtype", "target_digest")  # not the path


def estimate_bytes(dataset: Dataset, layer_ids: tuple[int, ...], hidden_size: int, dtype: torch.dtype) -> int:
    """Bytes the dump of `dataset` will take: tokens x (taps + final state) x H x element size (+ ids,
    masks)."""
    tokens = sum(len(ids) for ids in dataset["input_ids"])
    width = (len(layer_ids) + (LAST not in layer_ids)) * hidden_size
    return tokens * (width * torch.tensor([], dtype=dtype).element_size() + 8 + 1)


@torch.no_grad()
def dump_hidden_states(
    target: nn.Module,
    dataset: Dataset,
    layer_ids: tuple[int, ...],
    out_dir: str | Path,
    shard_size: int = 32,
    dtype: torch.dtype | None = None,
    batch_size: int = 8,
    accelerator: Accelerator | None = None,
) -> Path:
    """Write `out_dir/shard-NNNNN.safetensors` (per example i: `ids.i`, `mask.i`, `features.i`, `last.i`, each
    unpadded) and `index.json`; prints the size before writing. Finished shards are kept on rerun (resumable).

    The layout depends only on `shard_size`, never on the number of processes: shard n holds examples
    [n * shard_size, (n + 1) * shard_size). Under `accelerator`, process r writes every num_processes-th of
    the shards still missing, starting at the r-th, and checks as many of those already on disk (a resumed
    dump stays balanced). So a dump by N processes is the same dump as a 1-process one (bit for bit at one
    thread per process: each shard runs the same batches), and a dump stopped under N processes resumes
    under M.

    Args:
        target: the frozen target.
        dataset: the tokenised training set (input_ids, loss_mask), in the order training reads it.
        layer_ids: the taps the head reads (output-of-layer ids, or `LAST`).
        out_dir: where the shards and index.json go (created).
        shard_size: examples per shard; part of the layout, so a resume must use the same.
        dtype: what the states are stored in; None = the target's parameter dtype.
        batch_size: examples per target forward (right-padded; a shard's examples run longest first).
        accelerator: splits the shards among its processes; None = this process writes them all.
    Returns:
        `out_dir` as a Path, once every process has finished and index.json says "complete".
    Raises:
        ValueError: `out_dir` holds a dump written with other settings, or shards of other data.
    """
    if batch_size < 1 or shard_size < 1:
        raise ValueError(f"batch_size {batch_size} and shard_size {shard_size} must both be at least 1")
    out = Path(out_dir)
    rank, world = (accelerator.process_index, accelerator.num_processes) if accelerator else (0, 1)
    dtype = dtype or next(target.parameters()).dtype
    hidden = target.config.get_text_config().hidden_size
    index = {
        "examples": len(dataset),
        "shard_size": shard_size,
        "layer_ids": list(layer_ids),
        "shards": [f"shard-{n:05d}.safetensors" for n in range(-(-len(dataset) // shard_size))],
        "hidden_size": hidden,
        "dtype": str(dtype).removeprefix("torch."),
        "target": getattr(target.config, "_name_or_path", None),
        "target_digest": weights_digest(target),
    }
    on_disk = [(out / name).is_file() for name in index["shards"]]  # read by all before any rank writes one
    if (out / INDEX_FILE).is_file():  # resuming: kept shards must come from the same target, taps and data
        old = json.loads((out / INDEX_FILE).read_text())  # every rank checks (all raise alike, none waits)
        changed = [
            f"{key} {old[key]!r} -> {index[key]!r}"
            for key in RESUME_KEYS  # keys an older index lacks
            if key in old and old[key] != index[key]
        ]  # are not compared (their shards still are)
        if changed:
            raise ValueError(
                f"{out} holds a dump written with other settings ({'; '.join(changed)}); "
                f"write this one into an empty folder"
            )
    _barrier(accelerator)  # every rank has read the old index before the main process replaces it
    if rank == 0:
        out.mkdir(parents=True, exist_ok=True)
        size = estimate_bytes(dataset, layer_ids, hidden, dtype)
        print(
            f"offline hidden states: {len(dataset)} examples, {size / 2**20:.1f} MiB to write into {out} "
            f"({world} process(es), {batch_size} per forward)",
            flush=True,
        )
        _write_index(out, {**index, "complete": False})  # a killed dump is recognised, and resumed, as such
    _barrier(accelerator)
    taps = tuple(layer_ids) + (() if LAST in layer_ids else (LAST,))
    shards = list(enumerate(index["shards"]))
    to_check = [shard for shard, done in zip(shards, on_disk) if done][rank::world]
    to_write = [shard for shard, done in zip(shards, on_disk) if not done][rank::world]
    for number, name in to_check:  # written by an earlier run, under any number of processes
        _check_shard(out / name, dataset, _shard_examples(number, shard_size, len(dataset)))
    decoder = target.get_decoder()  # without the lm_head: the logits (B, T, V) are recomputed when training
    with FeatureCapture(target, taps) as capture:
        for number, name in tqdm(to_write, desc="dump", disable=rank != 0):
            examples = _shard_examples(number, shard_size, len(dataset))
            rows = {i: dataset[i] for i in examples}
            order = sorted(examples, key=lambda i: -len(rows[i]["input_ids"]))  # longest first: less padding
            tensors = {}
            for start in range(0, len(order), batch_size):
                chunk = order[start : start + batch_size]
                batch = collate([rows[i] for i in chunk], pad_token_id=0)  # right-padded
                # tokens' states as alone
                decoder(
                    input_ids=batch["input_ids"].to(target.device),  # causal attention leaves the real
                    attention_mask=batch["attention_mask"].to(target.device),
                )
                states = capture.features().to(dtype).cpu()  # (B, T, len(taps) * H)
                for b, i in enumerate(chunk):
                    n = len(rows[i]["input_ids"])  # each example's own rows, without the padding
                    tensors[f"ids.{i}"] = batch["input_ids"][b, :n].clone()
                    tensors[f"mask.{i}"] = torch.tensor(rows[i]["loss_mask"], dtype=torch.int8)
                    tensors[f"features.{i}"] = states[b, :n, : len(layer_ids) * hidden].clone()
                    tensors[f"last.{i}"] = states[b, :n, -hidden:].clone()
            atomic_write(out / name, lambda tmp, tensors=tensors: save_file(tensors, tmp))
    print(f"process {rank}/{world}: {len(to_write)} shard(s) written, {len(to_check)} kept", flush=True)
    _barrier(accelerator)  # "complete" only once every rank's shards are on disk
    if rank == 0:
        _write_index(out, {**index, "complete": True})
    _barrier(accelerator)
    return out


def dump_for_run(cfg: EagleRunConfig, batch_size: int = 8, shard_size: int = 32) -> Path:
    """The offline hidden states of an EAGLE run's training data, written into `cfg.data.offline_dir` by every
    process of the launch (`dump_hidden_states`), in the run's `model.dtype`, with the taps its head reads.

    Args:
        cfg: the run's EagleRunConfig (model, data, eagle sections; `data.offline_dir` set).
        batch_size: examples per target forward.
        shard_size: examples per shard file (part of the layout: a resume must use the same).
    Returns:
        The dump folder.
    Raises:
        ValueError: `data.offline_dir` is not set (before any model loads).
    """
    if not cfg.data.offline_dir:
        raise ValueError("set data.offline_dir=<folder> (where the states go)")
    accelerator = make_accelerator(cfg.train, cfg.model.dtype)
    target, tokenizer = load_frozen_target(cfg.model, accelerator)  # whole on every process, at its revision
    train_set, _ = load_datasets(cfg.data, tokenizer, accelerator)
    overrides = {"aux_layer_ids": tuple(cfg.eagle.aux_layer_ids)} if cfg.eagle.aux_layer_ids else {}
    head_config = EagleConfig.from_target(target.config, cfg.eagle.head_type, **overrides)
    layers = (LAST,) if head_config.head_type == "eagle1" else tuple(head_config.aux_layer_ids)
    out = dump_hidden_states(
        target,
        train_set,
        layers,
        cfg.data.offline_dir,
        shard_size=shard_size,
        dtype=TORCH_DTYPES[cfg.model.dtype],
        batch_size=batch_size,
        accelerator=accelerator,
    )
    accelerator.end_training()
    return out


def _barrier(accelerator: Accelerator | None) -> None:
    """Wait for every process (no-op in a single process)."""
    if accelerator is not None:
        accelerator.wait_for_everyone()


def _write_index(out: Path, index: dict) -> None:
    write_json(out / INDEX_FILE, index)


def weights_digest(model: nn.Module) -> str | None:
    """A short fingerprint of a model's weights: 4,096 values spread over each tensor, with its name and
    shape (it read the first values of the first and last three tensors only, blind to the middle layers):
    tells a fine-tuned or other revision of the same architecture apart without hashing every weight. None
    where some tensor is sharded or not materialised (ZeRO-3, FSDP, meta): the digest cannot be read."""
    digest = hashlib.sha256()
    for name, tensor in model.state_dict().items():
        if tensor.is_meta or tensor.numel() == 0 or type(tensor).__name__ == "DTensor":
            return None
        flat = tensor.detach().reshape(-1)
        digest.update(f"{name}{tuple(tensor.shape)}".encode())
        sample = flat[:: max(1, flat.numel() // 4096)][:4096]  # rounded to bf16: a bf16 copy reads the same
        digest.update(sample.to(torch.bfloat16).float().cpu().numpy().tobytes())
    return digest.hexdigest()[:16]


def _shard_examples(number: int, shard_size: int, total: int) -> range:
    """Indices of the examples shard `number` holds."""
    return range(number * shard_size, min((number + 1) * shard_size, total))


def _check_shard(path: Path, dataset: Dataset, indices: range) -> None:
    """Raise unless the shard at `path` holds exactly the token ids of `dataset[indices]` (a dump written from
    other data, or with other settings, must never be trained on in silence)."""
    with safe_open(path, framework="pt") as tensors:
        keys = set(tensors.keys())
        for i in indices:
            if f"ids.{i}" not in keys:
                raise ValueError(
                    f"{path}: example {i} is missing; the dump was written from other data "
                    f"settings (write it again into an empty folder)"
                )
            stored, expected = tensors.get_tensor(f"ids.{i}").tolist(), list(dataset[i]["input_ids"])
            if stored != expected:
                where = next(
                    (t for t, (a, b) in enumerate(zip(stored, expected)) if a != b),
                    min(len(stored), len(expected)),
                )
                raise ValueError(
                    f"{path}: example {i} holds other tokens than the training set's "
                    f"({len(stored)} vs {len(expected)} tokens, first difference at token "
                    f"{where}); the dump was written from other data or settings: write it "
                    f"again into an empty folder"
                )


class OfflineStates:
    """Reads a dump; checks it holds the taps the head needs. Rows come back as the recipe's batches do.
    Every dump holds the final state, so `layer_ids=None` (Medusa) and `(LAST,)` (EAGLE-1, whose feature is
    that state) accept any dump, e.g. one written for EAGLE-3's taps."""

    def __init__(
        self, out_dir: str | Path, layer_ids: tuple[int, ...] | None, softcap: float | None = None
    ) -> None:
        self.root, self.softcap = Path(out_dir), softcap
        index_file = self.root / INDEX_FILE
        if not index_file.is_file():
            raise FileNotFoundError(
                f"{index_file}: no offline hidden states here; write them with scripts/dump_hidden_states.py"
            )
        self.index = json.loads(index_file.read_text())
        if self.index.get("complete") is False:
            raise ValueError(
                f"{self.root}: the dump was stopped before it finished; rerun "
                f"scripts/dump_hidden_states.py with the same settings to complete it"
            )
        self.features_are_last = layer_ids is not None and tuple(layer_ids) == (LAST,)
        stored_taps = tuple(self.index["layer_ids"])
        if layer_ids is not None and not self.features_are_last and stored_taps != tuple(layer_ids):
            raise ValueError(f"{self.root} holds taps {list(stored_taps)}, the head needs {list(layer_ids)}")

    def __len__(self) -> int:
        return self.index["examples"]

    def check_target(self, target: nn.Module | None) -> None:
        """Raise where the dump was written from another target than `target` (the weights' digest differs:
        another model or revision of the same tokenizer, whose states the head would learn beside this
        target's lm_head). Not checked where either digest cannot be read (sharded weights, an old dump)."""
        recorded = self.index.get("target_digest")
        ours = weights_digest(target) if target is not None and recorded else None
        if ours is not None and ours != recorded:
            raise ValueError(
                f"{self.root}: written from another target ({self.index.get('target')!r}, weights digest "
                f"{recorded}) than this run's ({getattr(target.config, '_name_or_path', None)!r}, {ours}; "
                "dumps written before selfspec read every layer for it differ too): dump again into an "
                "empty folder"
            )

    def check_matches(self, dataset: Dataset) -> None:
        """Raise unless the dump holds `dataset`'s examples, token for token, in order."""
        if len(self) != len(dataset):
            raise ValueError(
                f"{self.root} holds {len(self)} examples but the training set has "
                f"{len(dataset)}: rerun scripts/dump_hidden_states.py with this run's data "
                f"settings"
            )
        for number, name in enumerate(self.index["shards"]):
            examples = _shard_examples(number, self.index["shard_size"], len(dataset))
            _check_shard(self.root / name, dataset, examples)

    def row(self, i: int) -> dict[str, Tensor]:
        shard = self.root / self.index["shards"][i // self.index["shard_size"]]
        with safe_open(shard, framework="pt") as tensors:  # memory-mapped: reads only this row's tensors
            row = {k: tensors.get_tensor(f"{k}.{i}") for k in ("ids", "mask", "last")}
            row["features"] = row["last"] if self.features_are_last else tensors.get_tensor(f"features.{i}")
        return row

    def batch(
        self,
        indices: list[int],
        pad_id: int,
        lm_head: nn.Module | None,
        loss_masks: list[list[int]] | None = None,
    ) -> dict[str, Tensor]:
        """Right-padded batch with `features` (B, T, F) and the target's `logits` (B, T, V) from `last`;
        without `lm_head`, the final states themselves as `last` (B, T, H) instead of logits. `loss_masks`
        (the training set's) replace the masks stored in the dump: a masking change needs no new dump.

        `features` and `last` come as float32 whatever the dump's dtype: they are the input of the trainable
        head, which is float32 (autocast lowers it where a half-precision run enables it), so a bf16 dump also
        trains a float32 run. `logits` come in the lm_head's dtype, as the online target pass gives them (the
        losses read them in float32; a second float32 (B, T, V) copy is not worth holding)."""
        rows = [self.row(i) for i in indices]
        for row, mask in zip(rows, loss_masks or ()):
            row["mask"] = torch.tensor(mask, dtype=torch.int8)
        length = max(r["ids"].numel() for r in rows)
        out = {
            "input_ids": torch.full((len(rows), length), pad_id, dtype=torch.long),
            "attention_mask": torch.zeros(len(rows), length, dtype=torch.long),
            "loss_mask": torch.zeros(len(rows), length, dtype=torch.long),
        }
        features = torch.zeros(len(rows), length, rows[0]["features"].shape[-1])  # (B, T, F) float32
        last = torch.zeros(len(rows), length, rows[0]["last"].shape[-1])  # (B, T, H) float32
        for b, r in enumerate(rows):
            n = r["ids"].numel()
            out["input_ids"][b, :n], out["attention_mask"][b, :n] = r["ids"], 1
            out["loss_mask"][b, :n] = r["mask"].long()
            features[b, :n], last[b, :n] = r["features"], r["last"]
        if lm_head is None:
            out["last"] = last
            return out
        weight = lm_head.weight
        with torch.no_grad():  # a bf16 dump read by a bf16 target: the bf16 -> float32 -> bf16 trip is exact
            logits = lm_head(last.to(device=weight.device, dtype=weight.dtype))
            if self.softcap:  # Gemma-2 style final logit soft-capping, as the target's forward applies it
                logits = torch.tanh(logits / self.softcap) * self.softcap
            out["logits"] = logits
        out["features"] = features.to(weight.device)
        return out


def offline_rows(
    data,
    train_set: Dataset,
    pad_id: int,
    layer_ids: tuple[int, ...] | None,
    lm_head: nn.Module | None,
    softcap: float | None = None,
    target: nn.Module | None = None,
):
    """(rows to shuffle and shard, collate_fn) for a recipe: the tokenised set itself online (collate_fn
    None); offline, example indices into the dump of `data.offline_dir`, whose batches `OfflineStates.batch`
    builds.

    Args:
        data: the run's DataConfig (hidden_states, offline_dir).
        train_set: the tokenised training set the dump was written from (sizes must agree).
        pad_id: padding token id.
        layer_ids: taps the head needs (EAGLE), or None for the final state only (Medusa).
        lm_head: the target's lm_head to recompute its logits (EAGLE), or None to pass the final states
            (Medusa).
        softcap: the target's final logit soft-capping, if any.
        target: the target the run trains on: a dump of another one's states is refused
            (`OfflineStates.check_target`).
    """
    if data.hidden_states == "online":
        return train_set, None
    states = OfflineStates(data.offline_dir, layer_ids, softcap=softcap)
    states.check_matches(train_set)
    states.check_target(target)
    rows = Dataset.from_dict({"index": list(range(len(train_set))), "loss_mask": train_set["loss_mask"]})
    return rows, lambda batch: states.batch(
        [row["index"] for row in batch], pad_id, lm_head, [row["loss_mask"] for row in batch]
    )
