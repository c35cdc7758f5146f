"""Run configs of the recipes: dataclasses <- a YAML file of sections <- `section.key=value` overrides.

`load_config(RunConfig, yaml_path, overrides)` is the one loader. Unknown keys, wrong types, bad choices and
missing required keys fail with the dotted key named, before any model is loaded (docs/design.md, Configs).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import torch
import yaml

from heads.files import YAML_FLOAT, dump_yaml
from heads.typed import ConfigError, build_dataclass
from targets import DEFAULT_TARGET

T = TypeVar("T")

TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
DTYPES = tuple(TORCH_DTYPES)
ATTN_IMPLEMENTATIONS = ("eager", "sdpa")
HIDDEN_STATES = ("online", "offline")
LR_SCHEDULERS = ("cosine", "linear", "constant")
RECIPE_HEAD_TYPES = ("eagle3", "eagle1", "dflash", "peagle")  # what train/eagle.py trains (eagle.head_type)
DISTILL_LOSSES = ("soft_ce", "forward_kl", "lk_nla", "lk_hybrid")  # eagle.distill_loss (train.losses)
REPORT_TO = ("none", "wandb", "tensorboard")
HALF_PRECISIONS = {"bf16": "bfloat16", "fp16": "float16"}  # train.mixed_precision -> its model.dtype
MIXED_PRECISIONS = ("no", *HALF_PRECISIONS)
CPU_BF16 = ("native", "always")  # train.cpu_bf16: bf16 on a CPU where it has bf16 kernels, or always


def _one_of(name: str, value: object, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise ValueError(f"{name} must be one of {list(allowed)}, got {value!r}")


def _at_least(obj: object, minimum: float, *names: str) -> None:
    for name in names:
        if getattr(obj, name) < minimum:
            raise ValueError(f"{name} must be >= {minimum}, got {getattr(obj, name)!r}")


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise ValueError(message)


@dataclass(kw_only=True)
class ModelConfig:
    target: str = DEFAULT_TARGET  # hub id or local folder of the frozen target; default SmolLM2-135M, offline
    revision: str | None = None  # hub commit or tag, recorded in exports; None = default branch
    dtype: str = "float32"  # frozen target's weights; float32 on CPU (bf16 matmuls are slow there), bf16
    # on GPU. Trainable weights (heads, LoRA) and Adam states are always float32
    attn_implementation: str = "eager"  # eager: multi-token CPU passes ~15% cheaper than sdpa (docs/cpu.md)

    def __post_init__(self) -> None:
        _one_of("dtype", self.dtype, DTYPES)
        _one_of("attn_implementation", self.attn_implementation, ATTN_IMPLEMENTATIONS)


@dataclass(kw_only=True)
class DataConfig:
    train_files: list[str]  # required: JSONL conversation files, relative to the launch directory
    eval_files: list[str] = field(default_factory=list)  # held-out JSONL files; [] = use eval_fraction
    max_length: int = 512  # tokens per example after the chat template; longer ones are truncated
    max_bad_fraction: float = 0.05  # fraction of malformed / fully-masked examples tolerated before failing
    eval_fraction: float = 0.0  # held-out slice of train_files when eval_files is empty; 0 = no eval set
    shuffle_seed: int = 0  # seed of the example order and of the eval_fraction split (reproducible)
    group_by_length: bool = False  # batches of rows of similar lengths (less padding), train/data.py
    hidden_states: str = "online"  # online: run the target every step; offline: read states from offline_dir
    offline_dir: str | None = None  # folder of precomputed target hidden states; required when offline
    trim_loops: int = 0  # > 0: cut a reply looping past this many repeated 8-word runs (train.data.trim_loop)
    sources: list[str] = field(default_factory=list)  # [] = every row; else only rows of these `source`s

    def __post_init__(self) -> None:
        _one_of("hidden_states", self.hidden_states, HIDDEN_STATES)
        _require(len(self.train_files) > 0, "train_files must name at least one file")
        _at_least(self, 2, "max_length")
        _at_least(self, 0, "trim_loops")
        _require(
            0 <= self.max_bad_fraction <= 1,
            f"max_bad_fraction must be in [0, 1], got {self.max_bad_fraction}",
        )
        _require(0 <= self.eval_fraction < 1, f"eval_fraction must be in [0, 1), got {self.eval_fraction}")
        _require(
            self.hidden_states == "online" or self.offline_dir is not None,
            "offline_dir must be set when hidden_states='offline'",
        )


@dataclass(kw_only=True)
class TrainConfig:
    output_dir: str  # required: run folder (exports, resume states, resolved config.yaml)
    learning_rate: float = 1e-4  # peak AdamW lr; EAGLE-3 1e-4 (SpecForge); Medusa YAMLs set 1e-3
    weight_decay: float = 0.0  # AdamW decoupled weight decay; EAGLE and Medusa train without it
    adam_beta1: float = 0.9  # AdamW first-moment decay (EAGLE)
    adam_beta2: float = 0.95  # AdamW second-moment decay; EAGLE uses (0.9, 0.95)
    max_grad_norm: float = 0.5  # global grad-norm clip (EAGLE: 0.5); 0 = no clipping
    num_epochs: int = 1  # passes over train_files; ignored when max_steps > 0
    max_steps: int = 0  # optimizer steps; 0 = derive from num_epochs
    per_device_batch_size: int = 4  # sequences per process per micro-batch
    gradient_accumulation_steps: int = 1  # micro-batches per optimizer step (global batch: x batch x procs)
    warmup_ratio: float = 0.1  # fraction of optimizer steps in linear warmup (Medusa: 0.1)
    lr_scheduler: str = "cosine"  # decay after warmup; cosine in Medusa and SpecForge
    seed: int = 0  # seeds head init, feature noise and dropout (accelerate.utils.set_seed)
    save_every_steps: int = 1000  # optimizer steps between resume state + export; 0 = only at the end
    keep_checkpoints: int = 2  # resume states kept on disk, older deleted; >= 1 so a resume always exists
    eval_every_steps: int = 500  # optimizer steps between eval-loss passes; 0 = only at the end
    log_every_steps: int = 10  # optimizer steps between tracker logs (loss, lr, grad norm, per-head acc)
    report_to: str = "none"  # tracker for accelerator.log; "none" = console only (no network needed)
    mixed_precision: str = "no"  # compute under accelerate's autocast (weights stay fp32); "no" on CPU,
    # "bf16" on recent GPUs (bf16 also runs on CPU); "fp16" needs CUDA (grad scaler)
    cpu_bf16: str = "native"  # bf16 on a CPU: "native" = only where oneDNN has bf16 kernels, else fp32
    # with a warning (AVX2 emulates bf16 matmuls ~100x slower: train.distributed); "always" = bf16 even there
    gradient_checkpointing: bool = False  # Medusa-2: recompute the LoRA-adapted target's activations in
    # backward (less memory, ~30% more compute); frozen passes keep none
    eval_tau_prompts: int = 0  # held-out prompts of the periodic simulated-tau eval; 0 = off
    eval_tau_new_tokens: int = 64  # new tokens per prompt in that eval (tau counts the bonus token)
    eval_tau_batch_size: int = 1  # prompts decoded together in that eval (decode.generate.decode_prompts)
    keep_best_tau: bool = False  # also export the head of the best simulated tau so far to head_best/
    # (checkpoint selection on the held-out prompts; needs eval_tau_prompts > 0)

    def __post_init__(self) -> None:
        _one_of("lr_scheduler", self.lr_scheduler, LR_SCHEDULERS)
        _one_of("report_to", self.report_to, REPORT_TO)
        _one_of("mixed_precision", self.mixed_precision, MIXED_PRECISIONS)
        _one_of("cpu_bf16", self.cpu_bf16, CPU_BF16)
        _require(self.learning_rate > 0, f"learning_rate must be > 0, got {self.learning_rate}")
        _require(0 <= self.warmup_ratio < 1, f"warmup_ratio must be in [0, 1), got {self.warmup_ratio}")
        _at_least(
            self,
            1,
            "per_device_batch_size",
            "gradient_accumulation_steps",
            "keep_checkpoints",
            "log_every_steps",
            "eval_tau_batch_size",
        )
        _at_least(
            self,
            0,
            "weight_decay",
            "max_grad_norm",
            "num_epochs",
            "max_steps",
            "save_every_steps",
            "eval_every_steps",
            "eval_tau_prompts",
            "eval_tau_new_tokens",
        )
        _require(self.num_epochs > 0 or self.max_steps > 0, "num_epochs or max_steps must be > 0")
        _require(
            not self.keep_best_tau or self.eval_tau_prompts > 0,
            "keep_best_tau selects by the simulated tau: set train.eval_tau_prompts > 0",
        )


@dataclass(kw_only=True)
class EagleTrainConfig:
    head_type: str = "eagle3"  # eagle3: 3 fused taps, TTT, reduced-vocab lm_head; eagle1: final state;
    # dflash: a block drafter of `draft_layers` layers drafting block_size - 1 tokens per forward; peagle:
    # EAGLE-3's head drafting parallel_depths tokens per forward (P-EAGLE)
    aux_layer_ids: list[int] | None = None  # eagle3 / dflash taps, output-of-layer ids; None = the default
    # (eagle3: 1, N/2-1, N-4; dflash: draft_layers taps spread over 1 .. N-3)
    draft_vocab_size: int = 0  # eagle3 / dflash draft vocabulary (most frequent training tokens); 0 = full
    block_size: int = 8  # dflash: the block (root + block_size - 1 drafts), the paper's 8 or 16
    draft_layers: int = 3  # dflash: decoder layers of the drafter (the paper: 5)
    mask_token_id: int | None = None  # dflash / peagle: the token filling the draft slots; None = the
    # highest token id that never occurs in the training data
    anchors: int = 64  # dflash: blocks per training row at most (the paper: 512 on 3k-token rows); peagle:
    # chains per training row at most (speculators: 512)
    parallel_depths: int = 4  # peagle: K, tokens drafted per forward (speculators' example: 4, default 8)
    cod_ratio: float = 0.7  # peagle: depth d trains on max(cod_ratio**d, cod_min_ratio) of the positions
    cod_min_ratio: float = 0.2  # (speculators' down_sample_ratio and down_sample_ratio_min)
    block_gamma: float = 0.0  # dflash: slot k weighs exp(-(k-1)/gamma); 0 = the paper's (4 for B=8, 7 for 16)
    layers_from_target: bool = False  # dflash: start the draft layers as copies of the target's last ones
    ttt_steps: int = 3  # eagle3 training-time-test unroll depth (speculators: 3, SpecForge: 7)
    ttt_decay: float = 0.8  # TTT step i is weighted ttt_decay**i (EAGLE-3)
    distill_loss: str = "soft_ce"  # eagle3 with a reduced vocabulary: soft_ce = cross-entropy against the
    # target's distribution renormalised over the draft vocabulary (EAGLE-3, SpecForge); forward_kl = against
    # the target's full-vocabulary probabilities of those tokens, so positions whose mass lies mostly outside
    # the draft vocabulary (which the draft can never propose) weigh less; lk_nla / lk_hybrid = the LK losses
    # (arXiv 2602.23881) on those same probabilities: -log of the expected acceptance, or KL and TV mixed
    # by exp(-lk_eta * acceptance) per position (train.losses.lk_loss)
    lk_eta: float = 3.0  # lk_hybrid's eta (the paper: 3 for EAGLE-3)
    noise_width: float = 0.2  # uniform noise U(-w/2, w/2) on input features against drift (EAGLE-1)
    feature_loss_weight: float = 1.0  # eagle1 SmoothL1 feature loss weight (EAGLE-1: 1.0); eagle3 has none
    ce_loss_weight: float = 0.1  # eagle1 soft-CE weight (EAGLE-1: 0.1); eagle3's TTT soft-CE is unweighted
    fc_bias: bool = False  # bias on fc; False matches vLLM / SGLang exports (old EAGLE-1 had one)
    norm_before_fc: bool = False  # EAGLE-3.1: RMSNorm over the concatenated taps before fc (eagle3)
    norm_output: bool = False  # EAGLE-3.1: the draft's normed output is its next step's feature (eagle3)
    init_from: str | None = None  # exported head folder to start from (more epochs, new data); its sizes,
    # taps and draft vocabulary win over aux_layer_ids / draft_vocab_size (but see redraw_vocab); peagle may
    # start from an eagle3 head (its layer, taps and vocabulary; new placeholder inputs:
    # heads.peagle.PEagleHead.from_eagle3)
    redraw_vocab: bool = False  # with init_from (eagle3 / peagle): draw the draft vocabulary anew from this
    # run's training data, draft_vocab_size tokens (0: as many as the head has); rows of tokens the head
    # drafted carry over, new ones start as the target's lm_head rows (heads.eagle.with_draft_vocab)

    def __post_init__(self) -> None:
        _one_of("head_type", self.head_type, RECIPE_HEAD_TYPES)
        _at_least(self, 0, "draft_vocab_size", "noise_width", "feature_loss_weight", "ce_loss_weight")
        _at_least(self, 0, "block_gamma")
        _at_least(self, 1, "draft_layers", "anchors", "parallel_depths")
        _require(0 < self.cod_ratio <= 1, f"cod_ratio must be in (0, 1], got {self.cod_ratio}")
        _require(0 <= self.cod_min_ratio <= 1, f"cod_min_ratio must be in [0, 1], got {self.cod_min_ratio}")
        _require(
            self.block_size >= 2, f"block_size must be at least 2 (a root and a draft), got {self.block_size}"
        )
        _at_least(self, 1, "ttt_steps")
        _require(0 < self.ttt_decay <= 1, f"ttt_decay must be in (0, 1], got {self.ttt_decay}")
        _one_of("distill_loss", self.distill_loss, DISTILL_LOSSES)
        _at_least(self, 0, "lk_eta")
        _require(
            self.head_type in ("eagle3", "peagle") or not (self.norm_before_fc or self.norm_output),
            "norm_before_fc and norm_output are EAGLE-3.1 options: eagle.head_type must be eagle3",
        )
        _require(
            self.head_type != "peagle" or not self.norm_output,
            "norm_output is not an option for peagle: vLLM's P-EAGLE config does not pass it on",
        )
        _require(
            self.distill_loss == "soft_ce" or self.head_type != "eagle1",
            f"distill_loss {self.distill_loss!r} is for eagle3 and dflash (eagle1 drafts over the full "
            "vocabulary)",
        )
        _require(
            not self.redraw_vocab or (self.init_from and self.head_type in ("eagle3", "peagle")),
            "redraw_vocab redraws the vocabulary of the eagle3 / peagle head in eagle.init_from: set both",
        )
        if self.head_type == "eagle1":  # eagle1 reads the final state and reuses the target's lm_head
            _require(self.aux_layer_ids is None, "aux_layer_ids must be null for eagle1 (eagle3 only)")
            _require(self.draft_vocab_size == 0, "draft_vocab_size must be 0 for eagle1 (eagle3 only)")


@dataclass(kw_only=True)
class MedusaTrainConfig:
    num_heads: int = 4  # K draft heads (Medusa: 3-5)
    num_layers: int = 1  # ResBlocks per head (Medusa: 1)
    share_lm_head: bool = False  # True: project with the frozen target lm_head (saves K x H x V parameters)
    decay: float = 0.8  # head k's CE is weighted decay**k (Medusa)
    head_loss_weight: float = 0.2  # Medusa-2: loss = LM loss + head_loss_weight * sum_k decay**k CE_k
    lora_r: int = 0  # 0 = Medusa-1 (heads only, target frozen); > 0 = Medusa-2 LoRA rank
    lora_alpha: int = 16  # LoRA scale numerator (scale = lora_alpha / lora_r)
    lora_dropout: float = 0.05  # dropout on the LoRA input
    lora_target_modules: list[str] = field(  # Linear layers given LoRA (HF names): the attention projections
        default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj"]
    )
    heads_only_steps: int = 0  # Medusa-2 stage 1: optimizer steps on the heads alone before LoRA joins
    head_lr_multiplier: float = 4.0  # Medusa-2: heads' lr = learning_rate x this (Medusa: x4)
    init_from: str | None = None  # exported Medusa head folder to start from (more epochs, new data); its
    # num_heads, num_layers and share_lm_head must equal the ones above

    def __post_init__(self) -> None:
        _at_least(self, 1, "num_heads")
        _at_least(self, 0, "num_layers", "lora_r", "heads_only_steps", "head_loss_weight")
        _require(0 < self.decay <= 1, f"decay must be in (0, 1], got {self.decay}")
        _require(0 <= self.lora_dropout < 1, f"lora_dropout must be in [0, 1), got {self.lora_dropout}")
        _require(
            self.head_lr_multiplier > 0, f"head_lr_multiplier must be > 0, got {self.head_lr_multiplier!r}"
        )
        _require(
            self.lora_r > 0 or self.heads_only_steps == 0, "heads_only_steps needs lora_r > 0 (Medusa-2)"
        )


def _check_precision(model: ModelConfig, train: TrainConfig) -> None:
    """A target stored in half precision needs the matching autocast: the fp32 head's activations meet the
    target's frozen embedding and lm_head, which only autocast reconciles."""
    needed = {dtype: precision for precision, dtype in HALF_PRECISIONS.items()}.get(model.dtype)
    if needed is not None and train.mixed_precision != needed:
        raise ValueError(
            f"model.dtype={model.dtype} needs train.mixed_precision={needed}, got "
            f"{train.mixed_precision!r}: the head trains in float32 and only autocast lets its "
            f"activations meet the {model.dtype} target's embedding and lm_head "
            f"(or set model.dtype=float32)"
        )


@dataclass(kw_only=True)
class EagleRunConfig:
    model: ModelConfig = field(default_factory=ModelConfig)  # frozen target; defaults: SmolLM2 on CPU
    data: DataConfig  # required section: train_files has no default
    eagle: EagleTrainConfig = field(default_factory=EagleTrainConfig)  # head and loss; defaults: EAGLE-3
    train: TrainConfig  # required section: output_dir has no default

    def __post_init__(self) -> None:
        _check_precision(self.model, self.train)


@dataclass(kw_only=True)
class MedusaRunConfig:
    model: ModelConfig = field(default_factory=ModelConfig)  # frozen target (LoRA-adapted when lora_r > 0)
    data: DataConfig  # required section: train_files has no default
    medusa: MedusaTrainConfig = field(default_factory=MedusaTrainConfig)  # heads and loss; defaults: Medusa-1
    train: TrainConfig  # required section: output_dir has no default

    def __post_init__(self) -> None:
        _check_precision(self.model, self.train)


class _Loader(yaml.SafeLoader):
    """SafeLoader that reads `1e-4` as a float (plain PyYAML follows YAML 1.1 and returns the str '1e-4') and
    refuses a key given twice in one mapping (PyYAML keeps the last: a second `train:` section dropped the
    first whole)."""


_Loader.add_implicit_resolver("tag:yaml.org,2002:float", YAML_FLOAT, list("-+0123456789"))


def _mapping_without_repeats(loader: yaml.SafeLoader, node: yaml.MappingNode) -> dict:
    seen: dict = {}
    for key_node, _ in node.value:
        key = loader.construct_object(key_node)
        line = key_node.start_mark.line + 1
        if isinstance(key, str) and key in seen:
            raise ConfigError(f"key {key!r} is given twice in one section (lines {seen[key]} and {line})")
        seen[key] = line
    return loader.construct_mapping(node)


_Loader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _mapping_without_repeats)


def load_config(cls: type[T], yaml_path: str | Path | None, overrides: Sequence[str] = ()) -> T:
    """Build a run config from a YAML file of sections, then `section.key=value` overrides.

    Args:
        cls: the run config dataclass, e.g. `EagleRunConfig` or `MedusaRunConfig`.
        yaml_path: YAML mapping of sections (`model:`, `train:`, ...); None = dataclass defaults only.
        overrides: `dotted.key=value` strings; values are parsed as YAML (`eagle.aux_layer_ids=[1,14,26]`).
    Returns:
        A validated `cls` instance.
    Raises:
        ConfigError: (a ValueError) unknown key, wrong type, bad choice or missing required key. The message
            names the dotted key, the file or override it came from, and the valid keys / type / choices.
    """
    source = str(yaml_path) if yaml_path is not None else "<no YAML file>"
    try:
        raw = yaml.load(Path(yaml_path).read_text(encoding="utf-8"), Loader=_Loader) if yaml_path else {}
    except ConfigError as error:
        raise ConfigError(f"{source}: {error}") from None
    raw = {} if raw is None else raw
    if not isinstance(raw, dict):
        raise ConfigError(f"{source}: the top level must be a mapping of sections, got {type(raw).__name__}")
    origins: dict[str, str] = {}  # dotted key -> the override that set it
    for item in overrides:
        key, sep, text = item.partition("=")
        key = key.strip()
        if not sep or not key:
            raise ConfigError(f"override {item!r} is not of the form dotted.key=value (config {source})")
        *parents, leaf = key.split(".")
        node = raw
        for depth, part in enumerate(parents):
            if node.get(part) is None:
                node[part] = {}
            if not isinstance(node[part], dict):
                raise ConfigError(
                    f"override {item!r}: {'.'.join(parents[: depth + 1])} is not a section (config {source})"
                )
            node = node[part]
        value = yaml.load(text, Loader=_Loader)
        if isinstance(value, dict) and isinstance(node.get(leaf), dict):
            _merge(
                node[leaf], value
            )  # `eagle={ce_loss_weight: 0.2}` sets that key; the section's others stay
        else:
            node[leaf] = value
        origins[key] = f"override {item!r} (config {source})"

    def where(key: str) -> str:
        hits = [k for k in origins if key == k or key.startswith((k + ".", k + "["))]
        return origins[max(hits, key=len)] if hits else source

    return build_dataclass(cls, raw, "", where)


def _merge(into: dict, value: dict) -> None:
    """`value`'s keys set in `into`, mappings merged key by key (a replaced section lost its other keys)."""
    for key, item in value.items():
        if isinstance(item, dict) and isinstance(into.get(key), dict):
            _merge(into[key], item)
        else:
            into[key] = item


def to_dict(cfg: Any) -> dict:
    """The config as plain YAML-safe data: nested dicts in field order, tuples as lists."""

    def plain(value: Any) -> Any:
        if isinstance(value, dict):
            return {k: plain(v) for k, v in value.items()}
        return [plain(v) for v in value] if isinstance(value, (list, tuple)) else value

    return plain(dataclasses.asdict(cfg))


def flatten(tree: dict, prefix: str = "") -> dict:
    """{"train": {"seed": 0}} -> {"train.seed": 0}: the dotted keys of the overrides; lists and None become
    strings (trackers take flat scalar hyperparameters; tensorboard rejects lists)."""
    flat = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            flat.update(flatten(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value if isinstance(value, (int, float, str, bool)) else str(value)
    return flat


def save_config(cfg: Any, path: str | Path) -> None:
    """Write the resolved config as YAML (next to each checkpoint); `load_config(type(cfg), path)` reads it.

    Args:
        cfg: a run config instance.
        path: destination file; its parent folders are created.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    name = type(cfg).__name__
    header = f"# resolved {name}; read back with load_config({name}, <this file>)\n"
    path.write_text(header + dump_yaml(to_dict(cfg)), encoding="utf-8")
