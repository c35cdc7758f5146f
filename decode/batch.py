"""Batched decoding: B sequences share one target KV cache and one forward per step, each with its own tree,
its own committed length and its own accepted path.

The cache stays rectangular, (B, heads, L, head_dim) per layer. Column validity is per row (`valid`, (B, L)):
left padding and the columns a row did not keep are masked out, never attended to. Positions come from each
row's committed length (`lengths`), not from the column, so a row's holes cost nothing but memory. After a
step, `commit` moves each row's accepted tree entries right behind that row's last committed column and cuts
the columns no row uses any more: the cache grows by the longest accepted path, not by the tree size.

`generate_batch` decodes B prompts with draft trees (one drafter per row, the target verifying every row's
tree in one forward; `decode.generate` routes a batch here), or without (`heads=None`: plain decoding through
the same loop). Tested against per-prompt decoding and transformers' own batched `generate`.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field

import torch
from torch import Tensor, nn
from transformers import DynamicCache

from decode.accept import accept_greedy, accept_sampling, sample, tally_ranks, target_probs
from decode.batch_draft import make_batch_drafter, propose_batch
from decode.inputs import check_attention_mask, check_request, check_window, window_limit
from decode.propose import Drafter, drafter_limits, make_drafter, propose
from decode.timing import synchronize
from decode.tree import resolve_tree, tree_label, verify_rows
from heads.eagle import additive_mask
from heads.features import FeatureCapture


@dataclass
class BatchState:
    """What a batched decode carries between steps."""

    cache: DynamicCache
    valid: Tensor  # (B, L) bool: cache column j holds a committed token of row b
    lengths: Tensor  # (B,) int64: committed tokens per row (the next token's position)
    ends: Tensor  # (B,) int64: one past each row's last valid column
    host_ends: list[int] = field(
        default_factory=list
    )  # `ends` on the host: laying out the cache reads nothing

    def __post_init__(self) -> None:
        if not self.host_ends:
            self.host_ends = self.ends.tolist()

    @property
    def columns(self) -> int:
        return self.valid.shape[1]

    def select(self, rows: list[int]) -> None:
        """Keep only `rows` (indices into the batch) in the batch and the cache (finished sequences leave)."""
        index = torch.tensor(rows, dtype=torch.long, device=self.valid.device)
        self.cache.batch_select_indices(index)
        self.valid, self.lengths, self.ends = self.valid[index], self.lengths[index], self.ends[index]
        self.host_ends = [self.host_ends[r] for r in rows]
        self._trim()

    def _trim(self) -> None:
        end = max(self.host_ends, default=0)
        if end < self.columns:
            self.valid = self.valid[:, :end]
            for layer in self.cache.layers:
                layer.keys, layer.values = layer.keys[..., :end, :], layer.values[..., :end, :]


def left_padded(rows: list[torch.Tensor], pad: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(B, T) ids and attention mask of 1-D prompts of any lengths, padded on the left with `pad`."""
    width = max(r.numel() for r in rows)
    ids = torch.full((len(rows), width), pad, dtype=torch.long)
    mask = torch.zeros(len(rows), width, dtype=torch.long)
    for b, row in enumerate(rows):
        ids[b, width - row.numel() :], mask[b, width - row.numel() :] = row, 1
    return ids, mask


@torch.no_grad()
def prefill(
    model: nn.Module, input_ids: Tensor, attention_mask: Tensor, capture: FeatureCapture | None = None
) -> tuple[BatchState, Tensor, Tensor | None]:
    """Run the left-padded prompts (B, T) through the target.

    Returns:
        the batch state, the logits after each prompt's last token (B, V), and the captured features
        (B, T, F) or None.
    """
    mask = check_attention_mask(attention_mask, tuple(input_ids.shape)).to(model.device)
    lengths = mask.sum(-1)
    # a sliding-window layer keeps only its window: a batch wider than it is laid out by one batched pass
    window = getattr(model.config.get_text_config(), "sliding_window", None)
    fits = window is None or input_ids.shape[1] <= window
    if fits and input_ids.numel() > PER_ROW_PREFILL * int(lengths.sum()):
        cache, last, features = _prefill_rows(model, input_ids.to(model.device), lengths, capture)
    else:
        cache = DynamicCache(config=model.config)
        out = model(
            input_ids=input_ids.to(model.device),
            attention_mask=mask,
            position_ids=(mask.cumsum(-1) - 1).clamp(min=0),
            cache=cache,
            use_cache=True,
            logits_to_keep=1,  # the next token's logits only: not B x T x V floats
        )
        last, features = out.logits[:, -1], capture.features() if capture is not None else None
    valid = mask.bool()
    state = BatchState(
        cache=cache,
        valid=valid,
        lengths=lengths,
        ends=torch.full((valid.shape[0],), valid.shape[1], dtype=torch.long, device=valid.device),
    )
    return state, last, features


PER_ROW_PREFILL = 1.5  # prefill row by row when padding would make the batched prompt pass this much larger


def _prefill_rows(
    model: nn.Module, input_ids: Tensor, lengths: Tensor, capture: FeatureCapture | None
) -> tuple[DynamicCache, Tensor, Tensor | None]:
    """`prefill` one row at a time (each over its own tokens only, no padding), the results laid out as the
    batched pass lays them out: the cache and the features left-padded to the batch's width. For prompts of
    very different lengths (one long prompt in a batch of short ones): sum of the lengths instead of B x the
    longest, and no attention over padding."""
    batch, width = input_ids.shape
    rows, lasts, feats = [], [], []
    for r in range(batch):
        n = int(lengths[r])
        cache = DynamicCache(config=model.config)
        out = model(
            input_ids=input_ids[r : r + 1, width - n :], cache=cache, use_cache=True, logits_to_keep=1
        )
        rows.append(cache)
        lasts.append(out.logits[0, -1])
        if capture is not None:
            feats.append(capture.features()[0])
    cache = DynamicCache(config=model.config)
    for index in range(len(rows[0].layers)):
        parts = [(row.layers[index].keys, row.layers[index].values) for row in rows]
        shape = (batch, *parts[0][0].shape[1:-2], width, parts[0][0].shape[-1])
        keys = parts[0][0].new_zeros(shape)
        values = parts[0][1].new_zeros(shape[:-1] + (parts[0][1].shape[-1],))
        for r, (k, v) in enumerate(parts):
            keys[r, ..., width - k.shape[-2] :, :], values[r, ..., width - v.shape[-2] :, :] = k[0], v[0]
        cache.update(keys, values, index)
    features = None
    if capture is not None:
        features = feats[0].new_zeros(batch, width, feats[0].shape[-1])
        for r, f in enumerate(feats):
            features[r, width - f.shape[0] :] = f
    return cache, torch.stack(lasts), features


def batch_tree_mask(valid: Tensor, ancestors: Tensor, dtype: torch.dtype) -> Tensor:
    """(B, 1, N, L + N) additive mask: each row's nodes see that row's valid columns, their ancestors and
    themselves. `valid` (B, L) bool, `ancestors` (B, N, N) bool (ancestor-or-self)."""
    b, n = ancestors.shape[:2]
    allowed = torch.cat([valid[:, None, :].expand(b, n, valid.shape[1]), ancestors], dim=-1)
    return additive_mask(allowed, dtype)[:, None]


@torch.no_grad()
def verify_batch(
    model: nn.Module,
    state: BatchState,
    tokens: Tensor,
    depths: Tensor,
    ancestors: Tensor,
    capture: FeatureCapture | None = None,
) -> tuple[Tensor, Tensor | None]:
    """Score B trees of N nodes each in one target forward; their KV is appended to the cache.

    Args:
        model: the target.
        state: the batch (its cache holds `state.columns` columns).
        tokens: (B, N) node tokens, node 0 = the row's root (its last emitted token, not yet cached).
        depths: (B, N) node depths (root 0).
        ancestors: (B, N, N) bool ancestor-or-self matrices.
        capture: records the features a drafter needs, if any.
    Returns:
        logits (B, N, V) and features (B, N, F) or None.
    """
    device = model.device
    positions = state.lengths[:, None] + depths.to(device)
    mask = batch_tree_mask(state.valid, ancestors.to(device), model.dtype)
    out = model(
        input_ids=tokens.to(device),
        position_ids=positions,
        attention_mask=mask,
        cache=state.cache,
        use_cache=True,
    )
    features = capture.features() if capture is not None else None
    return out.logits, features


def commit(state: BatchState, keep: list[list[int]], tree_size: int, path: Tensor | None = None) -> None:
    """Keep each row's accepted nodes (`keep[b]`: node indices, root first, in path order) of the last
    `verify_batch` (`tree_size` nodes per row): move their KV right behind the row's last valid column, mark
    them valid, advance the row's length, and cut the columns no row uses.

    The move is a few batched ops per layer whatever B is (a gather of every row's path, a scatter behind its
    end). `path`: the same nodes as a (B, P) device tensor padded with -1 (what `accept_greedy` returns, one
    row per sequence), so nothing is uploaded; without it `keep` is uploaded once."""
    before = state.columns  # the columns before this step's tree (`valid` does not cover the tree yet)
    batch = state.valid.shape[0]
    if len(keep) != batch:
        raise ValueError(f"keep has {len(keep)} rows, the batch {batch}")
    lengths = {layer.keys.shape[-2] for layer in state.cache.layers}
    if len(lengths) > 1:
        raise NotImplementedError(
            "cache layers differ in length (a sliding window is full); sequences longer than the sliding "
            "window are not supported yet"
        )
    if lengths != {before + tree_size}:
        raise ValueError(
            f"the cache holds {lengths.pop()} columns, expected {before} + a tree of {tree_size}"
        )
    device = state.valid.device
    width = min(max((len(nodes) for nodes in keep), default=0), tree_size)  # a path is at most the tree
    valid = torch.cat([state.valid, state.valid.new_zeros(batch, tree_size)], dim=1)
    if width:
        if path is None:
            path = torch.tensor([nodes + [-1] * (width - len(nodes)) for nodes in keep], device=device)
        path = path[:, :width].to(device)
        taken = path >= 0
        # row b's i-th kept node goes to column ends[b] + i; the padding (-1) copies the root into columns
        # past the row's new end, which stay invalid (ends[b] + width - 1 <= before + tree_size - 1)
        target = state.ends[:, None] + torch.arange(width, device=device)
        source = before + path.clamp(min=0)
        for layer in state.cache.layers:
            for name in ("keys", "values"):
                cached = getattr(layer, name)
                shape = (-1, cached.shape[1], -1, cached.shape[-1])
                src = source.to(cached.device)[:, None, :, None].expand(shape)
                dst = target.to(cached.device)[:, None, :, None].expand(shape)
                cached.scatter_(2, dst, cached.gather(2, src))
        valid.scatter_(1, target, taken)
        counts = taken.sum(1)
        state.ends = state.ends + counts
        state.lengths = state.lengths + counts
        state.host_ends = [end + len(nodes) for end, nodes in zip(state.host_ends, keep)]
    state.valid = valid
    state._trim()


def _padded(path: Tensor, width: int) -> Tensor:
    """`path` (P,) cut or padded with -1 to `width` entries (on the device: nothing read back)."""
    if path.numel() >= width:
        return path[:width]
    return torch.cat([path, path.new_full((width - path.numel(),), -1)])


def truncate_at_stop(tokens: list[int], eos: frozenset[int], max_new_tokens: int) -> list[int]:
    """Cut at the first stop token (kept) and at max_new_tokens."""
    for i, token in enumerate(tokens):
        if token in eos:
            tokens = tokens[: i + 1]
            break
    return tokens[:max_new_tokens]


@dataclass
class BatchOutput:
    """Per-row results of `generate_batch`; statistics as `decode.generate.GenerateOutput`'s, per row."""

    sequences: Tensor  # (B, T + longest reply): the left-padded prompts, each reply after them, right-padded
    new_tokens: list[int]  # per row: tokens generated (EOS included when hit)
    tau: list[float]  # per row: tokens emitted per verify pass, the bonus token included
    steps: list[int]  # per row: verify passes it took part in
    accepted_per_depth: list[list[int]] = field(default_factory=list)  # per row, as GenerateOutput's
    accepted_ranks: list[list[list[int]]] = field(default_factory=list)  # per row, as GenerateOutput's
    offered_ranks: list[list[list[int]]] = field(default_factory=list)  # per row, as GenerateOutput's
    target_forwards: int = 0  # batched target forwards, the prefill included
    seconds: float = 0.0

    @property
    def replies(self) -> list[list[int]]:
        width = self.sequences.shape[1] - max(self.new_tokens, default=0)
        return [self.sequences[r, width : width + n].tolist() for r, n in enumerate(self.new_tokens)]


@torch.no_grad()
def generate_batch(
    model: nn.Module,
    input_ids: Tensor,
    attention_mask: Tensor | None = None,
    heads: nn.Module | list[Drafter] | None = None,
    *,
    max_new_tokens: int,
    temperature: float = 0.0,
    top_p: float = 1.0,
    top_k: int = 0,
    tree=None,
    seed: int | None = None,
    eos_token_id: int | list[int] | None = None,
    pad_token_id: int = 0,
    batch_draft: bool = True,
) -> BatchOutput:
    """Speculative decoding of B prompts at once: every row drafts its own tree below its own last token, one
    target forward verifies all B trees (`verify_batch`), each row accepts its own path (greedy, or the
    lossless sampling rule with temperature > 0) and keeps its own KV (`commit`); a row that stops (EOS,
    max_new_tokens) leaves the batch and drafts no more.

    Args:
        model: the target.
        input_ids: (B, T) left-padded prompts.
        attention_mask: (B, T), 1 on tokens; None = no padding.
        heads: a head module (one drafter per row is made from it), a list of B drafters, or None (plain
            decoding through the same loop).
        max_new_tokens, temperature, top_p, top_k, seed, eos_token_id: as `decode.generate`.
        tree: as `decode.generate`, or a policy: a callable from the rows still decoding to a tree or None
            (plain decoding for that step), asked every step (`decode.sizing.policy_tree` over
            `batch_policy`'s choices), so the tree follows the batch as sequences finish. A policy with an
            `observe(accepted, offered)` method (`decode.sizing.AdaptivePolicy`) is told, after every
            speculative step, the step's acceptance per (depth, rank) summed over its rows; one with a
            `record_time(seconds)` method is told every step's wall time.
        pad_token_id: what pads the replies in `sequences`.
        batch_draft: draft every row's tree in one head forward per level (`decode.batch_draft`; EAGLE and
            Medusa heads); False drafts row by row, one drafter each (what a list of drafters always does),
            which a `DynamicTree.min_prob` bound refuses (ValueError): it sizes the rows' trees together.
    Returns:
        BatchOutput.
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
    top_p, top_k, eos, attention_mask = request.top_p, request.top_k, request.eos, request.attention_mask
    batch = input_ids.shape[0]
    mask = torch.ones_like(input_ids) if attention_mask is None else attention_mask
    together = None  # the batched drafter, when the rows draft together (`decode.batch_draft`)
    if isinstance(heads, (list, tuple)):
        if len(heads) != batch:
            raise ValueError(f"{len(heads)} drafters for a batch of {batch}")
        drafters = list(heads)
    elif isinstance(heads, Drafter) and batch > 1:
        raise ValueError(
            f"one Drafter instance for a batch of {batch}: a drafter holds one sequence's state; pass a list "
            f"of {batch} drafters, or the head module (each row then gets its own drafter)"
        )
    else:
        together = make_batch_drafter(heads, model, batch) if heads is not None and batch_draft else None
        if together is not None:
            drafters = [together] * batch  # one drafter for all rows (its feature_layers, its limits)
        else:
            drafters = [None if heads is None else make_drafter(heads, model) for _ in range(batch)]
    resolved: dict = {}  # tree spec -> its resolved form (a policy hands out a few specs, again and again)

    def spec_for(rows_alive: int):
        """The tree of this step: `tree` itself, or what the policy `tree(rows)` picks (None: plain)."""
        if drafters[0] is None:
            return None
        wanted = tree(rows_alive) if callable(tree) else tree
        if callable(tree) and wanted is None:
            return None
        key = repr(wanted)
        if key not in resolved:
            max_depth, dynamic = drafter_limits(heads[0] if isinstance(heads, (list, tuple)) else heads)
            resolved[key] = resolve_tree(wanted, max_depth=max_depth, dynamic=dynamic, device=model.device)
        return resolved[key]

    # a sliding-window target: refused before any work when the tree is known (the last step verifies it
    # behind the prompt and all but the newest of max_new_tokens - 1 tokens), else step by step
    window = window_limit(model)
    if callable(tree):
        check_window(window, input_ids.shape[1], "the prompt")
    else:
        fixed = spec_for(batch)
        columns = input_ids.shape[1] + max_new_tokens - 2 + (verify_rows(fixed) if fixed is not None else 1)
        check_window(window, columns, "this prompt and max_new_tokens")
    generator = torch.Generator(device=model.device).manual_seed(seed) if seed is not None else None
    vocab_size = model.get_output_embeddings().weight.shape[0]

    synchronize(model.device)
    start = time.perf_counter()
    layers = drafters[0].feature_layers if drafters[0] is not None else None
    capture = FeatureCapture(model, layers) if layers is not None else None
    with capture if capture is not None else contextlib.nullcontext():
        state, last, features = prefill(model, input_ids, mask, capture)
        forwards = 1

        def first(logits: Tensor) -> Tensor:
            if temperature == 0:
                return logits.argmax(-1)
            return sample(target_probs(logits, temperature, top_p, top_k), generator)

        roots = [first(last[r]).view(1) for r in range(batch)]
        generated = [[int(root)] for root in roots]
        stats = [
            {"steps": 0, "emitted": 0, "per_depth": [], "ranks": [], "offered": []} for _ in range(batch)
        ]
        observe = getattr(tree, "observe", None) if callable(tree) else None
        record_time = getattr(tree, "record_time", None) if callable(tree) else None
        rows = [r for r in range(batch) if not (generated[r][0] in eos or max_new_tokens == 1)]
        prompt = input_ids.to(model.device)
        # what each row's drafter has yet to take in: (features, next tokens) of its accepted positions. The
        # drafters take it in just before they draft, so plain steps chosen by a policy cost no draft forward
        pending: dict[int, list[tuple[Tensor, Tensor]]] = {r: [] for r in rows}
        for r in rows:
            if drafters[r] is not None:
                valid = state.valid[r]
                pending[r].append((features[r][valid], torch.cat([prompt[r][valid][1:], roots[r]])))
        if len(rows) < batch:
            state.select(rows)
            if together is not None:
                together.select(rows)

        def catch_up() -> None:
            """The drafters take in every row's pending positions (in one call when drafting together)."""
            taken = [
                (torch.cat([f for f, _ in pending[r]]), torch.cat([t for _, t in pending[r]])) for r in rows
            ]
            if together is not None:
                together.advance([f for f, _ in taken], [t for _, t in taken])
            else:
                for r, (f, t) in zip(rows, taken):
                    drafters[r].advance(f, t)
            for r in rows:
                pending[r].clear()

        drafted_last = False  # whether the last step drafted (the drafters then lag one step behind, no more)
        while rows:
            spec = spec_for(len(rows))  # None: a plain step (the drafters' pending positions wait)
            step_start = time.perf_counter()  # after the policy's pick: its search is not a step's cost
            draws = {"temperature": temperature, "generator": generator, "vocab_size": vocab_size}
            if spec is not None:
                # a drafter catching up on the prompt or on plain steps: a one-off cost, left out of the
                # step's time (waited for on both sides, so a GPU's queued work does not leak into it)
                one_off = record_time is not None and not drafted_last
                if one_off:
                    synchronize(model.device)
                catch_up()
                if one_off:
                    synchronize(model.device)
                    step_start = time.perf_counter()
            drafted_last = spec is not None
            if together is not None and spec is not None:
                trees = propose_batch(together, torch.cat([roots[r] for r in rows]), spec, **draws)
            elif getattr(spec, "min_prob", 0) > 0 and len(rows) > 1:
                raise ValueError(
                    f"{tree_label(spec)}: a min_prob bound sizes a batch's trees together, which needs the "
                    "rows to draft together (batch_draft=True with EAGLE or Medusa heads); these rows draft "
                    "one by one"
                )
            else:
                trees = [
                    propose(drafters[r] if spec is not None else None, roots[r], spec, **draws) for r in rows
                ]
            sizes = {len(t) for t in trees}
            if len(sizes) != 1:
                raise NotImplementedError(
                    f"the rows' trees differ in size ({sorted(sizes)}): one size per step"
                )
            size = sizes.pop()
            check_window(window, state.columns + size, f"a step verifying {size} tokens")
            tokens = torch.stack([t.tokens for t in trees])  # (B, N)
            logits, step_features = verify_batch(
                model,
                state,
                tokens,
                torch.stack([t.depths for t in trees]),
                torch.stack([t.ancestors for t in trees]),
                capture,
            )
            forwards += 1
            if temperature == 0:
                accepted = [accept_greedy(draft, logits[i]) for i, draft in enumerate(trees)]
            else:
                accepted = [
                    accept_sampling(draft, logits[i], temperature, top_p, top_k, generator)
                    for i, draft in enumerate(trees)
                ]
            depth = min(max(path.numel() for path, _ in accepted), size)  # a path is at most the tree
            paths = torch.stack([_padded(path, depth) for path, _ in accepted])  # (B, P), -1 padded
            bonuses = torch.stack([bonus.reshape(()) for _, bonus in accepted])  # (B,)
            parts = [paths.flatten(), bonuses, tokens.flatten()]
            if size > 1:  # the trees' shapes, for the statistics
                parts += [torch.stack([t.parents for t in trees]).flatten()]
                parts += [torch.stack([t.ranks for t in trees]).flatten()]
            # the step's one read of the device, for every row: paths, bonus tokens, tree tokens (and shapes)
            host = torch.cat([part.to(paths.device) for part in parts]).tolist()
            count = len(rows)
            host_paths = [host[i * depth : (i + 1) * depth] for i in range(count)]
            host_bonus = host[count * depth : count * depth + count]
            offset = count * depth + count
            host_tokens = [host[offset + i * size : offset + (i + 1) * size] for i in range(count)]
            offset += count * size
            keeps, alive = [], []
            step_accepted: list[list[int]] = []  # this step's acceptance per (depth, rank), all rows
            step_offered: list[list[int]] = []
            for i, r in enumerate(rows):
                keep = [node for node in host_paths[i] if node >= 0]
                new = [host_tokens[i][node] for node in keep[1:]] + [host_bonus[i]]
                generated[r] += new
                stat = stats[r]
                stat["steps"] += 1
                stat["emitted"] += len(new)
                for level in range(1, len(keep)):
                    stat["per_depth"] += [0] * (level - len(stat["per_depth"]))
                    stat["per_depth"][level - 1] += 1
                if size > 1:
                    parents = host[offset + i * size : offset + (i + 1) * size]
                    ranks = host[offset + (count + i) * size : offset + (count + i + 1) * size]
                    tally_ranks(parents, ranks, keep, stat["ranks"], stat["offered"])
                    if observe is not None:
                        tally_ranks(parents, ranks, keep, step_accepted, step_offered)
                keeps.append(keep)
                roots[r] = bonuses[i : i + 1]
                if not (eos.intersection(new) or len(generated[r]) >= max_new_tokens):
                    alive.append(i)
                    if drafters[r] is not None:
                        kept = paths[i, : len(keep)]  # the accepted nodes as a device index: no upload
                        pending[r].append(
                            (
                                step_features[i].index_select(0, kept),
                                torch.cat([tokens[i].index_select(0, kept[1:]), roots[r]]),
                            )
                        )
            commit(state, keeps, size, paths)
            if observe is not None and size > 1:
                observe(step_accepted, step_offered)
            if len(alive) < len(rows):
                state.select(alive)
                if together is not None:
                    together.select(alive)
                rows = [rows[i] for i in alive]
            if record_time is not None:  # the step's host read above synchronized: no extra wait here
                record_time(time.perf_counter() - step_start)
    synchronize(model.device)
    seconds = time.perf_counter() - start
    replies = [truncate_at_stop(g, eos, max_new_tokens) for g in generated]
    width = max(len(reply) for reply in replies)
    sequences = torch.full((batch, input_ids.shape[1] + width), pad_token_id, dtype=input_ids.dtype)
    sequences[:, : input_ids.shape[1]] = input_ids.cpu()
    for r, reply in enumerate(replies):
        sequences[r, input_ids.shape[1] : input_ids.shape[1] + len(reply)] = torch.tensor(reply)
    return BatchOutput(
        sequences=sequences.to(input_ids.device),
        new_tokens=[len(reply) for reply in replies],
        tau=[(len(reply) - 1) / st["steps"] if st["steps"] else 1.0 for reply, st in zip(replies, stats)],
        steps=[st["steps"] for st in stats],
        accepted_per_depth=[st["per_depth"] for st in stats],
        accepted_ranks=[st["ranks"] for st in stats],
        offered_ranks=[st["offered"] for st in stats],
        target_forwards=forwards,
        seconds=seconds,
    )
