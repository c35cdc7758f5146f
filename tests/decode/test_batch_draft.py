"""decode/drafters (EagleDrafter, MedusaDrafter) and decode/propose.py: drafting B rows in one head forward
per level grows, row by row, the trees each row's own one-row drafter grows alone (EAGLE-1, EAGLE-3 and
Medusa; dynamic and static trees), over steps where the rows take in different numbers of accepted positions,
after a row leaves the batch, and after the draft cache is compacted; and batched decoding with it stays equal
to each prompt decoded alone."""

import pytest
import torch

from decode import generate
from decode.batch import left_padded
from decode.drafter import Drafter
from decode.drafters import make_drafter
from decode.drafters.eagle import EagleDrafter
from decode.propose import propose
from decode.tree import DynamicTree, build_tree
from heads import EagleConfig, EagleHead, MedusaConfig, MedusaHeads

TREES = [DynamicTree(depth=4, top_k=3, total_tokens=8), build_tree([(0,), (1,), (0, 0), (1, 0), (0, 0, 0)])]


def _head(model, kind: str):
    torch.manual_seed(2)
    if kind == "medusa":
        head = MedusaHeads(MedusaConfig(model.config.hidden_size, model.config.vocab_size, num_heads=3))
    else:
        vocab = {"draft_vocab_size": 64} if kind == "eagle3" else {}
        head = EagleHead(EagleConfig.from_target(model.config, kind, **vocab))
        if kind == "eagle3":
            head.set_draft_vocab(torch.randperm(model.config.vocab_size)[:64])
    for param in head.parameters():  # distinct logits: no near-ties for top-k to break differently
        if param.is_floating_point():
            torch.nn.init.normal_(param, std=0.5)
    return head.eval()


def _same(alone, together, where: str) -> None:
    for name in ("tokens", "parents", "ranks", "depths", "ancestors"):
        assert torch.equal(getattr(alone, name), getattr(together, name)), f"{where}: {name}"
    assert (alone.max_depth, alone.max_children) == (together.max_depth, together.max_children), where


@pytest.mark.parametrize("kind", ["eagle1", "eagle3", "medusa"])
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_batched_drafting_grows_the_trees_each_row_grows_alone(build_target, arch, kind):
    model = build_target(arch)
    head = _head(model, kind)
    width = len(head.feature_layers) * model.config.hidden_size
    generator = torch.Generator().manual_seed(7)

    def taken(n: int) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.randn(n, width, generator=generator), torch.randint(0, 128, (n,), generator=generator)

    rows = [taken(n) for n in (5, 40, 3)]  # prompts of different lengths; row 1 leaves after two steps
    alone = [make_drafter(head, model, 1) for _ in rows]
    together = make_drafter(head, model, len(rows))
    for drafter, (f, t) in zip(alone, rows):
        drafter.advance([f], [t])
    together.advance([f for f, _ in rows], [t for _, t in rows])
    live = [0, 1, 2]
    for step in range(5):
        if step == 2:  # row 1 finished: it leaves, and its long history is compacted away at the next advance
            together.select([0, 2])
            live = [0, 2]
        roots = torch.randint(0, 128, (len(live),), generator=generator)
        for tree in TREES:
            batch = propose(together, roots, tree, temperature=0.0, generator=None, vocab_size=128)
            for i, r in enumerate(live):
                (one,) = propose(
                    alone[r], roots[i : i + 1], tree, temperature=0.0, generator=None, vocab_size=128
                )
                _same(one, batch[i], f"{arch} {kind} step {step} row {r} {type(tree).__name__}")
        accepted = [taken(n) for n in (1, 3, 2)[: len(live)]]  # each row accepted a different number
        for r, (f, t) in zip(live, accepted):
            alone[r].advance([f], [t])
        together.advance([f for f, _ in accepted], [t for _, t in accepted])
    if isinstance(together, EagleDrafter):
        assert together.valid.shape[1] < 40  # the finished row's columns were dropped
        assert together.valid.sum(1).tolist() == [alone[r].host_counts[0] for r in live]  # nothing valid lost
        assert together.host_counts == [alone[r].host_counts[0] for r in live]


@pytest.mark.parametrize("kind", ["eagle3", "medusa"])
def test_batched_decoding_with_batched_drafts_equals_each_prompt_alone(build_target, kind):
    """A head module drafts every row together (one batch drafter): each row's reply and steps equal that
    prompt decoded alone, and equal the row-by-row drafting of the same batch (a list of B head sources: one
    one-row drafter per row, `decode.drafter.RowDrafters`)."""
    model = build_target("mistral")
    head = _head(model, kind)
    generator = torch.Generator().manual_seed(4)
    prompts = [torch.randint(1, 128, (n,), generator=generator) for n in (5, 8, 3, 6)]
    ids, mask = left_padded(prompts, 0)
    tree = TREES[0] if kind == "eagle3" else [(0,), (1,), (0, 0), (0, 0, 0)]
    kwargs = {"max_new_tokens": 12, "eos_token_id": [], "tree": tree}
    out = generate(model, ids, head, attention_mask=mask, **kwargs)
    rowwise = generate(model, ids, [head] * len(prompts), attention_mask=mask, **kwargs)
    assert out.replies == rowwise.replies and out.steps == rowwise.steps
    for row, prompt in enumerate(prompts):
        alone = generate(model, prompt, head, max_new_tokens=12, eos_token_id=[], tree=tree).one
        assert out.replies[row] == alone.sequences[0, len(prompt) :].tolist(), f"{kind} row {row}"
        assert out.steps[row] == alone.steps


@pytest.mark.parametrize("kind", ["eagle3", "medusa"])
def test_batched_drafting_cost_is_measured_per_tree_and_batch_size(build_target, kind):
    from decode.calibrate import measure_propose_cost

    model = build_target("llama")
    head = _head(model, kind)
    trees = [DynamicTree(2, 2, 4), DynamicTree(4, 3, 8)] if kind == "eagle3" else [build_tree([(0,), (0, 0)])]
    context = torch.randint(1, 128, (1, 7))
    for batch in (1, 4):
        costs = measure_propose_cost(model, head, context, trees, repeats=2, batch=batch)
        assert len(costs) == len(trees) and all(c > 0 for c in costs)
    with pytest.raises(TypeError, match="no drafter is registered for Linear"):
        measure_propose_cost(model, torch.nn.Linear(2, 2), context, trees, batch=2)


def test_plain_steps_of_a_policy_cost_no_draft_forward(build_target, monkeypatch):
    """A policy that answers plain decoding for every step: the drafter never runs (its positions wait until
    a speculative step), and the rows still equal each prompt alone."""
    model = build_target("llama")
    head = _head(model, "eagle3")
    calls = []
    real = EagleDrafter.advance
    monkeypatch.setattr(EagleDrafter, "advance", lambda self, *a: calls.append(1) or real(self, *a))
    generator = torch.Generator().manual_seed(6)
    prompts = [torch.randint(1, 128, (n,), generator=generator) for n in (4, 6)]
    ids, mask = left_padded(prompts, 0)
    kwargs = {"attention_mask": mask, "max_new_tokens": 6, "eos_token_id": []}
    out = generate(model, ids, head, tree=lambda rows: None, **kwargs)
    assert calls == [] and out.steps == [5, 5]
    every_other = iter([None, TREES[0]] * 10)
    out = generate(model, ids, head, tree=lambda rows: next(every_other), **kwargs)
    assert 0 < len(calls) <= 3  # once per speculative step, each taking in what waited
    for row, prompt in enumerate(prompts):
        alone = generate(model, prompt, None, max_new_tokens=6, eos_token_id=[]).one
        assert out.replies[row] == alone.sequences[0, len(prompt) :].tolist()


class _RowDistributions(Drafter):
    """A batch drafter whose row b gives every node's children the distribution probs[b] (then a flat tail),
    whatever the parent: row b's cumulative draft probabilities are products over rank paths."""

    def __init__(self, probs: list[list[float]], vocab_size: int = 16) -> None:
        rows = []
        for row in probs:
            p = torch.full((vocab_size,), (1.0 - sum(row)) / (vocab_size - len(row)))
            p[: len(row)] = torch.tensor(row)
            rows.append(p.log())
        self.logits, self.levels = torch.stack(rows), []

    def root_logits(self):
        return self.logits

    def expand(self, parent_rows, tokens, depth):
        self.levels.append(depth)
        return self.logits[:, None].expand(-1, tokens.shape[1], -1)


def test_a_min_prob_bound_gives_every_row_the_size_of_the_row_that_keeps_most():
    """Row 0 is sure (0.6, 0.3, 0.05: ten nodes reach 0.1, the last at depth 4), row 1 is not (0.3, 0.3, 0.3:
    three reach 0.1, at depth 1): both get ten nodes, row 0 exactly those it keeps alone, row 1 its ten best;
    levels are drafted while some row has a node at the floor. A floor no row reaches: the roots alone."""
    sure, unsure = [0.6, 0.3, 0.05], [0.3, 0.3, 0.3]
    draws = {"temperature": 0.0, "generator": None, "vocab_size": 16}
    roots = torch.tensor([3, 4])
    bounded = DynamicTree(6, 3, 20, min_prob=0.1)
    drafter = _RowDistributions([sure, unsure])
    trees = propose(drafter, roots, bounded, **draws)
    assert [len(t) for t in trees] == [11, 11] and drafter.levels == [1, 2, 3, 4]
    alone = _RowDistributions([sure])
    _same(propose(alone, roots[:1], bounded, **draws)[0], trees[0], "the sure row")
    best_ten = propose(_RowDistributions([unsure]), roots[1:], DynamicTree(6, 3, 10), **draws)[0]
    for name in ("tokens", "parents", "ranks", "depths"):  # its ten best: three at depth 1, seven at 2
        assert torch.equal(getattr(trees[1], name), getattr(best_ten, name)), name
    none = _RowDistributions([sure, unsure])
    roots_only = propose(none, roots, DynamicTree(6, 3, 20, min_prob=0.7), **draws)
    assert [t.tokens.tolist() for t in roots_only] == [[3], [4]] and none.levels == []


def test_a_min_prob_bound_in_batched_decoding_is_lossless_and_sizes_row_by_row_drafts_too(build_target):
    """Medusa heads drafting every row together under a bound: trees change size from step to step, every
    reply equals plain greedy decoding of its prompt. Drafting row by row (one drafter per row, once refused:
    the rows' sizes would differ) is sized by the same growth engine, all rows together: the same replies,
    steps and tree sizes per step."""
    import importlib

    generate_module = importlib.import_module("decode.generate")  # `decode.generate` is the function
    model = build_target("mistral")
    head = _head(model, "medusa")
    generator = torch.Generator().manual_seed(4)
    prompts = [torch.randint(1, 128, (n,), generator=generator) for n in (5, 8, 3)]
    ids, mask = left_padded(prompts, 0)
    tree = DynamicTree(3, 3, 12, min_prob=0.05)
    sizes, grow = [], generate_module.propose

    def recorded(*args, **kwargs):
        trees = grow(*args, **kwargs)
        sizes.append({len(t) for t in trees})
        return trees

    kwargs = {"attention_mask": mask, "max_new_tokens": 16, "eos_token_id": [], "tree": tree}
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(generate_module, "propose", recorded)
        out = generate(model, ids, head, **kwargs)
        together = list(sizes)
        sizes.clear()
        rowwise = generate(model, ids, [head] * len(prompts), **kwargs)
    for row, prompt in enumerate(prompts):
        plain = generate(model, prompt, None, max_new_tokens=16, eos_token_id=[]).one
        assert out.replies[row] == plain.sequences[0, len(prompt) :].tolist(), f"row {row}"
    assert all(len(step) == 1 for step in together)
    per_step = [step.pop() for step in together]
    assert len(set(per_step)) > 1 and max(per_step) <= 13
    assert rowwise.replies == out.replies and rowwise.steps == out.steps
    assert all(len(step) == 1 for step in sizes) and [step.pop() for step in sizes] == per_step


def test_row_drafters_with_different_draft_vocabularies_are_refused(build_target):
    """A batch maps every row's draft ids through one map (row 0's): two EAGLE-3 heads with different d2t
    maps in one list would draft the second row's tokens through the first row's vocabulary. One map is
    fine (the same head twice)."""
    model = build_target("llama")
    first, second = _head(model, "eagle3"), _head(model, "eagle3")
    second.set_draft_vocab(
        torch.randperm(model.config.vocab_size, generator=torch.Generator().manual_seed(9))[:64]
    )
    prompts = [torch.tensor([5, 6, 7]), torch.tensor([8, 9, 10])]
    ids = torch.stack(prompts)
    with pytest.raises(
        ValueError, match="row drafters 0 and 1 map their draft vocabularies to other target ids"
    ):
        generate(model, ids, [first, second], max_new_tokens=4, eos_token_id=[], tree=TREES[0])
    generate(model, ids, [first, first], max_new_tokens=4, eos_token_id=[], tree=TREES[0])
