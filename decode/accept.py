"""Accept: which drafted tokens the target keeps, and the bonus token it adds itself.

Greedy (temperature 0): follow the child whose token is the target's argmax; exact by construction.

Sampling is lossless by recursive rejection sampling over siblings drawn WITHOUT replacement
(SpecInfer 2305.09781, SpecTr 2310.15141; Leviathan et al. 2211.17192 for one draft). The argument:
  Lemma. Let x ~ q, accept x with probability min(1, p(x)/q(x)), and on rejection output Y with
  Y | (x, rejected) ~ r = normalize(max(0, p - q)). Then the output is distributed as p.
  Proof: P(out = y) = min(p(y), q(y)) + (1 - sum_z min(p, q)) * max(0, p(y) - q(y)) / sum_z max(0, p - q)
  = min(p(y), q(y)) + max(0, p(y) - q(y)) = p(y), because sum_z max(0, p - q) = 1 - sum_z min(p, q).
At a node with target distribution p, children c_1..c_m were drawn in order from the draft q without
replacement, so given c_1..c_{i-1}, c_i ~ q_i = q with c_1..c_{i-1} removed and renormalised, and whether
c_i exists never depends on c_i's own value (decode/propose.py). We test c_i against the current target
p_i with q_i; on rejection p_{i+1} = normalize(max(0, p_i - q_i)) (which is 0 at c_i, as is q_{i+1}).
After the last sibling we sample from the last residual. By induction from the last sibling up, each
round outputs exactly its p_i given the past, so the token emitted at the node is distributed as p. An
accepted child continues the walk at its own node with the target's conditional distribution there, so
the whole emitted sequence is distributed as plain sampling from the target. The same p (temperature,
top-p, top-k applied to the target's logits by `target_probs`) is used by plain decoding.
Medusa's typical acceptance is NOT lossless; it is only available as `accept_typical`, opt-in.
"""

from __future__ import annotations

import torch
from torch import Tensor

from decode.tree import DraftTree


def tempered(logits: Tensor, temperature: float) -> Tensor:
    """fp32 (logits - max) / T: the same softmax as logits / T, but a tiny T (1e-40) no longer overflows to
    inf - inf = NaN, which sampled token 0 forever; it tends to greedy, as it should."""
    logits = logits.float()
    return (logits - logits.amax(-1, keepdim=True)) / temperature


def target_probs(logits: Tensor, temperature: float, top_p: float = 1.0, top_k: int = 0) -> Tensor:
    """The distribution plain sampling draws from: softmax(logits / T), then top-k and top-p filtering.

    Args:
        logits: (..., V).
        temperature: > 0.
        top_p: keep the smallest set of most likely tokens whose mass reaches top_p (1.0 keeps all).
        top_k: keep the k most likely tokens (0 keeps all).
    Returns:
        (..., V) fp32 probabilities.
    """
    probs = torch.softmax(tempered(logits, temperature), dim=-1)  # fp32: bf16 ties flip rankings
    if top_k and top_k < probs.shape[-1]:
        kth = torch.topk(probs, top_k, dim=-1).values[..., -1:]
        probs = torch.where(probs < kth, torch.zeros_like(probs), probs)
    if top_p < 1.0:
        sorted_probs, order = torch.sort(probs, dim=-1, descending=True)
        mass_before = torch.cumsum(sorted_probs, dim=-1) - sorted_probs
        drop_sorted = mass_before >= top_p * sorted_probs.sum(-1, keepdim=True)
        drop_sorted[..., 0] = False  # the likeliest token always stays (a top_p that rounds to 0 dropped all)
        probs = probs.masked_fill(torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted), 0.0)
    return probs / probs.sum(-1, keepdim=True)


def sample(probs: Tensor, generator: torch.Generator | None) -> Tensor:
    """One token drawn from `probs` (V,) (normalised or not) as a 0-d int64 on its device: argmax(p / E) with
    E ~ Exp(1) i.i.d., the exponential race `torch.multinomial(probs, 1)` itself runs, without its two
    validity checks that read the device back to the host (`probs` here is always a valid distribution)."""
    return (probs / torch.empty_like(probs).exponential_(1, generator=generator)).argmax()


def _row(table: Tensor, index: Tensor) -> Tensor:
    """table[index] for a 0-d device index (indexing with a 0-d tensor would read it back to the host)."""
    return table.index_select(0, index.view(1))[0]


def accept_greedy(tree: DraftTree, target_logits: Tensor) -> tuple[Tensor, Tensor]:
    """Longest path whose tokens equal the target's argmax at their parents, computed on the device.

    One argmax over all tree rows, then per node the first child (by rank) carrying its argmax; a node is on
    the accepted path when it and all its ancestors are such children. Nothing is read back to the host.

    Args:
        tree: the proposal.
        target_logits: (N, V) target logits after each node.
    Returns:
        path: (max_depth + 1,) int64 accepted nodes by depth, root first, then -1 padding;
        bonus: () int64, the argmax after the last accepted node.
    """
    # max(-1).indices: the first maximal index, as argmax gives, but a few times cheaper than argmax on a CPU
    # over a tree's rows of a full vocabulary (measured: docs/cpu.md, Greedy acceptance)
    best = target_logits.max(-1).indices  # (N,)
    device, n = best.device, len(tree)
    path = torch.full((tree.max_depth + 1,), -1, dtype=torch.long, device=device)
    if tree.max_children == 0 or n == 1:
        return path.index_fill(0, torch.zeros(1, dtype=torch.long, device=device), 0), best[0]
    table = tree.child_table()  # (N, m)
    tokens = tree.tokens.to(device)
    match = (tokens[table.clamp(min=0)] == best[:, None]) & (table >= 0)  # (N, m)
    first = table.gather(1, match.long().argmax(-1, keepdim=True))[:, 0]  # argmax: the first True by rank
    chosen_child = torch.where(match.any(-1), first, -1)  # (N,) the child each node accepts
    nodes = torch.arange(n, device=device)
    chosen = (chosen_child[tree.parents.clamp(min=0)] == nodes) | (nodes == 0)  # the root is always on it
    reached = ~(tree.ancestors & ~chosen[None, :]).any(-1)  # every ancestor chosen: one root-to-leaf chain
    depth = torch.where(reached, tree.depths, tree.max_depth + 1)  # unreached nodes go to a spare slot
    slots = torch.full((tree.max_depth + 2,), -1, dtype=torch.long, device=device)
    path = slots.scatter(0, depth, nodes)[: tree.max_depth + 1]
    leaf = torch.where(reached, tree.depths, -1).argmax()
    return path, _row(best, leaf)


def accept_sampling(
    tree: DraftTree,
    target_logits: Tensor,
    temperature: float,
    top_p: float,
    top_k: int,
    generator: torch.Generator | None,
) -> tuple[Tensor, Tensor]:
    """Recursive rejection sampling over siblings drawn without replacement (lossless; see module doc).

    Runs on the device without reading anything back. The walk visits every depth up to `tree.max_depth`,
    masking the depths after it has stopped instead of leaving the loop. At a node, the residuals that each
    sibling is tested against (the target's p after rejecting all earlier siblings, the draft's q without
    them) do not depend on the random draws, so they are computed for every sibling slot first, and then all
    tests at once: the first sibling whose uniform falls below its ratio is the one the sequential rule would
    accept. Every test has its own uniform, drawn up front (one per depth and slot; those of tests that do not
    happen go unused), so the rule and its output distribution are those of the sequential walk; only which
    draws of the random stream a given seed uses changes. Residuals are kept unnormalised (p_i = P / p_mass).

    A tree whose children were chosen rather than drawn (no `q_table`: a `BestFirstTree`'s ranks) goes to
    `accept_chosen`, the same rule with point masses.

    Returns:
        path: (max_depth + 1,) int64 accepted nodes by depth, root first, then -1 padding;
        bonus: () int64, the token the target emits after the last accepted node.
    """
    if tree.q_table is None and tree.max_children:
        return accept_chosen(tree, target_logits, temperature, top_p, top_k, generator)
    device, m = target_logits.device, tree.max_children
    table, tokens = tree.child_table(), tree.tokens.to(device)
    uniforms = torch.rand((tree.max_depth, m), generator=generator, device=device) if m else None
    path = torch.full((tree.max_depth + 1,), -1, dtype=torch.long, device=device)
    path[:1].zero_()  # the root; a slice op, not `= 0` (which makes a scalar tensor to copy)
    node = torch.zeros((), dtype=torch.long, device=device)
    walking = torch.ones((), dtype=torch.bool, device=device)  # the walk has not stopped at a node yet
    final = None  # the (unnormalised) distribution the bonus token is drawn from
    for depth in range(tree.max_depth + 1):
        p = target_probs(_row(target_logits, node), temperature, top_p, top_k)
        took = torch.zeros((), dtype=torch.bool, device=device)
        if depth < tree.max_depth and m:
            p0, p_mass = p, p.sum()
            q_row = _row(tree.q_rows, node).clamp(min=0)  # a leaf has none: row 0 then goes unused
            q = _row(tree.q_table, q_row).to(device, copy=True)  # a copy: rejected siblings are zeroed in it
            q_mass = q.sum()
            children = _row(table, node)  # (m,) by rank, -1: none
            child_tokens, exists = tokens[children.clamp(min=0)], children >= 0
            # every earlier sibling rejected, and draft mass left to draw another
            live = walking & (q_mass > 0)
            tested, p_at, q_at, p_masses, q_masses = [], [], [], [], []
            for slot in range(m):
                token = child_tokens[slot : slot + 1]
                testing = live & exists[slot]
                tested.append(testing)
                p_at.append(p.index_select(0, token))
                q_at.append(q.index_select(0, token))
                p_masses.append(p_mass)
                q_masses.append(q_mass)
                # rejected: p <- normalize(max(0, p_i - q_i)), i.e. P <- max(0, P - (p_mass / q_mass) Q). A
                # slot not tested gets scale 0, which leaves P as it is (P >= 0): no select over the vocab.
                # Selected, not multiplied: once the draft's mass is spent, q_mass is 0 and inf * 0 made P
                # NaN, which the fallback below turned into the target's p again (rejected tokens drawn)
                scale = torch.where(testing, p_mass / q_mass, 0.0)
                p = torch.addcmul(p, q, scale, value=-1).clamp_(min=0.0)
                p_mass = p.sum()
                q.index_copy_(0, token, q_at[-1].masked_fill(testing, 0.0))
                q_mass = q.sum()
                live = live & (q_mass > 0)  # no draft mass left: no later sibling can be tested
            p_at = torch.cat(p_at) / torch.stack(p_masses)  # p_i(c_i): after rejecting c_1 .. c_{i-1}
            q_at = torch.cat(q_at) / torch.stack(q_masses)  # q_i(c_i): without c_1 .. c_{i-1}
            ratio = torch.where(q_at > 0, p_at / q_at, 0.0)
            take = torch.stack(tested) & (uniforms[depth] < ratio)  # (m,)
            took = take.any()
            accepted = _row(children, take.long().argmax())  # the first sibling that passes its test
            path[depth + 1] = torch.where(walking & took, accepted, -1)
            node = torch.where(took, accepted, node)
            p = torch.where(p_mass > 0, p, p0)  # p == q exactly: rejection has probability 0; keep p valid
        final = p if final is None else torch.where(walking & ~took, p, final)
        walking = walking & took
    return path, sample(final, generator)


def accept_chosen(
    tree: DraftTree,
    target_logits: Tensor,
    temperature: float,
    top_p: float,
    top_k: int,
    generator: torch.Generator | None,
) -> tuple[Tensor, Tensor]:
    """Lossless sampling over children that were CHOSEN, not drawn (a `BestFirstTree`'s top-ranked tokens):
    each child c_i's draft distribution is a point mass on it. Recursive rejection with point masses tests
    c_1 with probability p(c_1), and on rejection zeroes c_1 in p and renormalises; then c_2 with
    p(c_2) / (1 - p(c_1)), and so on; after the last child it draws from what is left. So child c_i is taken
    with probability p(c_i) and any other token y is emitted with probability p(y): the same as drawing ONE
    token x from p at the node and descending when x is a child (emitting x and stopping otherwise). That is
    how it runs here: one draw per depth, on the device, nothing read back. Every emitted token is a draw
    from the target's distribution given its prefix, whatever the tree. Returns as `accept_sampling`."""
    device, m = target_logits.device, tree.max_children
    table, tokens = tree.child_table(), tree.tokens.to(device)
    path = torch.full((tree.max_depth + 1,), -1, dtype=torch.long, device=device)
    path[:1].zero_()
    node = torch.zeros((), dtype=torch.long, device=device)
    walking = torch.ones((), dtype=torch.bool, device=device)
    bonus = None
    for depth in range(tree.max_depth + 1):
        drawn = sample(target_probs(_row(target_logits, node), temperature, top_p, top_k), generator)
        took = torch.zeros((), dtype=torch.bool, device=device)
        if depth < tree.max_depth and m:
            children = _row(table, node)  # (m,) by rank, -1: none; siblings are distinct tokens
            hit = (children >= 0) & (tokens[children.clamp(min=0)] == drawn)
            took = hit.any()
            accepted = _row(children, hit.long().argmax())
            path[depth + 1] = torch.where(walking & took, accepted, -1)
            node = torch.where(took, accepted, node)
        bonus = drawn if bonus is None else torch.where(walking & ~took, drawn, bonus)
        walking = walking & took
    return path, bonus


def accept_typical(
    tree: DraftTree,
    target_logits: Tensor,
    temperature: float,
    top_p: float,
    top_k: int,
    generator: torch.Generator | None,
    epsilon: float = 0.09,
    delta: float = 0.3,
) -> tuple[Tensor, Tensor]:
    """LOSSY Medusa typical acceptance: keep a child when p(child) > min(epsilon, delta * exp(-H(p))).

    p is the distribution plain sampling draws from (`target_probs`: temperature, then top-k and top-p), so a
    token those filters drop is never accepted nor emitted. Output is NOT distributed as the target's; offered
    only as an explicit opt-in. Computed on the device and returned in `accept_sampling`'s form; the threshold
    is compared in float64, as the host comparison was.
    """
    device, m = target_logits.device, tree.max_children
    table, tokens = tree.child_table(), tree.tokens.to(device)
    path = torch.full((tree.max_depth + 1,), -1, dtype=torch.long, device=device)
    path[:1].zero_()  # the root; a slice op, not `= 0` (which makes a scalar tensor to copy)
    node = torch.zeros((), dtype=torch.long, device=device)
    walking = torch.ones((), dtype=torch.bool, device=device)
    final = None
    for depth in range(tree.max_depth + 1):
        p = target_probs(_row(target_logits, node), temperature, top_p, top_k)
        took = torch.zeros((), dtype=torch.bool, device=device)
        if depth < tree.max_depth and m:
            entropy = -(p * torch.log(p.clamp_min(1e-12))).sum()
            threshold = torch.clamp(torch.exp(-entropy).double() * delta, max=epsilon)
            children = _row(table, node)  # (m,)
            typical = (children >= 0) & (p[tokens[children.clamp(min=0)]].double() > threshold)
            took = typical.any()
            accepted = _row(children, typical.long().argmax())  # the first typical child by rank
            path[depth + 1] = torch.where(walking & took, accepted, -1)
            node = torch.where(took, accepted, node)
        final = p if final is None else torch.where(walking & ~took, p, final)
        walking = walking & took
    return path, sample(final, generator)


def tally_ranks(
    parents: list[int], ranks: list[int], path: list[int], accepted: list[list[int]], offered: list[list[int]]
) -> None:
    """Add one step's acceptance per (depth, sibling rank) to the tables (row d - 1: depth d): `offered`
    counts the children that the accepted path's nodes (root included) offered, `accepted` the path's nodes
    past the root. `parents`, `ranks`: the tree's, on the host; `path`: the accepted node indices, root
    first. What `decode.sizing.rank_acceptance` pools."""
    on_path = {node: depth for depth, node in enumerate(path)}
    for node, (parent, rank) in enumerate(zip(parents, ranks)):
        if node and parent in on_path:
            _bump(offered, on_path[parent], rank)  # the child sits at depth + 1: row `depth` of the table
    for depth, node in enumerate(path[1:]):
        _bump(accepted, depth, ranks[node])


def _bump(table: list[list[int]], row: int, column: int) -> None:
    while len(table) <= row:
        table.append([])
    table[row] += [0] * (column + 1 - len(table[row]))
    table[row][column] += 1
