"""The drafters that plug in through the registry without edits to the loop: n-gram lookup
(decode/drafters/ngram.py), a separate draft model (decode/drafters/model.py, with targets/layer_draft.py's
draft made of the target's first layers) and a composite (decode/drafters/composite.py). Greedy output equals
plain decoding, alone and in batches; their trees are what they claim (copied continuations, a draft model's
tree attention); sampling is in test_lossless_sampling.py."""

import math

import pytest
import torch
from transformers import AutoModelForCausalLM

from decode import DynamicTree, generate
from decode.batch import left_padded
from decode.drafter import Drafter
from decode.drafters import make_drafter
from decode.drafters.composite import Composite, CompositeDrafter
from decode.drafters.eagle import EagleDrafter
from decode.drafters.model import DraftModel, ModelDrafter
from decode.drafters.ngram import Ngram, NgramDrafter
from decode.propose import propose
from decode.tree import build_tree, chain
from heads import EagleConfig, EagleHead, FeatureCapture, MedusaConfig, MedusaHeads
from targets.layer_draft import layer_draft, save_layer_draft

PROMPT = torch.randint(0, 128, (1, 9), generator=torch.Generator().manual_seed(4))
N = 40
DYNAMIC = DynamicTree(depth=4, top_k=3, total_tokens=10)
# a static tree holding the rank-0 chain to depth 3 among siblings: a self-draft must take all of that chain
CHAIN_AND_SIBLINGS = [(0,), (1,), (0, 0), (0, 1), (1, 0), (0, 0, 0)]


def _plain(model, ids=PROMPT, n=N) -> list[int]:
    return generate(model, ids, max_new_tokens=n).one.sequences[0].tolist()


def _sources(model):
    torch.manual_seed(0)
    return {
        "ngram": Ngram(),
        "draft_model": DraftModel(layer_draft(model, 1)),
        "composite": Composite([EagleHead(EagleConfig.from_target(model.config, "eagle3")).eval(), Ngram()]),
    }


@pytest.mark.parametrize("kind", ["ngram", "draft_model", "composite"])
@pytest.mark.parametrize("tree", [DYNAMIC, chain(3), CHAIN_AND_SIBLINGS], ids=["dynamic", "chain", "static"])
def test_greedy_output_equals_plain_decoding(tiny_target, kind, tree):
    out = generate(tiny_target, PROMPT, _sources(tiny_target)[kind], max_new_tokens=N, tree=tree).one
    assert out.sequences[0].tolist() == _plain(tiny_target)
    assert out.new_tokens == N and out.steps == out.target_forwards - 1 and out.draft_nodes > 0


@pytest.mark.parametrize("kind", ["ngram", "draft_model", "composite"])
def test_batched_rows_equal_each_prompt_alone(build_target, kind):
    model = build_target("qwen2")
    prompts = [torch.randint(0, 128, (n,), generator=torch.Generator().manual_seed(n)) for n in (9, 4, 13)]
    ids, mask = left_padded(prompts, 0)
    source = _sources(model)[kind]
    batch = generate(model, ids, source, max_new_tokens=24, attention_mask=mask, tree=DYNAMIC)
    for row, prompt in enumerate(prompts):
        alone = generate(model, prompt, source, max_new_tokens=24, tree=DYNAMIC).one
        assert (
            batch.replies[row]
            == alone.sequences[0, prompt.numel() :].tolist()
            == _plain(model, prompt, 24)[prompt.numel() :]
        )
        assert batch.steps[row] == alone.steps and batch.accepted_per_depth[row] == alone.accepted_per_depth


def test_the_target_drafting_for_itself_is_always_accepted(any_target):
    """`layer_draft` with every layer is the target: its rank-0 chain is always right, so every step takes the
    whole chain of the tree (depth 3 + the bonus token). Wrong tree masks or positions in the draft model's
    cache would make some of its drafts differ from the target's own choice."""
    layers = any_target.config.num_hidden_layers
    source = DraftModel(layer_draft(any_target, layers))
    out = generate(any_target, PROMPT, source, max_new_tokens=N, tree=CHAIN_AND_SIBLINGS).one
    assert out.sequences[0].tolist() == _plain(any_target)
    assert out.accepted_per_depth == [out.steps] * 3 and out.tau == pytest.approx((N - 1) / out.steps)
    assert out.steps == -(-(N - 1) // 4)  # every step emits 4 tokens (the last may be cut short)


@pytest.mark.parametrize("arch", ["mistral", "gemma2"])
def test_a_sliding_window_draft_keeps_its_window(build_target, arch):
    """A window of 4 tokens, far shorter than the sequences (mistral: every layer; gemma2: every other one):
    the drafter's root logits after the prompt equal the draft model's own, and the target drafting for
    itself is always accepted (the drafter's one full-attention mask let every layer see past its window:
    other logits, 13 of 18 first drafts accepted)."""
    model = build_target(arch, sliding_window=4)
    prompt = torch.randint(0, 128, (12,), generator=torch.Generator().manual_seed(7))
    drafter = ModelDrafter(DraftModel(model), model, 1)
    drafter.start([prompt])
    drafter.advance(None, [prompt[1:]])
    torch.testing.assert_close(
        drafter.root_logits()[0], model(prompt[None]).logits[0, -1], atol=1e-5, rtol=1e-5
    )
    source = DraftModel(layer_draft(model, model.config.num_hidden_layers))
    out = generate(model, PROMPT, source, max_new_tokens=N, tree=CHAIN_AND_SIBLINGS).one
    assert out.sequences[0].tolist() == _plain(model)
    assert out.accepted_per_depth == [out.steps] * 3


def test_a_layer_draft_is_the_targets_first_layers_and_saves_as_an_ordinary_model(build_target, tmp_path):
    model = build_target("qwen2")
    draft = layer_draft(model, 2)
    assert draft.config.num_hidden_layers == 2 and len(draft.model.layers) == 2
    for name, weight in draft.named_parameters():
        assert torch.equal(weight, model.get_parameter(name)), name
    with FeatureCapture(model, [1]) as capture:  # the draft's last layer output = the target's layer 1 output
        model(PROMPT)
        hidden = capture.features()
    draft_out = draft(PROMPT, output_hidden_states=True)
    torch.testing.assert_close(
        draft_out.logits, model.lm_head(draft.model.norm(hidden)), atol=1e-5, rtol=1e-5
    )
    folder = save_layer_draft(model, 2, tmp_path / "draft")
    loaded = AutoModelForCausalLM.from_pretrained(folder).eval()
    torch.testing.assert_close(loaded(PROMPT).logits, draft_out.logits)
    with pytest.raises(ValueError, match=r"num_layers must be in \[1, 4\]"):
        layer_draft(model, 5)


def test_a_draft_model_over_another_vocabulary_is_refused(build_target):
    model, other = build_target("llama"), build_target("llama", vocab_size=96)
    with pytest.raises(ValueError, match="the draft model scores 96 tokens, the target 128"):
        generate(model, PROMPT, DraftModel(other), max_new_tokens=4)
    chunked = build_target("llama", attention_chunk_size=4)  # (as Llama 4's): its masks are not built
    with pytest.raises(ValueError, match="the draft model: llama has chunked attention layers"):
        generate(model, PROMPT, DraftModel(chunked), max_new_tokens=4)


def test_ngram_drafts_the_continuation_of_the_longest_earlier_match(build_target):
    """Text `5 6 7 8 | 5 6 9 | 5 6` (the root last): after `5 6` came 7 then 9, so the root's children are 7
    and 9 (each seen once; the longer suffix `x 5 6` matches nothing); below 9 the path `5 6 9` matched once,
    so its child is 5; and the tree is grown from those scores by the one growth engine."""
    model = build_target("llama")
    drafter = NgramDrafter(Ngram(max_ngram=3), model, 1)
    text = torch.tensor([5, 6, 7, 8, 5, 6, 9, 5, 6])
    drafter.start([text[:4]])
    drafter.advance(None, [text[1:]])
    root = drafter.root_logits()[0]
    assert set(torch.topk(root, 2).indices.tolist()) == {7, 9} and root[7] == root[9] > root[8] + 20
    (tree,) = propose(
        drafter, text[-1:], build_tree(chain(3)), temperature=0.0, generator=None, vocab_size=128
    )
    assert tree.tokens.tolist()[1:] in ([7, 8, 5], [9, 5, 6])  # a copy of what followed, whichever first
    logits = drafter.expand(torch.tensor([[-1]]), torch.tensor([[9]]), 1)[0, 0]  # below 9: `5 6 9` -> 5
    assert int(logits.argmax()) == 5


def test_ngram_drafts_are_taken_where_the_text_repeats_itself(build_target):
    """A tiny random target's greedy text falls into a loop; once it does, lookup drafts the loop and the
    target takes whole chains of it: far fewer steps than tokens."""
    model = build_target("mistral")
    out = generate(model, PROMPT, Ngram(), max_new_tokens=120, tree=chain(4)).one
    assert out.sequences[0].tolist() == _plain(model, PROMPT, 120)
    assert out.tau > 2.0 and out.accepted_per_depth[0] > out.steps / 2


def test_a_composite_gives_each_part_its_own_features_and_mixes_their_drafts(build_target):
    """EAGLE-3 (three taps) and EAGLE-1 (the last layer) in one composite: each part drafts exactly as it
    would alone (the composite slices its part of the features it taps), and the composite's draft
    distribution is the weighted mixture of theirs."""
    model = build_target("llama")
    torch.manual_seed(1)
    eagle3 = EagleHead(EagleConfig.from_target(model.config, "eagle3")).eval()
    eagle1 = EagleHead(EagleConfig.from_target(model.config, "eagle1")).eval()
    composite = make_drafter(Composite([eagle3, eagle1], weights=[3, 1]), model, 1)
    assert isinstance(composite, CompositeDrafter)
    assert set(composite.feature_layers) == set(eagle3.feature_layers) | set(eagle1.feature_layers)
    with FeatureCapture(model, composite.feature_layers) as capture:
        model(PROMPT)
        features = capture.features()[0]
    tokens = torch.cat([PROMPT[0, 1:], torch.tensor([3])])
    composite.start([PROMPT[0]])
    composite.advance([features], [tokens])
    mixed = torch.zeros(128)
    for head, weight in ((eagle3, 0.75), (eagle1, 0.25)):
        alone = EagleDrafter(head, model, 1)
        with FeatureCapture(model, head.feature_layers) as capture:
            model(PROMPT)
            alone.advance([capture.features()[0]], [tokens])
        mixed += weight * torch.softmax(alone.root_logits()[0], -1)
    torch.testing.assert_close(composite.root_logits()[0].exp(), mixed, atol=1e-6, rtol=1e-5)


class _SpeaksAtFirstNode(Drafter):
    """A part with no distribution at all (-inf logits) except at the first node of each level below the
    root, where it prefers token 7."""

    def advance(self, features, tokens):
        pass

    def root_logits(self):
        return torch.full((1, 128), -math.inf)

    def expand(self, parent_rows, tokens, depth):
        logits = torch.full((1, parent_rows.shape[1], 128), -math.inf)
        logits[0, 0] = torch.arange(128.0) == 7
        return logits

    def select(self, rows):
        pass


def test_a_composite_part_without_an_opinion_leaves_the_mixture(build_target):
    """Where the n-gram part has no match (flat logits) the composite drafts exactly as its EAGLE-3 part
    alone (a reduced draft vocabulary: scattered into the target's); where it matches, the mixture is the
    weighted one, also when one call holds nodes of both kinds. With `abstain=False` the flat part is mixed
    in everywhere, halving EAGLE-3's probabilities where lookup knows nothing. A part with -inf logits at a
    node has no say there either (and no NaN comes of it)."""
    model = build_target("llama")
    torch.manual_seed(2)
    eagle3 = EagleHead(EagleConfig.from_target(model.config, "eagle3", draft_vocab_size=64)).eval()
    eagle3.set_draft_vocab(torch.arange(64) * 2)  # even ids: lookup's 7 and 3 lie outside
    prompt = torch.tensor([[5, 6, 7, 9, 5, 6]])
    with FeatureCapture(model, eagle3.feature_layers) as capture:
        model(prompt)
        features = capture.features()[0]
    tokens = torch.cat([prompt[0, 1:], torch.tensor([3])])  # the text: 5 6 7 9 5 6 3, root 3

    def proposal(source, takes_features=True):
        """Root; the root's children 5 and 6; then 6 below that 5 and 9 below that 6. The text ...3 5 6 ends
        in "5 6", which lookup (2- and 3-grams) has seen followed by 7 and by 3; "6 3", "3 5", "3 6" and
        "6 9" it has not. Probabilities over the target's vocabulary, per node."""
        made = make_drafter(source, model, 1)
        made.start([prompt[0]])
        made.advance([features] if takes_features else None, [tokens])
        root = made.root_logits()[0]
        level1 = made.expand(torch.tensor([[-1, -1]]), torch.tensor([[5, 6]]), 1)[0]
        level2 = made.expand(torch.tensor([[0, 1]]), torch.tensor([[6, 9]]), 2)[0]
        nodes = [root, level1[0], level1[1], level2[0], level2[1]]
        ids = made.to_target_ids(torch.arange(root.shape[-1]))
        return [torch.zeros(128).index_copy_(0, ids, torch.softmax(x.float(), -1)) for x in nodes]

    alone = proposal(eagle3)
    assert all(p[1::2].sum() == 0 for p in alone)  # EAGLE-3 alone never drafts an odd id
    lookup = proposal(Ngram(min_ngram=2), takes_features=False)
    assert [p.max().item() == p.min().item() for p in lookup] == [True, True, True, False, True]
    assert lookup[3][7] == pytest.approx(0.5, abs=1e-6) and lookup[3][3] == pytest.approx(0.5, abs=1e-6)
    gated = proposal(Composite([eagle3, Ngram(min_ngram=2)], weights=[1, 1]))
    mixed = proposal(Composite([eagle3, Ngram(min_ngram=2)], weights=[1, 1], abstain=False))
    partial = proposal(Composite([eagle3, _SpeaksAtFirstNode()], weights=[3, 1]))
    seven = torch.softmax((torch.arange(128) == 7).float(), -1)
    for node in range(5):
        both = 0.5 * alone[node] + 0.5 * lookup[node]
        torch.testing.assert_close(gated[node], both if node == 3 else alone[node], atol=1e-6, rtol=1e-5)
        torch.testing.assert_close(mixed[node], both, atol=1e-6, rtol=1e-5)
        expected = 0.75 * alone[node] + 0.25 * seven if node in (1, 3) else alone[node]
        torch.testing.assert_close(partial[node], expected, atol=1e-6, rtol=1e-5)


def test_a_composite_mixes_a_part_that_scores_a_whole_level_at_once_with_one_that_scores_each_node(
    build_target,
):
    """Medusa heads give one row for every node of a level, (B, 1, V); lookup one per node. The mixture
    broadcasts the level's row to every node (each node's own weights), and greedy decoding with the two is
    plain decoding."""
    model = build_target("llama")
    torch.manual_seed(3)
    medusa = MedusaHeads(MedusaConfig(hidden_size=32, vocab_size=128, num_heads=3)).eval()
    text = torch.tensor([[5, 6, 7, 9, 5, 6, 3, 5, 6, 7, 9, 5]])
    made = [make_drafter(source, model, 1) for source in (Composite([medusa, Ngram(min_ngram=2)]), medusa)]
    made.append(make_drafter(Ngram(min_ngram=2), model, 1))
    with FeatureCapture(model, made[0].feature_layers) as capture:
        model(text)
        features = capture.features()[0]
    levels = []
    for drafter in made:
        drafter.start([text[0]])
        taps = [features] if drafter.feature_layers else None
        drafter.advance(taps, [torch.cat([text[0, 1:], torch.tensor([6])])])  # root 6: "5 6" seen before
        drafter.root_logits()
        # below the root 6: node 7 (path "5 6 7", seen, followed by 9) and node 8 ("6 8", never seen)
        levels.append(
            torch.softmax(drafter.expand(torch.tensor([[-1, -1]]), torch.tensor([[7, 8]]), 1)[0], -1)
        )
    level, (row,), lookup = levels
    assert level.shape == (2, 128) and lookup[0, 9] > 0.99 and lookup[1].max() == lookup[1].min()
    torch.testing.assert_close(level[0], 0.5 * row + 0.5 * lookup[0], atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(level[1], row, atol=1e-6, rtol=1e-5)
    both = Composite([medusa, Ngram(min_ngram=2)])
    out = generate(model, PROMPT, both, max_new_tokens=N, tree=DYNAMIC).one.sequences[0].tolist()
    assert out == _plain(model)


def test_every_part_of_a_composite_must_be_a_draft_source():
    with pytest.raises(ValueError, match="at least two parts"):
        Composite([Ngram()])
    with pytest.raises(ValueError, match="weights must be 2 positive numbers"):
        Composite([Ngram(), Ngram()], weights=[1.0, 0.0])
