"""Runs INSIDE the vLLM venv (see test_vllm_external.py), never imported by selfspec.

Greedy-decodes token-id prompts with vLLM's CPU engine, with a draft head (an export folder and vLLM's method
name) or without one ("-"), and writes the generated token ids and vLLM's speculative-decoding counters.
Usage: python vllm_check.py TARGET_DIR EXPORT_DIR|- METHOD PROMPTS.json MAX_TOKENS OUT.json
"""

import json
import os
import sys


def main(target: str, draft: str, method: str, prompts_file: str, max_tokens: str, out_file: str) -> None:
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB of KV cache: enough for a 135M target
    from vllm import LLM, SamplingParams

    kwargs = {
        "model": target,
        "enforce_eager": True,
        "max_model_len": 1024,
        "seed": 0,
        "disable_log_stats": False,
        "dtype": "float32",
    }
    if draft != "-":
        kwargs["speculative_config"] = {"model": draft, "method": method, "num_speculative_tokens": 3}
    llm = LLM(**kwargs)
    with open(prompts_file) as f:
        prompts = json.load(f)
    outputs = llm.generate(
        [{"prompt_token_ids": ids} for ids in prompts],
        SamplingParams(temperature=0.0, max_tokens=int(max_tokens)),
    )
    metrics = {}
    for metric in llm.get_metrics():
        if metric.name.startswith("vllm:spec_decode"):
            metrics[metric.name] = getattr(metric, "values", None) or getattr(metric, "value", None)
    result = {"tokens": [list(o.outputs[0].token_ids) for o in outputs], "metrics": metrics}
    with open(out_file, "w") as f:
        json.dump(result, f)


if __name__ == "__main__":  # vLLM starts worker processes: nothing may run on their import
    main(*sys.argv[1:7])
