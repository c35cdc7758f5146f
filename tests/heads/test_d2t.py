"""The EAGLE-3 draft vocabulary map d2t is checked on every path that brings one into a head: a non-injective
or out-of-range map would load into a head that samples from the wrong distribution, without any error."""

import re

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from engines.export import export_head, import_head
from heads.dflash import DFlashConfig, DFlashHead
from heads.eagle import EagleConfig, EagleHead
from heads.io import WEIGHTS_NAME, load_heads, save_heads

VD, V = 64, 128
IDS = torch.arange(0, V, 2)  # draft id i -> target id 2i


def _map(edit):
    """A state edit writing d2t for the target ids IDS changed by `edit` (t2d is left as saved)."""

    def apply(state):
        target = IDS.clone()
        edit(target)
        state["d2t"] = target - torch.arange(VD)

    return apply


def _set(state, key, value):
    state[key] = value


# (name, state edit, message after "<weights file>: "); each loaded silently before the check existed
BAD = [
    (
        "duplicate",
        _map(lambda t: t.__setitem__(17, 6)),
        r"d2t maps draft ids 3 and 17 to target id 6 \(the draft",
    ),
    (
        "all_to_one",
        lambda s: _set(s, "d2t", 42 - torch.arange(VD)),
        r"d2t maps draft ids 0 and 1 to target id 42 ",
    ),
    (
        "past_vocab",
        _map(lambda t: t.__setitem__(5, V)),
        r"d2t maps draft id 5 to target id 128, outside the target vocab \[0, 128\)",
    ),
    (
        "negative",
        _map(lambda t: t.__setitem__(7, -3)),
        r"d2t maps draft id 7 to target id -3, outside the target vocab \[0, 128\)",
    ),
    (
        "float",
        lambda s: _set(s, "d2t", s["d2t"].float()),
        r"d2t must be a 1-D int64 tensor, got torch\.float32 of shape \(64,\)",
    ),
    ("t2d_disagrees", lambda s: _set(s, "t2d", s["t2d"].roll(1)), r"d2t and t2d disagree"),
]
SAME_SHAPE = [pytest.param(edit, msg, id=name) for name, edit, msg in BAD]
WRONG_SHAPE = [
    pytest.param(
        lambda s: _set(s, "d2t", s["d2t"][:63]),
        "d2t has 63 entries, but the config says draft_vocab_size=64",
        id="short",
    ),
    pytest.param(
        lambda s: _set(s, "d2t", s["d2t"].view(8, 8)),
        r"d2t must be a 1-D int64 tensor, got torch\.int64 of shape \(8, 8\)",
        id="2d",
    ),
]


@pytest.fixture
def llama(build_target):
    return build_target("llama")


@pytest.fixture
def head(llama):
    torch.manual_seed(0)
    head = EagleHead(EagleConfig.from_target(llama.config, "eagle3", draft_vocab_size=VD))
    head.set_draft_vocab(IDS[torch.randperm(VD)])
    return head.eval()


def _edit(folder, edit):
    state = load_file(folder / WEIGHTS_NAME)
    edit(state)
    save_file(state, folder / WEIGHTS_NAME)


def _raises(folder, message):
    return pytest.raises(ValueError, match=re.escape(f"{folder / WEIGHTS_NAME}: ") + message)


def test_valid_maps_load(tmp_path, llama, head):
    for loaded in (
        load_heads(save_heads(head, tmp_path / "ours", base_model="org/tiny"), llama),
        import_head(export_head(head, "sglang", tmp_path / "sglang")[0].parent, target=llama),
        import_head(
            export_head(head, "speculators", tmp_path / "spec", target=llama)[0].parent, target=llama
        ),
    ):
        assert torch.equal(loaded.to_target_ids(torch.arange(VD)), IDS)
        assert torch.equal(loaded.t2d.nonzero().flatten(), IDS)


@pytest.mark.parametrize(("edit", "message"), SAME_SHAPE + WRONG_SHAPE)
def test_load_heads_refuses_bad_d2t(tmp_path, llama, head, edit, message):
    folder = save_heads(head, tmp_path / "ours", base_model="org/tiny")
    _edit(folder, edit)
    with _raises(folder, message):
        load_heads(folder, llama)
    with _raises(folder, message):  # without a target too
        load_heads(folder)


@pytest.mark.parametrize("fmt", ["sglang", "speculators"])
@pytest.mark.parametrize(("edit", "message"), SAME_SHAPE)
def test_import_head_refuses_bad_d2t(tmp_path, llama, head, fmt, edit, message):
    folder = tmp_path / fmt
    export_head(head, fmt, folder, target=llama)
    _edit(folder, edit)
    with _raises(folder, message):
        import_head(folder)


def test_set_draft_vocab_names_the_duplicate(head):
    ids = IDS.clone()
    ids[40] = ids[9]
    with pytest.raises(
        ValueError, match=r"set_draft_vocab\(target_ids\): d2t maps draft ids 9 and 40 to target id 18"
    ):
        head.set_draft_vocab(ids)


@pytest.mark.parametrize(("edit", "message"), SAME_SHAPE + WRONG_SHAPE)
def test_a_dflash_head_with_its_own_vocabulary_is_checked_alike(tmp_path, llama, edit, message):
    torch.manual_seed(0)
    head = DFlashHead(DFlashConfig.from_target(llama.config, 3, num_hidden_layers=1, draft_vocab_size=VD))
    head.set_draft_vocab(IDS[torch.randperm(VD)])
    folder = save_heads(head, tmp_path / "dflash", base_model="org/tiny")
    assert torch.equal(load_heads(folder, llama).to_target_ids(torch.arange(VD)), IDS)
    _edit(folder, edit)
    with _raises(folder, message):
        load_heads(folder, llama)


def test_token_ids_and_tap_ids_must_be_integers_not_cut(llama, head):
    """Floats were cut by `torch.as_tensor(..., dtype=long)` or `int()`: 2.7 drafted as 2, tap 1.5 as 1."""
    ids = torch.randperm(llama.config.vocab_size)[:64].float() + 0.7
    with pytest.raises(ValueError, match="draft vocabulary ids must be integers, got a torch.float32 tensor"):
        head.set_draft_vocab(ids)
    with pytest.raises(ValueError, match=re.escape("aux_layer_ids must hold integer ids >= 0, got 1.5")):
        EagleConfig.from_target(llama.config, "eagle3", aux_layer_ids=[1.5, 2, 3])
    with pytest.raises(ValueError, match=re.escape("aux_layer_ids must hold integer ids >= 0, got -1")):
        DFlashConfig.from_target(llama.config, 7, aux_layer_ids=(-1, 2))
    config = EagleConfig.from_target(llama.config, "eagle3", aux_layer_ids=[np.int64(1), 2, 3])
    assert config.aux_layer_ids == (1, 2, 3) and all(type(i) is int for i in config.aux_layer_ids)
