"""`generate`: speculative decoding with tree attention; `heads=None` is plain decoding through the same loop.

Each step: propose (draft tree below the target's last token) -> verify (one target forward over the
tree) -> accept (greedy or lossless sampling) -> commit (keep the accepted path's KV, feed the drafter).
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field

import torch
from torch import Tensor, nn
from transformers import DynamicCache

from decode.accept import accept_greedy, accept_sampling, accept_typical, sample, tally_ranks, target_probs
from decode.batch import BatchOutput, generate_batch, left_padded, truncate_at_stop
from decode.inputs import check_request, check_window, window_limit
from decode.propose import drafter_limits, float_dtype, make_drafter, propose
from decode.timing import synchronize
from decode.tree import resolve_tree, verify_rows
from decode.verify import compact_cache, verify
from heads.eagle import EagleHead
from heads.features import FeatureCapture
from heads.io import check_head_matches_target
from heads.medusa import MedusaHeads


@dataclass
class GenerateOutput:
    sequences: Tensor  # (1, prompt + new) token ids
    new_tokens: int  # tokens generated (EOS included when hit)
    tau: float  # mean tokens per verify pass, the target's bonus token INCLUDED
    target_forwards: int  # target forward passes, prefill included
    steps: int  # verify passes (target_forwards - 1)
    # acceptance counts are taken before the EOS / max_new_tokens cut: they describe
    # the drafter, tau the output
    accepted_per_depth: list[int] = field(default_factory=list)  # steps whose depth-d draft was accepted
    # [d-1][r]: steps accepting a rank-r node at depth d
    accepted_ranks: list[list[int]] = field(default_factory=list)
    # [d-1][r]: steps offering a rank-r child below the accepted depth-(d-1) node
    offered_ranks: list[list[int]] = field(default_factory=list)
    draft_nodes: int = 0  # draft tokens proposed over all steps (root excluded)
    seconds: float = 0.0
    stopped_at_eos: bool = False

    @property
    def tokens_per_second(self) -> float:
        return self.new_tokens / self.seconds if self.seconds > 0 else float("nan")

    def acceptance_rates(self) -> list[float]:
        """Per-depth acceptance: P(depth d accepted | depth d - 1 accepted)."""
        prev, rates = self.steps, []
        for count in self.accepted_per_depth:
            rates.append(count / prev if prev else 0.0)
            prev = count
        return rates


def _check_placement(heads: nn.Module, model: nn.Module) -> None:
    """Heads must sit on the target's device, their floating-point weights in its dtype. Integer tensors (d2t,
    t2d) and int8 layers (`decode.prepare.quantize_draft`, whose kept fp32 parts match an fp32 target) are
    judged by the floating-point parameters that remain; heads with none are judged by device only."""
    tensors = [*heads.parameters(), *heads.buffers()]
    devices = {t.device for t in tensors}
    floats = {p.dtype for p in heads.parameters() if p.is_floating_point()}
    wrong_device = any(d != model.device for d in devices)
    if wrong_device or (floats and floats != {model.dtype}):
        where = "/".join(sorted(str(d) for d in devices)) or "cpu"
        dtype = float_dtype(heads) if len(floats) <= 1 else "/".join(sorted(str(f) for f in floats))
        raise ValueError(
            f"heads are on {where} / {str(dtype).removeprefix('torch.')} but the target is on "
            f"{model.device} / {str(model.dtype).removeprefix('torch.')}; load them with "
            "load_heads(path, target=model, dtype=model.dtype, device=model.device)"
        )


@torch.no_grad()
def generate(
    model: nn.Module,
    input_ids: Tensor,
    heads: nn.Module | None = None,
    *,
    max_new_tokens: int,
    temperature: float = 0.0,
    top_p: float = 1.0,
    top_k: int = 0,
    tree=None,
    seed: int | None = None,
    eos_token_id: int | list[int] | None = None,
    acceptance: str = "lossless",
    attention_mask: Tensor | None = None,
) -> GenerateOutput | BatchOutput:
    """Decode from a frozen target, drafting with `heads` (Medusa or EAGLE); output equals the target's own.

    Args:
        model: HF causal LM (the target).
        input_ids: (1, T) or (T,) prompt ids, T >= 1; or (B, T) left-padded prompts with their
            `attention_mask`: then `decode.batch.generate_batch` decodes them together and returns a
            BatchOutput (per-row replies and statistics).
        heads: MedusaHeads, EagleHead or a `decode.propose.Drafter`; None is plain decoding (the baseline and
            the test oracle).
        max_new_tokens: number of tokens to generate at most (>= 1).
        temperature: 0 is greedy; > 0 samples from the target distribution.
        top_p: nucleus filter of the target distribution (sampling only).
        top_k: top-k filter of the target distribution (sampling only; 0 = off).
        tree: static tree (rank paths, a name in DEFAULT_TREES, or TreeBuffers) or a DynamicTree; None = the
            default for the target's device (`decode.tree.default_tree`): on CUDA the GPU sizes of the papers,
            GPU_EAGLE_TREE (EAGLE-2's depth 6, top_k 10, 60 tokens) for EAGLE heads and
            DEFAULT_TREES[GPU_MEDUSA_TREE] for Medusa; elsewhere the sizes measured on a 2-core CPU,
            DEFAULT_EAGLE_TREE (depth 5, top_k 4, 12 tokens) and DEFAULT_TREES[DEFAULT_MEDUSA_TREE].
        seed: seeds the sampling and draft draws.
        eos_token_id: stop token(s); None = the model's generation_config.
        acceptance: "lossless" (default) or "typical" (Medusa typical acceptance; LOSSY, sampling only).
        attention_mask: (B, T), 1 on prompt tokens (left padding); given, or B > 1, or a per-step policy as
            `tree` (`decode.batch.generate_batch`), decodes as a batch (B may be 1).
    Returns:
        GenerateOutput with sequences and stats (tau counts the bonus token).
    Raises:
        TypeError, ValueError: bad arguments, refused before any work (`decode.inputs`: id dtypes and range,
            a mask that is not 0/1 or not left-padded, non-finite or out-of-range sampling parameters, a
            request outgrowing a sliding window); or heads that do not fit the target (sizes, tapped layers,
            or a device or floating dtype other than the target's; the message names both).

    A decoding step queues its device work (drafting, the tree mask and positions, verification, acceptance,
    cache compaction) without waiting for it, and reads back one small tensor: the accepted path and the
    tokens it emits (tests/decode/test_host_syncs.py counts the host round trips per step).
    """
    request = check_request(
        model,
        input_ids,
        attention_mask,
        max_new_tokens=max_new_tokens,
        temperature=temperature,
        top_p=top_p,
        top_k=top_k,
        eos_token_id=eos_token_id,
        seed=seed,
    )
    input_ids, max_new_tokens, temperature = request.input_ids, request.max_new_tokens, request.temperature
    top_p, top_k, eos = request.top_p, request.top_k, request.eos
    if acceptance not in ("lossless", "typical"):
        raise ValueError(f"acceptance must be 'lossless' or 'typical' (lossy), got {acceptance!r}")
    if acceptance == "typical" and temperature == 0:
        raise ValueError("typical acceptance applies to sampling (temperature > 0); greedy is exact already")
    if isinstance(heads, (MedusaHeads, EagleHead)):  # before any work with them (a Drafter is taken as it is)
        check_head_matches_target(heads.config, model, where=type(heads).__name__)
        _check_placement(heads, model)
    if input_ids.shape[0] != 1 or attention_mask is not None or callable(tree):
        if acceptance != "lossless":
            raise NotImplementedError("typical acceptance decodes one sequence at a time")
        return generate_batch(
            model,
            input_ids,
            request.attention_mask,
            heads,
            max_new_tokens=max_new_tokens,
            temperature=temperature,
            top_p=top_p,
            top_k=top_k,
            tree=tree,
            seed=seed,
            eos_token_id=eos_token_id,
        )
    drafter = make_drafter(heads, model) if heads is not None else None
    device = model.device
    tree_spec = None
    if drafter is not None:
        max_depth, dynamic = drafter_limits(heads)
        tree_spec = resolve_tree(tree, max_depth=max_depth, dynamic=dynamic, device=device)
        # the last step verifies its tree behind the prompt and all but the newest of max_new_tokens - 1
        # tokens (plain decoding passes no mask of its own: the target applies its window itself)
        columns = input_ids.shape[1] + max_new_tokens - 2 + verify_rows(tree_spec)
        check_window(window_limit(model), columns, "this prompt and max_new_tokens")
    generator = torch.Generator(device=device).manual_seed(seed) if seed is not None else None
    vocab_size = model.get_output_embeddings().weight.shape[0]

    synchronize(device)
    start = time.perf_counter()
    prompt = input_ids.to(device)
    cache = DynamicCache(config=model.config)
    capture = FeatureCapture(model, drafter.feature_layers) if drafter is not None else None
    with capture if capture is not None else contextlib.nullcontext():
        out = model(input_ids=prompt, cache=cache, use_cache=True, logits_to_keep=1)
        last = out.logits[0, -1]
        if temperature == 0:
            root = last.argmax().view(1)  # (1,) on the device
        else:
            root = sample(target_probs(last, temperature, top_p, top_k), generator).view(1)
        generated = [int(root)]
        past = prompt.shape[1]
        if drafter is not None and not (generated[0] in eos or max_new_tokens == 1):  # else no step follows
            drafter.advance(capture.features()[0], torch.cat([prompt[0, 1:], root]))
        steps, per_depth, per_rank, offered, drafted = 0, [], [], [], 0
        while not (eos.intersection(generated[-1:]) or len(generated) >= max_new_tokens):
            draft = propose(
                drafter, root, tree_spec, temperature=temperature, generator=generator, vocab_size=vocab_size
            )
            logits, features = verify(model, cache, draft, past, capture)
            if temperature == 0:
                path, bonus = accept_greedy(draft, logits)
            elif acceptance == "typical":
                path, bonus = accept_typical(draft, logits, temperature, top_p, top_k, generator)
            else:
                path, bonus = accept_sampling(draft, logits, temperature, top_p, top_k, generator)
            # The step's one device-to-host transfer: the accepted path, the bonus token, and the tree's
            # tokens, parents and ranks (for the statistics). Everything before it stayed on the device.
            host = torch.cat([path, bonus.view(1), draft.tokens, draft.parents, draft.ranks]).tolist()
            size, nodes = path.numel(), len(draft)
            keep = [node for node in host[:size] if node >= 0]
            tokens = host[size + 1 : size + 1 + nodes]
            parents, ranks = host[size + 1 + nodes : size + 1 + 2 * nodes], host[size + 1 + 2 * nodes :]
            steps += 1
            drafted += nodes - 1
            tally_ranks(parents, ranks, keep, per_rank, offered)
            for depth in range(1, len(keep)):
                per_depth += [0] * (depth - len(per_depth))
                per_depth[depth - 1] += 1
            kept = path[: len(keep)]  # the accepted nodes as a device index: no upload
            compact_cache(cache, past, keep, kept)
            past += len(keep)
            new = [tokens[i] for i in keep[1:]] + [host[size]]
            generated += new
            root = bonus.view(1)
            # an EOS inside the path ends it too
            if eos.intersection(new) or len(generated) >= max_new_tokens:
                break  # the drafter needs no more input (nor the tokens after an EOS)
            if drafter is not None:
                drafter.advance(features.index_select(0, kept), torch.cat([draft.tokens[kept[1:]], root]))
    generated = truncate_at_stop(generated, eos, max_new_tokens)
    synchronize(device)
    seconds = time.perf_counter() - start
    emitted_by_steps = len(generated) - 1
    new_ids = torch.tensor([generated], dtype=input_ids.dtype, device=input_ids.device)
    return GenerateOutput(
        sequences=torch.cat([input_ids, new_ids], dim=1),
        new_tokens=len(generated),
        tau=emitted_by_steps / steps if steps else 1.0,
        target_forwards=steps + 1,
        steps=steps,
        accepted_per_depth=per_depth,
        accepted_ranks=per_rank,
        offered_ranks=offered,
        draft_nodes=drafted,
        seconds=seconds,
        stopped_at_eos=generated[-1] in eos,
    )


@dataclass
class PromptResult:
    """One prompt's outcome in `decode_prompts`."""

    reply: list[int]  # the generated tokens (EOS included when hit)
    steps: int  # verify passes
    tau: float  # tokens per verify pass, the bonus token included


def decode_prompts(
    model: nn.Module,
    prompts: list[Tensor],
    heads: nn.Module | None,
    *,
    max_new_tokens: int,
    batch_size: int = 1,
    pad_token_id: int = 0,
    **kwargs,
) -> list[PromptResult]:
    """Decode each 1-D prompt of `prompts`, `batch_size` at a time: one `generate` per prompt when 1, else
    left-padded batches through `decode.batch` (every row decodes as it would alone: at T=0 the same tokens
    and the same steps, except under a `DynamicTree.min_prob` bound, where a row may take fewer steps). For
    loops over prompt sets that want acceptance, not per-prompt timing (simulated tau, the ablation's tau per
    category). `kwargs` go to `generate` (tree, temperature, seed, eos_token_id).
    """
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    results = []
    for start in range(0, len(prompts), batch_size):
        chunk = [p.reshape(-1) for p in prompts[start : start + batch_size]]
        if len(chunk) == 1:
            out = generate(model, chunk[0], heads, max_new_tokens=max_new_tokens, **kwargs)
            reply = out.sequences[0, chunk[0].numel() :].tolist()
            results.append(PromptResult(reply, out.steps, out.tau))
            continue
        ids, mask = left_padded(chunk, pad_token_id)
        out = generate(model, ids, heads, max_new_tokens=max_new_tokens, attention_mask=mask, **kwargs)
        results += [PromptResult(r, s, t) for r, s, t in zip(out.replies, out.steps, out.tau)]
    return results
