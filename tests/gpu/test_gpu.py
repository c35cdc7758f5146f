"""CUDA checks (`pytest -m gpu`; scripts/gpu_smoke.sh is the longer run on the real target): speculative
decoding on the GPU equals plain decoding on the GPU, and train/eagle.py trains on the GPU under bf16 autocast
with a bf16 target while the head and its Adam states stay float32. Where torch sees no CUDA device the module
is skipped, with one reason, before anything is built."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import train.eagle
from decode import DynamicTree, generate
from heads.eagle import EagleConfig, EagleHead
from train.config import EagleRunConfig, load_config

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA device (torch.cuda.is_available() is False)", allow_module_level=True)

DEVICE = "cuda"
ROOT = Path(__file__).resolve().parents[2]
PROMPT = torch.randint(0, 128, (1, 7), generator=torch.Generator().manual_seed(1))
N, V = 64, 128
TREES = {"dynamic": DynamicTree(depth=4, top_k=3, total_tokens=10), "tree8": "tree8"}


@pytest.fixture
def tiny_llama(build_target):
    """The shared tiny fp32 llama (tests/conftest.py), copied onto the GPU: the shared one is untouched."""
    return copy.deepcopy(build_target("llama")).to(DEVICE)


@pytest.mark.parametrize("tree", TREES)
def test_random_eagle3_head_on_cuda_equals_plain_decoding(tiny_llama, tree):
    torch.manual_seed(0)
    head = EagleHead(EagleConfig.from_target(tiny_llama.config, "eagle3", draft_vocab_size=64))
    head.set_draft_vocab(torch.randperm(V)[:64])
    head = head.to(tiny_llama.device).eval()
    prompt = PROMPT.to(DEVICE)
    plain = generate(tiny_llama, prompt, max_new_tokens=N).one
    spec = generate(tiny_llama, prompt, head, max_new_tokens=N, tree=TREES[tree]).one
    assert spec.sequences.device.type == DEVICE
    assert torch.equal(spec.sequences, plain.sequences) and spec.new_tokens == N


def test_accepted_tree_paths_on_cuda_equal_plain_decoding(tiny_llama, rank_oracle):
    """A drafter that knows the plain continuation (tests/conftest.py's RankOracle, its logits moved onto
    the GPU) gets long, branching paths accepted: verification, acceptance and cache compaction on CUDA."""
    prompt = PROMPT.to(DEVICE)
    plain = generate(tiny_llama, prompt, max_new_tokens=N + 8).one
    with torch.no_grad():
        features = tiny_llama(plain.sequences, output_hidden_states=True).hidden_states[-1][0]  # (T+N+8, H)

    class OnDevice(rank_oracle):
        def root_logits(self):
            return super().root_logits().to(DEVICE)

        def expand(self, parent_rows, tokens, depth):
            return super().expand(parent_rows, tokens, depth).to(DEVICE)

    oracle = OnDevice(plain.sequences[0].tolist(), V, [1 / 3, 1 / 3, 1 / 3], features=features)
    spec = generate(tiny_llama, prompt, oracle, max_new_tokens=N, tree=TREES["dynamic"]).one
    assert torch.equal(spec.sequences, plain.sequences[:, : PROMPT.shape[1] + N])
    assert spec.tau > 2.0  # paths were accepted, so the check above covered accepted-token bookkeeping


def _reset_accelerate() -> None:
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()


def test_recipe_on_cuda_with_bf16_autocast_keeps_the_head_fp32(tmp_path, monkeypatch, tiny_target_dir):
    chats = tmp_path / "train.jsonl"
    rows = [
        {
            "messages": [
                {"role": "user", "content": f"What is {i} plus {i}?"},
                {"role": "assistant", "content": f"The answer is {2 * i}. " * (1 + i % 7)},
            ]
        }
        for i in range(40)
    ]
    chats.write_text("".join(json.dumps(row) + "\n" for row in rows))
    out = tmp_path / "run"
    seen = []  # per loss call: head device, head dtypes, autocast on, autocast dtype, feature dtype
    loss = train.eagle.eagle3_ttt_loss

    def spy(head, features, *args, **kwargs):
        seen.append(
            (
                next(head.parameters()).device.type,
                frozenset(p.dtype for p in head.parameters()),
                torch.is_autocast_enabled(DEVICE),
                torch.get_autocast_dtype(DEVICE),
                features.dtype,
            )
        )
        return loss(head, features, *args, **kwargs)

    monkeypatch.setattr(train.eagle, "eagle3_ttt_loss", spy)
    cfg = load_config(
        EagleRunConfig,
        ROOT / "configs" / "tiny_test.yaml",
        [
            f"model.target='{tiny_target_dir}'",
            f"data.train_files=['{chats}']",
            f"train.output_dir='{out}'",
            "model.dtype=bfloat16",
            "model.attn_implementation=sdpa",
            "train.mixed_precision=bf16",
            "train.max_steps=3",
            "eagle.draft_vocab_size=256",
        ],
    )
    _reset_accelerate()
    try:
        train.eagle.main(cfg)  # tiny_test also evaluates each step: eval loss and a greedy generate (tau)
    finally:
        _reset_accelerate()

    assert seen and set(seen) == {(DEVICE, frozenset({torch.float32}), True, torch.bfloat16, torch.bfloat16)}
    assert json.loads((out / "head" / "config.json").read_text())["train_step"] == 3
    state = out / "state" / "step-3"
    for weights in (load_file(out / "head" / "model.safetensors"), load_file(state / "model.safetensors")):
        assert {t.dtype for t in weights.values() if t.is_floating_point()} == {torch.float32}
    optimizer = torch.load(state / "optimizer.bin", map_location="cpu", weights_only=True)
    moments = [
        t
        for entry in optimizer["state"].values()
        for t in entry.values()
        if t.is_floating_point() and t.dim()
    ]  # exp_avg, exp_avg_sq (not the 0-d step count)
    assert moments and {t.dtype for t in moments} == {torch.float32}
