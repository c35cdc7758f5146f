"""benchmarks/served.py: our chain counters in the form vLLM reports them, and the comparison
scripts/bench_vllm.py prints (vLLM itself: tests/engines/test_vllm_external.py)."""

import pytest
import torch

from benchmarks.served import accepted_length, chain_counts, compare, pool, table
from decode import generate

PROMPTS = [[5, 9, 3, 7], [11, 2, 8]]
NEW, DRAFTS = 24, 3


@pytest.fixture(scope="module")
def plain(build_target):
    model = build_target("llama")
    return model, chain_counts(model, None, PROMPTS, DRAFTS, NEW)


def oracle_counts(model, plain_tokens, rank_oracle, top1: float) -> dict:
    """chain_counts with one oracle drafter per prompt (it knows the greedy continuation)."""
    counts = {"tokens": [], "drafts": 0, "per_position": [0] * DRAFTS}
    for seed, (ids, tokens) in enumerate(zip(PROMPTS, plain_tokens, strict=True)):
        head = rank_oracle(ids + tokens + [0] * 8, 128, [top1], seed=seed)
        one = chain_counts(model, head, [ids], DRAFTS, NEW)
        counts["tokens"] += one["tokens"]
        counts["drafts"] += one["drafts"]
        counts["per_position"] = [a + b for a, b in zip(counts["per_position"], one["per_position"])]
    return counts


def test_chain_counts_are_the_decoders_steps_and_acceptance_per_position(plain, rank_oracle):
    model, counts = plain
    for ids, tokens in zip(PROMPTS, counts["tokens"], strict=True):
        assert (
            tokens
            == generate(model, torch.tensor([ids]), None, max_new_tokens=NEW)
            .one.sequences[0, len(ids) :]
            .tolist()
        )
        assert len(tokens) == NEW
    assert counts["per_position"] == [0] * DRAFTS
    drafted = oracle_counts(model, counts["tokens"], rank_oracle, 0.7)
    assert drafted["tokens"] == counts["tokens"]  # lossless: the chain changes nothing but the passes
    accepted = drafted["per_position"]
    assert accepted[0] > 0 and accepted[0] >= accepted[1] >= accepted[2]  # a chain accepts a prefix
    # every new token is the prefill's, a step's bonus token or an accepted draft (less what the limit cut)
    made = len(PROMPTS) + drafted["drafts"] + sum(accepted)
    assert 0 <= made - len(PROMPTS) * NEW <= len(PROMPTS) * DRAFTS
    assert drafted["drafts"] < len(PROMPTS) * (NEW - 1)  # fewer passes than plain decoding's


def test_compare_pools_and_tabulates_both_sides(plain, rank_oracle):
    model, counts = plain
    drafted = oracle_counts(model, counts["tokens"], rank_oracle, 0.7)
    wrong = {**drafted, "per_position": [drafted["per_position"][0] - 1, *drafted["per_position"][1:]]}
    other = {**drafted, "tokens": [drafted["tokens"][0], drafted["tokens"][1][:-1] + [0]]}
    rows = compare({"a": drafted, "b": drafted, "c": drafted}, {"a": drafted, "b": wrong, "c": other})
    assert [r["same_counts"] for r in rows] == [True, False, True]
    assert [r["same_tokens"] for r in rows] == [2, 2, 1]
    expected = 1 + sum(drafted["per_position"]) / drafted["drafts"]
    assert expected > 1 and accepted_length(rows[0]["served"]) == pytest.approx(expected)
    assert accepted_length(rows[1]["served"]) == pytest.approx(expected - 1 / drafted["drafts"])
    total = pool(rows, "all")
    assert total["prompts"] == 6 and total["served"]["drafts"] == 3 * drafted["drafts"]
    assert total["ours"]["per_position"] == [3 * n for n in drafted["per_position"]]
    assert total["same_tokens"] == 5 and total["same_counts"] is False
    text = table([*rows, total]).splitlines()
    assert len(text) == 2 + 4
    assert text[3].endswith("| NO | 2/2 |") and text[4].endswith("| yes | 1/2 |")
    assert f"| {expected:.2f} |" in text[2]


def test_compare_refuses_sides_with_other_prompt_counts(plain):
    counts = plain[1]
    short = {**counts, "tokens": counts["tokens"][:1]}
    with pytest.raises(ValueError, match="chat: the engine answered 1 prompts, ours 2"):
        compare({"chat": counts}, {"chat": short})
