"""Tests for decode/generate.py's argument checks: every bad call fails before any work, with a message that
names the offending value."""

import pytest
import torch
from torch import nn

from decode import generate
from decode.layout import can_int8
from decode.prepare import quantize_draft
from heads.eagle import EagleConfig, EagleHead
from heads.medusa import MedusaConfig, MedusaHeads

PROMPT = torch.tensor([[5, 17, 99, 3, 42, 8, 61]])
V = 128


def _medusa(num_heads=3, hidden_size=32, vocab_size=V):
    return MedusaHeads(MedusaConfig(hidden_size=hidden_size, vocab_size=vocab_size, num_heads=num_heads))


BAD_CALLS = {
    "empty prompt": ({"input_ids": torch.zeros(1, 0, dtype=torch.long)}, ValueError, r"non-empty.*\(1, 0\)"),
    "no new tokens": ({"max_new_tokens": 0}, ValueError, "max_new_tokens must be >= 1, got 0"),
    "negative new tokens": ({"max_new_tokens": -3}, ValueError, "max_new_tokens must be >= 1, got -3"),
    "negative temperature": ({"temperature": -0.5}, ValueError, "temperature must be >= 0, got -0.5"),
    "top_p zero": ({"temperature": 1.0, "top_p": 0.0}, ValueError, r"top_p must be in \(0, 1\], got 0.0"),
    "top_p above one": (
        {"temperature": 1.0, "top_p": 1.5},
        ValueError,
        r"top_p must be in \(0, 1\], got 1.5",
    ),
    "negative top_k": ({"temperature": 1.0, "top_k": -1}, ValueError, "top_k must be >= 0, got -1"),
    "3-d prompt": ({"input_ids": PROMPT[None]}, ValueError, r"\(1, 1, 7\)"),
    "tree not prefix-closed": (
        {"heads": lambda m: _medusa(), "tree": [(0,), (0, 0, 0)]},
        ValueError,
        r"not prefix-closed: path \(0, 0, 0\) needs its prefix \(0, 0\)",
    ),
    "tree deeper than medusa": (
        {"heads": lambda m: _medusa(num_heads=2), "tree": "chain4"},
        ValueError,
        "tree depth 4 exceeds the 2 levels",
    ),
    "heads for wider target": (
        {"heads": lambda m: _medusa(hidden_size=48)},
        ValueError,
        r"MedusaHeads was built for a target with hidden_size=48, but this target has hidden_size=32$",
    ),
    "heads for larger vocab": (
        {"heads": lambda m: EagleHead(EagleConfig.from_target(m.config, "eagle1", vocab_size=256))},
        ValueError,
        "vocab_size=256, but this target has vocab_size=128",
    ),
    "taps beyond depth": (
        {"heads": lambda m: EagleHead(EagleConfig.from_target(m.config, "eagle3", aux_layer_ids=(0, 9)))},
        ValueError,
        "EagleHead taps layer 9, but the target has 4 layers",
    ),
    "typical at greedy": ({"acceptance": "typical"}, ValueError, "typical acceptance applies to sampling"),
    "unknown acceptance": ({"acceptance": "fast"}, ValueError, "acceptance must be 'lossless' or 'typical'"),
    "unknown tree name": (
        {"heads": lambda m: _medusa(), "tree": "tree99"},
        ValueError,
        r"unknown tree name 'tree99'.*chain4",
    ),
    "tree of wrong type": ({"heads": lambda m: _medusa(), "tree": 7}, TypeError, "got int"),
    "float ids": ({"input_ids": PROMPT.float()}, TypeError, "integer token ids, got dtype torch.float32"),
    "bool ids": ({"input_ids": PROMPT > 50}, TypeError, "integer token ids, got dtype torch.bool"),
    "ids as a list": ({"input_ids": [[5, 17]]}, TypeError, "must be a torch.Tensor of token ids, got list"),
    "id past the vocabulary": (
        {"input_ids": torch.tensor([[5, 17, V]])},
        ValueError,
        r"input_ids row 0, column 2 holds 128, outside the target's vocabulary \[0, 128\)",
    ),
    "negative id": (
        {"input_ids": torch.tensor([[5, 9], [-1, 3]]), "attention_mask": torch.ones(2, 2)},
        ValueError,
        r"row 1, column 0 holds -1, outside .*\(padding too must be a valid id\)",
    ),
    "empty batch": (
        {"input_ids": torch.zeros(0, 5, dtype=torch.long)},
        ValueError,
        r"no prompts \(shape \(0, 5\)",
    ),
    "fractional new tokens": (
        {"max_new_tokens": 2.5},
        TypeError,
        r"max_new_tokens must be an integer, got 2.5",
    ),
    "boolean new tokens": (
        {"max_new_tokens": True},
        TypeError,
        "max_new_tokens must be an integer, got True",
    ),
    "fractional top_k": ({"temperature": 1.0, "top_k": 2.5}, TypeError, "top_k must be an integer, got 2.5"),
    "nan temperature": (
        {"temperature": float("nan")},
        ValueError,
        "temperature must be a finite number, got nan",
    ),
    "infinite temperature": (
        {"temperature": float("inf")},
        ValueError,
        "temperature must be a finite number",
    ),
    "temperature as text": ({"temperature": "0.7"}, TypeError, "temperature must be a number, got '0.7'"),
    "nan top_p": ({"temperature": 1.0, "top_p": float("nan")}, ValueError, "top_p must be a finite number"),
    "float eos tensor": (
        {"eos_token_id": torch.tensor([2.0])},
        TypeError,
        "eos_token_id must hold integer ids, got a torch.float32 tensor",
    ),
    "negative eos": ({"eos_token_id": -1}, ValueError, "eos_token_id must be >= 0, got -1"),
    "eos past the vocabulary": (
        {"eos_token_id": [500, 900]},
        ValueError,
        r"eos_token_id \[500, 900\] lies outside the target's vocabulary \[0, 128\)",
    ),
    "fractional seed": ({"seed": 1.5}, TypeError, "seed must be an integer, got 1.5"),
    "mask of another shape": (
        {"input_ids": PROMPT.repeat(2, 1), "attention_mask": torch.ones(2, 6)},
        ValueError,
        r"input_ids \(2, 7\) and attention_mask \(2, 6\) must have one \(B, T\) shape",
    ),
    "mask with a hole": (
        {
            "input_ids": PROMPT[:, :6].repeat(2, 1),
            "attention_mask": torch.tensor([[1] * 6, [1, 0, 1, 1, 1, 1]]),
        },
        ValueError,
        r"attention_mask row 1 is \[1, 0, 1, 1, 1, 1\]: prompts must be left-padded",
    ),
    "right-padded mask": (
        {
            "input_ids": PROMPT[:, :4].repeat(2, 1),
            "attention_mask": torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0]]),
        },
        ValueError,
        r"attention_mask row 1 is \[1, 1, 0, 0\]",
    ),
    "mask of twos": (
        {"input_ids": PROMPT, "attention_mask": torch.full((1, 7), 2)},
        ValueError,
        "attention_mask must hold only 0 and 1, found 2",
    ),
    "all-padding row": (
        {"input_ids": PROMPT[:, :3].repeat(2, 1), "attention_mask": torch.tensor([[1, 1, 1], [0, 0, 0]])},
        ValueError,
        r"attention_mask row 1 has no tokens \(all padding\)",
    ),
    "mask as a list": (
        {"attention_mask": [[1] * 7]},
        TypeError,
        "attention_mask must be a torch.Tensor, got list",
    ),
    "heads on another device": (
        {"heads": lambda m: _medusa().to("meta")},
        ValueError,
        (
            r"heads are on meta / float32 but the target is on cpu / float32; load them with "
            r"load_heads\(path, "
            r"target=model, dtype=model.dtype, device=model.device\)"
        ),
    ),
    "seed past a generator's": ({"seed": 2**70}, ValueError, "seed must be <= 18446744073709551615, got "),
    "pad beyond int64": ({"pad_token_id": 10**30}, ValueError, "pad_token_id must be <= 9223372036854775807"),
    "float pad": ({"pad_token_id": 1.5}, TypeError, r"pad_token_id must be an integer, got 1.5 \(float\)"),
    "heads in another dtype": (
        {"heads": lambda m: EagleHead(EagleConfig.from_target(m.config, "eagle3")).to(torch.bfloat16)},
        ValueError,
        "heads are on cpu / bfloat16 but the target is on cpu / float32",
    ),
}


@pytest.mark.parametrize("case", BAD_CALLS)
def test_bad_input_raises(build_target, case):
    model = build_target("llama")
    kwargs, error, message = BAD_CALLS[case]
    kwargs = {"input_ids": PROMPT, "max_new_tokens": 4, **kwargs}
    if callable(kwargs.get("heads")):
        kwargs["heads"] = kwargs["heads"](model)
    with pytest.raises(error, match=message):
        generate(model, **kwargs)


SHARED = [case for case, (kwargs, _, _) in BAD_CALLS.items() if not {"heads", "acceptance"} & set(kwargs)]


@pytest.mark.parametrize("case", SHARED)
def test_a_masked_request_refuses_the_same_input(build_target, case):
    """A request with an attention mask (the padded path, which a separate batched entry point once took)
    is checked by the same code, before any work: every case without a mask of its own gets an all-ones one
    of its prompt's shape, and the same error comes."""
    model = build_target("llama")
    kwargs, error, message = BAD_CALLS[case]
    kwargs = {"input_ids": PROMPT, "max_new_tokens": 4, **kwargs}
    if "attention_mask" not in kwargs:
        ids = kwargs["input_ids"]
        shape = tuple(ids.shape) if isinstance(ids, torch.Tensor) else (len(ids), len(ids[0]))
        kwargs["attention_mask"] = torch.ones(shape, dtype=torch.long)
    with pytest.raises(error, match=message):
        generate(model, **kwargs)


def test_typical_acceptance_decodes_a_batch(build_target):
    """Typical acceptance (lossy, sampling only) was once refused for more than one sequence; the one decode
    loop takes a batch: each row accepts by the rule and gets its reply."""
    model = build_target("llama")
    torch.manual_seed(0)
    out = generate(
        model,
        PROMPT.repeat(2, 1),
        _medusa(),
        max_new_tokens=4,
        temperature=1.0,
        seed=0,
        eos_token_id=[],
        acceptance="typical",
    )
    assert out.new_tokens == [4, 4] and [len(reply) for reply in out.replies] == [4, 4]


def test_integer_ids_of_any_width_decode_alike(build_target):
    """int32 or uint8 ids are token ids like int64 ones (the loop works in int64)."""
    model = build_target("llama")
    reference = generate(model, PROMPT, max_new_tokens=5).one.sequences
    for dtype in (torch.int32, torch.uint8):
        assert (
            generate(model, PROMPT.to(dtype), max_new_tokens=5).one.sequences.tolist() == reference.tolist()
        )


def test_eos_as_a_tensor_stops_like_an_int(build_target):
    model = build_target("llama")
    plain = generate(model, PROMPT, max_new_tokens=8).one.sequences[0, PROMPT.shape[1] :].tolist()
    stop = plain[3]
    for eos in (stop, torch.tensor(stop), torch.tensor([stop, 127])):
        out = generate(model, PROMPT, max_new_tokens=8, eos_token_id=eos).one
        assert out.sequences[0, PROMPT.shape[1] :].tolist() == plain[: plain.index(stop) + 1]


def test_wrong_heads_type_raises_type_error(build_target):
    with pytest.raises(
        TypeError, match="no drafter is registered for Linear; registered: eagle3 .EagleHead."
    ):
        generate(build_target("llama"), PROMPT, nn.Linear(32, 32), max_new_tokens=4)


@pytest.mark.skipif(not can_int8(), reason="int8 drafts need fbgemm (x86) kernels")
@pytest.mark.parametrize("kind", ["medusa", "eagle3"])
def test_int8_drafts_fit_an_fp32_target(build_target, kind):
    """int8 layers hold no floating parameters; the fp32 parts an int8 EAGLE head keeps (fc, norms) match."""
    model = build_target("llama")
    torch.manual_seed(0)
    heads = _medusa() if kind == "medusa" else EagleHead(EagleConfig.from_target(model.config, "eagle3"))
    out = generate(model, PROMPT, quantize_draft(heads.eval(), model), max_new_tokens=4).one
    assert out.new_tokens == 4


def test_a_tiny_temperature_or_top_p_tends_to_greedy_not_to_token_0(build_target):
    """softmax(logits / 1e-40) overflowed to inf - inf = NaN and every draw was token 0; a top_p that rounds
    to 0 in fp32 dropped every token, 0 / 0 again. Both now keep the likeliest token, as T -> 0 should."""
    model = build_target("llama")
    greedy = generate(model, PROMPT, max_new_tokens=8, eos_token_id=[]).replies
    assert greedy[0] != [0] * 8
    for kwargs in ({"temperature": 1e-40}, {"temperature": 1.0, "top_p": 1e-46}):
        for heads in (None, _medusa()):
            out = generate(model, PROMPT, heads, max_new_tokens=8, eos_token_id=[], seed=0, **kwargs)
            assert out.replies == greedy, (kwargs, heads is not None)


def test_one_prompt_takes_a_mask_of_its_own_shape(build_target):
    """Ids of shape (T,) with a mask of shape (T,): the mask is the prompt's, as the ids are (it was refused
    as "input_ids (1, T) and attention_mask (T,)", shapes the caller never passed)."""
    model = build_target("llama")
    ids = PROMPT[0]
    alone = generate(model, ids, max_new_tokens=6, eos_token_id=[]).replies
    masked = generate(model, ids, max_new_tokens=6, eos_token_id=[], attention_mask=torch.ones_like(ids))
    assert masked.replies == alone
