"""A draft model made from the target itself: its first N decoder layers, then its final norm and lm_head,
no training. It shares the target's tokenizer by construction, so `decode.drafters.model.DraftModel` and
vLLM's `method: draft_model` take it as they take any small model of the same family."""

from __future__ import annotations

import copy
from pathlib import Path

from transformers import PreTrainedModel

from heads.features import find_decoder_layers


def layer_draft(target: PreTrainedModel, num_layers: int) -> PreTrainedModel:
    """A new model of the target's class with its first `num_layers` decoder layers (copies of their weights),
    its embeddings, final norm and lm_head; in eval mode on the target's device and dtype.

    Raises:
        ValueError: `num_layers` outside [1, the target's layer count].
    """
    total = len(find_decoder_layers(target))
    if not 1 <= num_layers <= total:
        raise ValueError(
            f"num_layers must be in [1, {total}] (the target's decoder layers), got {num_layers}"
        )
    config = copy.deepcopy(target.config)
    text = config.get_text_config()
    text.num_hidden_layers = num_layers
    for name in ("layer_types", "mlp_only_layers"):  # per-layer lists some families carry
        value = getattr(text, name, None)
        if isinstance(value, list) and len(value) == total:
            setattr(text, name, value[:num_layers])
    draft = type(target)(config)
    state = target.state_dict()
    keep = {k: v for k, v in state.items() if k in draft.state_dict()}
    missing, unexpected = draft.load_state_dict(keep, strict=False)
    tied = set(getattr(draft, "_tied_weights_keys", None) or [])
    if unexpected or set(missing) - tied:
        raise ValueError(
            f"the truncated model does not match the target: missing {missing}, unexpected {unexpected}"
        )
    return draft.to(device=target.device, dtype=target.dtype).eval()


def save_layer_draft(target: PreTrainedModel, num_layers: int, out: str | Path, tokenizer=None) -> Path:
    """`layer_draft` saved as an ordinary model folder (config.json, safetensors weights; the tokenizer's
    files too when given), loadable with `AutoModelForCausalLM.from_pretrained` and by serving engines."""
    out = Path(out)
    draft = layer_draft(target, num_layers)
    draft.save_pretrained(out, safe_serialization=True)
    if tokenizer is not None:
        tokenizer.save_pretrained(out)
    return out
