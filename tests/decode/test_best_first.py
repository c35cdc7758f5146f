"""DDTree's best-first trees (decode.tree.BestFirstTree): the budget likeliest rank paths of a block drafter,
lossless at T=0."""

import itertools
import random

import pytest
import torch

from decode import generate
from decode.propose import best_first_paths
from decode.tree import BestFirstTree, tree_label, verify_rows
from heads import EagleConfig, EagleHead, MedusaConfig, MedusaHeads


@pytest.mark.parametrize(("depths", "width", "budget"), [(3, 4, 10), (4, 3, 30), (1, 5, 3), (2, 2, 6)])
def test_best_first_paths_are_the_budget_likeliest_rank_paths(depths, width, budget):
    rng = random.Random(depths * 100 + width)
    logq = [sorted((rng.uniform(-8, 0) for _ in range(width)), reverse=True) for _ in range(depths)]
    paths = best_first_paths(logq, budget)
    every = [p for d in range(1, depths + 1) for p in itertools.product(range(width), repeat=d)]
    score = {p: sum(logq[i][r] for i, r in enumerate(p)) for p in every}
    assert len(paths) == min(budget, len(every)) and len(set(paths)) == len(paths)
    cut = sorted(score.values(), reverse=True)[len(paths) - 1]
    assert all(score[p] >= cut for p in paths)  # none better was left out (ties aside)
    assert [score[p] for p in paths] == sorted((score[p] for p in paths), reverse=True)  # best first
    seen = set()
    for path in paths:  # every path after its prefix: parents precede children
        assert len(path) == 1 or path[:-1] in seen
        seen.add(path)


def _medusa(model) -> MedusaHeads:
    torch.manual_seed(0)
    heads = MedusaHeads(MedusaConfig(model.config.hidden_size, model.config.vocab_size, num_heads=3))
    heads.init_from_lm_head(model.get_output_embeddings().weight)
    return heads.eval()


def test_best_first_medusa_trees_decode_as_plain_greedy(tiny_target):
    heads = _medusa(tiny_target)
    prompt = torch.tensor([[3, 17, 42, 9, 11, 5]])
    plain = generate(tiny_target, prompt, None, max_new_tokens=32).one
    for tree in (BestFirstTree(budget=8), BestFirstTree(budget=20, depth=2), BestFirstTree(budget=1)):
        out = generate(tiny_target, prompt, heads, max_new_tokens=32, tree=tree).one
        assert out.sequences.tolist() == plain.sequences.tolist(), tree
        assert out.draft_nodes <= tree.budget * out.steps


def test_best_first_batches_decode_as_each_prompt_alone(build_target):
    from decode.batch import left_padded

    model = build_target("qwen2")
    heads = _medusa(model)
    prompts = [torch.tensor([5, 9, 2, 7, 1]), torch.tensor([8, 3]), torch.tensor([4, 4, 6, 1])]
    ids, mask = left_padded(prompts, 0)
    out = generate(model, ids, heads, attention_mask=mask, max_new_tokens=16, tree=BestFirstTree(budget=6))
    for b, prompt in enumerate(prompts):
        alone = generate(model, prompt[None], None, max_new_tokens=16).one
        assert out.replies[b] == alone.sequences[0, prompt.numel() :].tolist()


def test_best_first_names_what_it_cannot_do(build_target):
    model = build_target("llama")
    prompt = torch.tensor([[3, 17, 42]])
    eagle = EagleHead(EagleConfig.from_target(model.config, "eagle3")).eval()
    with pytest.raises(ValueError, match="needs a block drafter"):
        generate(model, prompt, eagle, max_new_tokens=4, tree=BestFirstTree(budget=4))
    with pytest.raises(ValueError, match="budget must be >= 1"):
        BestFirstTree(budget=0)
    assert verify_rows(BestFirstTree(budget=16)) == 17 and tree_label(BestFirstTree(8, 3)) == (
        "best-first(budget=8, depth=3)"
    )
