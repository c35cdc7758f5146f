"""Statistical losslessness of speculative SAMPLING: the emitted tokens follow the target's distribution.

Every token emitted by `generate` is scored against the target's exact conditional distribution given its
prefix (`fit_pvalue`); a chi-square goodness-of-fit test must NOT reject for the lossless rule and MUST
reject for deliberately biased rules (negative controls: the test is shown able to fail).
"""

import copy
import importlib

import numpy as np
import pytest
import torch
from scipy.stats import chisquare
from transformers import AutoConfig, AutoModelForCausalLM

from decode import BestFirstTree, DynamicTree, generate
from decode.accept import target_probs
from heads import EagleConfig, EagleHead, MedusaConfig, MedusaHeads
from heads.dflash import DFlashConfig, DFlashHead
from heads.peagle import PEagleConfig, PEagleHead

VOCAB, RUNS, NEW = 8, 16, 120
PROMPT = torch.tensor([[1, 4, 2]])


@pytest.fixture(scope="module")
def target():
    cfg = AutoConfig.for_model(
        "llama",
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        vocab_size=VOCAB,
    )
    torch.manual_seed(3)
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation="eager").eval()
    with torch.no_grad():  # peaky and nearly Markov: a biased rule then moves mass the same way everywhere
        model.lm_head.weight.mul_(6.0)
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.mul_(0.2)
            layer.mlp.down_proj.weight.mul_(0.2)
    model.generation_config.eos_token_id = None
    return model


def emitted_with_exact_probs(model, heads, tree, seed_base, sampling, alone=False, **kwargs):
    """Every emitted token, the token before it, the target's exact p_t given the whole prefix, and tau, over
    RUNS continuations of PROMPT: the RUNS rows of one `generate` call on PROMPT repeated (each row draws its
    own tokens; 3-6x cheaper than RUNS calls here), or `alone`, one call per continuation (one row takes
    decode.batch's unmasked one-row paths, `BatchState.full`)."""
    replies, taus = [], []
    for call in range(RUNS if alone else 1):
        ids = PROMPT if alone else PROMPT.expand(RUNS, -1)
        out = generate(
            model, ids, heads, max_new_tokens=NEW, tree=tree, seed=seed_base + call, **sampling, **kwargs
        )
        replies, taus = replies + out.replies, taus + out.tau
    n = PROMPT.shape[1]
    seqs = torch.cat([PROMPT.expand(len(replies), -1), torch.tensor(replies)], dim=1)
    with torch.no_grad():
        probs = target_probs(model(seqs).logits[:, n - 1 : -1], **sampling).double()
    return (
        seqs[:, n:].reshape(-1).numpy(),
        seqs[:, n - 1 : -1].reshape(-1).numpy(),
        probs.reshape(-1, VOCAB).numpy(),
        float(np.mean(taus)),
    )


BATCH_PROMPTS = [[1, 4, 2], [3, 1], [5, 6, 7, 0], [2]]  # different lengths: left padding in the batch


def emitted_batched(model, heads, tree, seed_base, sampling):
    """As `emitted_with_exact_probs`, with the prompts decoded 4 at a time (`generate` on a (4, T) batch):
    each row's tokens against the exact p_t of that row's own prefix. RUNS sequences in all."""
    width = max(len(p) for p in BATCH_PROMPTS)
    ids = torch.tensor([[0] * (width - len(p)) + p for p in BATCH_PROMPTS])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in BATCH_PROMPTS])
    tokens, previous, probs, taus = [], [], [], []
    for run in range(RUNS // len(BATCH_PROMPTS)):
        out = generate(
            model,
            ids,
            heads,
            attention_mask=mask,
            max_new_tokens=NEW,
            tree=tree,
            seed=seed_base + run,
            **sampling,
        )
        for row, prompt in enumerate(BATCH_PROMPTS):
            seq = torch.tensor(prompt + out.replies[row])
            with torch.no_grad():
                probs.append(
                    target_probs(model(seq[None]).logits[0, len(prompt) - 1 : -1], **sampling).double()
                )
            tokens.append(seq[len(prompt) :])
            previous.append(seq[len(prompt) - 1 : -1])
        taus += out.tau
    return (
        torch.cat(tokens).numpy(),
        torch.cat(previous).numpy(),
        torch.cat(probs).numpy(),
        float(np.mean(taus)),
    )


def fit_pvalue(
    model, heads, tree, seed_base, sampling=None, min_tau=None, batched=False, alone=False, **kwargs
) -> float:
    """Chi-square of (previous token, token) counts against the sums of the exact p_t in each group.

    Under losslessness x_t ~ p_t given the prefix, so observed - expected is a martingale in every cell;
    with p_t varying inside a group the Pearson statistic is stochastically smaller than chi-square, so the
    test is conservative for the lossless rule. The target is nearly Markov (see `target`), so a biased rule
    shifts mass the same way in every group and the negative controls are detected.
    """
    sampling = sampling or {"temperature": 1.0}
    if batched:
        tokens, previous, probs, tau = emitted_batched(model, heads, tree, seed_base, sampling)
    else:
        tokens, previous, probs, tau = emitted_with_exact_probs(
            model, heads, tree, seed_base, sampling, alone, **kwargs
        )
    if min_tau is not None:  # a test where drafts are never accepted would check nothing
        assert tau >= min_tau, f"drafts were rarely accepted (tau {tau:.2f}); the test would be vacuous"
    return bigram_pvalue(previous, tokens, probs, VOCAB)


def bigram_pvalue(previous: np.ndarray, tokens: np.ndarray, probs: np.ndarray, vocab: int) -> float:
    """Pearson chi-square p-value of the emitted (previous token, token) counts against the summed exact
    target probabilities `probs` (n, vocab) of each emitted position, grouped by the previous token."""
    observed, expected = np.zeros((vocab, vocab)), np.zeros((vocab, vocab))
    np.add.at(observed, (previous, tokens), 1)
    np.add.at(expected, previous, probs)
    big = expected >= 5  # pool sparse cells so the chi-square approximation holds
    obs, exp = observed[big], expected[big]
    if expected[~big].sum() > 0:
        obs, exp = np.append(obs, observed[~big].sum()), np.append(exp, expected[~big].sum())
    groups = int((expected.sum(1) > 0).sum())
    return chisquare(obs, exp, ddof=groups - 1).pvalue


def make_heads(model, kind, std=2.0):
    torch.manual_seed(11)
    if kind == "medusa":
        heads = MedusaHeads(MedusaConfig(16, VOCAB, num_heads=3))
        for proj in heads.lm_heads:  # random and unlike the target; small std = a flat draft
            torch.nn.init.normal_(proj.weight, std=std)
        return heads
    if kind == "dflash":  # a block drafter with its own lm_head over 4 of the 8 tokens
        head = DFlashHead(
            DFlashConfig.from_target(model.config, 7, num_hidden_layers=1, block_size=4, draft_vocab_size=4)
        )
        head.set_draft_vocab(torch.tensor([0, 2, 3, 5]))
        torch.nn.init.normal_(head.lm_head.weight, std=std)
        return head
    if kind == "peagle":  # EAGLE-3's layer drafting 3 depths in one forward, its own 4 of the 8 tokens
        head = PEagleHead(
            PEagleConfig.from_target(model.config, mask_token_id=7, parallel_depths=3, draft_vocab_size=4)
        )
        head.set_draft_vocab(torch.tensor([0, 2, 3, 5]))
        torch.nn.init.normal_(head.lm_head.weight, std=std)
        return head
    head = EagleHead(
        EagleConfig.from_target(model.config, kind, **({"draft_vocab_size": 4} if kind == "eagle3" else {}))
    )
    if kind == "eagle3":
        head.set_draft_vocab(torch.tensor([0, 2, 3, 5]))
        torch.nn.init.normal_(head.lm_head.weight, std=2.0)
    return head


CASES = [
    ("medusa", [(0,), (1,), (2,), (0, 0), (1, 0), (0, 1), (0, 0, 0)], {"temperature": 1.0}),
    ("eagle1", DynamicTree(depth=3, top_k=3, total_tokens=6), {"temperature": 1.0}),
    ("eagle3", [(0,), (1,), (0, 0), (0, 1), (1, 0)], {"temperature": 1.0}),
    ("eagle1", [(0,), (1,), (0, 0), (0, 0, 0)], {"temperature": 0.7, "top_k": 4, "top_p": 0.9}),
    ("dflash", [(0,), (1,), (2,), (0, 0), (1, 0), (0, 1), (0, 0, 0)], {"temperature": 1.0}),
    ("peagle", [(0,), (1,), (0, 0), (1, 0), (0, 0, 0)], {"temperature": 1.0}),
]


@pytest.mark.parametrize(
    "kind,tree,sampling",
    CASES,
    ids=["medusa", "eagle1-dynamic", "eagle3", "eagle1-topk-topp", "dflash", "peagle"],
)
def test_speculative_sampling_matches_target_distribution(target, kind, tree, sampling):
    pvalue = fit_pvalue(
        target, make_heads(target, kind), tree, seed_base=1000, sampling=sampling, min_tau=1.2
    )
    assert pvalue > 1e-3, f"{kind}: speculative sampling deviates from the target (chi-square p={pvalue:.2e})"


@pytest.mark.parametrize(
    "kind,tree", [("eagle3", CASES[2][1]), ("dflash", BestFirstTree(budget=6))], ids=["eagle3", "best-first"]
)
def test_one_prompt_alone_samples_the_target_distribution(target, kind, tree):
    """The other tests decode their continuations as the rows of one batch; one prompt alone takes the
    one-row paths (no mask, the accepted KV kept by a crop), here under both acceptance rules: drawn children
    (`accept_sampling`) and chosen ones (`accept_chosen`)."""
    pvalue = fit_pvalue(target, make_heads(target, kind), tree, seed_base=1000, min_tau=1.2, alone=True)
    assert pvalue > 1e-3, f"{kind}: one prompt alone deviates from the target (chi-square p={pvalue:.2e})"


def make_source(model, kind):
    """The drafters that are not heads: n-gram lookup, a separate draft model, a composite of all three kinds
    (EAGLE-3 with 4 of the 8 tokens)."""
    from decode.drafters.composite import Composite
    from decode.drafters.model import DraftModel
    from decode.drafters.ngram import Ngram

    if kind == "ngram":
        return Ngram(max_ngram=2)
    cfg = copy.deepcopy(model.config)
    cfg.num_hidden_layers = 1
    torch.manual_seed(5)
    draft = AutoModelForCausalLM.from_config(cfg, attn_implementation="eager").eval()
    with torch.no_grad():  # as peaky as the target, so that its drafts are often taken
        draft.lm_head.weight.mul_(4.0)
    if kind == "draft_model":
        return DraftModel(draft)
    if kind == "composite_level":  # Medusa scores a whole level at once, lookup (2-grams only) each node
        return Composite([make_heads(model, "medusa"), Ngram(min_ngram=2, max_ngram=2)])
    return Composite([make_heads(model, "eagle3"), Ngram(max_ngram=2), DraftModel(draft)], weights=[1, 2, 1])


@pytest.mark.parametrize("kind", ["ngram", "draft_model", "composite", "composite_level"])
def test_the_other_drafters_sample_the_target_distribution(target, kind):
    """Prompt lookup, a separate draft model and composites (their q a mixture of their parts', a part
    without a match left out, a level's one row mixed with each node's own): the emitted tokens follow the
    target's distribution, with drafts taken often enough for the test to mean something."""
    tree = DynamicTree(depth=3, top_k=2, total_tokens=6)
    pvalue = fit_pvalue(target, make_source(target, kind), tree, seed_base=7000, min_tau=1.2)
    assert pvalue > 1e-3, f"{kind}: speculative sampling deviates from the target (chi-square p={pvalue:.2e})"


def test_plain_sampling_matches_exact_distribution(target):
    """The oracle itself: plain sampling through the same loop passes the same test."""
    assert fit_pvalue(target, None, None, seed_base=5000) > 1e-3


def _accept_with_unit_draft_probability(tree, target_logits, temperature, top_p, top_k, generator):
    """BIASED on purpose: the ratio treats each sampled sibling's q as 1, the residual still subtracts q."""
    tokens = tree.tokens.tolist()
    path, node = [0], 0
    while True:
        p = target_probs(target_logits[node], temperature, top_p, top_k)
        accepted = None
        for child in tree.children[node]:
            q = tree.q_table[int(tree.q_rows[node])]
            if torch.rand((), generator=generator).item() < p[tokens[child]].item():
                accepted = child
                break
            p = torch.clamp(p - q, min=0)
            p = p / p.sum() if p.sum() > 0 else target_probs(target_logits[node], temperature, top_p, top_k)
        if accepted is None:  # in the form `generate` reads: the path padded with -1, the bonus token
            padded = torch.tensor(path + [-1] * (tree.max_depth + 1 - len(path)))
            return padded, torch.multinomial(p, 1, generator=generator)[0]
        path.append(accepted)
        node = accepted


def test_negative_control_unit_draft_probability_is_detected(target, monkeypatch):
    monkeypatch.setattr(
        importlib.import_module("decode.generate"), "accept_sampling", _accept_with_unit_draft_probability
    )
    # the bias of this rule is largest for a flat draft (x ~ q nearly uniform, kept with probability p(x))
    pvalue = fit_pvalue(target, make_heads(target, "medusa", std=0.1), CASES[0][1], seed_base=1000)
    assert pvalue < 1e-3, "the test failed to detect a biased acceptance rule"


def test_negative_control_typical_acceptance_is_detected(target):
    pvalue = fit_pvalue(
        target, make_heads(target, "medusa"), CASES[0][1], seed_base=1000, acceptance="typical"
    )
    assert pvalue < 1e-3, "typical acceptance should be detected as lossy"


@pytest.mark.parametrize(
    "kind,tree,sampling", [CASES[1], CASES[2], CASES[4]], ids=["eagle1-dynamic", "eagle3", "dflash"]
)
def test_batched_speculative_sampling_matches_target_distribution_per_row(target, kind, tree, sampling):
    """Four prompts of different lengths decoded together: every row's tokens follow its own target
    distribution."""
    pvalue = fit_pvalue(
        target, make_heads(target, kind), tree, seed_base=3000, sampling=sampling, min_tau=1.2, batched=True
    )
    assert pvalue > 1e-3, f"{kind}: batched sampling deviates from the target (chi-square p={pvalue:.2e})"


def test_negative_control_batched_rule_is_detected(target, monkeypatch):
    monkeypatch.setattr(
        importlib.import_module("decode.generate"), "accept_sampling", _accept_with_unit_draft_probability
    )
    pvalue = fit_pvalue(
        target, make_heads(target, "medusa", std=0.1), CASES[0][1], seed_base=3000, batched=True
    )
    assert pvalue < 1e-3, "the test failed to detect a biased acceptance rule in batched decoding"


BOUNDED = DynamicTree(depth=3, top_k=3, total_tokens=8, min_prob=0.15)


@pytest.mark.parametrize("batched", [False, True], ids=["one-prompt", "mixed-lengths"])
def test_sampling_under_a_min_prob_bound_matches_target_distribution(target, batched):
    """A `DynamicTree.min_prob` bound decides which nodes exist from slot scores (ancestors' values and draft
    distributions), never from a node's own draw: still the target's distribution, for one prompt and for
    prompts of mixed lengths."""
    pvalue = fit_pvalue(
        target, make_heads(target, "eagle1"), BOUNDED, seed_base=1000, min_tau=1.2, batched=batched
    )
    assert pvalue > 1e-3, f"a min_prob bound biases sampling (chi-square p={pvalue:.2e})"


def _scored_by_own_draw(draw):
    """BIASED on purpose: a node's score is the draft probability of the token it drew, so the bound keeps
    or drops a node by its own sampled value (and may keep a later draw without an earlier one)."""

    def scored(logits, k, temperature, generator):
        drawn = draw(logits, k, temperature, generator)
        if drawn.q is None:
            return drawn
        own = drawn.q.gather(1, drawn.draft_ids).log()
        return type(drawn)(drawn.draft_ids, own, drawn.q)

    return scored


def test_negative_control_a_bound_on_a_nodes_own_draw_is_detected(target, monkeypatch):
    propose_module = importlib.import_module("decode.propose")
    monkeypatch.setattr(propose_module, "draw_children", _scored_by_own_draw(propose_module.draw_children))
    pvalue = fit_pvalue(target, make_heads(target, "eagle1"), BOUNDED, seed_base=1000)
    assert pvalue < 1e-3, "the test failed to detect a bound that reads each node's own draw"


# The joint distribution of the first JOINT tokens, against the exact one: a rule can match every token's
# marginal given its previous token and still get their joint wrong (how a step's accepted drafts and its
# bonus token depend on each other), or starve acceptance so that only a tau guard notices.
JOINT, JOINT_ROWS = 3, 50


def _exact_joint(model, sampling) -> np.ndarray:
    """P(first JOINT tokens = s) for every s in [0, VOCAB)^JOINT (row-major codes), from one target pass."""
    grid = torch.cartesian_prod(*[torch.arange(VOCAB)] * JOINT)  # (VOCAB^JOINT, JOINT)
    ids = torch.cat([PROMPT.expand(grid.shape[0], -1), grid], dim=1)
    with torch.no_grad():
        probs = target_probs(model(ids).logits[:, PROMPT.shape[1] - 1 : -1], **sampling).double()
    return probs.gather(2, grid[..., None])[..., 0].prod(1).numpy()


def joint_pvalue(model, heads, tree, samples, sampling=None, **kwargs) -> float:
    """Chi-square of `samples` decoded prefixes of JOINT tokens against their exact joint distribution (cells
    expecting fewer than 5 pooled), JOINT_ROWS copies of the prompt decoded together per call (one prompt
    alone runs the same loop, draws and rule; 2,000 calls of it cost 45 s of CI a test)."""
    sampling = sampling or {"temperature": 1.0}
    replies = []
    for call in range(samples // JOINT_ROWS):
        ids = PROMPT.expand(JOINT_ROWS, -1)
        out = generate(model, ids, heads, max_new_tokens=JOINT, tree=tree, seed=call, **sampling, **kwargs)
        replies += out.replies
    codes = np.array([sum(t * VOCAB ** (JOINT - 1 - i) for i, t in enumerate(r)) for r in replies])
    observed = np.bincount(codes, minlength=VOCAB**JOINT).astype(float)
    expected = _exact_joint(model, sampling) * len(replies)
    expected *= observed.sum() / expected.sum()  # float rounding: chisquare wants equal totals
    big = expected >= 5
    obs, exp = np.append(observed[big], observed[~big].sum()), np.append(expected[big], expected[~big].sum())
    return chisquare(obs, exp).pvalue


@pytest.mark.parametrize(
    "kind,tree", [("eagle1", BOUNDED), ("medusa", CASES[0][1])], ids=["bounded", "medusa"]
)
def test_joint_distribution_of_the_first_tokens_is_the_targets(target, kind, tree):
    pvalue = joint_pvalue(target, make_heads(target, kind), tree, samples=2000)
    assert pvalue > 1e-3, f"the first {JOINT} tokens' joint distribution deviates (chi-square p={pvalue:.2e})"


def _pruned_renormalised(draw):
    """BIASED on purpose: acceptance reads the draft distribution with the tokens below the `min_prob` bound
    removed and renormalised, not the distribution the children were drawn from."""

    def pruned(logits, k, temperature, generator):
        drawn = draw(logits, k, temperature, generator)
        if drawn.q is None:
            return drawn
        kept = drawn.q * (drawn.q >= BOUNDED.min_prob)
        mass = kept.sum(-1, keepdim=True)
        return type(drawn)(drawn.draft_ids, drawn.slot_logq, torch.where(mass > 0, kept / mass, drawn.q))

    return pruned


def _mutate_draws(monkeypatch, mutation) -> None:
    """Apply `mutation` to the children draws of the growth engine."""
    module = importlib.import_module("decode.propose")
    monkeypatch.setattr(module, "draw_children", mutation(module.draw_children))


def _mutate_rule(monkeypatch, rule) -> None:
    monkeypatch.setattr(importlib.import_module("decode.generate"), "accept_sampling", rule)


# name: (apply the mutation, heads, tree, samples). 2,000 samples: with fewer, the cells a biased rule
# over-fills expect under 5 draws and are pooled, and the own-draw bound went unseen at 500 (p = 0.2)
JOINT_CONTROLS = {
    "pruned-renormalised q": (
        lambda mp: _mutate_draws(mp, _pruned_renormalised),
        lambda m: make_heads(m, "eagle1"),
        BOUNDED,
        2000,
    ),
    "bound on a node's own draw": (
        lambda mp: _mutate_draws(mp, _scored_by_own_draw),
        lambda m: make_heads(m, "eagle1"),
        BOUNDED,
        2000,
    ),
    "unit draft probability": (
        lambda mp: _mutate_rule(mp, _accept_with_unit_draft_probability),
        lambda m: make_heads(m, "medusa", std=0.1),
        CASES[0][1],
        2000,
    ),
}


@pytest.mark.parametrize("control", JOINT_CONTROLS)
def test_negative_controls_fail_the_joint_test(target, monkeypatch, control):
    """Batched, as every joint test (`joint_pvalue`): one prompt alone and 50 rows together run the same
    draws and acceptance rule (what the mutations replace), and the test's power is its sample count."""
    mutate, heads, tree, samples = JOINT_CONTROLS[control]
    mutate(monkeypatch)
    pvalue = joint_pvalue(target, heads(target), tree, samples=samples)
    assert pvalue < 1e-3, f"the joint test failed to detect the {control} rule (p={pvalue:.2e})"


def test_typical_acceptance_fails_the_joint_test(target):
    pvalue = joint_pvalue(
        target, make_heads(target, "medusa"), CASES[0][1], samples=2000, acceptance="typical"
    )
    assert pvalue < 1e-3, "typical acceptance should be detected as lossy"


@pytest.mark.parametrize("batched", [False, True], ids=["one-prompt", "mixed-lengths"])
@pytest.mark.parametrize(
    "kind, sampling",
    [
        ("medusa", {"temperature": 1.0}),
        ("dflash", {"temperature": 0.7, "top_k": 5}),
        ("dflash", {"temperature": 1.0}),
        ("peagle", {"temperature": 1.0}),
    ],
    ids=["medusa", "dflash-topk", "dflash", "peagle"],
)
def test_best_first_trees_sample_the_target_distribution(target, kind, sampling, batched):
    """DDTree's chosen (not drawn) children: acceptance draws from the target and descends while the draw is
    a child (`accept_chosen`), so the emitted tokens follow the target's distribution."""
    tree = BestFirstTree(budget=6)
    pvalue = fit_pvalue(target, make_heads(target, kind), tree, 9000, sampling, min_tau=1.2, batched=batched)
    assert pvalue > 1e-3, f"{kind}: best-first sampling deviates from the target (chi-square p={pvalue:.2e})"


def test_negative_control_taking_the_top_child_on_a_miss_is_detected(target, monkeypatch):
    """BIASED on purpose: when the target's draw at a node is none of its children, emit the node's rank-0
    child instead of the draw."""
    accept = importlib.import_module("decode.accept")
    real = accept.accept_chosen

    def biased(tree, logits, temperature, top_p, top_k, generator):
        path, bonus = real(tree, logits, temperature, top_p, top_k, generator)
        first = tree.child_table()[path[path >= 0][-1]]
        return path, (tree.tokens[first[0]] if first.numel() and first[0] >= 0 else bonus)

    monkeypatch.setattr(accept, "accept_chosen", biased)
    pvalue = fit_pvalue(target, make_heads(target, "dflash"), BestFirstTree(budget=6), 9000, min_tau=1.2)
    assert pvalue < 1e-3, f"the biased rule was not detected (chi-square p={pvalue:.2e})"
