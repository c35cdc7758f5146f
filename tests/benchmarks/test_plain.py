"""benchmarks/plain.py (scripts/bench_decode.py): both benchmarks on a tiny random Llama, the report's
two tables, the verdict against the goal, and the output check that fails on a mismatch."""

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig

from benchmarks.plain import GOAL, VERIFY_SIZES, check_same, report, run, verdict


@pytest.fixture(scope="module")
def tiny_llama() -> torch.nn.Module:
    """A random 2-layer Llama built from a config (no real model, no tokenizer: random prompt ids)."""
    config = LlamaConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=256,
        attn_implementation="eager",
    )
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).eval().requires_grad_(False)
    model.generation_config.eos_token_id = None  # random weights: an EOS argmax would make HF suppress it
    return model


def test_run_measures_both_and_the_report_shows_them(tiny_llama):
    record = run(tiny_llama, None, "tiny", prompts=2, max_new_tokens=4, repeats=1)
    assert [row["prompt_tokens"] for row in record["plain"]] == [12, 13]  # random ids: 12 + index
    assert all(
        row["new_tokens"] == 4 and row["ours_tok_s"] > 0 and row["theirs_tok_s"] > 0
        for row in record["plain"]
    )
    assert [row["n"] for row in record["verify"]] == list(VERIFY_SIZES)
    assert record["verify"][0]["ratio_to_1"] == 1.0 and all(row["verify_ms"] > 0 for row in record["verify"])
    assert record["goal"] == GOAL and record["verdict"] == verdict(record)
    lines = report(record).splitlines()
    assert any(line.startswith("### Plain decoding, 4 new tokens") for line in lines)
    assert any(line.startswith("### Target verify cost C_T(n)") for line in lines)
    assert any(line.startswith("| 0 | 12 |") for line in lines) and any(
        line.startswith("| 1 | 13 |") for line in lines
    )
    assert any(
        line.startswith("| all |") and f"{record['verdict']} (goal >= {GOAL})" in line for line in lines
    )
    for n in VERIFY_SIZES:
        assert any(line.startswith(f"| {n} | ") for line in lines), n
    with pytest.raises(ValueError, match="prompts must be in 1..5, got 6"):
        run(tiny_llama, None, "tiny", prompts=6)


def record(ours_over_hf: float) -> dict:
    return {
        "max_new_tokens": 64,
        "repeats": 5,
        "threads": 1,
        "attn_implementation": "eager",
        "plain": [],
        "ours_over_hf": ours_over_hf,
        "ours_over_hf_cpu": ours_over_hf,
        "goal": 0.95,
        "verify": [],
    }


def test_verdict_passes_at_the_goal_and_fails_below_it():
    assert verdict(record(1.02)) == "PASS" and verdict(record(0.95)) == "PASS"
    assert verdict(record(0.949)) == "FAIL"
    assert "| all |  |  |  | **0.900** FAIL (goal >= 0.95) |  |  |" in report(record(0.9)).splitlines()
    assert "| all |  |  |  | **0.970** PASS (goal >= 0.95) |  |  |" in report(record(0.97)).splitlines()


def test_check_same_names_the_first_mismatch_and_a_short_output():
    prompt = torch.tensor([[5, 6]])
    check_same(
        torch.cat([prompt, torch.tensor([[1, 2]])], 1), torch.cat([prompt, torch.tensor([[1, 2]])], 1), 2, 2
    )
    with pytest.raises(
        SystemExit, match="token mismatch at new token 1: ours \\[1, 2\\] vs theirs \\[1, 3\\]"
    ):
        check_same(torch.tensor([[5, 6, 1, 2]]), torch.tensor([[5, 6, 1, 3]]), 2, 2)
    with pytest.raises(SystemExit, match="model.generate produced 1 tokens, expected 2"):
        check_same(torch.tensor([[5, 6, 1, 2]]), torch.tensor([[5, 6, 1]]), 2, 2)
