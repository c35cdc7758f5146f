"""Smoke test for scripts/bench_decode.py: main() on a tiny random Llama prints both tables, writes JSON."""

import json
import runpy
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "bench_decode.py"


def test_bench_decode_tiny(tmp_path: Path, capsys) -> None:
    bench = runpy.run_path(str(SCRIPT))  # scripts/ is not a package; nothing runs at import time
    out_json = tmp_path / "bench.json"
    results = bench["main"](
        [
            "--tiny",
            "--max-new-tokens",
            "4",
            "--repeats",
            "1",
            "--prompts",
            "2",
            "--threads",
            "1",
            "--json",
            str(out_json),
        ]
    )
    printed = capsys.readouterr().out
    assert "### Plain decoding" in printed and "### Target verify cost" in printed
    lines = printed.splitlines()
    assert any(line.startswith("| 0 | 12 |") for line in lines)  # prompt 0: 12 random ids
    assert any(line.startswith("| 1 | 13 |") for line in lines)
    assert any(line.startswith("| all |") and ("PASS" in line or "FAIL" in line) for line in lines)
    for n in (1, 2, 4, 8, 16, 32, 64):
        assert any(line.startswith(f"| {n} | ") for line in lines), n
    assert [row["n"] for row in results["verify"]] == [1, 2, 4, 8, 16, 32, 64]
    assert len(results["plain"]) == 2 and results["plain"][0]["new_tokens"] == 4
    assert json.loads(out_json.read_text())["verdict"] in ("PASS", "FAIL")
