"""Shared fixtures: tiny random targets built from configs (no network), one per supported architecture."""

from __future__ import annotations

import functools

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

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
    """`build_target(arch, **config_overrides)`: a cached tiny fp32 target. Shared: tests must not mutate it."""
    return lambda arch, **overrides: _build(arch, tuple(sorted(overrides.items())))


@pytest.fixture(scope="session", params=ARCHS)
def tiny_target(request, build_target) -> torch.nn.Module:
    """A tiny random causal LM (4 layers, H=32, V=128, eager attention, seed 0), per architecture."""
    return build_target(request.param)


@pytest.fixture(scope="session", params=ARCHS + EXTRA_ARCHS)
def any_target(request, build_target) -> torch.nn.Module:
    """`tiny_target` and the extra architectures: for the cheaper per-architecture tests."""
    return build_target(request.param)
