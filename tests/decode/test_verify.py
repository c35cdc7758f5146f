"""Tests for decode/verify.py: one tree forward scores every node as if decoded alone, and compacting the KV
cache to the accepted path leaves exactly the cache a fresh forward over prompt + accepted tokens builds."""

import pytest
import torch
from transformers import DynamicCache

from decode.tree import DraftTree
from decode.verify import compact_cache, tree_attention_mask, verify
from heads.features import LAST, FeatureCapture

PROMPT = torch.tensor([[11, 42, 7, 99, 3, 64]])
PAST = PROMPT.shape[1]
# root 0 -> 1, 3; 1 -> 2; 2 -> 6; 3 -> 4, 5.  [0, 1, 2] is a prefix of the node order (compacted by a crop)
PARENTS = [-1, 0, 1, 0, 3, 3, 2]
RANKS = [0, 0, 0, 1, 0, 1, 0]
PATHS = [[0], [0, 1, 2], [0, 1, 2, 6], [0, 3, 5], [0, 3]]


def _draft_tree() -> DraftTree:
    tokens = torch.randint(0, 128, (len(PARENTS),), generator=torch.Generator().manual_seed(5))
    return DraftTree(tokens=tokens, parents=torch.tensor(PARENTS), ranks=torch.tensor(RANKS))


def _prefilled(model) -> DynamicCache:
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        model(input_ids=PROMPT, cache=cache, use_cache=True)
    return cache


@pytest.mark.parametrize(
    "path", PATHS, ids=["root", "crop", "chain-then-index", "second-sibling", "sibling-only"]
)
def test_compacted_cache_equals_recomputation(any_target, path):
    target = any_target
    tree = _draft_tree()
    cache = _prefilled(target)
    with FeatureCapture(target, (1, LAST)) as capture:
        logits, features = verify(target, cache, tree, PAST, capture)
    assert logits.shape == (len(PARENTS), 128) and features.shape == (len(PARENTS), 64)
    assert cache.get_seq_length() == PAST + len(PARENTS)
    compact_cache(cache, PAST, path)

    sequence = torch.cat([PROMPT, tree.tokens[path][None]], dim=1)
    fresh = DynamicCache(config=target.config)
    with torch.no_grad():
        out = target(input_ids=sequence, cache=fresh, use_cache=True, output_hidden_states=True)
    assert cache.get_seq_length() == fresh.get_seq_length() == PAST + len(path)
    for i, (ours, theirs) in enumerate(zip(cache.layers, fresh.layers, strict=True)):
        assert ours.keys.shape == theirs.keys.shape, i
        torch.testing.assert_close(ours.keys, theirs.keys, atol=1e-5, rtol=0)
        torch.testing.assert_close(ours.values, theirs.values, atol=1e-5, rtol=0)
    # tree logits / features along the path equal those of causal decoding
    torch.testing.assert_close(logits[path], out.logits[0, PAST:], atol=1e-5, rtol=0)
    expected = torch.cat([out.hidden_states[2], out.hidden_states[-1]], dim=-1)[0, PAST:]
    torch.testing.assert_close(features[path], expected, atol=1e-5, rtol=0)
    # decoding continues from the compacted cache exactly as from the fresh one
    step = torch.tensor([[77]])
    with torch.no_grad():
        ours = target(input_ids=step, cache=cache, use_cache=True).logits
        theirs = target(input_ids=step, cache=fresh, use_cache=True).logits
    torch.testing.assert_close(ours, theirs, atol=1e-5, rtol=0)


def test_single_node_tree_is_a_plain_step(build_target):
    model = build_target("llama")
    cache = _prefilled(model)
    root = DraftTree(tokens=torch.tensor([5]), parents=torch.tensor([-1]), ranks=torch.tensor([0]))
    logits, features = verify(model, cache, root, PAST)
    assert features is None
    with torch.no_grad():
        expected = model(torch.cat([PROMPT, torch.tensor([[5]])], dim=1)).logits[0, -1]
    torch.testing.assert_close(logits[0], expected, atol=1e-5, rtol=0)


def test_tree_attention_mask_values():
    ancestors = DraftTree(
        tokens=torch.zeros(4, dtype=torch.long),
        parents=torch.tensor([-1, 0, 0, 1]),
        ranks=torch.tensor([0, 0, 1, 0]),
    ).ancestors
    mask = tree_attention_mask(ancestors, past_length=2, dtype=torch.float32)
    assert mask.shape == (1, 1, 4, 6) and mask.dtype == torch.float32
    allowed = torch.tensor(
        [
            [1, 1, 1, 0, 0, 0],
            [1, 1, 1, 1, 0, 0],
            [1, 1, 1, 0, 1, 0],
            [1, 1, 1, 1, 0, 1],
        ],
        dtype=torch.bool,
    )
    assert torch.equal(mask[0, 0] == 0, allowed)
    assert (
        mask[0, 0][~allowed] == torch.finfo(torch.float32).min
    ).all()  # additive: booleans are wrong under eager
