"""`generate`: speculative decoding with tree attention, B >= 1 prompts at once; `heads=None` is plain
decoding through the same loop.

Each step: propose (every row's draft tree below its last token, `decode.propose`) -> verify (one target
forward over every row's tree, `decode.batch.verify_batch`) -> accept (greedy or lossless sampling, per row)
-> commit (keep each row's accepted path's KV, `decode.batch.commit`; feed the drafter). A row that stops
(EOS, max_new_tokens) leaves the batch and drafts no more. B = 1 is a batch of one.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from decode.accept import accept_greedy, accept_sampling, accept_typical, sample, tally_ranks, target_probs
from decode.batch import commit, left_padded, prefill, replay, truncate_at_stop, verify_batch
from decode.drafters import make_drafter
from decode.drafters.lm_head import float_dtype
from decode.inputs import check_request
from decode.policy import as_policy
from decode.prepare import drop_changed_copies
from decode.propose import propose
from decode.recurrent import HYBRID_CHAIN, check_chain, record, settle
from decode.timing import synchronize
from decode.tree import chain, resolve_tree
from heads.features import FeatureCapture
from heads.io import check_head_matches_target
from heads.registry import kind_of


@dataclass
class RowOutput:
    """One row's results (`GenerateOutput.row`; `.one` for B = 1): `GenerateOutput`'s fields, as scalars."""

    sequence: Tensor  # (T + new,) this row's prompt (without padding) and reply
    new_tokens: int
    tau: float
    steps: int
    accepted_per_depth: list[int]
    accepted_ranks: list[list[int]]
    offered_ranks: list[list[int]]
    draft_nodes: int
    stopped_at_eos: bool
    target_forwards: int
    seconds: float

    @property
    def sequences(self) -> Tensor:
        """(1, T + new): the row as a batch of one."""
        return self.sequence[None]

    @property
    def tokens_per_second(self) -> float:
        return self.new_tokens / self.seconds if self.seconds > 0 else float("nan")

    def acceptance_rates(self) -> list[float]:
        """Per-depth acceptance: P(depth d accepted | the accepted depth-(d - 1) node offered a child), the
        steps that accepted depth d over those whose accepted path offered a depth-d draft. Steps that
        offered none there do not count: a policy's plain steps, a tree pruned to its root, an accepted leaf.
        A node's children are offered as a prefix of ranks, so rank 0's `offered_ranks` count is theirs."""
        return [
            count / offered[0] if offered and offered[0] else 0.0
            for count, offered in zip(self.accepted_per_depth, self.offered_ranks)
        ]


@dataclass
class GenerateOutput:
    """What `generate` returns, per row. For one prompt, `out.one` gives the row's fields as scalars."""

    sequences: Tensor  # (B, T + longest reply): the prompts as given, each reply after them, right-padded
    prompt_lengths: list[int]  # per row: its prompt's tokens (padding excluded)
    new_tokens: list[int]  # per row: tokens generated (EOS included when hit)
    tau: list[float]  # per row: tokens emitted per verify pass, the target's bonus token INCLUDED
    steps: list[int]  # per row: verify passes it took part in
    # acceptance counts are taken before the EOS / max_new_tokens cut: they describe the drafter, tau the
    # output
    accepted_per_depth: list[list[int]]  # per row: [d - 1] steps whose depth-d draft was accepted
    accepted_ranks: list[list[list[int]]]  # per row: [d - 1][r] steps accepting a rank-r node at depth d
    offered_ranks: list[list[list[int]]]  # per row: [d - 1][r] steps offering a rank-r child below the
    # accepted depth-(d - 1) node
    draft_nodes: list[int]  # per row: draft tokens proposed over all steps (roots excluded)
    stopped_at_eos: list[bool]  # per row
    target_forwards: int  # batched target forward passes, the prefill included
    seconds: float

    @property
    def replies(self) -> list[list[int]]:
        width = self.sequences.shape[1] - max(self.new_tokens, default=0)
        return [self.sequences[r, width : width + n].tolist() for r, n in enumerate(self.new_tokens)]

    @property
    def tokens_per_second(self) -> float:
        return sum(self.new_tokens) / self.seconds if self.seconds > 0 else float("nan")

    def row(self, b: int) -> RowOutput:
        """Row b's results as scalars."""
        width = self.sequences.shape[1] - max(self.new_tokens, default=0)
        prompt = self.sequences[b, width - self.prompt_lengths[b] : width]
        return RowOutput(
            sequence=torch.cat([prompt, self.sequences[b, width : width + self.new_tokens[b]]]),
            new_tokens=self.new_tokens[b],
            tau=self.tau[b],
            steps=self.steps[b],
            accepted_per_depth=self.accepted_per_depth[b],
            accepted_ranks=self.accepted_ranks[b],
            offered_ranks=self.offered_ranks[b],
            draft_nodes=self.draft_nodes[b],
            stopped_at_eos=self.stopped_at_eos[b],
            target_forwards=self.target_forwards,
            seconds=self.seconds,
        )

    @property
    def one(self) -> RowOutput:
        """The shortcut for one prompt: its row as scalars (ValueError for a batch of several)."""
        if len(self.new_tokens) != 1:
            raise ValueError(f"`one` is for a batch of one; this output has {len(self.new_tokens)} rows")
        return self.row(0)


def _check_heads(heads, model: nn.Module) -> None:
    """Heads loaded from a checkpoint (a registered kind with head types) must fit the target and sit on its
    device in its floating dtype. Integer tensors (d2t, t2d) and int8 layers (`decode.prepare.quantize_draft`,
    whose kept fp32 parts match an fp32 target) are judged by the floating-point parameters that remain;
    heads with none are judged by device only. Other draft sources are taken as they are."""
    for source in heads if isinstance(heads, (list, tuple)) else [heads]:
        if not isinstance(source, nn.Module) or not kind_of(source).head_types:
            continue
        check_head_matches_target(source.config, model, where=type(source).__name__)
        tensors = [*source.parameters(), *source.buffers()]
        devices = {t.device for t in tensors}
        floats = {p.dtype for p in source.parameters() if p.is_floating_point()}
        if any(d != model.device for d in devices) or (floats and floats != {model.dtype}):
            where = "/".join(sorted(str(d) for d in devices)) or "cpu"
            dtype = float_dtype(source) if len(floats) <= 1 else "/".join(sorted(str(f) for f in floats))
            raise ValueError(
                f"heads are on {where} / {str(dtype).removeprefix('torch.')} but the target is on "
                f"{model.device} / {str(model.dtype).removeprefix('torch.')}; load them with "
                "load_heads(path, target=model, dtype=model.dtype, device=model.device)"
            )


def _stacked(tensors: list[Tensor]) -> Tensor:
    """`torch.stack`, without a copy for a batch of one (a view)."""
    return tensors[0][None] if len(tensors) == 1 else torch.stack(tensors)


def _joined(tensors: list[Tensor]) -> Tensor:
    """`torch.cat`, without a copy for one tensor."""
    return tensors[0] if len(tensors) == 1 else torch.cat(tensors)


def _padded(path: Tensor, width: int) -> Tensor:
    """`path` (P,) cut or padded with -1 to `width` entries (on the device: nothing read back)."""
    if path.numel() >= width:
        return path[:width]
    return torch.cat([path, path.new_full((width - path.numel(),), -1)])


class _Rows:
    """Per-row statistics of a decode."""

    def __init__(self, batch: int, roots: list[Tensor]) -> None:
        self.generated = [[int(root)] for root in roots]
        self.steps, self.drafted = [0] * batch, [0] * batch
        self.per_depth: list[list[int]] = [[] for _ in range(batch)]
        self.ranks: list[list[list[int]]] = [[] for _ in range(batch)]
        self.offered: list[list[list[int]]] = [[] for _ in range(batch)]

    def record(self, r: int, keep: list[int], size: int, parents, ranks) -> None:
        self.steps[r] += 1
        self.drafted[r] += size - 1
        for level in range(1, len(keep)):
            self.per_depth[r] += [0] * (level - len(self.per_depth[r]))
            self.per_depth[r][level - 1] += 1
        if parents is not None:
            tally_ranks(parents, ranks, keep, self.ranks[r], self.offered[r])


@torch.no_grad()
def generate(
    model: nn.Module,
    input_ids: Tensor,
    heads=None,
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
    pad_token_id: int = 0,
) -> GenerateOutput:
    """Decode from a frozen target, drafting with `heads`; the output equals the target's own.

    Args:
        model: HF causal LM (the target).
        input_ids: (T,) or (B, T) prompt ids, T >= 1; left-padded when B > 1 with an `attention_mask`.
        heads: a draft source: a head module (MedusaHeads, EagleHead), an `Ngram` spec, a `DraftModel`, a
            `Composite`, any registered kind (`heads.registry`), a `decode.drafter.Drafter` instance for the
            batch, or a list of B one-row sources; None is plain decoding (the baseline and the test oracle).
        max_new_tokens: number of tokens to generate at most per row (>= 1).
        temperature: 0 is greedy; > 0 samples from the target distribution.
        top_p: nucleus filter of the target distribution (sampling only).
        top_k: top-k filter of the target distribution (sampling only; 0 = off).
        tree: static tree (rank paths, a name in DEFAULT_TREES, or TreeBuffers) or a DynamicTree; None = the
            default for the target's device and the drafter (`decode.tree.default_tree`): on CUDA the GPU
            sizes of the papers (EAGLE-2's depth 6, top_k 10, 60 tokens for drafters that grow dynamic trees,
            DEFAULT_TREES[GPU_MEDUSA_TREE] for Medusa); elsewhere the sizes measured on a 2-core CPU,
            DEFAULT_EAGLE_TREE (depth 5, top_k 4, 12 tokens) and DEFAULT_TREES[DEFAULT_MEDUSA_TREE], and when
            sampling a chain of `decode.tree.SAMPLING_CHAIN` drafts for every drafter. Or a
            per-step policy (`decode.policy.TreePolicy`, or a callable `rows -> tree or None`), asked every
            step with the rows still decoding: None is a plain step. On a hybrid target (recurrent layers)
            a chain: `decode.tree.chain(depth)` or a DynamicTree with top_k=1; the default is a chain of
            `decode.recurrent.HYBRID_CHAIN` drafts.
        seed: seeds the sampling and draft draws.
        eos_token_id: stop token(s); None = the model's generation_config.
        acceptance: "lossless" (default) or "typical" (Medusa typical acceptance; LOSSY, sampling only).
        attention_mask: (B, T), 1 on prompt tokens (left padding); None = no padding.
        pad_token_id: what pads the replies in `sequences`.
    Returns:
        GenerateOutput, per row (`.one` for one prompt).
    Raises:
        TypeError, ValueError: bad arguments, refused before any work (`decode.inputs`: id dtypes and range,
            a mask that is not 0/1 or not left-padded, non-finite or out-of-range sampling parameters, a
            target whose cache decoding does not lay out); a tree with branches on a hybrid target (layers
            with recurrent state verify chains: `decode.recurrent`); or heads that do not fit the target
            (sizes, tapped layers, or a device or floating dtype other than the target's; the message names
            both).

    A decoding step queues its device work (drafting, the tree masks and positions, verification, acceptance,
    cache compaction) without waiting for it, and reads back one small tensor for every row: the accepted
    paths and the tokens they emit (tests/decode/test_host_syncs.py counts the host round trips per step).
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
        pad_token_id=pad_token_id,
    )
    input_ids, max_new_tokens, temperature = request.input_ids, request.max_new_tokens, request.temperature
    top_p, top_k, eos, attention_mask = request.top_p, request.top_k, request.eos, request.attention_mask
    if acceptance not in ("lossless", "typical"):
        raise ValueError(f"acceptance must be 'lossless' or 'typical' (lossy), got {acceptance!r}")
    if acceptance == "typical" and temperature == 0:
        raise ValueError("typical acceptance applies to sampling (temperature > 0); greedy is exact already")
    if heads is not None:
        _check_heads(heads, model)  # before any work with them
    drop_changed_copies(model, heads)  # weight copies whose weights were rewritten unseen (decode.layout)
    batch = input_ids.shape[0]
    drafter = make_drafter(heads, model, batch) if heads is not None else None
    policy = as_policy(tree)
    resolved: dict = {}  # id(tree spec) -> (spec, resolved form): a policy hands out a few, again and again

    def spec_for(rows_alive: int):
        """The tree of this step: `tree` itself, or what the policy picks (None: plain)."""
        if drafter is None:
            return None
        wanted = policy.tree(rows_alive) if policy is not None else tree
        if policy is not None and wanted is None:
            return None
        known = resolved.get(id(wanted))
        if known is None or known[0] is not wanted:  # (the spec is kept, so its id is not reused meanwhile)
            limits = drafter.limits()
            form = wanted
            if request.recurrent and form is None:  # a hybrid target verifies chains (`decode.recurrent`)
                form = chain(min(HYBRID_CHAIN, limits.max_depth or HYBRID_CHAIN))
            known = (
                wanted,
                resolve_tree(
                    form,
                    max_depth=limits.max_depth,
                    dynamic=limits.dynamic,
                    device=model.device,
                    temperature=temperature,
                ),
            )
            if request.recurrent:
                check_chain(known[1], model.config.get_text_config(decoder=True).model_type)
            resolved[id(wanted)] = known
        return known[1]

    if policy is None:
        spec_for(batch)  # a fixed tree is resolved, and a bad one refused, before any work
    generator = torch.Generator(device=model.device).manual_seed(seed) if seed is not None else None
    vocab_size = model.get_output_embeddings().weight.shape[0]

    # each row's prompt length, on the host (the mask is the caller's: read before the clock starts)
    prompt_lengths = (
        [input_ids.shape[1]] * batch if attention_mask is None else attention_mask.sum(-1).tolist()
    )
    synchronize(model.device)
    start = time.perf_counter()
    layers = drafter.feature_layers if drafter is not None else ()
    capture = FeatureCapture(model, layers) if layers else None
    with capture if capture is not None else contextlib.nullcontext():
        state, last, features = prefill(model, input_ids, attention_mask, capture, request.windows)
        forwards = 1
        if temperature == 0:
            roots = list(last.argmax(-1).view(batch, 1))
        else:
            roots = [
                sample(target_probs(last[r], temperature, top_p, top_k), generator).view(1)
                for r in range(batch)
            ]
        stats = _Rows(batch, roots)
        rows = [r for r in range(batch) if not (stats.generated[r][0] in eos or max_new_tokens == 1)]
        prompt, width = input_ids.to(model.device), input_ids.shape[1]
        # what the drafter has yet to take in, per row: (features, next tokens) of its committed positions. It
        # takes them in just before it drafts, so plain steps chosen by a policy cost no draft forward
        pending: dict[int, list[tuple[Tensor | None, Tensor]]] = {r: [] for r in rows}
        if drafter is not None:  # each row's prompt: its last `prompt_lengths[r]` columns (left padding)
            drafter.start([prompt[r, width - n :] for r, n in enumerate(prompt_lengths)])
            for r in rows:
                start_column = width - prompt_lengths[r]
                feats = features[r, start_column:] if capture is not None else None
                pending[r].append((feats, torch.cat([prompt[r, start_column + 1 :], roots[r]])))
        if rows and len(rows) < batch:
            state.select(rows)
            if drafter is not None:
                drafter.select(rows)

        def catch_up() -> None:
            """The drafter takes in every row's pending positions, in one call."""
            tokens = [_joined([t for _, t in pending[r]]) for r in rows]
            feats = [_joined([f for f, _ in pending[r]]) for r in rows] if capture is not None else None
            drafter.advance(feats, tokens)
            for r in rows:
                pending[r].clear()

        drafted_last = False  # whether the last step drafted (the drafter then lags one step behind, no more)
        while rows:
            spec = spec_for(len(rows))  # None: a plain step (the drafter's pending positions wait)
            step_start = time.perf_counter()  # after the policy's pick: its search is not a step's cost
            if spec is not None:
                # a drafter catching up on the prompt or on plain steps: a one-off cost, left out of the
                # step's time (waited for on both sides, so a GPU's queued work does not leak into it)
                one_off = policy is not None and not drafted_last
                if one_off:
                    synchronize(model.device)
                catch_up()
                if one_off:
                    synchronize(model.device)
                    step_start = time.perf_counter()
            drafted_last = spec is not None
            trees = propose(
                drafter if spec is not None else None,
                _joined([roots[r] for r in rows]),
                spec,
                temperature=temperature,
                generator=generator,
                vocab_size=vocab_size,
            )
            size = len(trees[0])
            tokens = _stacked([t.tokens for t in trees])  # (B, N)
            rolled = state.hybrid and size > 1  # a chain over recurrent layers: its states recorded
            if rolled:
                record(state.cache, size)
            logits, step_features = verify_batch(
                model,
                state,
                tokens,
                _stacked([t.depths for t in trees]),
                _stacked([t.ancestors for t in trees]),
                capture,
            )
            forwards += 1
            if temperature == 0:
                accepted = [accept_greedy(draft, logits[i]) for i, draft in enumerate(trees)]
            elif acceptance == "typical":
                accepted = [
                    accept_typical(draft, logits[i], temperature, top_p, top_k, generator)
                    for i, draft in enumerate(trees)
                ]
            else:
                accepted = [
                    accept_sampling(draft, logits[i], temperature, top_p, top_k, generator)
                    for i, draft in enumerate(trees)
                ]
            depth = min(max(path.numel() for path, _ in accepted), size)  # a path is at most the tree
            paths = _stacked([_padded(path, depth) for path, _ in accepted])  # (B, P), -1 padded
            bonuses = _stacked([bonus.reshape(()) for _, bonus in accepted])  # (B,)
            parts = [paths.flatten(), bonuses, tokens.flatten()]
            if size > 1:  # the trees' shapes, for the statistics
                parts += [_stacked([t.parents for t in trees]).flatten()]
                parts += [_stacked([t.ranks for t in trees]).flatten()]
            # the step's one read of the device, for every row: paths, bonus tokens, tree tokens (and shapes)
            host = torch.cat([part.to(paths.device) for part in parts]).tolist()
            count = len(rows)
            offset = count * depth + count
            keeps, alive = [], []
            step_accepted: list[list[int]] = []  # this step's acceptance per (depth, rank), all rows
            step_offered: list[list[int]] = []
            for i, r in enumerate(rows):
                keep = [node for node in host[i * depth : (i + 1) * depth] if node >= 0]
                row_tokens = host[offset + i * size : offset + (i + 1) * size]
                new = [row_tokens[node] for node in keep[1:]] + [host[count * depth + i]]
                stats.generated[r] += new
                parents = ranks = None
                if size > 1:
                    shapes = offset + count * size
                    parents = host[shapes + i * size : shapes + (i + 1) * size]
                    ranks = host[shapes + (count + i) * size : shapes + (count + i + 1) * size]
                    if policy is not None:
                        tally_ranks(parents, ranks, keep, step_accepted, step_offered)
                stats.record(r, keep, size, parents, ranks)
                keeps.append(keep)
                roots[r] = bonuses[i : i + 1]
                if not (eos.intersection(new) or len(stats.generated[r]) >= max_new_tokens):
                    alive.append(i)
                    if drafter is not None:
                        kept = paths[i, : len(keep)]  # the accepted nodes as a device index: no upload
                        feats = step_features[i].index_select(0, kept) if capture is not None else None
                        pending[r].append((feats, torch.cat([tokens[i].index_select(0, kept[1:]), roots[r]])))
            if rolled:  # each row's recurrent state back to its accepted prefix
                saved = settle(state.cache, (paths >= 0).sum(1), size)
                if saved is not None:  # layers that recorded no intermediate states: run those rows again
                    replay(model, state, saved, tokens, keeps, size)
            commit(state, keeps, size, paths)
            if policy is not None and size > 1:
                policy.observe(step_accepted, step_offered)
            if alive and len(alive) < len(rows):  # (when none is left, the loop ends: nothing to select)
                state.select(alive)
                if drafter is not None:
                    drafter.select(alive)
            rows = [rows[i] for i in alive]
            if policy is not None:  # the step's host read above synchronized: no extra wait here
                policy.record_time(time.perf_counter() - step_start)
    synchronize(model.device)
    seconds = time.perf_counter() - start
    replies = [truncate_at_stop(g, eos, max_new_tokens) for g in stats.generated]
    width = max(len(reply) for reply in replies)
    sequences = torch.full((batch, input_ids.shape[1] + width), pad_token_id, dtype=input_ids.dtype)
    sequences[:, : input_ids.shape[1]] = input_ids.cpu()
    for r, reply in enumerate(replies):
        sequences[r, input_ids.shape[1] : input_ids.shape[1] + len(reply)] = torch.tensor(reply)
    return GenerateOutput(
        sequences=sequences.to(input_ids.device),
        prompt_lengths=prompt_lengths,
        new_tokens=[len(reply) for reply in replies],
        tau=[(len(reply) - 1) / st if st else 1.0 for reply, st in zip(replies, stats.steps)],
        steps=stats.steps,
        accepted_per_depth=stats.per_depth,
        accepted_ranks=stats.ranks,
        offered_ranks=stats.offered,
        draft_nodes=stats.drafted,
        stopped_at_eos=[bool(reply) and reply[-1] in eos for reply in replies],
        target_forwards=forwards,
        seconds=seconds,
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
    heads,
    *,
    max_new_tokens: int,
    batch_size: int = 1,
    pad_token_id: int = 0,
    **kwargs,
) -> list[PromptResult]:
    """Decode each 1-D prompt of `prompts`, `batch_size` at a time (left-padded batches: every row decodes as
    it would alone, at T=0 the same tokens and the same steps, except under a `DynamicTree.min_prob` bound,
    where a row may take fewer steps). For loops over prompt sets that want acceptance, not per-prompt timing
    (simulated tau, the ablation's tau per category). `kwargs` go to `generate` (tree, temperature, seed,
    eos_token_id).
    """
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    results = []
    for start in range(0, len(prompts), batch_size):
        chunk = [p.reshape(-1) for p in prompts[start : start + batch_size]]
        ids, mask = left_padded(chunk, pad_token_id)
        out = generate(
            model,
            ids,
            heads,
            max_new_tokens=max_new_tokens,
            attention_mask=mask if len(chunk) > 1 else None,
            **kwargs,
        )
        results += [PromptResult(r, s, t) for r, s, t in zip(out.replies, out.steps, out.tau)]
    return results
