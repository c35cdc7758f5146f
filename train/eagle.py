"""EAGLE recipe: train an EAGLE-1, EAGLE-3, P-EAGLE or DFlash draft head on a frozen target (2401.15077,
2503.01840, 2602.01469, 2602.06036).

    accelerate launch train/eagle.py configs/eagle3_smollm2.yaml [section.key=value ...]

Every rank: load the frozen target (any dtype) and the data, build the head (float32: its weights and Adam
states stay fp32; `train.mixed_precision` runs the compute under autocast), then per step run the target
(online hidden states, no grad), the head and its loss (TTT for EAGLE-3), and step the optimizer. Every rank
takes part in evaluation (eval loss; the head is gathered for the main process's simulated tau, also when
ZeRO-3 or FSDP2 shard it) and in writing the resume state (output_dir/state) and the head export
(output_dir/head, from the main process). Rerunning the same command resumes from the newest complete state.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from accelerate.utils import set_seed
from torch import Tensor, nn

from heads import EagleConfig, EagleHead, FeatureCapture
from heads.dflash import DFlashConfig, DFlashHead
from heads.eagle import with_draft_vocab
from heads.io import load_heads
from heads.peagle import PEagleConfig, PEagleHead
from train.block_losses import dflash_loss, peagle_loss
from train.checkpoint import EXPORT_DIR, export_head, gather_head
from train.config import EagleRunConfig, EagleTrainConfig, load_config, to_dict
from train.data import draft_vocab_from_frequencies, pad_token_id, token_frequencies
from train.distributed import check_deepspeed_precision, make_accelerator, shard_fsdp2_units
from train.evaluate import check_tau_target, simulated_tau
from train.loader import load_datasets, load_frozen_target
from train.loop import prepare_run, train_loop
from train.losses import eagle1_loss, eagle3_ttt_loss, needs_outside_mass
from train.offline import offline_rows


class EagleStep(nn.Module):
    """The head and its loss as one module, so DDP / DeepSpeed wrap a single forward. The target's frozen
    embedding and lm_head are kept outside the module tree: never wrapped, sharded or saved with the head."""

    def __init__(self, head: EagleHead, cfg: EagleTrainConfig, embed: nn.Module, lm_head: nn.Module) -> None:
        super().__init__()
        self.head, self.cfg = head, cfg
        self._frozen = (embed, lm_head)  # a tuple is not registered as submodules

    def forward(
        self, features: Tensor, input_ids: Tensor, target_logits: Tensor, loss_mask: Tensor
    ) -> tuple[Tensor, dict[str, Tensor]]:
        embed, lm_head = self._frozen
        features = _as_head_input(features, self.head)
        if self.head.head_type == "dflash":
            return dflash_loss(
                self.head,
                features,
                input_ids,
                target_logits,
                loss_mask,
                embed,
                lm_head,
                anchors=self.cfg.anchors,
                gamma=self.cfg.block_gamma or None,
                distill=self.cfg.distill_loss,
                lk_eta=self.cfg.lk_eta,
            )
        if self.head.head_type == "peagle":
            return peagle_loss(
                self.head,
                features,
                input_ids,
                target_logits,
                loss_mask,
                embed,
                ratio=self.cfg.cod_ratio,
                min_ratio=self.cfg.cod_min_ratio,
                max_anchors=self.cfg.anchors,
                distill=self.cfg.distill_loss,
                lk_eta=self.cfg.lk_eta,
            )
        if self.head.head_type == "eagle1":
            return eagle1_loss(
                self.head,
                features,
                input_ids,
                target_logits,
                loss_mask,
                embed,
                lm_head,
                noise_width=self.cfg.noise_width if self.training else 0.0,
                feature_weight=self.cfg.feature_loss_weight,
                ce_weight=self.cfg.ce_loss_weight,
            )
        return eagle3_ttt_loss(
            self.head,
            features,
            input_ids,
            target_logits,
            loss_mask,
            embed,
            ttt_steps=self.cfg.ttt_steps,
            decay=self.cfg.ttt_decay,
            distill=self.cfg.distill_loss,
            lk_eta=self.cfg.lk_eta,
        )


def _as_head_input(features: Tensor, head: nn.Module) -> Tensor:
    """Features in the head's dtype where no autocast does it: under DeepSpeed with bf16 the engine holds the
    head in bf16 and runs no autocast, while offline dumps hand over fp32 features."""
    dtype = next(head.parameters()).dtype
    if features.dtype == dtype or torch.is_autocast_enabled(features.device.type):
        return features
    return features.to(dtype)


def mask_token(cfg: EagleTrainConfig, counts: Tensor) -> int:
    """The token filling a block drafter's draft slots: `cfg.mask_token_id`, else the highest id the data
    never shows (its embedding means nothing else to the draft)."""
    if cfg.mask_token_id is not None:
        return cfg.mask_token_id
    unused = (counts == 0).nonzero().flatten()
    return int(unused[-1]) if unused.numel() else counts.numel() - 1


def new_dflash_head(cfg: EagleTrainConfig, target: nn.Module, train_set) -> DFlashHead:
    """A fresh DFlash head sized from the target (`eagle.head_type: dflash`), its draft vocabulary and mask
    token from the training data."""
    vocab = target.config.get_text_config().vocab_size
    counts = token_frequencies(train_set, vocab)
    mask_id = mask_token(cfg, counts)
    overrides = {"num_hidden_layers": cfg.draft_layers, "block_size": cfg.block_size}
    overrides |= {"aux_layer_ids": tuple(cfg.aux_layer_ids) if cfg.aux_layer_ids is not None else None}
    overrides |= {"draft_vocab_size": cfg.draft_vocab_size or None}
    head = DFlashHead(DFlashConfig.from_target(target.config, mask_id, **overrides))
    if head.config.draft_vocab_size < vocab:
        head.set_draft_vocab(draft_vocab_from_frequencies(counts, head.config.draft_vocab_size))
        head.init_lm_head_from_target(target.get_output_embeddings().weight)
    head.init_from_target(target, layers=cfg.layers_from_target)
    return head.to(dtype=torch.float32, device=target.device)


def new_head(cfg: EagleTrainConfig, target: nn.Module, train_set) -> EagleHead | DFlashHead:
    """A fresh float32 head sized from the target, on its device; EAGLE-3 gets its draft vocabulary from the
    training data. With `cfg.init_from`, the exported head in that folder instead (checked against the
    target). Float32 whatever the target's dtype: AdamW on bf16 weights would lose small late updates."""
    if cfg.init_from:
        head = load_heads(cfg.init_from, target, dtype=torch.float32, device=target.device)
        redraw = cfg.redraw_vocab and head.head_type in ("eagle3", "peagle")
        to_peagle = cfg.head_type == "peagle" and head.head_type == "eagle3"
        if redraw or to_peagle:
            counts = token_frequencies(train_set, target.config.get_text_config().vocab_size)
        if redraw:
            size = cfg.draft_vocab_size or head.config.draft_vocab_size
            head = with_draft_vocab(
                head, draft_vocab_from_frequencies(counts, size), target.get_output_embeddings().weight
            )
        if to_peagle:  # P-EAGLE from a trained EAGLE-3 head
            head = PEagleHead.from_eagle3(
                head, cfg.parallel_depths, mask_token(cfg, counts), target.get_input_embeddings().weight
            )
            return head.to(dtype=torch.float32).train().requires_grad_(True)
        if head.head_type != cfg.head_type:
            raise ValueError(
                f"eagle.init_from={cfg.init_from} holds a {head.head_type} head, but "
                f"eagle.head_type is {cfg.head_type}"
            )
        for key in ("norm_before_fc", "norm_output"):  # architecture, not training: the head's own wins
            asked, held = getattr(cfg, key), getattr(head.config, key, False)
            if asked and not held:
                raise ValueError(
                    f"eagle.{key}=true, but the head in eagle.init_from={cfg.init_from} has no {key}: "
                    "start a new head, or drop the option"
                )
        return head.train().requires_grad_(True)
    if cfg.head_type == "dflash":
        return new_dflash_head(cfg, target, train_set)
    overrides = {"fc_bias": cfg.fc_bias}
    vocab = target.config.get_text_config().vocab_size
    counts = token_frequencies(train_set, vocab) if cfg.head_type != "eagle1" else None
    if cfg.head_type != "eagle1":
        if cfg.aux_layer_ids is not None:
            overrides["aux_layer_ids"] = tuple(cfg.aux_layer_ids)
        overrides["draft_vocab_size"] = cfg.draft_vocab_size or None
        overrides |= {"norm_before_fc": cfg.norm_before_fc, "norm_output": cfg.norm_output}
    if cfg.head_type == "peagle":
        overrides |= {"parallel_depths": cfg.parallel_depths, "mask_token_id": mask_token(cfg, counts)}
        head = PEagleHead(PEagleConfig.from_target(target.config, **overrides))
        head.init_from_target(target.get_input_embeddings().weight)
    else:
        head = EagleHead(EagleConfig.from_target(target.config, cfg.head_type, **overrides))
    if cfg.head_type != "eagle1":
        if head.config.draft_vocab_size < vocab:
            head.set_draft_vocab(draft_vocab_from_frequencies(counts, head.config.draft_vocab_size))
        head.init_lm_head_from_target(target.get_output_embeddings().weight)
    return head.to(dtype=torch.float32, device=target.device)


class DraftVocabLogits(nn.Module):
    """The target's logits over an EAGLE-3 draft vocabulary, from its final hidden states: the lm_head's rows
    of those tokens (the full-vocabulary projection is never computed), soft-capped as the target's own
    forward does (Gemma 2). With `other`, one more column: the log of the target's probability mass outside
    the draft vocabulary (log-sum-exp of the other logits), so softmax over the Vd + 1 columns is the
    target's distribution with the outside tokens pooled; that costs the full projection, in chunks of
    `chunk` positions."""

    def __init__(
        self, lm_head_weight: Tensor, t2d: Tensor, other: bool = False, softcap: float | None = None
    ) -> None:
        super().__init__()
        # `weight`: the rows a loader reads its device and dtype from (train.offline.OfflineStates.batch)
        self.weight = nn.Parameter(lm_head_weight[t2d].detach().clone(), requires_grad=False)  # (Vd, H)
        self._full = lm_head_weight.detach() if other else None  # (V, H), shared with the target, not saved
        outside = torch.ones(lm_head_weight.shape[0], dtype=torch.bool, device=lm_head_weight.device)
        outside[t2d] = False
        self._outside, self._t2d, self.softcap, self.chunk = outside, t2d, softcap, 128

    def _cap(self, logits: Tensor) -> Tensor:
        return torch.tanh(logits / self.softcap) * self.softcap if self.softcap else logits

    def forward(self, hidden: Tensor) -> Tensor:
        """(..., H) final states -> (..., Vd) logits, or (..., Vd + 1) with the outside column."""
        if self._full is None:
            return self._cap(nn.functional.linear(hidden, self.weight))
        flat, parts = hidden.reshape(-1, hidden.shape[-1]), []
        for rows in flat.split(self.chunk):
            full = self._cap(nn.functional.linear(rows, self._full)).float()  # (n, V); log-sum-exp in fp32
            outside = full.masked_fill(~self._outside, float("-inf")).logsumexp(-1, keepdim=True)
            parts.append(torch.cat([full[:, self._t2d], outside], dim=-1))
        return torch.cat(parts).reshape(*hidden.shape[:-1], -1)


@torch.no_grad()
def target_pass(
    target: nn.Module, capture: FeatureCapture, batch: dict, draft_logits: DraftVocabLogits | None = None
) -> tuple[Tensor, Tensor]:
    """The frozen target's tapped features (B, T, F) and logits for a batch.

    With `draft_logits` (EAGLE-3 with a reduced vocabulary) the target runs without its full-vocabulary
    lm_head and the logits are (B, T, Vd), or (B, T, Vd + 1) with the outside column: the loss reads only
    those.
    """
    if draft_logits is None:
        logits = target(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
        return capture.features(), logits
    hidden = target.get_decoder()(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"])[0]
    return capture.features(), draft_logits(hidden)


def draft_vocab_logits(head: EagleHead, target: nn.Module, other: bool = False) -> DraftVocabLogits | None:
    """The target-logit module of an EAGLE-3 head with a reduced vocabulary (with the outside column for a
    forward-KL loss: `other`), else None (the target's own lm_head serves)."""
    if getattr(head, "t2d", None) is None or head.config.draft_vocab_size == head.config.vocab_size:
        return None
    softcap = getattr(target.config.get_text_config(), "final_logit_softcapping", None)
    return DraftVocabLogits(target.get_output_embeddings().weight, head.t2d, other=other, softcap=softcap)


def main(cfg: EagleRunConfig) -> None:
    accelerator = make_accelerator(cfg.train, cfg.model.dtype)
    check_deepspeed_precision(accelerator, cfg.model)
    set_seed(cfg.train.seed)
    accelerator.print(
        f"EAGLE recipe: {cfg.eagle.head_type} on {cfg.model.target}, {accelerator.num_processes} "
        f"process(es), {accelerator.distributed_type}"
    )

    # 1. frozen target (replicated on every rank, never sharded) + trainable fp32 head
    target, tokenizer = load_frozen_target(cfg.model, accelerator)
    check_tau_target(target, cfg.train.eval_tau_prompts)
    pad_id = pad_token_id(tokenizer)

    # 2. data
    train_set, eval_set = load_datasets(cfg.data, tokenizer, accelerator)
    head = new_head(cfg.eagle, target, train_set)
    step_module = EagleStep(head, cfg.eagle, target.get_input_embeddings(), target.get_output_embeddings())
    # FSDP2: the shard units accelerate's own wrapping gets wrong, made before AdamW sees the parameters
    shard_fsdp2_units(accelerator, step_module, called_by_method=(head,))

    # 3. optimizer and schedule (in optimizer steps), wrapped for the distributed setting; start or resume
    run = prepare_run(accelerator, cfg, step_module, head.parameters(), train_set)

    # 4. hidden states come from the target online, or from a dump (scripts/dump_hidden_states.py)
    # EAGLE-3: the target's logits over the draft vocabulary only (+ the outside mass for forward KL and LK)
    draft_logits = draft_vocab_logits(head, target, other=needs_outside_mass(cfg.eagle.distill_loss))
    softcap = getattr(target.config.get_text_config(), "final_logit_softcapping", None)
    rows, collate_fn = offline_rows(  # draft_logits soft-caps itself; the full lm_head does not
        cfg.data,
        train_set,
        pad_id,
        head.feature_layers,
        draft_logits or target.get_output_embeddings(),
        softcap=None if draft_logits is not None else softcap,
        target=target,
    )
    capture = FeatureCapture(target, head.feature_layers)  # its hooks are on inside `with capture:` below

    def online_loss(batch: dict) -> tuple[Tensor, dict[str, Tensor]]:
        with accelerator.autocast():  # the target computes in the run's precision too
            features, logits = target_pass(target, capture, batch, draft_logits)
        return run.module(features, batch["input_ids"], logits, batch["loss_mask"])

    def loss(batch: dict, step: int) -> tuple[Tensor, dict[str, Tensor]]:
        if collate_fn is None:
            return online_loss(batch)
        return run.module(batch["features"], batch["input_ids"], batch["logits"], batch["loss_mask"])

    def eval_tau() -> float | None:
        """On the main process, with a whole copy of the head gathered from every rank (ZeRO-3, FSDP2)."""
        whole = gather_head(accelerator, run.module)  # collective; None off the main process
        if whole is None:
            return None
        with capture.paused():  # generate installs its own capture
            return simulated_tau(
                target,
                whole,
                eval_set,
                cfg.train.eval_tau_prompts,
                cfg.train.eval_tau_new_tokens,
                cfg.train.eval_tau_batch_size,
                pad_id,
            )

    def export(step: int, name: str = EXPORT_DIR, eval_tau: float | None = None) -> Path:
        extra = {"train_step": step, "training": to_dict(cfg)}
        extra |= {"eval_tau": eval_tau} if eval_tau is not None else {}
        return export_head(
            accelerator,
            run.module,
            run.output_dir,
            name=name,
            base_model=cfg.model.target,
            base_revision=cfg.model.revision,
            target=target,
            extra=extra,
        )

    # 5. loop: every N steps evaluate (every rank) and write a resume state and an export; the final export
    with capture:
        train_loop(
            run,
            rows,
            eval_set,
            pad_id,
            loss=loss,
            eval_loss=lambda batch: online_loss(batch)[0],  # the held-out rows are tokens: run the target
            eval_tau=eval_tau,
            export=export,
            collate_fn=collate_fn,
        )
    accelerator.end_training()


if __name__ == "__main__":
    main(load_config(EagleRunConfig, sys.argv[1], sys.argv[2:]))
