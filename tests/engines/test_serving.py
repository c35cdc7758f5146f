"""engines/serving.py and scripts/serve_vllm.py without vLLM: the export and method per head type, the server
command line, the counters parsed from a Prometheus page, and the script's export + command (--dry-run)."""

import json
import runpy
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from engines.serving import PER_POSITION, server_command, spec_metrics, vllm_drafting, vllm_export
from heads.io import save_heads
from tests.engines.test_export import make_head

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "serve_vllm.py"

# the shape of vLLM 0.32's /metrics page (prometheus_client text format): counters end in _total and carry
# engine / model labels, each has a _created twin, per-position counts carry a position label
PAGE = """\
# HELP vllm:spec_decode_num_drafts_total Number of spec decoding drafts.
# TYPE vllm:spec_decode_num_drafts_total counter
vllm:spec_decode_num_drafts_total{engine="0",model_name="m"} 155.0
vllm:spec_decode_num_drafts_created{engine="0",model_name="m"} 1.7649e+09
vllm:spec_decode_num_draft_tokens_total{engine="0",model_name="m"} 465.0
vllm:spec_decode_num_accepted_tokens_total{engine="0",model_name="m"} 65.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="m",position="0"} 62.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="m",position="2"} 0.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="m",position="1"} 3.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="1",model_name="m",position="1"} 2.0
vllm:num_requests_running{engine="0",model_name="m"} 0.0
vllm:kv_cache_usage_perc{engine="0",model_name="m"} NaN
vllm:spec_decode_num_drafts_total{engine="1",model_name="m"} 5.0 1764900000000
"""


def test_spec_metrics_sum_engines_and_order_positions():
    metrics = spec_metrics(PAGE)
    assert metrics == {
        "vllm:spec_decode_num_drafts": 160,  # the second engine's, with a timestamp, added
        "vllm:spec_decode_num_draft_tokens": 465,
        "vllm:spec_decode_num_accepted_tokens": 65,
        PER_POSITION: [62, 5, 0],  # ordered by the label, not by line; the second engine's 2 added
    }
    assert spec_metrics("# no speculative decoding\nvllm:num_requests_running 0.0\n") == {
        "vllm:spec_decode_num_drafts": 0,
        "vllm:spec_decode_num_draft_tokens": 0,
        "vllm:spec_decode_num_accepted_tokens": 0,
        PER_POSITION: [],
    }
    with pytest.raises(ValueError, match="without a position label"):
        spec_metrics('vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0"} 1.0\n')


def test_vllm_export_per_head_type():
    assert vllm_export("eagle3") == ("speculators", "eagle3")
    assert vllm_export("eagle1") == ("eagle1", "eagle")
    assert vllm_export("medusa") == ("medusa-vllm", "medusa")
    assert vllm_export("dflash") == ("dflash", "dflash")
    assert vllm_export("peagle") == ("peagle", "eagle3")
    with pytest.raises(ValueError, match="vLLM serves .* not 'lookahead'"):
        vllm_export("lookahead")
    # vLLM's EAGLE-1 fc has no bias, and its weight loader skips a ".bias" it has no parameter for
    assert vllm_export("eagle1", {"fc_bias": False}) == ("eagle1", "eagle")
    with pytest.raises(ValueError, match="without a bias and skips fc.bias"):
        vllm_export("eagle1", {"fc_bias": True})


def test_drafts_per_step_and_parallel_drafting_per_head_type():
    """A block drafter drafts what it was trained for; P-EAGLE only in one forward with parallel_drafting."""
    assert vllm_drafting("eagle3", {}) == (3, {})
    assert vllm_drafting("dflash", {"block_size": 16}) == (15, {})
    assert vllm_drafting("peagle", {"parallel_depths": 6}) == (6, {"parallel_drafting": True})


def test_server_command_drafts_with_the_export_in_fp32_on_localhost():
    command = server_command("/venv/bin/python", "/models/target", "/exports/spec", "eagle3", port=8123)
    assert command[:3] == ["/venv/bin/python", "-m", "vllm.entrypoints.openai.api_server"]

    def value(flag: str) -> str:
        return command[command.index(flag) + 1]

    assert value("--model") == "/models/target" and value("--host") == "127.0.0.1"
    assert value("--port") == "8123" and value("--dtype") == "float32" and "--enforce-eager" in command
    assert value("--served-model-name") == "target"
    spec = json.loads(value("--speculative-config"))
    assert spec == {"model": "/exports/spec", "method": "eagle3", "num_speculative_tokens": 3}
    plain = server_command("py", "t", None, "-", extra=["--max-num-seqs", "4"])
    assert "--speculative-config" not in plain and plain[-2:] == ["--max-num-seqs", "4"]


def test_serve_vllm_dry_run_exports_the_head_and_prints_the_command(
    tmp_path, tiny_target_dir, capsys, monkeypatch
):
    """The export lands in a cache folder named by the head's files: reused while the head is unchanged, a
    new one once it is retrained; the server arguments after `--` reach vLLM, the `--` itself does not."""
    monkeypatch.setenv("SELFSPEC_CACHE", str(tmp_path / "cache"))
    main = runpy.run_path(str(SCRIPT))["main"]  # scripts/ is not a package; nothing runs at import time
    target = AutoModelForCausalLM.from_pretrained(tiny_target_dir)
    head = make_head("eagle1", target)
    save_heads(head, tmp_path / "head", base_model="org/tiny-llama", target=target)
    argv = [str(tmp_path / "head"), "--target", str(tiny_target_dir), "--port", "8555"]
    argv += ["--vllm-python", "/opt/vllm/bin/python", "--dry-run", "--", "--max-num-seqs", "2"]
    main(argv)
    printed = capsys.readouterr().out.strip().splitlines()[-1]
    (export,) = (tmp_path / "cache" / "exports").iterdir()
    assert export.name.startswith("eagle1-")
    assert json.loads((export / "config.json").read_text())["architectures"] == ["LlamaForCausalLM"]
    assert printed.startswith("/opt/vllm/bin/python -m vllm.entrypoints.openai.api_server --model ")
    assert f'"model": "{export}", "method": "eagle"' in printed and printed.endswith("--max-num-seqs 2")
    assert " -- " not in printed and "--served-model-name " + tiny_target_dir.name in printed
    main(argv)  # the same head: its export is reused
    assert list((tmp_path / "cache" / "exports").iterdir()) == [export]
    with torch.no_grad():
        head.fc.weight.add_(1.0)  # trained further
    save_heads(head, tmp_path / "head", base_model="org/tiny-llama", target=target)
    main(argv)
    assert len(list((tmp_path / "cache" / "exports").iterdir())) == 2
    save_heads(make_head("medusa", target), tmp_path / "medusa", base_model="org/tiny-llama", target=target)
    main([str(tmp_path / "medusa"), "--target", str(tiny_target_dir), "--vllm-python", "py", "--dry-run"])
    assert '"method": "medusa"' in capsys.readouterr().out
    save_heads(make_head("peagle", target), tmp_path / "peagle", base_model="org/tiny-llama", target=target)
    main([str(tmp_path / "peagle"), "--target", str(tiny_target_dir), "--vllm-python", "py", "--dry-run"])
    printed = capsys.readouterr().out
    assert '"method": "eagle3", "num_speculative_tokens": 4, "parallel_drafting": true' in printed
