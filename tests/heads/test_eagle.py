"""Tests for heads/eagle.py (EAGLE-1 / EAGLE-3 heads, export key layout, draft vocab) and the EAGLE
drafter's tree attention in decode/propose.py: every tree node must see exactly its committed prefix and
its ancestor path, so its output equals running the head causally on that path."""

import pytest
import torch

from decode.drafters.eagle import EagleDrafter
from heads.eagle import EagleConfig, EagleHead, with_draft_vocab
from heads.peagle import PEagleConfig, PEagleHead

H, V, VD = 32, 128, 64
EAGLE3_KEYS = {  # docs/design.md, Export formats: SGLang / official form
    "fc.weight",
    "midlayer.self_attn.q_proj.weight",
    "midlayer.self_attn.k_proj.weight",
    "midlayer.self_attn.v_proj.weight",
    "midlayer.self_attn.o_proj.weight",
    "midlayer.mlp.gate_proj.weight",
    "midlayer.mlp.up_proj.weight",
    "midlayer.mlp.down_proj.weight",
    "midlayer.input_layernorm.weight",
    "midlayer.hidden_norm.weight",
    "midlayer.post_attention_layernorm.weight",
    "norm.weight",
    "lm_head.weight",
    "d2t",
    "t2d",
}


def _head(target_config, head_type: str, seed: int = 0, **overrides) -> EagleHead:
    if head_type == "eagle3":
        overrides.setdefault("draft_vocab_size", VD)
    torch.manual_seed(seed)
    head = EagleHead(EagleConfig.from_target(target_config, head_type, **overrides)).eval()
    if head_type == "eagle3":
        head.set_draft_vocab(torch.randperm(V, generator=torch.Generator().manual_seed(seed))[:VD])
    return head


@pytest.fixture
def llama(build_target):
    return build_target("llama")


@pytest.mark.parametrize("head_type", ["eagle1", "eagle3"])
def test_forward_and_logit_shapes(llama, head_type):
    head = _head(llama.config, head_type)
    taps = len(head.feature_layers)
    assert head.feature_layers == ((-1,) if head_type == "eagle1" else (0, 1, 2))
    features = head.project_features(torch.randn(1, 5, taps * H))
    hidden = head(features, torch.randn(1, 5, H), torch.arange(5)[None])
    assert features.shape == hidden.shape == (1, 5, H)
    assert head.logits(hidden, llama.lm_head).shape == (1, 5, V if head_type == "eagle1" else VD)


def test_eagle3_export_keys_and_shapes(llama):
    state = _head(llama.config, "eagle3").state_dict()
    assert set(state) == EAGLE3_KEYS
    assert not any("embed_tokens" in k for k in state)
    assert state["fc.weight"].shape == (H, 3 * H)
    for name in ("q", "k", "v"):
        assert state[f"midlayer.self_attn.{name}_proj.weight"].shape[1] == 2 * H
    assert state["midlayer.self_attn.o_proj.weight"].shape == (H, H)
    assert state["lm_head.weight"].shape == (VD, H)
    assert state["d2t"].shape == (VD,) and state["d2t"].dtype == torch.int64
    assert state["t2d"].shape == (V,) and state["t2d"].dtype == torch.bool
    assert "fc.bias" not in state


def test_eagle1_has_no_input_layernorm(llama):
    state = _head(llama.config, "eagle1").state_dict()
    assert not any("input_layernorm" in k or "hidden_norm" in k for k in state)
    assert not any(k.startswith(("lm_head", "norm.", "d2t", "t2d")) or "embed_tokens" in k for k in state)
    assert state["fc.weight"].shape == (H, 2 * H)
    assert state["midlayer.self_attn.q_proj.weight"].shape == (H, H)
    assert "midlayer.post_attention_layernorm.weight" in state


def test_set_draft_vocab_maps(llama):
    head = _head(llama.config, "eagle3", draft_vocab_size=VD)
    ids = torch.randperm(V, generator=torch.Generator().manual_seed(7))[:VD]
    head.set_draft_vocab(ids)
    assert torch.equal(torch.nonzero(head.t2d).flatten(), head.d2t + torch.arange(VD))
    assert head.t2d.sum() == VD
    assert torch.equal(head.to_target_ids(torch.arange(VD)), ids.sort().values)
    draft_ids = torch.tensor([[3, 0], [VD - 1, 5]])
    assert torch.equal(head.to_target_ids(draft_ids), ids.sort().values[draft_ids])
    head.init_lm_head_from_target(llama.lm_head.weight)
    assert torch.equal(head.lm_head.weight, llama.lm_head.weight[ids.sort().values])


def test_fresh_eagle3_draft_vocab_is_identity(llama):
    head = EagleHead(EagleConfig.from_target(llama.config, "eagle3", draft_vocab_size=VD))
    assert torch.equal(head.to_target_ids(torch.arange(VD)), torch.arange(VD))
    assert torch.equal(torch.nonzero(head.t2d).flatten(), torch.arange(VD))


@pytest.mark.parametrize(
    "ids, message",
    [
        (torch.arange(VD - 1), "d2t has 63 entries, but the config says draft_vocab_size=64"),
        (torch.cat([torch.arange(VD - 1), torch.tensor([0])]), "draft ids 0 and 63 to target id 0 "),
        (torch.arange(VD) + V - VD + 1, r"draft id 63 to target id 128, outside the target vocab \[0, 128\)"),
        (torch.arange(VD) - 1, r"draft id 0 to target id -1, outside the target vocab \[0, 128\)"),
    ],
)
def test_bad_draft_vocab_raises(llama, ids, message):
    head = _head(llama.config, "eagle3")
    d2t = head.d2t.clone()
    with pytest.raises(ValueError, match=message):
        head.set_draft_vocab(ids)
    assert torch.equal(head.d2t, d2t)
    with pytest.raises(ValueError, match="only eagle3"):
        _head(llama.config, "eagle1").set_draft_vocab(torch.arange(VD))


@pytest.mark.parametrize("kind", ["eagle3", "peagle"])
@pytest.mark.parametrize("size", [VD // 2, VD, 2 * VD])
def test_with_draft_vocab_keeps_trained_rows_and_starts_new_ones_from_the_target(llama, kind, size):
    if kind == "eagle3":
        head = _head(llama.config, "eagle3")
    else:
        torch.manual_seed(0)
        head = PEagleHead(PEagleConfig.from_target(llama.config, draft_vocab_size=VD, mask_token_id=3)).eval()
        head.set_draft_vocab(torch.randperm(V, generator=torch.Generator().manual_seed(0))[:VD])
    with torch.no_grad():
        head.lm_head.weight.normal_()  # trained rows: unlike the target's
    old_ids = head.to_target_ids(torch.arange(VD))
    ids = torch.randperm(V, generator=torch.Generator().manual_seed(5))[:size]
    new = with_draft_vocab(head, ids, llama.lm_head.weight)
    assert type(new) is type(head) and new.config.draft_vocab_size == size and not new.training
    assert torch.equal(new.to_target_ids(torch.arange(size)), ids.sort().values)
    assert torch.equal(torch.nonzero(new.t2d).flatten(), ids.sort().values)
    kept = 0
    for row, token in enumerate(new.to_target_ids(torch.arange(size)).tolist()):
        if token in old_ids.tolist():  # drafted before: its trained row
            expected, kept = head.lm_head.weight[old_ids.tolist().index(token)], kept + 1
        else:  # new: the target's row
            expected = llama.lm_head.weight[token]
        assert torch.equal(new.lm_head.weight[row], expected), token
    assert 0 < kept < size  # the draw overlaps the old vocabulary in part: both branches ran
    old_state, new_state = head.state_dict(), new.state_dict()
    assert set(old_state) == set(new_state)
    for key in set(old_state) - {"lm_head.weight", "d2t", "t2d"}:
        assert torch.equal(old_state[key], new_state[key]), key
    # the same hidden state scores each kept token as before
    features = head.project_features(torch.randn(1, 4, 3 * H))
    hidden = head(features, torch.randn(1, 4, H), torch.arange(4)[None])
    old_logits, new_logits = head.logits(hidden, llama.lm_head), new.logits(hidden, llama.lm_head)
    assert new_logits.shape == (1, 4, size)
    new_ids = new.to_target_ids(torch.arange(size)).tolist()
    both = [t for t in new_ids if t in old_ids.tolist()]
    assert torch.equal(
        new_logits[..., [new_ids.index(t) for t in both]],
        old_logits[..., [old_ids.tolist().index(t) for t in both]],
    )


def test_with_draft_vocab_refuses_what_it_cannot_redraw(llama):
    head = _head(llama.config, "eagle3")
    with pytest.raises(ValueError, match="this eagle1 head drafts over the target's vocabulary"):
        with_draft_vocab(_head(llama.config, "eagle1"), torch.arange(VD), llama.lm_head.weight)
    with pytest.raises(ValueError, match=r"target lm_head weight \(128, 16\), expected \(128, 32\)"):
        with_draft_vocab(head, torch.arange(VD), llama.lm_head.weight[:, :16])
    with pytest.raises(ValueError, match="draft ids 0 and 1 to target id 4"):
        with_draft_vocab(head, torch.tensor([4, 4, 5]), llama.lm_head.weight)


def test_config_validation():
    with pytest.raises(ValueError, match="head_type must be one of"):
        EagleConfig("eagle2", H, 4, 2, 8, 64, V)
    with pytest.raises(ValueError, match="aux_layer_ids"):
        EagleConfig("eagle3", H, 4, 2, 8, 64, V)
    with pytest.raises(ValueError, match="hidden sizes must match"):
        EagleConfig("eagle1", H, 4, 2, 8, 64, V, target_hidden_size=48)
    cfg = EagleConfig("eagle3", H, 4, 2, 8, 64, V, target_hidden_size=48, aux_layer_ids=[0, 2, 3])
    assert cfg.aux_layer_ids == (0, 2, 3) and cfg.draft_vocab_size == V
    assert EagleHead(cfg).fc.weight.shape == (H, 3 * 48)


def test_from_target_picks_gemma3_full_attention_rope(build_target):
    text = build_target("gemma3_text").config
    rope = text.rope_parameters
    assert rope["sliding_attention"]["rope_theta"] != rope["full_attention"]["rope_theta"]
    cfg = EagleConfig.from_target(text, "eagle3")
    assert cfg.rope_parameters == {"rope_type": "default", "rope_theta": 1_000_000.0}
    assert (cfg.hidden_size, cfg.head_dim, cfg.num_key_value_heads, cfg.vocab_size) == (H, 8, 2, V)
    assert cfg.aux_layer_ids == (0, 1, 2)
    assert EagleConfig.from_target(
        build_target("llama", rope_theta=5e5).config, "eagle1"
    ).rope_parameters == {"rope_type": "default", "rope_theta": 5e5}


# ---- the draft's tree attention equals causal decoding along each node's path --------------------------

CHAIN = [[0], [1], [2]]  # parents of the new nodes, one list per depth; node ids count up from 1
BRANCHING = [[0, 0], [1, 1, 2], [4]]  # two siblings at depth 1; node 4 (2nd child of node 1) grows on


def _causal_path_outputs(head, drafter, feats, tokens, path_tokens):
    """Reference: run the head causally (no cache, no tree) over committed inputs + one path, token by
    token."""
    embed = drafter.embed
    hiddens = []
    for step in range(len(path_tokens) + 1):
        previous = [h[None, None] for h in hiddens]
        inputs = torch.cat([feats, *previous], dim=1) if step else feats
        ids = torch.cat([tokens, torch.tensor(path_tokens[:step], dtype=torch.long)])
        out = head(inputs, embed(ids[None]), torch.arange(ids.numel())[None])
        hiddens.append(out[0, -1])
    return hiddens  # hiddens[0] = root (last committed position), hiddens[d] = the path's depth-d node


def _path_tokens(node: int, parents: list[int], tokens: list[int]) -> list[int]:
    """Tokens from the root's first child down to `node` (the root itself excluded)."""
    path = []
    while node > 0:
        path.insert(0, tokens[node])
        node = parents[node]
    return path


@pytest.mark.parametrize("levels", [CHAIN, BRANCHING], ids=["chain", "branching"])
@pytest.mark.parametrize("head_type", ["eagle1", "eagle3"])
def test_draft_tree_attention_equals_causal(llama, head_type, levels):
    head = _head(llama.config, head_type)
    drafter = EagleDrafter(head, llama, 1)
    gen = torch.Generator().manual_seed(3)
    width = len(head.feature_layers) * H
    raw = torch.randn(9, width, generator=gen)
    next_tokens = torch.randint(0, V, (9,), generator=gen)
    committed = 0
    with torch.no_grad():
        for new in (6, 3):  # two proposals: the second checks end_proposal() dropped the first tree's KV
            drafter.advance([raw[committed : committed + new]], [next_tokens[committed : committed + new]])
            committed += new
            assert drafter.host_counts == [committed] and len(drafter.cache) == committed
            feats = head.project_features(raw[None, :committed])
            tokens = next_tokens[:committed]
            parents, node_tokens = [-1], [int(tokens[-1])]
            row_of = {0: -1}  # node -> where it was expanded in this proposal (-1: the root)
            root_ref = _causal_path_outputs(head, drafter, feats, tokens, [])[0]
            torch.testing.assert_close(
                drafter.root_logits()[0], head.logits(root_ref, llama.lm_head), atol=1e-5, rtol=0
            )
            for depth, level in enumerate(levels, start=1):
                nodes = list(range(len(parents), len(parents) + len(level)))
                level_tokens = torch.randint(0, V, (len(level),), generator=gen)
                parents += level
                node_tokens += level_tokens.tolist()
                parent_rows = torch.tensor([[row_of[p] for p in level]])
                logits = drafter.expand(parent_rows, level_tokens[None], depth)[0]
                row_of.update({node: len(row_of) - 1 + i for i, node in enumerate(nodes)})
                assert logits.shape == (len(nodes), V if head_type == "eagle1" else VD)
                outputs = torch.cat(drafter._rows, dim=1)[0]  # each expanded node's output, by row
                for row, node in enumerate(nodes):
                    path = _path_tokens(node, parents, node_tokens)
                    assert len(path) == depth
                    expected = _causal_path_outputs(head, drafter, feats, tokens, path)[-1]
                    # the node's output feature (private state: it feeds the node's children)
                    torch.testing.assert_close(outputs[row_of[node]], expected, atol=1e-5, rtol=0)
                    torch.testing.assert_close(
                        logits[row], head.logits(expected, llama.lm_head), atol=1e-5, rtol=0
                    )
            assert len(drafter.cache) == committed + len(parents) - 1
            drafter.end_proposal()
            assert len(drafter.cache) == committed
