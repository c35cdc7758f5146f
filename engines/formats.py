"""Serving-engine export formats: their names, files and tap conventions, and the checks an export folder
must pass before it is published (engines drop unknown keys SILENTLY, so every key, shape, vocab map and tap
list is validated). `engines/export.py` writes and reads these folders; docs/design.md, Export formats, has
the layouts."""

from __future__ import annotations

import json
from pathlib import Path

from safetensors.torch import load_file

from heads import registry
from heads.eagle import check_draft_vocab
from heads.io import CONFIG_NAME, WEIGHTS_NAME
from heads.typed import taps_out_of_order

HEAD_TYPE = registry.formats()  # format -> the head type it holds (each kind lists its formats)
FORMATS = tuple(HEAD_TYPE)  # sglang, speculators, eagle1, medusa, medusa-vllm, dflash, peagle
MEDUSA_WEIGHTS_NAME = "medusa_lm_head.safetensors"
FILES = {fmt: (CONFIG_NAME, MEDUSA_WEIGHTS_NAME if fmt == "medusa" else WEIGHTS_NAME) for fmt in FORMATS}
# the tap id convention each EAGLE-3 format's config uses (sources: the module docstring of engines/export.py)
TAP_CONVENTION = {"sglang": "output", "speculators": "input", "peagle": "input"}
SPECULATORS_FORMATS = ("speculators", "peagle")  # speculators' layout (model type = the format's name)
_LAYER_KEYS = (
    "self_attn.q_proj.weight",
    "self_attn.k_proj.weight",
    "self_attn.v_proj.weight",
    "self_attn.o_proj.weight",
    "mlp.gate_proj.weight",
    "mlp.up_proj.weight",
    "mlp.down_proj.weight",
    "post_attention_layernorm.weight",
)
_EAGLE3_LAYER_KEYS = (*_LAYER_KEYS, "input_layernorm.weight", "hidden_norm.weight")


def _bad_ids(ids, low: int, high: int | None = None) -> list:
    """The entries of `ids` that are not integers in [low, high) (a validator lists them all; loading raises
    at the first, `heads.typed.check_int_ids`)."""
    return [
        i
        for i in ids
        if isinstance(i, bool) or not isinstance(i, int) or i < low or (high is not None and i >= high)
    ]


def _count(config: dict, key: str, low: int, errors: list[str]) -> int | None:
    """config[key] when it is an int >= low; else None and an error."""
    value = config[key]
    if _bad_ids([value], low):
        errors.append(f"{key} must be an integer >= {low}, got {value!r}")
        return None
    return value


def check_format(fmt: str) -> None:
    if fmt not in FORMATS:
        raise ValueError(f"unknown export format {fmt!r}; valid formats: {', '.join(FORMATS)}")


# ------------------------------------------------------------------------------------------------ validation
def _layer_sizes(layer: dict) -> tuple[int, int, int, int, int, int]:
    """(hidden, intermediate, vocab, heads, kv heads, head dim) of a draft layer's config dict."""
    h, heads = layer["hidden_size"], layer["num_attention_heads"]
    kv, head_dim = layer.get("num_key_value_heads") or heads, layer.get("head_dim") or h // heads
    return h, layer["intermediate_size"], layer["vocab_size"], heads, kv, head_dim


def _eagle_expected_shapes(
    config: dict, fmt: str, errors: list[str], state_keys
) -> dict[str, tuple[int, ...]]:
    """Key -> shape an EAGLE export must hold, from its config; config problems go to `errors`."""
    speculators = fmt in SPECULATORS_FORMATS
    layer = config.get("transformer_layer_config", config) if speculators else config
    need = ["hidden_size", "intermediate_size", "num_attention_heads", "vocab_size"]
    missing = [k for k in need if k not in layer]
    if missing:
        errors.append(f"config lacks {missing}")
        return {}
    h, inter, v, heads, kv, head_dim = _layer_sizes(layer)
    if layer.get("num_hidden_layers") != 1:
        errors.append(f"num_hidden_layers must be 1, got {layer.get('num_hidden_layers')!r}")
    prefix = "layers.0." if speculators or fmt == "eagle1" else "midlayer."
    attn_in = h if fmt == "eagle1" else 2 * h
    shapes = {
        "self_attn.q_proj.weight": (heads * head_dim, attn_in),
        "self_attn.k_proj.weight": (kv * head_dim, attn_in),
        "self_attn.v_proj.weight": (kv * head_dim, attn_in),
        "self_attn.o_proj.weight": (h, heads * head_dim),
        "mlp.gate_proj.weight": (inter, h),
        "mlp.up_proj.weight": (inter, h),
        "mlp.down_proj.weight": (h, inter),
        "post_attention_layernorm.weight": (h,),
        "input_layernorm.weight": (h,),
        "hidden_norm.weight": (h,),
    }
    keys = _LAYER_KEYS if fmt == "eagle1" else _EAGLE3_LAYER_KEYS
    expected = {prefix + k: shapes[k] for k in keys}
    if fmt == "eagle1":
        expected["fc.weight"] = (h, 2 * h)
        if config.get("bias") or "fc.bias" in state_keys:  # old official checkpoints carry it unannounced
            expected["fc.bias"] = (h,)
        return expected
    vd = config.get("draft_vocab_size")
    if vd is None:
        errors.append(
            "config lacks draft_vocab_size (engines then assume the full vocabulary and misread lm_head)"
        )
        vd = -1
    ht = config.get("target_hidden_size")
    if ht is None:
        if speculators:
            errors.append("config lacks target_hidden_size")
        ht = h
    if fmt == "sglang":
        ids = (config.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    else:
        ids = config.get("eagle_aux_hidden_state_layer_ids")
    convention = (config.get("selfspec") or {}).get("aux_layer_ids_convention")
    if not ids:
        errors.append("config lacks the tap ids (eagle_aux_hidden_state_layer_ids)")
        ids = []
    low = 1 if TAP_CONVENTION[fmt] == "input" else 0  # input-to-layer id 0 is the embeddings' output
    if _bad_ids(ids, low):
        errors.append(f"tap ids must be integers >= {low} ({TAP_CONVENTION[fmt]}-of-layer ids), got {ids!r}")
    elif taps_out_of_order(ids):
        errors.append(f"tap ids must be in increasing layer order (engines concatenate taps so), got {ids!r}")
    if convention is not None and convention != TAP_CONVENTION[fmt]:
        errors.append(
            f"tap ids are in the {convention!r}-of-layer convention, {fmt} expects {TAP_CONVENTION[fmt]!r}"
        )
    if speculators:
        model_type = "eagle3" if fmt == "speculators" else fmt
        spec = config.get("speculators_config") or {}
        if config.get("speculators_model_type") != model_type:
            errors.append(
                f"speculators_model_type must be {model_type!r}, got {config.get('speculators_model_type')!r}"
            )
        if spec.get("algorithm") != model_type or not spec.get("proposal_methods") or "verifier" not in spec:
            errors.append(f"speculators_config needs algorithm {model_type!r}, proposal_methods and verifier")
        expected["embed_tokens.weight"] = (v, h)
    if fmt == "peagle":  # vLLM's parallel drafting: the placeholder token and the placeholders' feature
        mask = config.get("mask_token_id")
        if not isinstance(mask, int) or isinstance(mask, bool) or not 0 <= mask < v:
            errors.append(f"mask_token_id must be a token id in [0, {v}), got {mask!r}")
        if config.get("norm_output"):
            errors.append("norm_output is set, but vLLM's P-EAGLE config does not pass it on")
        expected["mask_hidden"] = (1, 1, len(ids) * ht)
    if config.get("norm_before_fc"):  # EAGLE-3.1: a norm over the concatenated taps
        expected["input_norm.weight"] = (len(ids) * ht,)
    expected.update(
        {
            "fc.weight": (h, len(ids) * ht),
            "norm.weight": (h,),
            "lm_head.weight": (vd, h),
            "d2t": (vd,),
            "t2d": (v,),
        }
    )
    return expected


def _dflash_expected_shapes(config: dict, errors: list[str]) -> dict[str, tuple[int, ...]]:
    """Key -> shape a `dflash` export (vLLM's qwen3_dflash: DFlashDraftModel) must hold, from its config."""
    need = ["hidden_size", "intermediate_size", "num_attention_heads", "num_hidden_layers", "vocab_size"]
    missing = [k for k in need if k not in config]
    if "DFlashDraftModel" not in (config.get("architectures") or []):
        errors.append(f"architectures must hold 'DFlashDraftModel', got {config.get('architectures')!r}")
    dflash = config.get("dflash_config") or {}
    ids, mask = dflash.get("target_layer_ids"), dflash.get("mask_token_id")
    if not ids:
        errors.append("dflash_config lacks target_layer_ids (vLLM would tap the wrong layers)")
    elif _bad_ids(ids, 0, config.get("num_target_layers")):
        layers = config.get("num_target_layers")
        span = f"[0, {layers})" if layers is not None else ">= 0"
        errors.append(f"dflash_config.target_layer_ids must be integer layer ids {span}, got {ids!r}")
    elif taps_out_of_order(ids):
        errors.append(f"dflash_config.target_layer_ids must be in increasing layer order, got {ids!r}")
    vocab = config.get("vocab_size")
    if _bad_ids([mask], 0, vocab if isinstance(vocab, int) else None):
        errors.append(f"dflash_config.mask_token_id must be a token id in [0, {vocab}), got {mask!r}")
    block = config.get("block_size")
    if _bad_ids([block], 2):
        errors.append(f"block_size must be an integer >= 2 (the root and its drafts), got {block!r}")
    if (
        "eagle_aux_hidden_state_layer_ids" in config
    ):  # vLLM reads it before dflash_config, in another convention
        errors.append(
            "eagle_aux_hidden_state_layer_ids must not be set: vLLM would read it instead of the taps"
        )
    if "rope_theta" not in config and "rope_parameters" not in config:
        errors.append("config lacks rope_theta (vLLM's DFlash layers then assume 1e6)")
    if missing:
        errors.append(f"config lacks {missing}")
        return {}
    h, inter, v, heads, kv, d = _layer_sizes(config)
    ht = config.get("target_hidden_size") or h
    expected = {"fc.weight": (h, len(ids or ()) * ht), "hidden_norm.weight": (h,), "norm.weight": (h,)}
    for i in range(config["num_hidden_layers"]):
        for key, shape in {
            "input_layernorm.weight": (h,),
            "self_attn.q_proj.weight": (heads * d, h),
            "self_attn.k_proj.weight": (kv * d, h),
            "self_attn.v_proj.weight": (kv * d, h),
            "self_attn.o_proj.weight": (h, heads * d),
            "self_attn.q_norm.weight": (d,),
            "self_attn.k_norm.weight": (d,),
            "post_attention_layernorm.weight": (h,),
            "mlp.gate_proj.weight": (inter, h),
            "mlp.up_proj.weight": (inter, h),
            "mlp.down_proj.weight": (h, inter),
        }.items():
            expected[f"layers.{i}.{key}"] = shape
    vd = config.get("draft_vocab_size") or v
    if vd != v:  # its own lm_head over a reduced vocabulary; else vLLM shares the target's
        expected.update({"lm_head.weight": (vd, h), "d2t": (vd,), "t2d": (v,)})
    return expected


def _medusa_expected_shapes(config: dict, fmt: str, errors: list[str]) -> dict[str, tuple[int, ...]]:
    names = (
        ("medusa_num_heads", "medusa_num_layers") if fmt == "medusa" else ("num_heads", "num_hidden_layers")
    )
    missing = [k for k in (*names, "hidden_size", "vocab_size") if k not in config]
    if fmt == "medusa-vllm":
        if config.get("model_type") != "medusa":
            errors.append(f"model_type must be 'medusa', got {config.get('model_type')!r}")
        if config.get("medusa_fc_bias") is not True:
            errors.append("medusa_fc_bias must be true (vLLM drops the ResBlock biases otherwise)")
        truncated = config.get("truncated_vocab_size")
        if truncated is not None and truncated != config.get("vocab_size"):  # vLLM then reads a token_map
            errors.append(
                f"truncated_vocab_size {truncated!r} must equal vocab_size: the lm_heads cover it all"
            )
    if missing:
        errors.append(f"config lacks {missing}")
        return {}
    k, n = _count(config, names[0], 1, errors), _count(config, names[1], 0, errors)
    if k is None or n is None:
        return {}
    h, v = config["hidden_size"], config["vocab_size"]
    out = {}
    for i in range(k):
        for j in range(n):
            base = f"{i}.{j}.linear." if fmt == "medusa" else f"blocks.{i}.layers.{j}."
            out[base + "weight"], out[base + "bias"] = (h, h), (h,)
        out[f"{i}.{n}.weight" if fmt == "medusa" else f"lm_heads.{i}.weight"] = (v, h)
    return out


WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt")


def validate_export(out_dir: str | Path, fmt: str, other_files: bool = False) -> None:
    """Raise ValueError listing EVERYTHING missing or wrong in an export folder of format `fmt`.

    Checks the file list, the config fields engines need, every weight key and shape (unexpected keys too:
    engines drop them silently), fc width = taps x target hidden size, and d2t/t2d consistency.
    `other_files=True` (importing a published folder: a hub snapshot has README.md, .gitattributes) lets
    files other than weights sit beside the format's two; another weight file is an error either way.
    """
    check_format(fmt)
    out_dir = Path(out_dir)
    config_file, weights_file = FILES[fmt]
    errors = []
    present = sorted(p.name for p in out_dir.iterdir()) if out_dir.is_dir() else []
    if other_files:
        stray = [name for name in present if name not in FILES[fmt] and name.endswith(WEIGHT_SUFFIXES)]
        if stray or not set(FILES[fmt]) <= set(present):
            errors.append(
                f"files {present}: expected {sorted(FILES[fmt])}, and no other weight files (found {stray})"
            )
    elif present != sorted(FILES[fmt]):
        errors.append(f"files {present}, expected exactly {sorted(FILES[fmt])}")
    try:
        config = json.loads((out_dir / config_file).read_text())
    except (OSError, json.JSONDecodeError) as err:
        raise ValueError(f"{out_dir} is not a valid {fmt} export: unreadable {config_file} ({err})") from err
    try:
        state = load_file(out_dir / weights_file)
    except Exception as err:  # safetensors raises several types for missing/corrupt files
        raise ValueError(f"{out_dir} is not a valid {fmt} export: unreadable {weights_file} ({err})") from err
    if HEAD_TYPE[fmt] == "medusa":
        expected = _medusa_expected_shapes(config, fmt, errors)
    elif fmt == "dflash":
        expected = _dflash_expected_shapes(config, errors)
    else:
        expected = _eagle_expected_shapes(config, fmt, errors, set(state))
    missing = sorted(set(expected) - set(state))
    unexpected = sorted(set(state) - set(expected))
    if missing:
        errors.append(f"missing tensors {missing}")
    if unexpected and (expected or not errors):  # (a config error that left nothing expected is reported)
        errors.append(f"unexpected tensors {unexpected} (engines drop unknown keys silently)")
    for key in sorted(set(expected) & set(state)):
        if tuple(state[key].shape) != expected[key]:
            errors.append(f"{key} has shape {tuple(state[key].shape)}, expected {expected[key]}")
    shaped = {k for k in set(expected) & set(state) if tuple(state[k].shape) == expected[k]}
    if "d2t" in shaped:  # a wrong shape (or an unknown draft_vocab_size) is reported above
        t2d = state["t2d"] if "t2d" in shaped else None
        try:
            check_draft_vocab(
                state["d2t"], expected["t2d"][0], expected["d2t"][0], str(out_dir / weights_file), t2d
            )
        except ValueError as err:
            errors.append(str(err))
    if errors:
        raise ValueError(f"{out_dir} is not a valid {fmt} export:\n  - " + "\n  - ".join(errors))


def detect_format(path: str | Path) -> str:
    """The format of an export folder, from its config."""
    path = Path(path)
    if (path / MEDUSA_WEIGHTS_NAME).is_file():
        return "medusa"
    config = json.loads((path / CONFIG_NAME).read_text())
    if "medusa_num_heads" in config:
        return "medusa"
    if config.get("model_type") == "medusa":
        return "medusa-vllm"
    if "DFlashDraftModel" in (config.get("architectures") or []):
        return "dflash"
    if config.get("speculators_model_type") == "eagle3":
        return "speculators"
    if config.get("speculators_model_type") == "peagle":
        return "peagle"
    if "LlamaForCausalLMEagle3" in (config.get("architectures") or []) or "eagle_config" in config:
        return "sglang"
    if config.get("num_hidden_layers") == 1 and "speculators_model_type" not in config:
        return "eagle1"
    raise ValueError(
        f"{path}: cannot tell the export format from {CONFIG_NAME}; pass fmt= (one of {FORMATS})"
    )
