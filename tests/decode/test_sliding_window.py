"""Sliding-window targets: every layer's cache keeps every column (`decode.verify.target_cache`) and the
window is applied in the masks by position, so speculative, batched and policy-driven decoding stay exact
past the window, as plain decoding is; the window is really applied (decoding that ignores it gives other
tokens)."""

import pytest
import torch

from decode import generate
from decode.inputs import attention_windows
from heads.medusa import MedusaConfig, MedusaHeads

WINDOW = 12
PROMPT = torch.tensor([[5, 17, 99, 3]])
NEW = 3 * WINDOW  # every sequence crosses the window several times


@pytest.fixture(scope="module", params=["mistral", "gemma3_text"])
def windowed(request, build_target):
    return build_target(request.param, sliding_window=WINDOW)


def _recomputed(model, prompt: torch.Tensor, n: int) -> list[int]:
    """Greedy continuation recomputing the whole sequence each step (no cache, no library code)."""
    ids = prompt
    with torch.no_grad():
        for _ in range(n):
            ids = torch.cat([ids, model(input_ids=ids, use_cache=False).logits[:, -1:].argmax(-1)], dim=1)
    return ids[0].tolist()


def _heads():
    torch.manual_seed(1)
    return MedusaHeads(MedusaConfig(hidden_size=32, vocab_size=128, num_heads=4))


def test_the_windows_are_read_per_layer_type(windowed):
    types = getattr(windowed.config, "layer_types", None) or ["sliding_attention"]
    expected = {kind: WINDOW if kind == "sliding_attention" else None for kind in types}
    assert attention_windows(windowed) == expected


def test_plain_decoding_past_the_window_is_exact(windowed):
    out = generate(windowed, PROMPT, max_new_tokens=NEW).one
    assert out.sequences[0].tolist() == _recomputed(windowed, PROMPT, NEW)


@pytest.mark.parametrize(
    "tree",
    ["chain4", lambda rows: "chain4"],  # a fixed tree, and a policy choosing each step's
    ids=["tree", "policy"],
)
def test_speculative_decoding_past_the_window_is_exact_alone_and_batched(windowed, tree):
    expected = _recomputed(windowed, PROMPT, NEW)
    out = generate(windowed, PROMPT, _heads(), max_new_tokens=NEW, tree=tree).one
    assert out.sequences[0].tolist() == expected
    short = PROMPT[:, 1:]  # a second row, left-padded by one: its columns are not its positions
    ids = torch.cat([PROMPT, torch.cat([torch.zeros(1, 1, dtype=torch.long), short], dim=1)])
    mask = torch.ones_like(ids)
    mask[1, 0] = 0
    batched = generate(windowed, ids, _heads(), max_new_tokens=NEW, tree=tree, attention_mask=mask)
    assert batched.sequences[0].tolist() == expected
    assert batched.sequences[1, 1:].tolist() == _recomputed(windowed, short, NEW)


def test_batched_plain_decoding_past_the_window_is_exact(windowed):
    out = generate(windowed, PROMPT.repeat(2, 1), max_new_tokens=NEW)
    assert out.sequences.tolist() == [_recomputed(windowed, PROMPT, NEW)] * 2


def test_decoding_that_ignored_the_window_would_differ(windowed):
    """The control: the same model without its window continues differently within these lengths, so the
    tests above check the window."""
    wide = {**windowed.config.to_dict(), "sliding_window": 4096}  # longer than any sequence here
    unwindowed = type(windowed)(windowed.config.__class__(**wide))
    unwindowed.load_state_dict(windowed.state_dict())
    unwindowed.eval()
    assert _recomputed(unwindowed, PROMPT, NEW) != _recomputed(windowed, PROMPT, NEW)
