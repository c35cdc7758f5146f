"""Head checkpoints: `config.json` + `model.safetensors` with head weights only (docs/design.md, Checkpoints).

Never pickled. Loading checks the head against the target it will draft for and names both values on a
mismatch, because a head for another target decodes garbage without any error.
"""

from __future__ import annotations

import dataclasses
import json
import secrets
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file, save_file
from torch import nn

from heads.eagle import EagleHead
from heads.files import atomic_write, write_json
from heads.medusa import MedusaHeads
from heads.registry import kind_for_head_type
from heads.typed import ConfigError, build_dataclass, misspelt

FORMAT_VERSION = 1
# the top-level config.json keys that saving writes and loading reads (the others are notes)
READ_KEYS = frozenset({
    "head_type", "format_version", "base_model", "base_revision", "hidden_size", "vocab_size", "head_config",
    "base_model_type", "base_num_hidden_layers", "save_id",
})  # fmt: skip
SAVE_ID = "save_id"  # in config.json and the weights' metadata: which save wrote each (`save_heads`)
CONFIG_NAME = "config.json"
WEIGHTS_NAME = "model.safetensors"
Head = MedusaHeads | EagleHead


def build_head(head_type: str, head_config: dict, source: str = "head_config") -> Head:
    """A fresh head from its type and config dict, whose keys and types are checked first (an unknown or
    missing key, or `"576"` for an int, fails naming the key and `source`)."""
    if not isinstance(head_config, dict):
        raise ConfigError(f"{source}: head_config must be a mapping, got {type(head_config).__name__}")
    where = lambda key: source
    try:
        kind = kind_for_head_type(head_type)  # the registry: module class and config of each head type
    except ValueError as error:
        raise ConfigError(f"{source}: {error}") from None
    config_class = kind.part("config")
    raw = head_config
    if "head_type" in {f.name for f in dataclasses.fields(config_class)}:  # a config covering several types
        if head_config.get("head_type", head_type) != head_type:
            raise ConfigError(
                f"{source}: head_type {head_type!r} but head_config.head_type {head_config['head_type']!r}"
            )
        raw = {**head_config, "head_type": head_type}
    return kind.source_class()(build_dataclass(config_class, raw, "head_config.", where))


def _text_config(target) -> object:
    config = getattr(target, "config", target)
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def quantized_layers(module: nn.Module) -> list[str]:
    """Names of the torch.ao quantized layers under `module` (what `decode.prepare.quantize_draft` swaps
    in)."""
    return [
        name
        for name, layer in module.named_modules()
        if type(layer).__module__.startswith("torch.ao.nn") and not name.endswith("_packed_params")
    ]


def save_heads(
    head: Head,
    path: str | Path,
    *,
    base_model: str,
    base_revision: str | None = None,
    target=None,
    extra: dict | None = None,
) -> Path:
    """Write an export folder holding exactly `config.json` and `model.safetensors`.

    Args:
        head: the head module.
        path: output folder (created; replaced atomically file by file).
        base_model: hub id or path of the target the head was trained on.
        base_revision: the target's revision (commit hash, package version), if known.
        target: the target model or its config; records its architecture and depth for load-time checks.
        extra: more JSON-serialisable fields (training hyperparameters, tap convention notes).
    Returns:
        The folder.
    """
    quantized = quantized_layers(head)
    if quantized:  # decode.prepare.quantize_draft: int8 copies for decoding, not the trained weights
        raise ValueError(
            f"this head holds {len(quantized)} quantized layers ({', '.join(quantized[:3])}, ...): "
            "int8 drafts are for decoding only; save the fp32 head"
        )
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    head_config = head.config.to_dict()
    config = {
        "head_type": head.head_type,
        "format_version": FORMAT_VERSION,
        "base_model": base_model,
        "base_revision": base_revision,
        "hidden_size": head_config["hidden_size"],
        "vocab_size": head_config["vocab_size"],
        "head_config": head_config,
    }
    config.update(head.checkpoint_notes())
    if target is not None:
        text = _text_config(target)
        config["base_model_type"] = text.model_type
        config["base_num_hidden_layers"] = text.num_hidden_layers
    config.update(extra or {})
    state = {k: v.detach().cpu().contiguous().clone() for k, v in head.state_dict().items()}
    # one id in both files: a save killed between them leaves a pair that `load_heads` refuses, not new
    # weights read under the old config
    config[SAVE_ID] = secrets.token_hex(8)
    metadata = {"format": "pt", SAVE_ID: config[SAVE_ID]}
    atomic_write(path / WEIGHTS_NAME, lambda tmp: save_file(state, tmp, metadata=metadata))
    write_json(path / CONFIG_NAME, config)
    return path


def read_head_config(path: str | Path) -> dict:
    """The parsed `config.json` of an export folder, validated for the fields loading needs."""
    file = Path(path) / CONFIG_NAME
    if not file.is_file():
        raise FileNotFoundError(f"{file}: no head config (an export holds {CONFIG_NAME} + {WEIGHTS_NAME})")
    try:
        config = json.loads(file.read_text())
    except json.JSONDecodeError as err:
        raise ValueError(f"{file}: not valid JSON ({err})") from err
    for key in ("head_type", "format_version", "head_config"):
        if not isinstance(config, dict) or key not in config:
            raise ValueError(f"{file}: missing key {key!r}")
    version = config["format_version"]
    if isinstance(version, bool) or not isinstance(version, int) or version < 1:
        raise ValueError(f"{file}: format_version must be an integer >= 1, got {version!r}")
    if version > FORMAT_VERSION:
        raise ValueError(
            f"{file}: format_version {version} is newer than this selfspec reads ({FORMAT_VERSION})"
        )
    for key in config:  # other keys are free-form notes (`save_heads(extra=)`); a slip of a read one is not
        slip = misspelt(key, READ_KEYS)
        if slip is not None:
            raise ValueError(f"{file}: key {key!r} looks like a slip of {slip!r}, which loading reads")
    head = config["head_config"]
    for key in ("hidden_size", "vocab_size"):  # the top-level copies must agree with the head's own
        theirs = head.get(key) if isinstance(head, dict) else None  # (a wrong type there: build_head says)
        if key in config and type(theirs) is int and config[key] != theirs:
            raise ValueError(f"{file}: {key} is {config[key]!r} but head_config.{key} is {theirs!r}")
    return config


def check_head_matches_target(config, target, where: str = "head") -> None:
    """Raise if the head config does not fit the target (hidden size, vocab, architecture, tap depth).

    Args:
        config: an export's `config.json` (`read_head_config`), or a head module's own config (`head.config`:
            sizes and tapped layers only, as it records no base model).
        target: the target model or its config.
        where: names the head in the message.
    """
    if not isinstance(config, dict):
        config = {"head_config": config.to_dict()}
    text = _text_config(target)
    head = config["head_config"]
    checks = [
        ("hidden_size", head.get("target_hidden_size") or head["hidden_size"], text.hidden_size),
        ("vocab_size", head["vocab_size"], text.vocab_size),
    ]
    if config.get("base_model_type") is not None:
        checks.append(("model_type", config["base_model_type"], text.model_type))
    if config.get("base_num_hidden_layers") is not None:  # same width, other depth: the features differ
        checks.append(("num_hidden_layers", config["base_num_hidden_layers"], text.num_hidden_layers))
    source = f" (base_model={config['base_model']!r})" if "base_model" in config else ""
    for key, ours, theirs in checks:
        if ours != theirs:
            raise ValueError(
                f"{where} was built for a target with {key}={ours!r}, but this target has "
                f"{key}={theirs!r}{source}"
            )
    for layer in head.get("aux_layer_ids") or ():
        if not 0 <= layer < text.num_hidden_layers:
            raise ValueError(
                f"{where} taps layer {layer}, but the target has {text.num_hidden_layers} layers"
            )


def load_heads(
    path: str | Path,
    target=None,
    *,
    dtype: torch.dtype | None = None,
    device: str | torch.device | None = None,
) -> Head:
    """Load an export folder written by `save_heads`.

    Args:
        path: the folder.
        target: the target model (or its config) the head will draft for; checked when given. A model also
            sets the defaults of `dtype` and `device`: the head follows the target's.
        dtype: cast the floating-point weights (the d2t/t2d maps keep their dtypes); None = the target
            model's dtype, else fp32 (a head saved in bf16 is upcast: heads train and export in fp32).
        device: where to put the head; None = the target model's device, else the CPU.
    Returns:
        The head, in eval mode.
    """
    path = Path(path)
    config = read_head_config(path)
    head = build_head(config["head_type"], config["head_config"], str(path / CONFIG_NAME))  # checks types
    if target is not None:
        check_head_matches_target(config, target, where=f"head {path}")
    weights = path / WEIGHTS_NAME
    if not weights.is_file():
        raise FileNotFoundError(f"{weights}: missing head weights")
    try:
        state = load_file(weights)
        with safe_open(weights, "pt") as file:
            written = (file.metadata() or {}).get(SAVE_ID)
    except (SafetensorError, OSError) as err:
        raise ValueError(f"{weights}: corrupt or unreadable safetensors file ({err})") from err
    if written is not None and config.get(SAVE_ID) is not None and written != config[SAVE_ID]:
        raise ValueError(
            f"{path}: {WEIGHTS_NAME} (save {written}) and {CONFIG_NAME} (save {config[SAVE_ID]}) come from "
            "different saves (one killed between its two files?): save the head again"
        )
    _load_state_strict(head, state, weights)
    if isinstance(target, nn.Module):
        dtype = dtype if dtype is not None else getattr(target, "dtype", None)
        device = device if device is not None else getattr(target, "device", None)
    if dtype is not None:
        cast_keeping_rotary(head, dtype)
    return head.to(device if device is not None else "cpu").eval()


ROTARY_BUFFERS = ("inv_freq", "original_inv_freq")


def cast_keeping_rotary(module: nn.Module, dtype: torch.dtype) -> nn.Module:
    """`module.to(dtype)` except for its rotary frequencies, kept as they are (fp32): a transformers target
    loaded in bf16 keeps its own so, and training computes them so (in bf16 the angle at position 1,024 is
    off by up to 1.4 rad at SmolLM2's head size)."""
    kept = {
        name: buffer for name, buffer in module.named_buffers() if name.rpartition(".")[2] in ROTARY_BUFFERS
    }
    module.to(dtype=dtype)
    for name, buffer in kept.items():
        owner, _, attribute = name.rpartition(".")
        module.get_submodule(owner)._buffers[attribute] = buffer  # (keeps the buffer's persistence)
    return module


def _load_state_strict(head: nn.Module, state: dict, source: Path) -> None:
    expected = head.state_dict()
    missing = sorted(set(expected) - set(state))
    unexpected = sorted(set(state) - set(expected))
    if missing or unexpected:
        raise ValueError(
            f"{source}: keys do not match a {head.head_type} head: missing {missing}, unexpected {unexpected}"
        )
    for key, tensor in state.items():  # d2t's size is checked below, against the config's draft_vocab_size
        if expected[key].is_floating_point() and not tensor.is_floating_point():  # load_state_dict would cast
            raise ValueError(f"{source}: {key} holds {tensor.dtype} values, expected floating-point weights")
        if key != "d2t" and tensor.shape != expected[key].shape:
            raise ValueError(
                f"{source}: {key} has shape {tuple(tensor.shape)}, expected {tuple(expected[key].shape)}"
            )
    head.check_checkpoint(state, str(source))  # before load_state_dict casts (a float d2t into int64, say)
    head.load_state_dict(state, strict=True)
