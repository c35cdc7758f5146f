"""Plain decoding (`decode.generate`, heads=None) against transformers' `generate`, and the target's verify
cost C_T(n) for n tree tokens (`scripts/bench_decode.py`; docs/design.md, Metrics and When speculation pays).
"""

from __future__ import annotations

import platform
import statistics
import sys
import time

import torch
import transformers

from benchmarks.report import markdown
from decode import generate
from decode.inputs import attention_windows
from decode.recurrent import kv_length, rewind, snapshot
from decode.timing import synchronize
from decode.tree import DraftTree
from decode.verify import target_cache, verify

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


def prompt_ids(tokenizer, index: int, vocab_size: int) -> torch.Tensor:
    """(1, T) chat-template ids of PROMPTS[index]; seeded random ids (T = 12 + index) without a tokenizer."""
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


def check_same(ours: torch.Tensor, theirs: torch.Tensor, prompt_length: int, max_new_tokens: int) -> None:
    """Fail loudly (SystemExit) unless both produced exactly `max_new_tokens` identical tokens."""
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
        ids = prompt_ids(tokenizer, index, model.config.vocab_size)
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
            check_same(outputs["ours"], outputs["theirs"], ids.shape[1], max_new_tokens)
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
    # on the target's device: no upload when timed
    return DraftTree(
        tokens=tokens.to(device),
        parents=torch.tensor(parents, device=device),
        ranks=torch.tensor(ranks, device=device),
    )


def bench_verify(model, tokenizer, repeats: int) -> list[dict]:
    """Median ms of one verify forward over n tree tokens above a CONTEXT_LENGTH cache; lm_head alone."""
    vocab_size = model.config.vocab_size
    context = torch.cat([prompt_ids(tokenizer, i % len(PROMPTS), vocab_size) for i in range(12)], dim=1)
    context = context[:, :CONTEXT_LENGTH]
    cache, windows = target_cache(model), attention_windows(model)
    model(input_ids=context, cache=cache, use_cache=True, logits_to_keep=1)
    saved = snapshot(cache)  # a hybrid's recurrent states after the context (none for other targets)
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
            logits, _ = verify(model, cache, trees[n], past, windows=windows)
            synchronize(model.device)
            elapsed = time.perf_counter() - start
            rewind(cache, n, saved)  # the n positions just verified dropped, recurrent states put back
            if logits.shape != (n, vocab_size) or kv_length(cache) != past:
                raise SystemExit(f"verify n={n}: logits {tuple(logits.shape)}, cache {kv_length(cache)}")
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


def verdict(record: dict) -> str:
    """PASS when plain decoding reached the `goal` share of transformers' tokens/s (`ours_over_hf`)."""
    return "PASS" if record["ours_over_hf"] >= record["goal"] else "FAIL"


def run(
    model, tokenizer, model_name: str, *, prompts: int = 3, max_new_tokens: int = 64, repeats: int = 5
) -> dict:
    """Both benchmarks on the first `prompts` PROMPTS (random ids when `tokenizer` is None); returns the
    record that `report` renders (bench_decode's JSON)."""
    if not 1 <= prompts <= len(PROMPTS):
        raise ValueError(f"prompts must be in 1..{len(PROMPTS)}, got {prompts}")
    with torch.inference_mode():
        plain, ratios = bench_plain(model, tokenizer, prompts, max_new_tokens, repeats)
        costs = bench_verify(model, tokenizer, repeats)
    record = {
        "model": model_name,
        "attn_implementation": model.config._attn_implementation,
        "threads": torch.get_num_threads(),
        "max_new_tokens": max_new_tokens,
        "repeats": repeats,
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "machine": platform.machine(),
        "plain": plain,
        "ours_over_hf": ratios["wall"],
        "ours_over_hf_cpu": ratios["cpu"],
        "goal": GOAL,
    }
    return record | {"verdict": verdict(record), "verify": costs}


def report(record: dict) -> str:
    """The two markdown tables of a `run` record: plain decoding per prompt (with the verdict) and C_T(n)."""
    plain_headers = ["prompt", "prompt tokens", "ours tok/s", "HF tok/s", "ours/HF (median of pairs)"]
    plain_headers += ["ours ms/token outside forward", "HF ms/token outside forward"]
    plain_rows = [
        [
            str(r["prompt"]),
            str(r["prompt_tokens"]),
            f"{r['ours_tok_s']:.2f}",
            f"{r['theirs_tok_s']:.2f}",
            f"{r['ratio']:.3f}",
            f"{r['ours_overhead_ms']:.2f}",
            f"{r['theirs_overhead_ms']:.2f}",
        ]
        for r in record["plain"]
    ]
    total = f"**{record['ours_over_hf']:.3f}** {verdict(record)} (goal >= {record['goal']})"
    verify_rows = [
        [
            str(r["n"]),
            f"{r['verify_ms']:.1f}",
            f"{r['ratio_to_1']:.2f}",
            f"{r['ms_per_token']:.2f}",
            f"{r['lm_head_ms']:.1f}",
        ]
        for r in record["verify"]
    ]
    plain_title = (
        f"\n### Plain decoding, {record['max_new_tokens']} new tokens (prefill included), median of "
        f"{record['repeats']}, threads={record['threads']}, attn={record['attn_implementation']}\n"
    )
    cpu = "\nours/HF by process CPU time (robust to preemption with --threads 1): "
    cpu += f"{record['ours_over_hf_cpu']:.3f}"
    verify_title = (
        f"\n### Target verify cost C_T(n), {CONTEXT_LENGTH}-token context, random tree, median of "
        f"{record['repeats']}\n"
    )
    tables = [
        plain_title,
        markdown(plain_headers, [*plain_rows, ["all", "", "", "", total, "", ""]]),
        cpu,
        verify_title,
        markdown(["n", "verify ms", "x C_T(1)", "ms/token", "lm_head ms"], verify_rows),
    ]
    return "\n".join(tables)
