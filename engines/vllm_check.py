"""Runs INSIDE the vLLM venv (tests/engines/test_vllm_external.py, scripts/bench_vllm.py), never imported by
selfspec.

Greedy-decodes token-id prompts with vLLM's CPU engine once per job, each job with a draft head (an export
folder and vLLM's method name) or without one (draft null), and writes, per job, the generated token ids and
vLLM's speculative-decoding counters, or the error that stopped the job (e.g. an export vLLM refuses).
Usage: python vllm_check.py TARGET_DIR JOBS.json OUT.json
JOBS.json: {"prompts": [[ids...], ...], "max_tokens": N,
            "jobs": [{"name", "draft", "method"[, "num_speculative_tokens", "speculative_config",
                      "target", "prompts", "max_model_len", "max_num_batched_tokens"]}, ...]}
(num_speculative_tokens: 3 unless a job says; a DFlash export drafts its block less the root; target: another
target folder than TARGET_DIR for that job; prompts: that job's own instead of the shared ones; max_model_len:
1024 unless a job says; max_num_batched_tokens: max_model_len unless a job says)

The jobs share this one process: vLLM is imported once, and its engine core runs in this process
(VLLM_ENABLE_V1_MULTIPROCESSING=0) rather than in two more processes per job that would each import it again;
each job builds its own engine (a new `LLM`, whose counters start at zero) and tears it down before the next.
"""

import gc
import json
import os
import sys
import time
import traceback


def run_job(target: str, job: dict, prompts: list, max_tokens: int) -> dict:
    from vllm import LLM, SamplingParams

    kwargs = {
        "model": job.get("target", target),
        "enforce_eager": True,
        # the prompts are token ids and only token ids are read back: no tokenizer to load (Gemma 3's
        # 262k-entry one took 20 s of a 33 s refusal job; the same tokens and counters in all 12 jobs)
        "skip_tokenizer_init": True,
        "max_model_len": job.get("max_model_len", 1024),
        "seed": 0,
        "disable_log_stats": False,
        "dtype": "float32",
        # one batch of all the prompts, and 1,024 tokens per engine step: a smaller warm-up at every engine
        # start than the defaults' (256 sequences, 4096 tokens). A job sets more tokens where its prompts
        # together hold more, so no prefill is split into chunks (chunks gave another draft than ours once
        # in 1,188 on 10 long prompts: the states computed in pieces)
        "max_num_seqs": len(prompts),
        "max_num_batched_tokens": job.get("max_num_batched_tokens", job.get("max_model_len", 1024)),
    }
    if job["draft"] is not None:
        kwargs["speculative_config"] = {
            "model": job["draft"],
            "method": job["method"],
            "num_speculative_tokens": job.get("num_speculative_tokens", 3),
            **job.get("speculative_config", {}),  # more keys, e.g. P-EAGLE's parallel_drafting
        }
    llm = LLM(**kwargs)
    try:
        outputs = llm.generate(
            [{"prompt_token_ids": ids} for ids in prompts],
            SamplingParams(temperature=0.0, max_tokens=max_tokens),
        )
        metrics = {}
        for metric in llm.get_metrics():
            if metric.name.startswith("vllm:spec_decode"):
                metrics[metric.name] = getattr(metric, "values", None) or getattr(metric, "value", None)
        return {"tokens": [list(o.outputs[0].token_ids) for o in outputs], "metrics": metrics}
    finally:
        llm.llm_engine.engine_core.shutdown()
        del llm


def main(target: str, jobs_file: str, out_file: str) -> None:
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB of KV cache: enough for a 135M target
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the engine core in this process
    from vllm.distributed import cleanup_dist_env_and_memory

    with open(jobs_file) as f:
        spec = json.load(f)
    results = {}
    for job in spec["jobs"]:
        start = time.perf_counter()
        try:
            prompts = job.get("prompts", spec.get("prompts"))
            results[job["name"]] = run_job(target, job, prompts, int(spec["max_tokens"]))
        except Exception:  # noqa: BLE001 - reported to the test, which decides whether it is expected
            results[job["name"]] = {"error": traceback.format_exc()}
        finally:
            gc.collect()
            cleanup_dist_env_and_memory()  # the next job's engine sets up its own (1-process) group
        results[job["name"]]["seconds"] = time.perf_counter() - start
        print(f"vllm_check: job {job['name']} took {results[job['name']]['seconds']:.1f} s", flush=True)
        with open(out_file, "w") as f:  # after every job: a crash later still leaves the earlier results
            json.dump(results, f)


if __name__ == "__main__":  # vLLM may start worker processes: nothing may run on their import
    main(*sys.argv[1:4])
