"""Export heads to the layouts serving engines load (validated by engines/formats.py before they are
published), and import published heads back.

Formats (docs/design.md, Export formats): `sglang` (EAGLE-3, LlamaForCausalLMEagle3), `speculators` (vLLM
speculators EAGLE-3), `eagle1` (EAGLE-1 official), `medusa` (FasterDecoding original), `medusa-vllm`,
`dflash` (vLLM's DFlashDraftModel, qwen3_dflash) and `peagle` (speculators' P-EAGLE, which vLLM serves as
eagle3 with parallel drafting).
Engines drop unknown keys SILENTLY, so every export is validated (keys, shapes, vocab maps, taps) before it is
published.

Tap ids. Ours are "output of decoder layer i" (heads/features.py). What engines read:
- SGLang reads `eagle_config.eagle_aux_hidden_state_layer_ids` from the draft config and calls
  `set_eagle3_layers_to_capture(ids)`, which stores `layers_to_capture = [i + 1 for i in ids]` ("for the ith
  layer, it takes the output of the (i-1)th layer") and captures the residual stream ENTERING layer j: the ids
  are in the OUTPUT-of-layer convention, i.e. ours (sglang python/sglang/srt/models/llama.py and
  model_executor/model_runner.py).
- vLLM reads a top-level `eagle_aux_hidden_state_layer_ids` (vllm/v1/worker/gpu/spec_decode/eagle/
  eagle3_utils.py: get_eagle3_aux_layers_from_config) and passes it unchanged to
  `set_aux_hidden_state_layers`; its LlamaModel appends `hidden_states + residual` BEFORE running layer idx:
  INPUT-to-layer, ours + 1 (its default (2, N/2, N-3) is EAGLE-3's (1, N/2-1, N-4) in our convention). The
  speculators export writes ours + 1.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

from safetensors.torch import load_file, save_file
from torch import Tensor

from engines.formats import (
    FILES,
    FORMATS,
    HEAD_TYPE,
    SPECULATORS_FORMATS,
    TAP_CONVENTION,
    check_format,
    detect_format,
    validate_export,
)
from heads.dflash import DFlashConfig, DFlashHead
from heads.eagle import EagleConfig, EagleHead
from heads.features import from_input_convention, to_input_convention
from heads.files import UMASK
from heads.io import check_head_matches_target, load_heads, read_head_config
from heads.medusa import MedusaConfig, MedusaHeads
from heads.peagle import PEagleConfig, PEagleHead

Head = MedusaHeads | EagleHead | DFlashHead


# ---------------------------------------------------------------------------------------------- state dicts
def _rename(state: dict[str, Tensor], old: str, new: str) -> dict[str, Tensor]:
    return {(new + k[len(old) :] if k.startswith(old) else k): v for k, v in state.items()}


def _fp32(tensor: Tensor) -> Tensor:
    return tensor.float() if tensor.is_floating_point() else tensor


def _to_format_state(
    head: Head, fmt: str, embed_weight: Tensor | None, lm_head_weight: Tensor | None
) -> dict:
    """Our state dict renamed to the format's keys (plus the target tensors the format needs), floating
    tensors in fp32 as the configs state (`torch_dtype`): a bf16 head beside the target's fp32 embedding
    would otherwise ship a file of two dtypes."""
    state = {k: _fp32(v).detach().contiguous().clone() for k, v in head.state_dict().items()}
    embed_weight = _fp32(embed_weight) if embed_weight is not None else None
    lm_head_weight = _fp32(lm_head_weight) if lm_head_weight is not None else None
    if fmt == "sglang":
        return state
    if fmt in SPECULATORS_FORMATS:
        state = _rename(state, "midlayer.", "layers.0.")
        state["embed_tokens.weight"] = embed_weight.detach().contiguous().clone()
        if fmt == "peagle":  # the placeholders' inputs: vLLM reads the mask token's row of embed_tokens
            embedding = state.pop("mask_embedding")
            state["embed_tokens.weight"] = state["embed_tokens.weight"].to(embedding.dtype)
            state["embed_tokens.weight"][head.config.mask_token_id] = embedding
            state["mask_hidden"] = state["mask_hidden"].reshape(1, 1, -1).contiguous()  # speculators' shape
        return state
    if fmt == "eagle1":
        return _rename(state, "midlayer.", "layers.0.")
    if fmt == "dflash":  # our names are vLLM's (heads/dflash.py)
        return state
    out = {}
    config = head.config
    for h in range(config.num_heads):
        for layer in range(config.num_layers):
            for part in ("weight", "bias"):
                tensor = state[f"blocks.{h}.{layer}.linear.{part}"]
                key = f"{h}.{layer}.linear.{part}" if fmt == "medusa" else f"blocks.{h}.layers.{layer}.{part}"
                out[key] = tensor
        proj = state[f"lm_heads.{h}.weight"] if head.lm_heads is not None else lm_head_weight.detach().clone()
        out[f"{h}.{config.num_layers}.weight" if fmt == "medusa" else f"lm_heads.{h}.weight"] = (
            proj.contiguous()
        )
    return out


def _from_format_state(
    state: dict[str, Tensor], fmt: str, num_heads: int = 0, num_layers: int = 0, mask_token_id: int = 0
) -> dict:
    """A format's state dict renamed to our keys (target-owned tensors dropped)."""
    if fmt in ("sglang", "dflash"):
        return dict(state)
    if fmt == "peagle":
        state = dict(state)
        state["mask_embedding"] = state["embed_tokens.weight"][mask_token_id].clone()
        state["mask_hidden"] = state["mask_hidden"].flatten()
    if fmt in (*SPECULATORS_FORMATS, "eagle1"):
        state = {k: v for k, v in state.items() if k != "embed_tokens.weight"}
        return _rename(state, "layers.0.", "midlayer.")
    out = {}
    for h in range(num_heads):
        for layer in range(num_layers):
            for part in ("weight", "bias"):
                key = f"{h}.{layer}.linear.{part}" if fmt == "medusa" else f"blocks.{h}.layers.{layer}.{part}"
                out[f"blocks.{h}.{layer}.linear.{part}"] = state[key]
        out[f"lm_heads.{h}.weight"] = state[
            f"{h}.{num_layers}.weight" if fmt == "medusa" else f"lm_heads.{h}.weight"
        ]
    return out


# -------------------------------------------------------------------------------------------------- configs
def _llama_dict(config: EagleConfig) -> dict:
    """Llama config of the draft layer, with rope_theta spelled out for transformers-4.x readers."""
    llama = config.llama_config().to_dict()
    for key in (
        "_attn_implementation",
        "_attn_implementation_autoset",
        "transformers_version",
        "architectures",
        "dtype",
        "torch_dtype",
        "_name_or_path",  # PretrainedConfig bookkeeping below: noise in a published config
        "id2label",
        "label2id",
        "problem_type",
        "is_encoder_decoder",
        "output_attentions",
        "output_hidden_states",
        "return_dict",
        "use_cache",
    ):
        llama.pop(key, None)
    llama.update(
        num_hidden_layers=1,
        tie_word_embeddings=False,
        rope_theta=config.rope_parameters["rope_theta"],
        torch_dtype="float32",
    )
    return llama


def _dflash_config(head: DFlashHead, meta: dict, num_target_layers: int | None) -> dict:
    """vLLM's DFlash draft config (a Qwen3 config with `dflash_config`): taps in the output-of-layer
    convention, as vLLM's `dflash_config.target_layer_ids` are (it adds 1 itself); rope_theta spelled out
    (vLLM's DFlash layers default it to 1e6); no eagle_aux_hidden_state_layer_ids (vLLM would read those
    first, as input-to-layer ids)."""
    c = head.config
    out = {
        "architectures": ["DFlashDraftModel"],
        "model_type": "qwen3",
        "hidden_size": c.hidden_size,
        "intermediate_size": c.intermediate_size,
        "num_attention_heads": c.num_attention_heads,
        "num_key_value_heads": c.num_key_value_heads,
        "head_dim": c.head_dim,
        "num_hidden_layers": c.num_hidden_layers,
        "vocab_size": c.vocab_size,
        "rms_norm_eps": c.rms_norm_eps,
        "hidden_act": c.hidden_act,
        "max_position_embeddings": c.max_position_embeddings,
        "rope_theta": c.rope_parameters["rope_theta"],
        "rope_parameters": dict(c.rope_parameters),
        "attention_bias": c.attention_bias,
        "tie_word_embeddings": False,
        "block_size": c.block_size,
        "dflash_config": {"mask_token_id": c.mask_token_id, "target_layer_ids": list(c.aux_layer_ids)},
        "torch_dtype": "float32",
        "selfspec": {**meta, "aux_layer_ids_convention": "output"},
    }
    if num_target_layers is not None:
        out["num_target_layers"] = num_target_layers
    if c.draft_vocab_size != c.vocab_size:
        out["draft_vocab_size"] = c.draft_vocab_size
    if c.target_hidden_size != c.hidden_size:
        out["target_hidden_size"] = c.target_hidden_size
    return out


def _format_config(
    head: Head,
    fmt: str,
    *,
    base_model: str | None,
    verifier_architectures: list[str],
    num_speculative_tokens: int,
    num_target_layers: int | None = None,
) -> dict:
    c = head.config
    meta = {"head_type": head.head_type, "format": fmt, "exporter": "selfspec"}
    if fmt == "medusa":
        return {
            "medusa_num_heads": c.num_heads,
            "medusa_num_layers": c.num_layers,
            "base_model_name_or_path": base_model,
            "hidden_size": c.hidden_size,
            "vocab_size": c.vocab_size,
            "selfspec": meta,
        }
    if fmt == "medusa-vllm":
        return {
            "model_type": "medusa",
            "architectures": ["MedusaModel"],
            "hidden_size": c.hidden_size,
            "vocab_size": c.vocab_size,
            "truncated_vocab_size": c.vocab_size,
            "num_heads": c.num_heads,
            "num_hidden_layers": c.num_layers,
            "medusa_fc_bias": True,
            "base_model_name_or_path": base_model,
            "selfspec": meta,
        }
    if fmt == "dflash":
        return _dflash_config(head, meta, num_target_layers)
    llama = _llama_dict(c)
    if fmt == "eagle1":
        return {**llama, "architectures": ["LlamaForCausalLM"], "bias": c.fc_bias, "selfspec": meta}
    ids = list(c.aux_layer_ids)
    meta["aux_layer_ids_convention"] = TAP_CONVENTION[fmt]
    if fmt == "sglang":
        out = {
            **llama,
            "architectures": ["LlamaForCausalLMEagle3"],
            "draft_vocab_size": c.draft_vocab_size,
            "eagle_config": {"eagle_aux_hidden_state_layer_ids": ids, "use_aux_hidden_state": True},
            "selfspec": meta,
        }
        if c.target_hidden_size != c.hidden_size:
            out["target_hidden_size"] = c.target_hidden_size
        return out
    input_ids = to_input_convention(ids)
    peagle = fmt == "peagle"
    out = {
        "architectures": ["PEagleSpeculator" if peagle else "Eagle3Speculator"],
        "speculators_model_type": fmt if peagle else "eagle3",
        "speculators_version": "0.9.0",
        "transformer_layer_config": {**llama, "architectures": ["LlamaForCausalLM"], "model_type": "llama"},
        "draft_vocab_size": c.draft_vocab_size,
        "target_hidden_size": c.target_hidden_size,
        "norm_before_residual": False,  # ours adds the residual of the raw fused feature (heads/eagle.py)
        "norm_before_fc": c.norm_before_fc,  # EAGLE-3.1, read by vLLM's speculators config
        "norm_output": c.norm_output,
        "eagle_aux_hidden_state_layer_ids": input_ids,
        "speculators_config": {
            "algorithm": fmt if peagle else "eagle3",
            "default_proposal_method": "greedy",
            "proposal_methods": [
                {
                    "proposal_type": "greedy",
                    # P-EAGLE: vLLM drafts this many in one forward, the depths the head was trained for
                    "speculative_tokens": c.parallel_depths if peagle else num_speculative_tokens,
                    "verifier_accept_k": 1,
                    "accept_tolerance": 0.0,
                }
            ],
            "verifier": {"name_or_path": base_model, "architectures": verifier_architectures},
        },
        "selfspec": meta,
    }
    if peagle:
        out["mask_token_id"] = c.mask_token_id  # vLLM's placeholder token (it writes it as pard_token)
    return out


# --------------------------------------------------------------------------------------------------- export
def _target_tensors(target) -> tuple[Tensor | None, Tensor | None, object]:
    """(embedding, lm_head weight, config) of a target model, or of an HF folder/hub id (loaded on CPU)."""
    if target is None:
        return None, None, None
    if isinstance(target, (str, Path)):
        from targets import load_target  # resolves the offline default target too

        target, _ = load_target(str(target))
    return (target.get_input_embeddings().weight, target.get_output_embeddings().weight, target.config)


def verifier_architectures(target_config) -> list[str]:
    """The verifier's `architectures` an export names: the target config's own; for a config built in code
    (none recorded) transformers' causal-LM class of its model type (a tiny qwen3 target is a
    Qwen3ForCausalLM, not a llama); without a target config, a llama, as the exports assumed before."""
    if target_config is None:
        return ["LlamaForCausalLM"]
    named = list(getattr(target_config, "architectures", None) or [])
    if named:
        return named
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    model_type = target_config.model_type
    name = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(model_type) or MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(
        _text(target_config).model_type
    )
    if name is None:
        raise ValueError(
            f"the target config (model_type {model_type!r}) names no architectures and transformers has no "
            "causal-LM class for its model type: set config.architectures"
        )
    return [name]


def export_head(
    head_dir_or_module: str | Path | Head,
    fmt: str,
    out_dir: str | Path,
    *,
    target=None,
    target_config=None,
    verifier_name: str | None = None,
    num_speculative_tokens: int = 3,
) -> list[Path]:
    """Write `head` in format `fmt` to `out_dir`, validated; an incomplete export is never left behind.

    Args:
        head_dir_or_module: a head module, or a folder written by `heads.io.save_heads`.
        fmt: one of FORMATS.
        out_dir: the export folder (must not exist, or be empty).
        target: the target model or its HF folder / hub id; required by `speculators` (its embedding is
            shipped) and by `medusa`/`medusa-vllm` heads that share the target's lm_head.
        target_config: the target's HF config (checks sizes; gives the verifier's architectures).
        verifier_name: the target's hub id or path written into the config; default: the head's base_model.
        num_speculative_tokens: `speculators` only: draft tokens per step the proposal method advertises.
    Returns:
        The files written.
    """
    check_format(fmt)
    base_model, recorded = None, None
    if isinstance(head_dir_or_module, (str, Path)):
        recorded = read_head_config(head_dir_or_module)  # its target's architecture and depth too
        base_model = recorded.get("base_model")
        head = load_heads(head_dir_or_module)
    else:
        head = head_dir_or_module
    base_model = verifier_name or base_model or (str(target) if isinstance(target, (str, Path)) else None)
    if HEAD_TYPE[fmt] != head.head_type:
        hint = (
            " (an EAGLE-3 head served as EAGLE-1 drafts garbage: acceptance length 1.0, no error)"
            if head.head_type == "eagle3" and fmt == "eagle1"
            else ""
        )
        raise ValueError(
            f"format {fmt!r} holds {HEAD_TYPE[fmt]} heads, but this head is {head.head_type}{hint}; "
            f"formats for {head.head_type}: {[f for f in FORMATS if HEAD_TYPE[f] == head.head_type]}"
        )
    if fmt == "sglang" and (head.config.norm_before_fc or head.config.norm_output):
        raise ValueError(
            "the sglang layout written here has no EAGLE-3.1 norms (norm_before_fc / norm_output): they "
            "would be dropped silently; export this head as speculators (vLLM reads both)"
        )
    if fmt == "peagle" and head.config.norm_output:
        raise ValueError(
            "vLLM's P-EAGLE config passes no norm_output (EAGLE-3.1's normed draft output): this head's "
            "would be dropped silently"
        )
    if head.head_type in ("eagle3", "peagle") and head.config.fc_bias:
        raise ValueError(
            f"{fmt} builds the EAGLE-3 fc without a bias: this head's fc.bias would be dropped silently"
        )
    embed, lm_head, loaded_config = _target_tensors(target)
    target_config = target_config or loaded_config
    if target_config is not None:  # a folder's config.json also records its target's type and depth
        check_head_matches_target(
            recorded or {"head_config": head.config.to_dict()}, target_config, where=f"{head.head_type} head"
        )
    if fmt in SPECULATORS_FORMATS and embed is None:
        raise ValueError(f"the {fmt} format ships the target's embed_tokens: pass target= (model or path)")
    if fmt in ("medusa", "medusa-vllm") and head.lm_heads is None and lm_head is None:
        raise ValueError(f"{fmt} stores one lm_head per head; these heads share the target's: pass target=")
    architectures = verifier_architectures(target_config)
    config = _format_config(
        head,
        fmt,
        base_model=base_model,
        verifier_architectures=architectures,
        num_speculative_tokens=num_speculative_tokens,
        num_target_layers=_text(target_config).num_hidden_layers if target_config is not None else None,
    )
    state = _to_format_state(head, fmt, embed, lm_head)

    out_dir = Path(out_dir)
    if out_dir.exists() and any(out_dir.iterdir()):
        raise FileExistsError(f"{out_dir} exists and is not empty; export into a new folder")
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(dir=out_dir.parent, prefix=f".{out_dir.name}.tmp"))
    staging.chmod(0o777 & ~UMASK)  # mkdtemp makes 0700: a server running as another user could not read it
    try:
        config_file, weights_file = FILES[fmt]
        (staging / config_file).write_text(json.dumps(config, indent=2) + "\n")
        save_file(state, staging / weights_file, metadata={"format": "pt"})
        validate_export(staging, fmt)
        if out_dir.exists():
            out_dir.rmdir()
        os.replace(staging, out_dir)
    finally:
        if staging.exists():
            shutil.rmtree(staging)
    return [out_dir / name for name in FILES[fmt]]


def _text(config):
    return config.get_text_config() if hasattr(config, "get_text_config") else config


# --------------------------------------------------------------------------------------------------- import
def _dflash_head_config(config: dict) -> DFlashConfig:
    return DFlashConfig(
        hidden_size=config["hidden_size"],
        num_attention_heads=config["num_attention_heads"],
        num_key_value_heads=config.get("num_key_value_heads") or config["num_attention_heads"],
        head_dim=config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"],
        intermediate_size=config["intermediate_size"],
        vocab_size=config["vocab_size"],
        aux_layer_ids=tuple(config["dflash_config"]["target_layer_ids"]),
        mask_token_id=config["dflash_config"]["mask_token_id"],
        num_hidden_layers=config["num_hidden_layers"],
        block_size=config["block_size"],  # required by validate_export: the drafts depend on it
        target_hidden_size=config.get("target_hidden_size"),
        draft_vocab_size=config.get("draft_vocab_size"),
        rms_norm_eps=config.get("rms_norm_eps", 1e-6),
        hidden_act=config.get("hidden_act", "silu"),
        max_position_embeddings=config.get("max_position_embeddings", 8192),
        rope_parameters=_rope_parameters(config),
        attention_bias=config.get("attention_bias", False),
    )


def _rope_parameters(layer: dict) -> dict:
    rope = dict(layer.get("rope_parameters") or layer.get("rope_scaling") or {})
    rope.setdefault("rope_type", rope.pop("type", "default"))
    rope.setdefault("rope_theta", layer.get("rope_theta", 10000.0))
    return rope


def _eagle_config(config: dict, fmt: str) -> EagleConfig:
    layer = config.get("transformer_layer_config", config) if fmt in SPECULATORS_FORMATS else config
    fields = {
        "head_type": HEAD_TYPE[fmt],
        "hidden_size": layer["hidden_size"],
        "num_attention_heads": layer["num_attention_heads"],
        "num_key_value_heads": layer.get("num_key_value_heads") or layer["num_attention_heads"],
        "head_dim": layer.get("head_dim") or layer["hidden_size"] // layer["num_attention_heads"],
        "intermediate_size": layer["intermediate_size"],
        "vocab_size": layer["vocab_size"],
        "rms_norm_eps": layer.get("rms_norm_eps", 1e-6),
        "hidden_act": layer.get("hidden_act", "silu"),
        "max_position_embeddings": layer.get("max_position_embeddings", 8192),
        "rope_parameters": _rope_parameters(layer),
        "attention_bias": layer.get("attention_bias", False),
    }
    if fmt == "eagle1":
        return EagleConfig(**fields, fc_bias=bool(config.get("bias", False)))
    unsupported = [k for k in ("norm_before_residual", "fc_norm") if config.get(k)]
    # variants our EagleHead does not implement: loading them would draft differently, silently
    if unsupported:
        raise ValueError(f"this {fmt} head sets {unsupported}, which selfspec's EagleHead does not implement")
    if fmt == "sglang":
        ids = list(config["eagle_config"]["eagle_aux_hidden_state_layer_ids"])
    else:
        ids = from_input_convention(config["eagle_aux_hidden_state_layer_ids"])
    fields |= {
        "aux_layer_ids": tuple(ids),
        "draft_vocab_size": config["draft_vocab_size"],
        "target_hidden_size": config.get("target_hidden_size") or layer["hidden_size"],
        "norm_before_fc": bool(config.get("norm_before_fc")),
        "norm_output": bool(config.get("norm_output")),
    }
    if fmt == "peagle":
        depths = config["speculators_config"]["proposal_methods"][0]["speculative_tokens"]
        return PEagleConfig(**fields, parallel_depths=depths, mask_token_id=config["mask_token_id"])
    return EagleConfig(**fields)


def import_head(path: str | Path, fmt: str | None = None, target=None) -> Head:
    """Load an exported / published head folder into our MedusaHeads or EagleHead (eval mode, CPU).

    Args:
        path: the folder (config.json + weights of one of FORMATS).
        fmt: its format; None detects it from the config.
        target: the target model or its config; when given, the head's sizes and taps are checked against it.
    Returns:
        The head, ready for `decode.generate`.
    """
    path = Path(path)
    fmt = fmt or detect_format(path)
    check_format(fmt)
    validate_export(path, fmt, other_files=True)  # a hub snapshot adds README.md etc.
    config_file, weights_file = FILES[fmt]
    config = json.loads((path / config_file).read_text())
    state = load_file(path / weights_file)
    if fmt == "eagle1" and "fc.bias" in state:
        config["bias"] = True
    if HEAD_TYPE[fmt] == "medusa":
        k, n = (
            (config["medusa_num_heads"], config["medusa_num_layers"])
            if fmt == "medusa"
            else (config["num_heads"], config["num_hidden_layers"])
        )
        head = MedusaHeads(
            MedusaConfig(
                hidden_size=config["hidden_size"], vocab_size=config["vocab_size"], num_heads=k, num_layers=n
            )
        )
        ours = _from_format_state(state, fmt, k, n)
    elif fmt == "dflash":
        head, ours = DFlashHead(_dflash_head_config(config)), _from_format_state(state, fmt)
    elif fmt == "peagle":
        head = PEagleHead(_eagle_config(config, fmt))
        ours = _from_format_state(state, fmt, mask_token_id=head.config.mask_token_id)
    else:
        head = EagleHead(_eagle_config(config, fmt))
        ours = _from_format_state(state, fmt)
    if target is not None:
        recorded = {"head_config": head.config.to_dict()}
        if isinstance(config.get("num_target_layers"), int):  # what a DFlash export records of its target
            recorded["base_num_hidden_layers"] = config["num_target_layers"]
        check_head_matches_target(recorded, target, where=f"{fmt} head {path}")
    head.load_state_dict(ours, strict=True)
    return head.eval()


__all__ = ["FILES", "FORMATS", "detect_format", "export_head", "import_head", "validate_export"]
