"""What speculation costs and gains on a hybrid target on this CPU (`scripts/bench_hybrid.py`).

No hybrid small enough for this CPU ships on PyPI, so the targets are random: a Qwen3.5-style hybrid at the
default target's size (30 layers, width 576, three gated delta-net layers to one attention layer) and its
twin with attention in every layer, otherwise identical. Random weights make a head's acceptance meaningless,
so the drafts come from an oracle that knows the plain greedy continuation and gets the first d drafts of a
chain right with set probabilities (`ChainOracle`): every speedup here is at a chosen acceptance, and the
oracle drafts for free, so a real head's drafting cost comes on top (docs/drafters.md, cost per step).

What it shows: the cost of a chain's verify pass on the hybrid (its recurrent layers compute the chain's
states one token at a time and keep them, `decode.recurrent.record`; the accepted prefix's state is then
gathered, `settle`) against the same pass on the attention twin, and what is left of the speedup.
"""

from __future__ import annotations

import statistics
import time

import torch
from transformers import AutoConfig, AutoModelForCausalLM

from benchmarks.report import markdown
from decode import generate
from decode.drafter import Drafter, DraftLimits
from decode.tree import chain

SIZE = {  # the default target's shape (SmolLM2-135M): 30 layers, width 576, 9 heads of 64, 3 KV heads
    "hidden_size": 576,
    "intermediate_size": 1536,
    "num_hidden_layers": 30,
    "num_attention_heads": 9,
    "num_key_value_heads": 3,
    "head_dim": 64,
    "vocab_size": 49152,
    "linear_key_head_dim": 64,  # gated delta-net layers of the same width: 9 value heads of 64
    "linear_value_head_dim": 64,
    "linear_num_key_heads": 3,
    "linear_num_value_heads": 9,
    "tie_word_embeddings": True,
}
INTERVAL = 4  # Qwen3.5's layout: every fourth layer attention, the others gated delta-net
PROFILES = {  # the chance that draft d is right given drafts 1..d-1 were (greedy: an exact match)
    "every draft right": (1.0, 1.0, 1.0, 1.0),
    "p = 0.7 per draft": (0.7, 0.7, 0.7, 0.7),
    "p = 0.5 per draft": (0.5, 0.5, 0.5, 0.5),
}
DRAFTS = 4  # decode.recurrent.HYBRID_CHAIN: the chain a hybrid verifies by default


def targets(size: dict = SIZE, seed: int = 0) -> dict[str, torch.nn.Module]:
    """The random hybrid and its all-attention twin (same seed, same sizes)."""
    models = {}
    for name, attention_every in (("hybrid", INTERVAL), ("attention twin", 1)):
        layers = [
            "full_attention" if (i + 1) % attention_every == 0 else "linear_attention"
            for i in range(size["num_hidden_layers"])
        ]
        config = AutoConfig.for_model("qwen3_5_text", **size, layer_types=layers)
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, attn_implementation="eager").eval()
        model.generation_config.eos_token_id = None  # no early stop: every run decodes its full length
        models[name] = model.requires_grad_(False)
    return models


class ChainOracle(Drafter):
    """A one-row drafter that knows the plain greedy continuation `sequence` (prompt included): each proposal
    gets its first d drafts right with probability prod(probs[:d]), and the draft after them wrong (the true
    token + 1). Scores are one-hot, so a chain drafts exactly those tokens."""

    def __init__(self, sequence: list[int], vocab_size: int, probs: tuple[float, ...], seed: int = 0):
        self.sequence, self.vocab_size, self.probs = sequence, vocab_size, probs
        self.generator = torch.Generator().manual_seed(seed)
        self.root = 0  # index in `sequence` of the current root token
        self.right = 0  # drafts of this proposal that will be right

    def limits(self) -> DraftLimits:
        return DraftLimits(max_depth=len(self.probs), dynamic=False)

    def advance(self, features, tokens) -> None:
        self.root += tokens[0].numel()

    def _scores(self, depth: int) -> torch.Tensor:
        index = self.root + depth
        truth = self.sequence[index] if index < len(self.sequence) else 0
        token = truth if depth <= self.right else (truth + 1) % self.vocab_size
        scores = torch.zeros(1, self.vocab_size)
        scores[0, token] = 10.0
        return scores

    def root_logits(self) -> torch.Tensor:
        self.right = 0
        draws = torch.rand(len(self.probs), generator=self.generator).tolist()
        while self.right < len(self.probs) and draws[self.right] < self.probs[self.right]:
            self.right += 1
        return self._scores(1)

    def expand(self, parent_rows, tokens, depth) -> torch.Tensor:
        return self._scores(depth + 1)[None]

    def select(self, rows) -> None:
        assert rows == [0], rows


def _decode(model, ids: torch.Tensor, new_tokens: int, oracle: ChainOracle | None = None):
    """One row's decoding, timed: (its output, seconds). Plain without an oracle, else chains of DRAFTS."""
    tree = chain(DRAFTS) if oracle is not None else None
    start = time.perf_counter()
    out = generate(model, ids, oracle, tree=tree, max_new_tokens=new_tokens, eos_token_id=[]).one
    return out, time.perf_counter() - start


def run(
    prompts: int = 3, prompt_length: int = 64, new_tokens: int = 64, repeats: int = 3, size: dict = SIZE
) -> dict:
    """Plain decoding and oracle chains of DRAFTS on both targets, each prompt timed `repeats` times in
    rotation (plain, then each profile), in one process: the median of the repeats per prompt and method,
    summed over prompts. Raises AssertionError where a speculative reply differs from the plain one.
    Returns the rows and the run's settings."""
    rows = []
    for name, model in targets(size).items():
        vocab = model.config.vocab_size
        ids = [
            torch.randint(3, vocab, (1, prompt_length), generator=torch.Generator().manual_seed(p))
            for p in range(prompts)
        ]
        plain_runs = [_decode(model, x, new_tokens)[0].sequences for x in ids]
        times: dict[str, list[list[float]]] = {m: [[] for _ in ids] for m in ["plain", *PROFILES]}
        steps: dict[str, list[int]] = {label: [0] * prompts for label in PROFILES}
        for _ in range(repeats):
            for p, x in enumerate(ids):
                times["plain"][p].append(_decode(model, x, new_tokens)[1])
                for label, probs in PROFILES.items():
                    # seeded per prompt: every repeat drafts, accepts and times the same steps
                    oracle = ChainOracle(plain_runs[p][0].tolist(), vocab, probs, seed=p)
                    out, seconds = _decode(model, x, new_tokens, oracle)
                    if not torch.equal(out.sequences, plain_runs[p]):
                        raise AssertionError(f"{name}, {label}, prompt {p}: not the plain reply")
                    if steps[label][p] not in (0, out.steps):
                        raise AssertionError(f"{name}, {label}, prompt {p}: repeats took other steps")
                    steps[label][p] = out.steps
                    times[label][p].append(seconds)
        plain = sum(statistics.median(t) for t in times["plain"])
        for label in ["plain", *PROFILES]:
            total = sum(statistics.median(t) for t in times[label])
            # target forwards, the prefill's included; tau as decode.generate counts it (the prefill's token
            # left out): accepted tokens per verify step
            forwards = prompts * new_tokens if label == "plain" else sum(steps[label]) + prompts
            rows.append(
                {
                    "target": name,
                    "method": label if label == "plain" else f"oracle chain of {DRAFTS}, {label}",
                    "tau": prompts * (new_tokens - 1) / (forwards - prompts),
                    "ms_per_step": 1000 * total / forwards,
                    "step_vs_plain_step": (total / forwards) / (plain / (prompts * new_tokens)),
                    "speedup": plain / total,
                }
            )
    return {
        "rows": rows,
        "prompts": prompts,
        "prompt_length": prompt_length,
        "new_tokens": new_tokens,
        "repeats": repeats,
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
    }


def report(record: dict) -> str:
    """The run as a markdown table."""
    head = (
        f"{record['prompts']} random prompts of {record['prompt_length']} tokens, {record['new_tokens']} new "
        f"tokens, median of {record['repeats']} repeats, {record['threads']} threads, "
        f"torch {record['torch']}; every output equal to plain decoding.\n\n"
    )
    table = markdown(
        ["target", "method", "tau", "ms per step", "step / plain step", "speedup"],
        [
            [
                row["target"],
                row["method"],
                f"{row['tau']:.2f}",
                f"{row['ms_per_step']:.1f}",
                f"{row['step_vs_plain_step']:.2f}",
                f"{row['speedup']:.2f}x",
            ]
            for row in record["rows"]
        ],
    )
    return head + table
