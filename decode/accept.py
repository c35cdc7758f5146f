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
    probs = torch.softmax(logits.float() / temperature, dim=-1)  # fp32: bf16 ties flip rankings
    if top_k and top_k < probs.shape[-1]:
        kth = torch.topk(probs, top_k, dim=-1).values[..., -1:]
        probs = torch.where(probs < kth, torch.zeros_like(probs), probs)
    if top_p < 1.0:
        sorted_probs, order = torch.sort(probs, dim=-1, descending=True)
        mass_before = torch.cumsum(sorted_probs, dim=-1) - sorted_probs
        drop_sorted = mass_before >= top_p * sorted_probs.sum(-1, keepdim=True)
        probs = probs.masked_fill(torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted), 0.0)
    return probs / probs.sum(-1, keepdim=True)


def accept_greedy(tree: DraftTree, target_logits: Tensor) -> tuple[list[int], int]:
    """Longest path whose tokens equal the target's argmax at their parents.

    Args:
        tree: the proposal.
        target_logits: (N, V) target logits after each node.
    Returns:
        (accepted node path starting at the root, bonus token = argmax after the last accepted node).
    """
    tokens = tree.tokens.tolist()
    path, node = [0], 0
    while True:  # argmax of the path's rows only (a full (33, 49152) argmax took ~4 ms on one CPU thread here)
        best = int(target_logits[node].argmax())
        nxt = next((c for c in tree.children[node] if tokens[c] == best), None)
        if nxt is None:
            return path, best
        path.append(nxt)
        node = nxt


def accept_sampling(tree: DraftTree, target_logits: Tensor, temperature: float, top_p: float, top_k: int,
                    generator: torch.Generator | None) -> tuple[list[int], int]:
    """Recursive rejection sampling over siblings drawn without replacement (lossless; see module doc).

    Returns:
        (accepted node path starting at the root, the token the target emits after it).
    """
    tokens = tree.tokens.tolist()
    path, node = [0], 0
    while True:
        p = target_probs(target_logits[node], temperature, top_p, top_k)
        children = tree.children[node]
        accepted = None
        if children:
            q = tree.q_table[int(tree.q_rows[node])].to(p.device).clone()
            for child in children:
                token = tokens[child]
                ratio = (p[token] / q[token]).item() if q[token] > 0 else 0.0
                if torch.rand((), generator=generator, device=p.device).item() < ratio:
                    accepted = child
                    break
                p = torch.clamp(p - q, min=0.0)
                mass = p.sum()
                if mass <= 0:  # p == q exactly: rejection has probability 0; keep p valid regardless
                    p = target_probs(target_logits[node], temperature, top_p, top_k)
                else:
                    p = p / mass
                q[token] = 0.0
                q_mass = q.sum()
                if q_mass <= 0:
                    break
                q = q / q_mass
        if accepted is None:
            return path, int(torch.multinomial(p, 1, generator=generator).item())
        path.append(accepted)
        node = accepted


def accept_typical(tree: DraftTree, target_logits: Tensor, temperature: float, generator: torch.Generator | None,
                   epsilon: float = 0.09, delta: float = 0.3) -> tuple[list[int], int]:
    """LOSSY Medusa typical acceptance: keep a child when p(child) > min(epsilon, delta * exp(-H(p))).

    Output is NOT distributed as the target's; offered only as an explicit opt-in.
    """
    tokens = tree.tokens.tolist()
    path, node = [0], 0
    while True:
        p = target_probs(target_logits[node], temperature)
        entropy = -(p * torch.log(p.clamp_min(1e-12))).sum()
        threshold = min(epsilon, delta * torch.exp(-entropy).item())
        nxt = next((c for c in tree.children[node] if p[tokens[c]].item() > threshold), None)
        if nxt is None:
            return path, int(torch.multinomial(p, 1, generator=generator).item())
        path.append(nxt)
        node = nxt
