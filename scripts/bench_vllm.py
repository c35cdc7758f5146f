"""What a user who serves a head with vLLM gets, per prompt category: vLLM's own speculative-decoding counters
(drafts, accepted tokens per draft position, and the accepted length they give) on the benchmark's prompts,
beside ours with the same chain of drafts, in-source and held-out-source categories side by side.

    python scripts/bench_vllm.py [HEAD_DIR] [--prompts 10] [--max-new-tokens 64] [--heldout] [--out DIR]

HEAD_DIR defaults to the EAGLE-3 head shipped for the default target. vLLM drafts chains, not trees: each
step it drafts `--drafts` tokens one after another (default: 3, or what the head type serves with,
engines.serving.vllm_drafting) and verifies them in one target pass. Its CPU build (the cached venv of
train/venv.py, built on first use in about 4 minutes) decodes every category's prompts in one batch, greedy
and in fp32, with the head exported as `scripts/serve_vllm.py` exports it (engines/vllm_check.py, one engine
per category, all in one process); meanwhile this process decodes the same prompts one at a time with
`decode.generate` and `decode.tree.chain`. Greedy decoding is exact on both sides, so the tokens must be equal
and the counters too; the report says where they are not.

Accepted length = 1 + accepted drafts / drafting steps (vLLM's mean acceptance length: the tokens one target
pass yields, bonus token included). Pooled rows add the categories' counts. Writes vllm.md and vllm.json to
--out and prints the table; vLLM's jobs, tokens and log stay in <cache>/bench_vllm.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

import torch

from benchmarks.prompts import CATEGORIES, HELDOUT_CATEGORIES, load_prompts, prompt_ids
from benchmarks.served import accepted_length, chain_counts, compare, pool, table
from engines.export import export_head
from engines.serving import PER_POSITION, export_folder, vllm_drafting, vllm_export
from heads import load_heads
from heads.io import read_head_config
from heads.shipping import pretrained_dir
from targets import DEFAULT_TARGET, cache_dir, load_target, materialize_default_target
from train.venv import VLLM_ENV, clean_env, vllm_python

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT / "data" / "smollm2"
CHECK = ROOT / "engines" / "vllm_check.py"


def theirs(result: dict) -> dict:
    """vllm_check.py's run of one category as `benchmarks.served.chain_counts` gives ours."""
    if "error" in result:
        raise SystemExit(f"vLLM failed:\n{result['error'][-3000:]}")
    metrics = result["metrics"]
    return {
        "tokens": result["tokens"],
        "drafts": int(metrics["vllm:spec_decode_num_drafts"]),
        "per_position": [int(n) for n in metrics[PER_POSITION]],
    }


def engine_tokens(needed: int) -> int:
    """A token count for vLLM's engine that holds `needed`: vllm_check.py's default 1,024, or more in steps
    of 256."""
    return max(1024, -(-needed // 256) * 256)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("head_dir", type=Path, nargs="?", default=None, help="default: the shipped EAGLE-3")
    parser.add_argument("--prompts", type=int, default=10, help="prompts per category")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--heldout", action="store_true", help="also the held-out-source categories")
    parser.add_argument("--drafts", type=int, default=None, help="drafts per step (default: the head type's)")
    parser.add_argument("--out", type=Path, default=ROOT / "results" / "vllm_chain")
    args = parser.parse_args(argv)
    head_dir = args.head_dir or pretrained_dir(DEFAULT_TARGET, "eagle3")
    config = read_head_config(head_dir)
    if config.get("base_model") not in (None, DEFAULT_TARGET):  # the prompts and the target are the default's
        raise SystemExit(f"{head_dir}: a head for {config['base_model']}, not for {DEFAULT_TARGET}")
    fmt, method = vllm_export(config["head_type"], config["head_config"])
    default_drafts, speculative = vllm_drafting(config["head_type"], config["head_config"])
    drafts = args.drafts or default_drafts

    torch.set_num_threads(1)  # vLLM's engine takes one core, this process the other
    model, tokenizer = load_target()
    head = load_heads(head_dir, target=model).eval()
    target = str(materialize_default_target())
    export = export_folder(cache_dir() / "exports", head_dir, fmt, target, drafts)
    if not (export / "config.json").is_file():
        export_head(head_dir, fmt, export, target=target, verifier_name=target, num_speculative_tokens=drafts)
    prompts = load_prompts(DATA, args.prompts, 0, heldout=args.heldout)[0]
    ids = {name: [prompt_ids(tokenizer, row)[0].tolist() for row in rows] for name, rows in prompts.items()}
    jobs = []
    for name, batch in ids.items():
        longest = max(len(p) for p in batch) + args.max_new_tokens + drafts + 1
        jobs.append(
            {
                "name": name,
                "draft": str(export),
                "method": method,
                "num_speculative_tokens": drafts,
                "speculative_config": speculative,
                "prompts": batch,
                "max_model_len": engine_tokens(longest),
                # every prompt prefilled in the first engine step, none split into chunks (vllm_check.py)
                "max_num_batched_tokens": engine_tokens(sum(map(len, batch))),
            }
        )
    args.out.mkdir(parents=True, exist_ok=True)
    work = cache_dir() / "bench_vllm"  # the jobs, vLLM's tokens and its log: kept for a look, not reported
    work.mkdir(parents=True, exist_ok=True)
    (work / "jobs.json").write_text(json.dumps({"max_tokens": args.max_new_tokens, "jobs": jobs}))
    (work / "runs.json").unlink(missing_ok=True)  # a run before this one's results are never read as its own
    python, built = vllm_python()
    if built is not None:
        print(f"built the vLLM venv in {built:.0f} s", flush=True)
    start = time.perf_counter()
    with (work / "vllm_check.log").open("w") as log:
        command = [str(python), str(CHECK), target, str(work / "jobs.json"), str(work / "runs.json")]
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=clean_env(VLLM_ENV))
    try:
        mine = {n: chain_counts(model, head, batch, drafts, args.max_new_tokens) for n, batch in ids.items()}
        process.wait()
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    if process.returncode != 0:
        tail = (work / "vllm_check.log").read_text(errors="replace")[-4000:]
        raise SystemExit(f"vllm_check.py failed ({process.returncode}):\n{tail}")
    runs = json.loads((work / "runs.json").read_text())
    rows = compare(mine, {name: theirs(runs[name]) for name in ids})
    by_name = {r["category"]: r for r in rows}
    pooled = [pool([by_name[c] for c in CATEGORIES], "in-source")]
    if args.heldout:
        pooled.append(pool([by_name[c] for c in HELDOUT_CATEGORIES], "held-out"))
    command = " ".join(["python scripts/bench_vllm.py", *(sys.argv[1:] if argv is None else argv)])
    seconds = sum(runs[name]["seconds"] for name in ids)
    shown = Path(head_dir).resolve()
    shown = shown.relative_to(ROOT) if shown.is_relative_to(ROOT) else shown
    text = (
        f"Command: `{command}`\n\n"
        f"Head {shown} ({config['head_type']}), exported as {fmt}, served by vLLM as method {method} with "
        f"{drafts} drafts per step; target {DEFAULT_TARGET}, greedy, fp32, {args.max_new_tokens} new tokens; "
        f"vLLM's runs took {seconds:.0f} s (engine starts included), the whole comparison "
        f"{time.perf_counter() - start:.0f} s.\n\n" + table(rows + pooled) + "\n"
    )
    if len(pooled) == 2:
        ratio = accepted_length(pooled[1]["served"]) / accepted_length(pooled[0]["served"])
        text += f"\nHeld-out / in-source accepted length (vLLM): {ratio:.2f}\n"
    (args.out / "vllm.md").write_text(text)
    (args.out / "vllm.json").write_text(
        json.dumps(
            {"command": command, "head": str(shown), "drafts": drafts, "rows": rows, "pooled": pooled},
            indent=1,
        )
    )
    print(text)
    mismatched = [r["category"] for r in rows if not r["same_counts"] or r["same_tokens"] != r["prompts"]]
    if mismatched:
        raise SystemExit(f"vLLM decoded differently from ours on {mismatched}: see {args.out / 'vllm.md'}")


if __name__ == "__main__":
    main()
