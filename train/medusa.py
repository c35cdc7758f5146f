"""Medusa recipe: Medusa-1 (heads on a frozen target) and Medusa-2 (heads + LoRA on the target, trained
jointly after a heads-only stage), Cai et al. 2401.10774 section 2.2.

    accelerate launch train/medusa.py configs/medusa1_smollm2.yaml [section.key=value ...]

Every rank: load the target (frozen; LoRA-wrapped with peft when medusa.lora_r > 0) and the data, build the
heads from the target's lm_head, then per step run the target and the head losses and step the optimizer.
The main process logs and writes the resume state (output_dir/state), the head export (output_dir/head) and,
for Medusa-2, the LoRA adapter (output_dir/lora, safetensors): decode with the adapter merged into the target.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from accelerate.utils import set_seed
from torch import Tensor, nn
from tqdm.auto import tqdm

from heads import MedusaConfig, MedusaHeads, load_heads
from heads.target import load_target
from train.checkpoint import export_head, save_state
from train.common import (
    StepLogger,
    backward_and_clip,
    check_finite,
    epoch_loader,
    load_datasets,
    make_accelerator,
    make_optimizer,
    simulated_tau,
    start_or_resume,
    steps_per_epoch,
    total_steps,
    whole_on_every_rank,
)
from train.config import MedusaRunConfig, MedusaTrainConfig, load_config, to_dict
from train.losses import masked_mean, medusa_loss_from_hidden
from train.offline import offline_rows

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class MedusaStep(nn.Module):
    """Heads (and, for Medusa-2, the LoRA-wrapped target) with the loss as one module for DDP / DeepSpeed.

    Medusa-1 keeps the frozen target outside the module tree; Medusa-2 registers it, since its LoRA weights
    train. `lm_weight` switches the LM loss off during the heads-only stage.
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

    def forward(self, input_ids: Tensor, attention_mask: Tensor, loss_mask: Tensor,
                lm_weight: float = 1.0, hidden: Tensor | None = None) -> tuple[Tensor, dict[str, Tensor]]:
        """`hidden`: the target's final states from an offline dump (Medusa-1 only); None runs the target."""
        joint = self.cfg.lora_r > 0
        if hidden is None or joint:
            with torch.set_grad_enabled(joint and torch.is_grad_enabled()):
                out = self.base(input_ids=input_ids, attention_mask=attention_mask, output_hidden_states=True)
            hidden = out.hidden_states[-1]  # after the final norm: what the lm_head (and decode capture) sees
        lm_head = self.base.get_output_embeddings() if self.cfg.share_lm_head else None
        head_loss, metrics = medusa_loss_from_hidden(self.heads, hidden, input_ids, loss_mask,
                                                     decay=self.cfg.decay, lm_head=lm_head)
        if not joint:
            return head_loss, metrics
        logits = out.logits[:, :-1].float()
        lm_loss = masked_mean(F.cross_entropy(logits.transpose(1, 2), input_ids[:, 1:], reduction="none"),
                              loss_mask[:, 1:].bool())
        metrics["lm_loss"] = lm_loss.detach()
        return lm_weight * lm_loss + self.cfg.head_loss_weight * head_loss, metrics


def frozen_or_lora_target(cfg: MedusaRunConfig, accelerator) -> tuple[nn.Module, object]:
    """The target (frozen, replicated on every rank) and tokenizer; wrapped with trainable LoRA adapters for
    Medusa-2 (then it is part of the trained module, which ZeRO-3 may shard)."""
    if cfg.medusa.lora_r > 0:
        target, tokenizer = load_target(cfg.model.target, dtype=DTYPES[cfg.model.dtype],
                                        attn_implementation=cfg.model.attn_implementation, device=accelerator.device)
    else:
        with whole_on_every_rank(accelerator):
            target, tokenizer = load_target(cfg.model.target, dtype=DTYPES[cfg.model.dtype],
                                            attn_implementation=cfg.model.attn_implementation,
                                            device=accelerator.device)
    if cfg.medusa.lora_r > 0:
        from peft import LoraConfig, get_peft_model

        target = get_peft_model(target, LoraConfig(r=cfg.medusa.lora_r, lora_alpha=cfg.medusa.lora_alpha,
                                                   lora_dropout=cfg.medusa.lora_dropout,
                                                   target_modules=list(cfg.medusa.lora_target_modules)))
    return target, tokenizer


def new_heads(cfg: MedusaTrainConfig, target: nn.Module) -> MedusaHeads:
    """Fresh heads whose projections start from the target's lm_head, or, with `cfg.init_from`, the exported
    heads in that folder (checked against the target and against num_heads / num_layers / share_lm_head)."""
    text = target.config.get_text_config()
    wanted = {"num_heads": cfg.num_heads, "num_layers": cfg.num_layers, "share_lm_head": cfg.share_lm_head}
    if not cfg.init_from:
        heads = MedusaHeads(MedusaConfig(text.hidden_size, text.vocab_size, **wanted))
        heads.init_from_lm_head(target.get_output_embeddings().weight)
        return heads
    heads = load_heads(cfg.init_from, target.config)
    if not isinstance(heads, MedusaHeads):
        raise TypeError(f"medusa.init_from={cfg.init_from} holds a {heads.head_type} head, not Medusa heads")
    found = {key: getattr(heads.config, key) for key in wanted}
    if found != wanted:
        diff = ", ".join(f"{k}: {wanted[k]} (config) vs {found[k]} (head)" for k in wanted if wanted[k] != found[k])
        raise ValueError(f"medusa.init_from={cfg.init_from} does not match the medusa section: {diff}")
    return heads.train().requires_grad_(True)


def main(cfg: MedusaRunConfig) -> None:
    if cfg.data.hidden_states != "online" and cfg.medusa.lora_r > 0:  # fail before any model loads
        raise ValueError("data.hidden_states=offline is for Medusa-1 only: Medusa-2 trains LoRA on the target, "
                         "which changes its hidden states, so it must run the target online (medusa.lora_r=0 or "
                         "data.hidden_states=online)")
    accelerator = make_accelerator(cfg.train)
    set_seed(cfg.train.seed)
    out = Path(cfg.train.output_dir)
    mode = f"Medusa-2 (LoRA r={cfg.medusa.lora_r})" if cfg.medusa.lora_r > 0 else "Medusa-1"
    accelerator.print(f"Medusa recipe: {mode}, {cfg.medusa.num_heads} heads on {cfg.model.target}, "
                      f"{accelerator.num_processes} process(es)")

    # 1. target (frozen, or LoRA for Medusa-2) + trainable heads, projections initialised from its lm_head
    target, tokenizer = frozen_or_lora_target(cfg, accelerator)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    heads = new_heads(cfg.medusa, target)
    heads.to(dtype=target.dtype, device=accelerator.device)
    step_module = MedusaStep(heads, target, cfg.medusa)

    # 2. data
    train_set, eval_set = load_datasets(cfg.data, tokenizer, accelerator)

    # 3. optimizer: heads at lr x head_lr_multiplier (Medusa-2) or lr (Medusa-1); LoRA idle in stage 1
    per_epoch = steps_per_epoch(train_set, cfg.train, accelerator.num_processes)
    num_steps = total_steps(cfg.train, per_epoch)
    groups = [{"params": list(heads.parameters())}]
    if cfg.medusa.lora_r > 0:
        groups[0]["lr"] = cfg.train.learning_rate * cfg.medusa.head_lr_multiplier
        groups.append({"params": [p for p in target.parameters() if p.requires_grad]})
    optimizer, scheduler = make_optimizer(groups, cfg.train, num_steps)

    # 4. wrap; the scheduler is stepped by hand once per optimizer step
    step_module, optimizer = accelerator.prepare(step_module, optimizer)
    accelerator.register_for_checkpointing(scheduler)
    step = start_or_resume(accelerator, cfg, out, num_steps)

    # 5. loop; final states from the target online, or from a dump (scripts/dump_hidden_states.py, Medusa-1)
    rows, collate_fn = offline_rows(cfg.data, train_set, pad_id, None, None)
    export_kwargs = {"base_model": cfg.model.target, "base_revision": cfg.model.revision, "target": target}
    progress = tqdm(total=num_steps, initial=step, disable=not accelerator.is_main_process, desc="train")
    logger = StepLogger(accelerator, progress, cfg.train.log_every_steps)
    while step < num_steps:
        epoch, done = divmod(step, per_epoch)
        loader = epoch_loader(rows, cfg.train, cfg.data, epoch, pad_id, accelerator,
                              skip_batches=done * cfg.train.gradient_accumulation_steps, collate_fn=collate_fn)
        for batch in loader:
            stage_one = step < cfg.medusa.heads_only_steps
            with accelerator.accumulate(step_module):
                loss, metrics = step_module(batch["input_ids"], batch["attention_mask"], batch["loss_mask"],
                                            lm_weight=0.0 if stage_one else 1.0, hidden=batch.get("last"))
                check_finite(accelerator, loss, step, out)
                # heads-only stage: LoRA weights do not move, and their gradients do not enter the clip norm
                lora_idle = stage_one and len(optimizer.param_groups) > 1
                idle = optimizer.param_groups[1]["params"] if lora_idle else None
                grad_norm = backward_and_clip(accelerator, loss, step_module, cfg.train.max_grad_norm, idle)
                optimizer.step()
                optimizer.zero_grad()
            logger.count(batch)
            if not accelerator.sync_gradients:
                continue
            scheduler.step()
            step += 1
            logger.step(step, step == num_steps, loss, scheduler.get_last_lr()[0], grad_norm, metrics)
            if (cfg.train.eval_every_steps and step % cfg.train.eval_every_steps == 0) or step == num_steps:
                evaluate(accelerator, step_module, eval_set, cfg, step)
            if cfg.train.save_every_steps and step % cfg.train.save_every_steps == 0 and step < num_steps:
                save_state(accelerator, out, step, cfg.train.keep_checkpoints)
                export(accelerator, step_module, out, cfg, step, export_kwargs)
            if step >= num_steps or step % per_epoch == 0:
                break
    progress.close()
    save_state(accelerator, out, step, cfg.train.keep_checkpoints)
    path = export(accelerator, step_module, out, cfg, step, export_kwargs)
    accelerator.print(f"exported {path}")
    accelerator.end_training()


def export(accelerator, step_module, out: Path, cfg: MedusaRunConfig, step: int, export_kwargs: dict) -> Path:
    """Head export, plus the LoRA adapter (safetensors) for Medusa-2."""
    extra = {"train_step": step, "training": to_dict(cfg)}
    if cfg.medusa.lora_r > 0:
        extra["lora_adapter"] = "../lora (merge into the target before decoding: the heads expect it)"
    path = export_head(accelerator, step_module, out, attr="heads", **export_kwargs, extra=extra)
    if cfg.medusa.lora_r > 0:
        module = accelerator.unwrap_model(step_module)
        accelerator.wait_for_everyone()
        if accelerator.is_main_process:
            module.target.save_pretrained(out / "lora", safe_serialization=True)
    return path


@torch.no_grad()
def evaluate(accelerator, step_module, eval_set, cfg: MedusaRunConfig, step: int) -> None:
    """Simulated tau of greedy decoding with the current heads on held-out prompts (main process)."""
    if accelerator.is_main_process and cfg.medusa.lora_r == 0:
        module = accelerator.unwrap_model(step_module)
        tau = simulated_tau(module.base, module.heads, eval_set, cfg.train.eval_tau_prompts,
                            cfg.train.eval_tau_new_tokens)
        if tau is not None:
            accelerator.print(f"step {step}: eval_tau {tau:.3f}")
            accelerator.log({"eval_tau": tau}, step=step)
    accelerator.wait_for_everyone()


if __name__ == "__main__":
    main(load_config(MedusaRunConfig, sys.argv[1], sys.argv[2:]))
