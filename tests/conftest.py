"""Shared fixtures: tiny random targets built from configs (no network), one per supported architecture."""

from __future__ import annotations

import functools
import os
from pathlib import Path

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from decode.drafter import Drafter
from heads.features import LAST
from targets import materialize_default_target

# The four architectures the lossless grid runs on, and two more that build and decode losslessly here too
# (gemma2: alternating sliding / full layers and soft-capping; gemma3_text: sliding layers and per-layer-type
# rope; windows of 4096, far longer than any test sequence), used by the cheaper per-architecture tests.
ARCHS = ["llama", "qwen2", "mistral", "gemma"]
EXTRA_ARCHS = ["gemma2", "gemma3_text"]
TINY = {
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 8,
    "vocab_size": 128,
}


# The longest modules, in the order they start: .ci/run spreads the suite over two pytest-xdist workers by
# module (`-n 2 --dist loadfile --no-loadscope-reorder`: a module's fixtures are built once, on one worker),
# and the longest starting first lets both workers end together. The CI log's 60 slowest tests say which.
FIRST = (
    "engines/test_vllm_external.py",
    "decode/test_host_syncs.py",
    "decode/test_real_model.py",
    "decode/test_lossless_sampling.py",
    "train/test_distributed.py",
    "train/test_distributed_medusa.py",
    "train/test_ablation.py",
    "targets/test_architectures.py",
    "targets/test_gemma3.py",
)


CONFIG: list = []  # this process's pytest config (hooks that get no config read it)


def pytest_configure(config):
    """A worker of a parallel run computes on one thread, and so do the processes it starts (training runs,
    vLLM): two workers share the machine's cores, and two OpenMP threads per process then spin-wait on each
    other (a training step on a loaded 2-core machine took 10x longer on two threads than on one)."""
    CONFIG[:] = [config]
    if os.environ.get("PYTEST_XDIST_WORKER"):
        os.environ["OMP_NUM_THREADS"] = os.environ["MKL_NUM_THREADS"] = "1"
        torch.set_num_threads(1)


SAID: list[str] = []  # lines `say` queued that no test report has carried yet


@pytest.fixture(scope="session")
def say():
    """`say(line)`: a line in pytest's own output, past the capture, so CI logs show it under -q (a venv's
    build time, an engine's counters). On pytest-xdist workers, whose output nobody sees, too: the line rides
    on the next test report to the process that prints the run."""
    return SAID.append


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    if SAID:
        outcome.get_result().user_properties.extend(("say", line) for line in SAID)
        SAID.clear()


def pytest_runtest_logreport(report):
    """The process that prints the run (the only one, or xdist's controller) writes the lines `say` queued."""
    lines = [value for name, value in report.user_properties if name == "say"]
    reporter = CONFIG[0].pluginmanager.get_plugin("terminalreporter") if CONFIG else None
    if lines and reporter is not None and not hasattr(CONFIG[0], "workerinput"):
        reporter.ensure_newline()
        for line in lines:
            reporter.write_line(line)


def pytest_collection_modifyitems(config, items):
    """The modules of `FIRST` first, in its order; every module's tests keep their order."""
    tests = Path(__file__).parent

    def rank(item) -> int:
        module = item.path.relative_to(tests).as_posix() if item.path.is_relative_to(tests) else ""
        return FIRST.index(module) if module in FIRST else len(FIRST)

    items.sort(key=rank)


@functools.cache
def _build(arch: str, overrides: tuple = ()) -> torch.nn.Module:
    cfg = AutoConfig.for_model(arch, **{**TINY, **dict(overrides)})
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation="eager").eval()
    model.generation_config.eos_token_id = None  # no early stop: runs are long and lengths predictable
    model.requires_grad_(False)
    return model


@pytest.fixture(scope="session")
def build_target():
    """`build_target(arch, **config_overrides)`: a cached tiny fp32 target. Shared: tests must not mutate
    it."""
    return lambda arch, **overrides: _build(arch, tuple(sorted(overrides.items())))


@pytest.fixture(scope="session", params=ARCHS)
def tiny_target(request, build_target) -> torch.nn.Module:
    """A tiny random causal LM (4 layers, H=32, V=128, eager attention, seed 0), per architecture."""
    return build_target(request.param)


@pytest.fixture(scope="session", params=ARCHS + EXTRA_ARCHS)
def any_target(request, build_target) -> torch.nn.Module:
    """`tiny_target` and the extra architectures: for the cheaper per-architecture tests."""
    return build_target(request.param)


class RankOracle(Drafter):
    """A one-row drafter that knows the plain greedy continuation `sequence` (prompt included): it ranks the
    true next token r-th with probability rank_probs[r] (the rest: not among its top candidates), random
    logits elsewhere. With `features` (the target's final hidden states over `sequence`) it also checks what
    it is fed. Several drive a batch as a list (`decode.drafter.RowDrafters`)."""

    feature_layers = (LAST,)

    def __init__(
        self,
        sequence: list[int],
        vocab_size: int,
        rank_probs: list[float],
        seed: int = 0,
        features: torch.Tensor | None = None,
    ) -> None:
        self.sequence, self.vocab_size, self.features = sequence, vocab_size, features
        self.rank_probs = torch.tensor([*rank_probs, max(0.0, 1.0 - sum(rank_probs))])
        self.generator = torch.Generator().manual_seed(seed)
        self.root = (
            0  # index in `sequence` of the current root token (the first advance covers prompt[1:] + root)
        )
        self.on_path: list[bool] = []  # per expansion row of this proposal: lies on the true continuation

    def start(self, prompts):
        assert len(prompts) == 1 and prompts[0].tolist() == self.sequence[: prompts[0].numel()]

    def advance(self, features, tokens):
        (next_tokens,) = tokens
        n = next_tokens.numel()
        assert next_tokens.tolist() == self.sequence[self.root + 1 : self.root + 1 + n]
        if self.features is not None:
            torch.testing.assert_close(
                features[0], self.features[self.root : self.root + n], atol=1e-4, rtol=0
            )
        self.root += n

    def _logits(self, index: int, on_path: bool) -> torch.Tensor:
        logits = torch.rand(self.vocab_size, generator=self.generator)
        if on_path and index < len(self.sequence):
            truth = self.sequence[index]
            others = [
                t for t in torch.randperm(self.vocab_size, generator=self.generator).tolist() if t != truth
            ]
            rank = int(torch.multinomial(self.rank_probs, 1, generator=self.generator))
            top = (others[:rank] + [truth] + others[rank:])[: len(self.rank_probs) - 1]  # truth may fall off
            logits[top] = torch.arange(20.0, 20.0 - len(top), -1.0)
        return logits

    def root_logits(self):
        return self._logits(self.root + 1, True)[None]

    def expand(self, parent_rows, tokens, depth):
        rows = []
        index = self.root + depth
        for parent, token in zip(parent_rows[0].tolist(), tokens[0].tolist()):
            parent_on_path = True if parent < 0 else self.on_path[parent]
            on_path = parent_on_path and index < len(self.sequence) and token == self.sequence[index]
            self.on_path.append(on_path)
            rows.append(self._logits(index + 1, on_path))
        return torch.stack(rows)[None]

    def end_proposal(self):
        self.on_path = []

    def select(self, rows):
        assert rows == [0], rows


@pytest.fixture(scope="session")
def rank_oracle():
    """The `RankOracle` class (conftest modules are not importable from tests under
    --import-mode=importlib)."""
    return RankOracle


@pytest.fixture(scope="session")
def tiny_target_dir(tmp_path_factory) -> Path:
    """A random 4-layer llama (H=32, tied embeddings) saved with the SmolLM2 tokenizer, so the recipe's
    chat template, masking and draft-vocabulary code run on a real 49k vocabulary. No network."""
    tokenizer = AutoTokenizer.from_pretrained(materialize_default_target())
    config = AutoConfig.for_model(
        "llama",
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=len(tokenizer),
        tie_word_embeddings=True,
    )
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    path = tmp_path_factory.mktemp("tiny_llama")
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path
