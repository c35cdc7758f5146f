"""benchmarks/hybrid.py on a tiny hybrid: the oracle's chains give the acceptance they are set to, every reply
equals plain decoding (the run checks it), and the table reports the run."""

import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks.hybrid import DRAFTS, SIZE, report, run
from tests.conftest import TINY as FAMILIAR

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "bench_hybrid.py"

TINY = {  # the tiny targets' sizes (tests/conftest.py), the gated delta-net layers' too
    **SIZE,
    **FAMILIAR,
    "linear_key_head_dim": 8,
    "linear_value_head_dim": 8,
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 4,
}


def test_oracle_chains_accept_as_set_and_decode_as_plain():
    record = run(prompts=2, prompt_length=8, new_tokens=21, repeats=1, size=TINY)
    rows = {(row["target"], row["method"]): row for row in record["rows"]}
    assert {target for target, _ in rows} == {"hybrid", "attention twin"}
    for target in ("hybrid", "attention twin"):
        assert rows[target, "plain"]["tau"] == 1.0 and rows[target, "plain"]["speedup"] == 1.0
        # every draft right: DRAFTS + 1 tokens per verify step after the prefill's token (21 = 1 + 4 x 5)
        assert rows[target, f"oracle chain of {DRAFTS}, every draft right"]["tau"] == pytest.approx(5.0)
        half = rows[target, f"oracle chain of {DRAFTS}, p = 0.5 per draft"]["tau"]
        assert 1.2 < half < rows[target, f"oracle chain of {DRAFTS}, p = 0.7 per draft"]["tau"] + 0.5
    text = report(record)
    assert "| hybrid | oracle chain of 4, every draft right | 5.00 |" in text


def test_bench_hybrid_script_refuses_bad_counts():
    command = [sys.executable, SCRIPT, "--prompts", "0"]
    done = subprocess.run(command, check=False, capture_output=True, text=True)
    assert done.returncode == 2
    assert "--prompts, --prompt-length, --new-tokens and --repeats must be >= 1" in done.stderr
