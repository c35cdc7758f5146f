"""Sliding-window targets: decoding inside the window is lossless; a request that would outgrow it is refused
before any work (a tree verify attends to every cached column, which the window's cache drops), except plain
single-sequence decoding, where the target applies its own window and stays exact."""

import pytest
import torch

from decode import generate
from decode.inputs import window_limit
from heads.medusa import MedusaConfig, MedusaHeads

WINDOW = 12
PROMPT = torch.tensor([[5, 17, 99, 3]])


@pytest.fixture(scope="module", params=["mistral", "gemma3_text"])
def windowed(request, build_target):
    return build_target(request.param, sliding_window=WINDOW)


def _recomputed(model, n: int) -> list[int]:
    """Greedy continuation recomputing the whole sequence each step (no cache, no library code)."""
    ids = PROMPT
    with torch.no_grad():
        for _ in range(n):
            ids = torch.cat([ids, model(input_ids=ids, use_cache=False).logits[:, -1:].argmax(-1)], dim=1)
    return ids[0].tolist()


def _heads():
    torch.manual_seed(1)
    return MedusaHeads(MedusaConfig(hidden_size=32, vocab_size=128, num_heads=4))


def test_the_limit_is_what_the_window_cache_keeps(windowed):
    assert window_limit(windowed) == WINDOW - 1


def test_speculative_decoding_inside_the_window_is_exact(windowed):
    # the last step verifies chain4's 5 tokens behind 4 prompt + 2 committed tokens: 11 columns
    out = generate(windowed, PROMPT, _heads(), max_new_tokens=4, tree="chain4").one
    assert out.sequences[0].tolist() == _recomputed(windowed, 4)


def test_plain_decoding_past_the_window_is_exact(windowed):
    out = generate(windowed, PROMPT, max_new_tokens=3 * WINDOW).one
    assert out.sequences[0].tolist() == _recomputed(windowed, 3 * WINDOW)


@pytest.mark.parametrize(
    "call",
    [
        lambda m: generate(m, PROMPT, _heads(), max_new_tokens=5, tree="chain4"),
        lambda m: generate(m, PROMPT.repeat(2, 1), _heads(), max_new_tokens=5, tree="chain4"),
        lambda m: generate(m, PROMPT.repeat(2, 1), max_new_tokens=WINDOW),  # batched plain decoding too
        lambda m: generate(
            m, torch.zeros(1, WINDOW, dtype=torch.long), max_new_tokens=1, tree=lambda r: None
        ),
    ],
    ids=["tree", "batched tree", "batched plain", "policy: long prompt"],
)
def test_outgrowing_the_window_is_refused_before_decoding(windowed, call):
    with pytest.raises(
        ValueError, match=f"sliding window keeps {WINDOW - 1}: speculative and batched decoding"
    ):
        call(windowed)


def test_a_policy_is_stopped_at_the_step_that_would_outgrow_the_window(windowed):
    """A policy picks each step's tree, so its request is checked step by step."""
    with pytest.raises(ValueError, match=r"a step verifying 5 tokens needs 1[2-9] cache columns"):
        generate(windowed, PROMPT.repeat(2, 1), _heads(), max_new_tokens=12, tree=lambda rows: "chain4")
