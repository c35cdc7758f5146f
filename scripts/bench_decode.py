"""Benchmark plain decoding (`decode.generate`, heads=None) against transformers' `generate`, and the
target's verify cost C_T(n) for n tree tokens (REFERENCE sections 1, 4 and 6). Run with:

    python scripts/bench_decode.py --threads 1 --max-new-tokens 64 --repeats 5 --prompts 3 --json
    bench_decode.json

On a shared 2-core machine use --threads 1: two OpenMP threads stall whenever another process takes a core.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time

import torch
import transformers
from transformers import AutoModelForCausalLM, DynamicCache, LlamaConfig

from decode import generate
from decode.timing import synchronize
from decode.tree import DraftTree
from decode.verify import verify
from heads.target import DEFAULT_TARGET, load_target

PROMPTS = [  # short, generic, and long-winded enough that greedy answers run past 64 tokens
    "Give me three tips for staying focused while studying.",
    "Explain how a bicycle stays upright while it moves.",
    "Write a short story about a lighthouse keeper who finds a message in a bottle.",
    "What are the main differences between a list and a tuple in Python?",
    "Describe the water cycle to a ten-year-old.",
]
VERIFY_SIZES = (1, 2, 4, 8, 16, 32, 64)  # tree tokens per target forward
CONTEXT_LENGTH = 128  # committed tokens in the KV cache while timing verify
GOAL = 0.95  # plain decoding must reach 95% of transformers' tokens/s


def _tiny_target() -> tuple[torch.nn.Module, None]:
    """A random 2-layer Llama built from a config (tests: no real model, no tokenizer)."""
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
    return model, None


def _prompt_ids(tokenizer, index: int, vocab_size: int) -> torch.Tensor:
    """(1, T) chat-template ids of PROMPTS[index]; seeded random ids when there is no tokenizer."""
    if tokenizer is None:
        return torch.randint(3, vocab_size, (1, 12 + index), generator=torch.Generator().manual_seed(index))
    messages = [{"role": "user", "content": PROMPTS[index]}]
    return tokenizer.apply_chat_template(
        messages, add_generation_prompt=True, return_dict=True, return_tensors="pt"
    )["input_ids"]


def _ours(model, ids: torch.Tensor, max_new_tokens: int) -> torch.Tensor:
    """Plain decoding through our loop; no EOS, so exactly max_new_tokens tokens."""
    return generate(model, ids, heads=None, max_new_tokens=max_new_tokens, eos_token_id=[]).sequences


def _theirs(model, ids: torch.Tensor, max_new_tokens: int) -> torch.Tensor:
    """transformers' greedy generate, forced to max_new_tokens tokens."""
    # Explicit all-ones mask: with pad == EOS (SmolLM2) HF would mask every <|im_end|> inside the prompt.
    return model.generate(
        ids,
        attention_mask=torch.ones_like(ids),
        do_sample=False,
        max_new_tokens=max_new_tokens,
        min_new_tokens=max_new_tokens,
    )


def _check_same(ours: torch.Tensor, theirs: torch.Tensor, prompt_length: int, max_new_tokens: int) -> None:
    """Fail loudly unless both produced exactly `max_new_tokens` identical tokens."""
    for name, seq in (("decode.generate", ours), ("model.generate", theirs)):
        if seq.shape[1] - prompt_length != max_new_tokens:
            new = seq.shape[1] - prompt_length
            raise SystemExit(f"{name} produced {new} tokens, expected {max_new_tokens}")
    if not torch.equal(ours, theirs):
        first = int((ours[0] != theirs[0]).nonzero()[0]) - prompt_length
        raise SystemExit(
            f"token mismatch at new token {first}: ours {ours[0, prompt_length:].tolist()} vs "
            f"theirs {theirs[0, prompt_length:].tolist()} (an EOS argmax that min_new_tokens "
            "suppresses in HF also shows up here: try another prompt or fewer tokens)"
        )


class _ForwardClock:
    """Wall time inside `model.forward` (hooks): a generate call = model time + loop overhead. On CUDA each
    hook synchronizes first, so the forward's kernels count as model time (the waits add to both loops)."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.seconds, self._start, self._device = 0.0, 0.0, model.device
        self._hooks = [
            model.register_forward_pre_hook(lambda *_: self._begin()),
            model.register_forward_hook(lambda *_: self._stop()),
        ]

    def _begin(self) -> None:
        synchronize(self._device)
        self._start = time.perf_counter()

    def _stop(self) -> None:
        synchronize(self._device)
        self.seconds += time.perf_counter() - self._start

    def remove(self) -> None:
        for hook in self._hooks:
            hook.remove()


def bench_plain(
    model, tokenizer, num_prompts: int, max_new_tokens: int, repeats: int
) -> tuple[list[dict], dict[str, float]]:
    """Median tokens/s of ours vs HF per prompt, interleaved after one warm-up each; median paired ratios."""
    rows, pairs = [], {"wall": [], "cpu": []}
    clock = _ForwardClock(model)
    for index in range(num_prompts):
        ids = _prompt_ids(tokenizer, index, model.config.vocab_size)
        # wall s, process CPU s, ms per token outside model.forward
        wall, cpu, overhead = ({"ours": [], "theirs": []} for _ in range(3))
        for repeat in range(repeats + 1):  # repeat 0 is the warm-up, not recorded
            outputs = {}
            order = (("ours", _ours), ("theirs", _theirs))  # A B, B A, A B, ...: who goes first alternates
            for name, run in order if repeat % 2 == 0 else order[::-1]:
                synchronize(model.device)
                clock.seconds, start, start_cpu = 0.0, time.perf_counter(), time.process_time()
                outputs[name] = run(model, ids, max_new_tokens)
                synchronize(model.device)
                if repeat:
                    wall[name].append(time.perf_counter() - start)
                    cpu[name].append(time.process_time() - start_cpu)
                    overhead[name].append(1e3 * (wall[name][-1] - clock.seconds) / max_new_tokens)
            _check_same(outputs["ours"], outputs["theirs"], ids.shape[1], max_new_tokens)
        wall_ratios = [t / o for o, t in zip(wall["ours"], wall["theirs"])]  # ours tok/s / theirs, per pair
        pairs["wall"] += wall_ratios
        pairs["cpu"] += [t / o for o, t in zip(cpu["ours"], cpu["theirs"])]
        print(
            f"bench_decode: prompt {index} done, ours/HF per pair {[round(r, 3) for r in wall_ratios]}",
            file=sys.stderr,
        )
        rows.append(
            {
                "prompt": index,
                "prompt_tokens": ids.shape[1],
                "new_tokens": max_new_tokens,
                "ours_tok_s": max_new_tokens / statistics.median(wall["ours"]),
                "theirs_tok_s": max_new_tokens / statistics.median(wall["theirs"]),
                "ratio": statistics.median(wall_ratios),
                "ours_overhead_ms": statistics.median(overhead["ours"]),
                "theirs_overhead_ms": statistics.median(overhead["theirs"]),
                "ours_s": wall["ours"],
                "theirs_s": wall["theirs"],
                "ours_cpu_s": cpu["ours"],
                "theirs_cpu_s": cpu["theirs"],
            }
        )
    clock.remove()
    return rows, {key: statistics.median(values) for key, values in pairs.items()}


def _random_tree(n: int, vocab_size: int, generator: torch.Generator, device: torch.device) -> DraftTree:
    """A random tree of n nodes: node i's parent is drawn uniformly from nodes 0..i-1."""
    parents = [-1] + [int(torch.randint(0, i, (), generator=generator)) for i in range(1, n)]
    seen: dict[int, int] = {}
    ranks = []
    for parent in parents:
        ranks.append(seen.get(parent, 0))
        seen[parent] = ranks[-1] + 1
    tokens = torch.randint(0, vocab_size, (n,), generator=generator)
    return DraftTree(
        tokens=tokens.to(device),
        parents=torch.tensor(parents, device=device),
        ranks=torch.tensor(ranks, device=device),
    )  # on the target's device: no upload when timed


def bench_verify(model, tokenizer, repeats: int) -> list[dict]:
    """Median ms of one verify forward over n tree tokens above a CONTEXT_LENGTH cache; lm_head alone."""
    vocab_size = model.config.vocab_size
    context = torch.cat([_prompt_ids(tokenizer, i % len(PROMPTS), vocab_size) for i in range(12)], dim=1)
    context = context[:, :CONTEXT_LENGTH]
    cache = DynamicCache(config=model.config)
    model(input_ids=context, cache=cache, use_cache=True, logits_to_keep=1)
    past = context.shape[1]
    generator = torch.Generator().manual_seed(0)
    trees = {n: _random_tree(n, vocab_size, generator, model.device) for n in VERIFY_SIZES}
    lm_head = model.get_output_embeddings()
    hidden = torch.randn(1, max(VERIFY_SIZES), model.config.hidden_size, generator=generator)
    verify_ms: dict[int, list[float]] = {n: [] for n in VERIFY_SIZES}
    head_ms: dict[int, list[float]] = {n: [] for n in VERIFY_SIZES}
    for repeat in range(repeats + 1):  # repeat 0 is the warm-up; sizes interleave so drift hits all alike
        for n in VERIFY_SIZES:
            synchronize(model.device)
            start = time.perf_counter()
            logits, _ = verify(model, cache, trees[n], past)
            synchronize(model.device)
            elapsed = time.perf_counter() - start
            cache.crop(-n)  # transformers 5.x crop takes the (negative) number of positions to drop
            if logits.shape != (n, vocab_size) or cache.get_seq_length() != past:
                raise SystemExit(
                    f"verify n={n}: logits {tuple(logits.shape)}, cache {cache.get_seq_length()}"
                )
            synchronize(model.device)
            start_head = time.perf_counter()
            lm_head(hidden[:, :n])
            synchronize(model.device)
            if repeat:
                verify_ms[n].append(1e3 * elapsed)
                head_ms[n].append(1e3 * (time.perf_counter() - start_head))
    medians = {n: statistics.median(verify_ms[n]) for n in VERIFY_SIZES}
    return [
        {
            "n": n,
            "verify_ms": medians[n],
            "ratio_to_1": medians[n] / medians[1],
            "ms_per_token": medians[n] / n,
            "lm_head_ms": statistics.median(head_ms[n]),
        }
        for n in VERIFY_SIZES
    ]


def _markdown(headers: list[str], rows: list[list[str]]) -> str:
    """A markdown table."""
    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    return "\n".join(lines + ["| " + " | ".join(row) + " |" for row in rows])


def main(argv: list[str] | None = None) -> dict:
    """Run both benchmarks, print two markdown tables, optionally write JSON; returns the results."""
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default=DEFAULT_TARGET, help="target name or local HF folder")
    parser.add_argument("--attn-implementation", choices=("eager", "sdpa"), default="eager")
    parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's)")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=5, help="timed runs per method, after one warm-up")
    parser.add_argument(
        "--prompts", type=int, default=3, help=f"how many of the {len(PROMPTS)} fixed prompts"
    )
    parser.add_argument("--json", default=None, help="write the results to this path")
    parser.add_argument("--tiny", action="store_true", help=argparse.SUPPRESS)  # tests: random tiny model
    args = parser.parse_args(argv)
    if not 1 <= args.prompts <= len(PROMPTS):
        parser.error(f"--prompts must be in 1..{len(PROMPTS)}")
    if args.repeats < 1 or args.max_new_tokens < 1:
        parser.error("--repeats and --max-new-tokens must be >= 1")
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    if args.tiny:
        model, tokenizer = _tiny_target()
    else:
        model, tokenizer = load_target(
            args.model, dtype=torch.float32, attn_implementation=args.attn_implementation
        )

    with torch.inference_mode():
        plain, ratios = bench_plain(model, tokenizer, args.prompts, args.max_new_tokens, args.repeats)
        costs = bench_verify(model, tokenizer, args.repeats)

    ratio = ratios["wall"]
    verdict = "PASS" if ratio >= GOAL else "FAIL"
    attn = model.config._attn_implementation
    print(
        f"\n### Plain decoding, {args.max_new_tokens} new tokens (prefill included), median of "
        f"{args.repeats}, "
        f"threads={torch.get_num_threads()}, attn={attn}\n"
    )
    print(
        _markdown(
            [
                "prompt",
                "prompt tokens",
                "ours tok/s",
                "HF tok/s",
                "ours/HF (median of pairs)",
                "ours ms/token outside forward",
                "HF ms/token outside forward",
            ],
            [
                [
                    str(r["prompt"]),
                    str(r["prompt_tokens"]),
                    f"{r['ours_tok_s']:.2f}",
                    f"{r['theirs_tok_s']:.2f}",
                    f"{r['ratio']:.3f}",
                    f"{r['ours_overhead_ms']:.2f}",
                    f"{r['theirs_overhead_ms']:.2f}",
                ]
                for r in plain
            ]
            + [["all", "", "", "", f"**{ratio:.3f}** {verdict} (goal >= {GOAL})", "", ""]],
        )
    )
    print(f"\nours/HF by process CPU time (robust to preemption with --threads 1): {ratios['cpu']:.3f}")
    print(
        f"\n### Target verify cost C_T(n), {CONTEXT_LENGTH}-token context, random tree, "
        f"median of {args.repeats}\n"
    )
    print(
        _markdown(
            ["n", "verify ms", "x C_T(1)", "ms/token", "lm_head ms"],
            [
                [
                    str(r["n"]),
                    f"{r['verify_ms']:.1f}",
                    f"{r['ratio_to_1']:.2f}",
                    f"{r['ms_per_token']:.2f}",
                    f"{r['lm_head_ms']:.1f}",
                ]
                for r in costs
            ],
        )
    )
    results = {
        "model": "tiny" if args.tiny else args.model,
        "attn_implementation": attn,
        "threads": torch.get_num_threads(),
        "max_new_tokens": args.max_new_tokens,
        "repeats": args.repeats,
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "machine": platform.machine(),
        "plain": plain,
        "ours_over_hf": ratio,
        "ours_over_hf_cpu": ratios["cpu"],
        "goal": GOAL,
        "verdict": verdict,
        "verify": costs,
    }
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)
    return results


if __name__ == "__main__":
    main()
