"""Medusa recipe: Medusa-1 (heads on a frozen target) and Medusa-2 (heads + LoRA on the target, trained
jointly after a heads-only stage), Cai et al. 2401.10774 section 2.2.

    accelerate launch train/medusa.py configs/medusa1_smollm2.yaml [section.key=value ...]

Every rank: load the target (frozen, any dtype; LoRA-wrapped with peft when medusa.lora_r > 0) and the data,
build float32 heads from the target's lm_head (trainable weights and Adam states stay fp32;
`train.mixed_precision` runs the compute under autocast), then per step run the target and the head losses
and step the optimizer. Every rank takes part in evaluation (eval loss; heads, and for Medusa-2 its LoRA
weights, gathered for the main process's simulated tau) and in writing the resume state (output_dir/state),
the head export (output_dir/head) and, for Medusa-2, the LoRA adapter (output_dir/lora, safetensors; decode
with it merged into the target), which the main process writes from gathered weights.
"""

from __future__ import annotations

import contextlib
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from accelerate.utils import set_seed
from torch import Tensor, nn

from decode.layout import drop_onednn
from heads import MedusaConfig, MedusaHeads, load_heads
from train.checkpoint import EXPORT_DIR, export_head, head_from_state
from train.config import MedusaRunConfig, MedusaTrainConfig, load_config, to_dict
from train.data import pad_token_id
from train.distributed import (
    check_deepspeed_precision,
    make_accelerator,
    shard_fsdp2_units,
    shards_trained_weights,
    whole_on_every_rank,
    whole_parameters,
)
from train.evaluate import check_tau_target, simulated_tau
from train.loader import load_datasets, load_frozen_target
from train.loop import prepare_run, train_loop
from train.losses import masked_mean, medusa_loss_from_hidden
from train.offline import offline_rows


class MedusaStep(nn.Module):
    """Heads (and, for Medusa-2, the LoRA-wrapped target) with the loss as one module for DDP / DeepSpeed.

    Medusa-1 keeps the frozen target outside the module tree; Medusa-2 registers it, since its LoRA weights
    train. `lm_weight` 0 is the heads-only stage: the LM loss is off and the LoRA weights get exact zero
    gradients (DeepSpeed keeps its own gradient buffers, so dropping `.grad` afterwards would not hold them).
    """

    def __init__(self, heads: MedusaHeads, target: nn.Module, cfg: MedusaTrainConfig) -> None:
        super().__init__()
        self.heads, self.cfg = heads, cfg
        if cfg.lora_r > 0:
            self.target = target
        else:
            self._frozen = (target,)

    @property
    def base(self) -> nn.Module:
        return self.target if self.cfg.lora_r > 0 else self._frozen[0]

    def forward(
        self,
        input_ids: Tensor,
        attention_mask: Tensor,
        loss_mask: Tensor,
        lm_weight: float = 1.0,
        hidden: Tensor | None = None,
    ) -> tuple[Tensor, dict[str, Tensor]]:
        """`hidden`: the target's final states from an offline dump (Medusa-1 only); None runs the target."""
        joint = self.cfg.lora_r > 0
        if joint:
            out = self.base(input_ids=input_ids, attention_mask=attention_mask, output_hidden_states=True)
            hidden = out.hidden_states[-1]  # after the final norm: what the lm_head (and decode capture) sees
            if lm_weight == 0:  # heads-only stage: the heads learn, the LoRA weights see zero gradients
                hidden = hidden.detach() + 0 * hidden
        elif hidden is not None and not torch.is_autocast_enabled(hidden.device.type):
            # offline fp32 states, DeepSpeed bf16 heads
            hidden = hidden.to(next(self.heads.parameters()).dtype)
        elif hidden is None:  # Medusa-1 online: the decoder only (its output is after the final norm); the
            with torch.no_grad():  # full-vocabulary logits of the target are never read
                hidden = self.base.get_decoder()(input_ids=input_ids, attention_mask=attention_mask)[0]
        lm_head = self.base.get_output_embeddings() if self.cfg.share_lm_head else None
        head_loss, metrics = medusa_loss_from_hidden(
            self.heads, hidden, input_ids, loss_mask, decay=self.cfg.decay, lm_head=lm_head
        )
        if not joint:
            return head_loss, metrics
        logits = out.logits[:, :-1].float()
        lm_loss = masked_mean(
            F.cross_entropy(logits.transpose(1, 2), input_ids[:, 1:], reduction="none"),
            loss_mask[:, 1:].bool(),
        )
        metrics["lm_loss"] = lm_loss.detach()
        return lm_weight * lm_loss + self.cfg.head_loss_weight * head_loss, metrics


def frozen_or_lora_target(cfg: MedusaRunConfig, accelerator) -> tuple[nn.Module, object]:
    """The target (frozen, replicated on every rank) and tokenizer; wrapped with trainable float32 LoRA
    adapters for Medusa-2 (then it is part of the trained module, which ZeRO-3 and FSDP2 may shard)."""
    joint = cfg.medusa.lora_r > 0
    target, tokenizer = load_frozen_target(cfg.model, accelerator, whole=not joint)
    check_tau_target(target, cfg.train.eval_tau_prompts)
    if joint:
        from peft import get_peft_model

        if cfg.train.gradient_checkpointing:  # non-reentrant: needs no input that requires grad
            target.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
            target.config.use_cache = False
        # autocast_adapter_dtype (peft's default) keeps the adapters float32 on a bf16 target
        target = get_peft_model(target, lora_config(cfg.medusa), autocast_adapter_dtype=True)
    return target, tokenizer


def lora_config(cfg: MedusaTrainConfig):
    """The peft LoraConfig of Medusa-2's adapters."""
    from peft import LoraConfig

    return LoraConfig(
        r=cfg.lora_r,
        lora_alpha=cfg.lora_alpha,
        lora_dropout=cfg.lora_dropout,
        target_modules=list(cfg.lora_target_modules),
    )


def new_heads(cfg: MedusaTrainConfig, target: nn.Module) -> MedusaHeads:
    """Fresh heads whose projections start from the target's lm_head, or, with `cfg.init_from`, the exported
    heads in that folder (checked against the target and against num_heads / num_layers / share_lm_head)."""
    text = target.config.get_text_config()
    wanted = {"num_heads": cfg.num_heads, "num_layers": cfg.num_layers, "share_lm_head": cfg.share_lm_head}
    if not cfg.init_from:
        heads = MedusaHeads(MedusaConfig(text.hidden_size, text.vocab_size, **wanted))
        with whole_parameters([target.get_output_embeddings().weight]) as (weight,):
            heads.init_from_lm_head(weight)
        return heads
    heads = load_heads(cfg.init_from, target.config)
    if not isinstance(heads, MedusaHeads):
        raise TypeError(f"medusa.init_from={cfg.init_from} holds a {heads.head_type} head, not Medusa heads")
    found = {key: getattr(heads.config, key) for key in wanted}
    if found != wanted:
        diff = ", ".join(
            f"{k}: {wanted[k]} (config) vs {found[k]} (head)" for k in wanted if wanted[k] != found[k]
        )
        raise ValueError(f"medusa.init_from={cfg.init_from} does not match the medusa section: {diff}")
    return heads.train().requires_grad_(True)


def main(cfg: MedusaRunConfig) -> None:
    if cfg.data.hidden_states != "online" and cfg.medusa.lora_r > 0:  # fail before any model loads
        raise ValueError(
            "data.hidden_states=offline is for Medusa-1 only: Medusa-2 trains LoRA on the target, "
            "which changes its hidden states, so it must run the target online (medusa.lora_r=0 or "
            "data.hidden_states=online)"
        )
    accelerator = make_accelerator(cfg.train, cfg.model.dtype)
    check_deepspeed_precision(accelerator, cfg.model)
    set_seed(cfg.train.seed)
    joint = cfg.medusa.lora_r > 0
    mode = f"Medusa-2 (LoRA r={cfg.medusa.lora_r})" if joint else "Medusa-1"
    accelerator.print(
        f"Medusa recipe: {mode}, {cfg.medusa.num_heads} heads on {cfg.model.target}, "
        f"{accelerator.num_processes} process(es), {accelerator.distributed_type}"
    )

    # 1. target (frozen, or LoRA for Medusa-2) + trainable heads, projections initialised from its lm_head
    target, tokenizer = frozen_or_lora_target(cfg, accelerator)
    pad_id = pad_token_id(tokenizer)
    heads = new_heads(cfg.medusa, target)
    heads.to(dtype=torch.float32, device=accelerator.device)  # fp32 whatever the target: AdamW master weights
    step_module = MedusaStep(heads, target, cfg.medusa)
    # Medusa-2: the adapted target trains (LoRA dropout on); load_target returns eval mode
    step_module.train()
    # FSDP2: the shard units accelerate's own wrapping gets wrong, made before AdamW sees the parameters
    shard_fsdp2_units(accelerator, step_module, called_by_method=(heads,))

    # 2. data
    train_set, eval_set = load_datasets(cfg.data, tokenizer, accelerator)

    # 3. optimizer: heads at lr x head_lr_multiplier (Medusa-2) or lr (Medusa-1); LoRA idle in stage 1.
    # Wrapped for the distributed setting; start or resume
    groups = [{"params": list(heads.parameters())}]
    if joint:
        groups[0]["lr"] = cfg.train.learning_rate * cfg.medusa.head_lr_multiplier
        groups.append({"params": [p for p in target.parameters() if p.requires_grad]})
    run = prepare_run(accelerator, cfg, step_module, groups, train_set)

    # 4. final states from the target online, or from a dump (scripts/dump_hidden_states.py, Medusa-1)
    rows, collate_fn = offline_rows(cfg.data, train_set, pad_id, None, None, target=None if joint else target)
    eval_copy = {}  # Medusa-2 under ZeRO-3 / FSDP2: the main process's own adapted target for simulated tau

    def loss(batch: dict, step: int) -> tuple[Tensor, dict[str, Tensor]]:
        heads_only = step < cfg.medusa.heads_only_steps
        if joint:  # heads-only stage: no weight decay may move the idle LoRA weights (DeepSpeed keeps copies)
            run.optimizer.param_groups[1]["weight_decay"] = 0.0 if heads_only else cfg.train.weight_decay
        ids, mask, loss_mask = batch["input_ids"], batch["attention_mask"], batch["loss_mask"]
        return run.module(
            ids, mask, loss_mask, lm_weight=0.0 if heads_only else 1.0, hidden=batch.get("last")
        )

    def idle_lora(step: int) -> list[nn.Parameter] | None:
        """Heads-only stage: the LoRA gradients are exact zeros (MedusaStep); dropped, Adam skips them.
        DeepSpeed's Adam still counts these steps for LoRA (bias correction differs later; docs/gpu.md)."""
        if joint and step < cfg.medusa.heads_only_steps:
            return run.optimizer.param_groups[1]["params"]
        return None

    def held_out_loss(batch: dict) -> Tensor:  # the whole loss (LM + heads for Medusa-2), stage aside
        return run.module(batch["input_ids"], batch["attention_mask"], batch["loss_mask"])[0]

    # 5. loop: every N steps evaluate (every rank) and write a resume state and an export; the final export
    train_loop(
        run,
        rows,
        eval_set,
        pad_id,
        loss=loss,
        eval_loss=held_out_loss,
        eval_tau=lambda: eval_tau(accelerator, run.module, eval_set, cfg, eval_copy),
        export=lambda step, name=EXPORT_DIR, eval_tau=None: export(
            accelerator, run.module, run.output_dir, cfg, step, target, name, eval_tau
        ),
        collate_fn=collate_fn,
        idle_params=idle_lora,
    )
    accelerator.end_training()


def export(
    accelerator,
    step_module,
    out: Path,
    cfg: MedusaRunConfig,
    step: int,
    target: nn.Module,
    name: str = EXPORT_DIR,
    eval_tau: float | None = None,
) -> Path:
    """Head export to `out/<name>`, plus the LoRA adapter (safetensors) for Medusa-2 beside it (`lora/` for
    `head/`, `lora_best/` for `head_best/`), both from weights gathered from every rank (collective), so a
    sharded run (ZeRO-3, FSDP2) saves whole tensors."""
    extra = {"train_step": step, "training": to_dict(cfg)}
    extra |= {"eval_tau": eval_tau} if eval_tau is not None else {}
    lora = name.replace("head", "lora")
    if cfg.medusa.lora_r > 0:
        extra["lora_adapter"] = f"../{lora} (merge into the target before decoding: the heads expect it)"
    state = accelerator.get_state_dict(step_module)  # collective under ZeRO-3 and FSDP2
    path = export_head(
        accelerator,
        step_module,
        out,
        attr="heads",
        state=state,
        base_model=cfg.model.target,
        base_revision=cfg.model.revision,
        target=target,
        extra=extra,
        name=name,
    )
    if cfg.medusa.lora_r > 0 and accelerator.is_main_process:
        adapted = accelerator.unwrap_model(step_module).target
        adapted.save_pretrained(out / lora, safe_serialization=True, state_dict=_prefixed(state, "target."))
    accelerator.wait_for_everyone()
    return path


def _prefixed(state: dict, prefix: str) -> dict:
    """The entries of `state` under `prefix`, with the prefix removed."""
    return {k[len(prefix) :]: v for k, v in state.items() if k.startswith(prefix)}


def eval_tau(accelerator, step_module, eval_set, cfg: MedusaRunConfig, eval_copy: dict) -> float | None:
    """Simulated tau of greedy decoding on the main process, with the heads gathered from every rank and, for
    Medusa-2, its LoRA-adapted target (its own copy when ZeRO-3 or FSDP2 shard the run's); collective."""
    joint, sharded = cfg.medusa.lora_r > 0, shards_trained_weights(accelerator)
    state = accelerator.get_state_dict(step_module)  # collective under ZeRO-3 and FSDP2
    heads = head_from_state(accelerator, step_module, state, "heads")  # None off the main process
    if heads is None:
        return None
    module = accelerator.unwrap_model(step_module)
    if not joint:
        target = module.base
    elif not sharded:
        target = module.target.get_base_model()  # LoRA layers active: the adapted target
    else:
        target = _adapted_copy(cfg, accelerator, eval_copy, _prefixed(state, "target."))
    was_training = target.training
    target.eval()
    # The main process's own copy under ZeRO-3: outside it, peft and transformers would treat it as
    # partitioned and start collectives that the other ranks never join
    with whole_on_every_rank(accelerator) if sharded else contextlib.nullcontext():
        tau = simulated_tau(
            target,
            heads,
            eval_set,
            cfg.train.eval_tau_prompts,
            cfg.train.eval_tau_new_tokens,
            cfg.train.eval_tau_batch_size,
        )
    target.train(was_training)
    return tau


def _adapted_copy(cfg: MedusaRunConfig, accelerator, eval_copy: dict, state: dict) -> nn.Module:
    """The main process's whole LoRA-adapted target with the gathered weights `state` (built once, then
    refreshed): what a sharded Medusa-2 run evaluates on, since no rank holds the whole adapted target."""
    with whole_on_every_rank(accelerator):  # ZeRO-3: peft would gather "partitioned" weights collectively
        if "model" not in eval_copy:
            from peft import get_peft_model

            target, _ = load_frozen_target(cfg.model, accelerator)
            # its weights are overwritten at every evaluation: a cached oneDNN copy would only be stale
            drop_onednn(target)
            eval_copy["model"] = get_peft_model(target, lora_config(cfg.medusa), autocast_adapter_dtype=True)
        model = eval_copy["model"]
        model.load_state_dict(state, strict=True)
    return model.get_base_model()


if __name__ == "__main__":
    main(load_config(MedusaRunConfig, sys.argv[1], sys.argv[2:]))
