"""Tiny random targets of the architectures drafters are trained for today (MoE, MLA, gpt-oss's sinks and
sliding windows, layers without rope, ...): taps, one recipe step per head type, exports, lossless greedy
decoding at B = 1 and 2, and sampling's chi-square on one MoE and one MLA target. Hybrid targets (linear
attention, Mamba) train, export and decode losslessly along chains, their recurrent state rolled back to the
accepted prefix (with a negative control), and sample from the target's distribution."""

from __future__ import annotations

import copy
import functools
import importlib
import json

import numpy as np
import pytest
import torch
from datasets import Dataset
from transformers import AutoConfig, AutoModelForCausalLM

from decode import DynamicTree, generate, prepare
from decode.accept import target_probs
from decode.tree import chain
from engines.export import export_head, import_head, validate_export
from heads import FeatureCapture
from heads.features import LAST, find_decoder_layers
from heads.medusa import MedusaConfig, MedusaHeads
from heads.registry import kind_for_head_type
from tests.conftest import TINY as FAMILIAR
from tests.conftest import RankOracle
from tests.decode.test_lossless_sampling import bigram_pvalue
from train.config import EagleTrainConfig, MedusaTrainConfig
from train.data import collate
from train.eagle import EagleStep, draft_vocab_logits, new_head, target_pass
from train.losses import needs_outside_mass
from train.medusa import MedusaStep, new_heads

TINY = {
    **FAMILIAR,  # the sizes of the other tests' tiny targets
    "pad_token_id": None,  # the configs' own special ids lie outside a 128-token vocabulary
    "bos_token_id": None,
    "eos_token_id": None,
}
MOE = {"num_experts_per_tok": 2, "moe_intermediate_size": 16}
WINDOW = 8  # gpt_oss's sliding window: the test sequences (PROMPT_LENGTH + NEW tokens) are 4 times longer
ARCHS = {
    "llama": {},  # the families tested since the start, through the same checks
    "qwen2": {},
    "gemma": {},
    "gemma2": {},
    "gemma3_text": {},
    "qwen3": {},
    "qwen3_moe": {**MOE, "num_experts": 4},
    "mixtral": {"num_local_experts": 4, "num_experts_per_tok": 2},
    # MLA: queries and keys of rope and no-rope parts (8 wide), values 12 wide, as many KV heads as heads
    "deepseek_v3": {
        **MOE,
        "n_routed_experts": 4,
        "n_group": 1,
        "topk_group": 1,
        "first_k_dense_replace": 1,
        "q_lora_rank": 16,
        "kv_lora_rank": 16,
        "qk_rope_head_dim": 4,
        "qk_nope_head_dim": 4,
        "v_head_dim": 12,
        "head_dim": 4,
        "num_key_value_heads": 4,
    },
    "gpt_oss": {
        "num_local_experts": 4,
        "num_experts_per_tok": 2,
        "sliding_window": WINDOW,
        "layer_types": ["sliding_attention", "full_attention"] * 2,
    },
    "mistral": {"sliding_window": WINDOW},  # every layer slides, one mask for all: no `layer_types`
    "glm4_moe": {**MOE, "n_routed_experts": 4, "first_k_dense_replace": 1},
    "smollm3": {"no_rope_layer_interval": 2},  # layers 1 and 3 have no rope
    "olmo2": {},
    "phi3": {},
}
# Hybrids: some layers keep recurrent state (gated delta-net linear attention, Mamba-2) instead of a KV cache
HYBRIDS = {
    "qwen3_next": {
        **MOE,
        "num_experts": 4,
        "shared_expert_intermediate_size": 16,
        "linear_key_head_dim": 8,
        "linear_value_head_dim": 8,
        "linear_num_key_heads": 2,
        "linear_num_value_heads": 4,
    },
    "qwen3_5_text": {
        "linear_key_head_dim": 8,
        "linear_value_head_dim": 8,
        "linear_num_key_heads": 2,
        "linear_num_value_heads": 4,
    },
    "granitemoehybrid": {
        "num_local_experts": 4,
        "num_experts_per_tok": 2,
        "shared_intermediate_size": 16,
        "mamba_n_heads": 4,
        "mamba_d_state": 8,
        "mamba_d_head": 16,
        "mamba_chunk_size": 8,
        "layer_types": ["mamba", "attention"] * 2,
    },
    "nemotron_h": {
        **MOE,
        "layers_block_type": ["linear_attention", "full_attention", "mlp", "moe"],
        "n_routed_experts": 4,
        "moe_shared_expert_intermediate_size": 16,
        "mamba_num_heads": 4,
        "mamba_head_dim": 16,
        "ssm_state_size": 8,
        "n_groups": 1,
        "chunk_size": 8,
        "use_mamba_kernels": False,
    },
}
HEAD_TYPES = ("medusa", "eagle1", "eagle3", "dflash", "peagle")
V, PROMPT_LENGTH, NEW = 128, 7, 25
PROMPTS = torch.randint(0, V, (2, PROMPT_LENGTH), generator=torch.Generator().manual_seed(1))
SHORT = 4  # row 1 of a batch keeps its last SHORT prompt tokens: left padding
ORACLE_TREE = DynamicTree(depth=4, top_k=2, total_tokens=8)


@functools.cache
def _target(arch: str, **overrides) -> torch.nn.Module:
    config = {**TINY, **ARCHS.get(arch, {}), **HYBRIDS.get(arch, {}), **overrides}
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(
        AutoConfig.for_model(arch, **config), attn_implementation="eager"
    ).eval()
    model.generation_config.eos_token_id = None  # replies of a known length
    return model.requires_grad_(False)


@pytest.fixture(scope="module", params=list(ARCHS))
def arch(request) -> str:
    return request.param


# ---- taps and training ------------------------------------------------------------------------------


def test_taps_are_the_decoder_layer_outputs(arch):
    model = _target(arch)
    n = len(find_decoder_layers(model))
    with FeatureCapture(model, (*range(n - 1), LAST)) as capture, torch.no_grad():
        out = model(PROMPTS, output_hidden_states=True)
        features = capture.features()
    expected = torch.cat([*out.hidden_states[1:n], out.hidden_states[-1]], dim=-1)
    torch.testing.assert_close(features, expected, atol=1e-6, rtol=0)


def _training_rows() -> Dataset:
    """Two rows of random tokens, the second shorter (padding in the batch); the first 4 tokens unscored."""
    generator = torch.Generator().manual_seed(2)
    rows = [torch.randint(0, V - 1, (n,), generator=generator).tolist() for n in (24, 17)]
    return Dataset.from_dict({"input_ids": rows, "loss_mask": [[0] * 4 + [1] * (len(r) - 4) for r in rows]})


@functools.cache
def _trained(arch: str, head_type: str) -> tuple[torch.nn.Module, float, bool]:
    """A fresh head of `head_type` made by its recipe's code, after one AdamW step of its recipe's loss on
    the target's captured taps; with the loss and whether every gradient was finite and one nonzero."""
    target = _target(arch)
    rows = _training_rows()
    batch = collate(list(rows), pad_token_id=0)
    torch.manual_seed(0)
    if head_type == "medusa":  # train/medusa.py: heads from the target's lm_head, the decoder's final states
        cfg = MedusaTrainConfig(num_heads=3)
        head = new_heads(cfg, target)
        step = MedusaStep(head, target, cfg)
        loss, _ = step(batch["input_ids"], batch["attention_mask"], batch["loss_mask"])
    else:  # train/eagle.py: the target's taps and logits, then the head's loss
        small = {"block_size": 4, "draft_layers": 1, "anchors": 8, "ttt_steps": 2, "parallel_depths": 3}
        vocab = {"draft_vocab_size": 64} if head_type != "eagle1" else {}  # a reduced draft vocabulary
        cfg = EagleTrainConfig(head_type=head_type, **small, **vocab)
        head = new_head(cfg, target, rows)
        step = EagleStep(head, cfg, target.get_input_embeddings(), target.get_output_embeddings())
        logits_of = draft_vocab_logits(head, target, other=needs_outside_mass(cfg.distill_loss))
        with FeatureCapture(target, head.feature_layers) as capture:
            features, logits = target_pass(target, capture, batch, logits_of)
        loss, _ = step(features, batch["input_ids"], logits, batch["loss_mask"])
    optimizer = torch.optim.AdamW(head.parameters(), lr=1e-3)
    loss.backward()
    grads = [p.grad for p in head.parameters() if p.grad is not None]
    healthy = bool(grads) and all(g.isfinite().all() for g in grads) and any(g.abs().sum() > 0 for g in grads)
    optimizer.step()
    return head.eval().requires_grad_(False), loss.item(), healthy


@pytest.mark.parametrize("head_type", HEAD_TYPES)
def test_every_head_type_trains_a_step(arch, head_type):
    _, loss, healthy = _trained(arch, head_type)
    assert np.isfinite(loss) and loss > 0, loss
    assert healthy, "a gradient was NaN or infinite, or every gradient zero"


# ---- exports ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("head_type", HEAD_TYPES)
def test_exports_pass_their_validators_and_load_back(arch, head_type, tmp_path):
    _check_exports(arch, head_type, tmp_path)


def _check_exports(arch: str, head_type: str, tmp_path) -> None:
    """The trained head in every format of its kind: validated, loaded back to the same tensors, and naming
    the target's own class as its verifier (a config built in code records none)."""
    head, target = _trained(arch, head_type)[0], _target(arch)
    for fmt in kind_for_head_type(head_type).formats:
        out = tmp_path / fmt
        export_head(head, fmt, out, target=target, verifier_name=f"tiny/{arch}")  # validates before writing
        validate_export(out, fmt)
        verifier = json.loads((out / "config.json").read_text()).get("speculators_config", {}).get("verifier")
        if verifier is not None:
            assert verifier["architectures"] == [type(target).__name__], fmt
        back = import_head(out, fmt, target=target)
        ours, theirs = head.state_dict(), back.state_dict()
        assert ours.keys() == theirs.keys(), fmt
        assert all(torch.equal(ours[k], theirs[k]) for k in ours), fmt


# ---- greedy decoding --------------------------------------------------------------------------------


def _recomputed(model: torch.nn.Module, prompt: torch.Tensor, n: int) -> list[int]:
    """Greedy continuation recomputing the whole sequence each step: no cache, no library code."""
    ids = prompt[None]
    with torch.no_grad():
        for _ in range(n):
            ids = torch.cat([ids, model(input_ids=ids, use_cache=False).logits[:, -1:].argmax(-1)], dim=1)
    return ids[0].tolist()


def _rows() -> list[torch.Tensor]:
    """The batch's prompts, unpadded: row 1 is shorter."""
    return [PROMPTS[0], PROMPTS[1, -SHORT:]]


@functools.cache
def _plain(arch: str, row: int) -> tuple[list[int], torch.Tensor]:
    """Plain greedy decoding of prompt `row` alone (B = 1), NEW tokens and slack past them for overshooting
    drafts, and the target's final hidden states over it."""
    model = _target(arch)
    sequence = generate(model, _rows()[row], max_new_tokens=NEW + 8).one.sequence
    with torch.no_grad():
        hidden = model(sequence[None], output_hidden_states=True).hidden_states[-1][0]
    return sequence.tolist(), hidden


def _decode(arch: str, drafter, batch: int, tree=None) -> tuple[list[list[int]], list[float]]:
    """Every row's reply and tau: row 0 alone (B = 1), or rows 0 and 1 left-padded together (B = 2)."""
    prompts = _rows()[:batch]
    width = max(len(p) for p in prompts)
    ids = torch.stack([torch.cat([p.new_zeros(width - len(p)), p]) for p in prompts])
    mask = torch.stack([(torch.arange(width) >= width - len(p)).long() for p in prompts])
    out = generate(
        _target(arch), ids, drafter, max_new_tokens=NEW, attention_mask=mask if batch > 1 else None, tree=tree
    )
    return out.replies, out.tau


def test_plain_decoding_equals_the_models_own_forward(arch):
    for row, prompt in enumerate(_rows()):
        assert _plain(arch, row)[0][: len(prompt) + NEW] == _recomputed(_target(arch), prompt, NEW), row


@pytest.mark.parametrize("windowed", ["gpt_oss", "mistral"])
def test_the_sequences_cross_the_sliding_windows(windowed):
    """So that decoding which attended past a window, or dropped columns a tree still needs, would fail."""
    assert _target(windowed).config.sliding_window == WINDOW and SHORT + NEW > 3 * WINDOW


@pytest.mark.parametrize("windowed", ["gpt_oss", "mistral"])
def test_negative_control_attending_past_the_window_is_detected(windowed, monkeypatch):
    """Masks that let the sliding layers see past their window (the layer types read as windowless) change
    the batched replies: the lossless tests of this module would catch it."""
    monkeypatch.setattr(importlib.import_module("decode.inputs"), "attention_windows", lambda model: {})
    replies, _ = _decode(windowed, None, batch=2)
    plain = [_plain(windowed, row)[0][len(prompt) : len(prompt) + NEW] for row, prompt in enumerate(_rows())]
    assert replies != plain


@pytest.mark.parametrize("batch", [1, 2])
@pytest.mark.parametrize("head_type", HEAD_TYPES)
def test_trained_heads_decode_losslessly(arch, head_type, batch):
    replies, _ = _decode(arch, _trained(arch, head_type)[0], batch)
    for row, reply in enumerate(replies):
        sequence = _plain(arch, row)[0]
        prompt = len(_rows()[row])
        assert reply == sequence[prompt : prompt + NEW], (head_type, row)


@pytest.mark.parametrize("batch", [1, 2])
def test_oracle_drafts_along_branching_trees_decode_losslessly(arch, batch, rank_oracle):
    """An oracle ranks the true next token 1st or 2nd, so long paths through branching trees are accepted:
    the verify masks, positions and cache compaction are exercised far beyond the root. It also checks the
    features it is fed against the target's own."""
    oracles = []
    for row in range(batch):
        sequence, features = _plain(arch, row)
        oracles.append(rank_oracle(sequence, V, [0.6, 0.3], seed=row, features=features))
    replies, taus = _decode(arch, oracles if batch > 1 else oracles[0], batch, tree=ORACLE_TREE)
    for row, reply in enumerate(replies):
        sequence = _plain(arch, row)[0]
        prompt = len(_rows()[row])
        assert reply == sequence[prompt : prompt + NEW], row
    assert min(taus) > 2.0, taus


# ---- sampling: one MoE and one MLA target -----------------------------------------------------------

SAMPLING_VOCAB, RUNS, SAMPLED = 8, 8, 100
SAMPLING_PROMPT = torch.tensor([1, 4, 2])
SAMPLING_TREE = [(0,), (1,), (2,), (0, 0), (1, 0), (0, 1), (0, 0, 0)]


@functools.cache
def _peaky(arch: str) -> torch.nn.Module:
    """A 2-layer, 8-token target, peaky and nearly Markov (as tests/decode/test_lossless_sampling.py's): a
    biased acceptance rule then moves mass the same way in every context, which the test detects."""
    sizes = {"hidden_size": 16, "num_hidden_layers": 2, "vocab_size": SAMPLING_VOCAB}
    model = _target(arch, **sizes, **({"first_k_dense_replace": 0} if arch == "deepseek_v3" else {}))
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(6.0)
        for name, param in find_decoder_layers(model).named_parameters():
            if name.endswith(("o_proj.weight", "down_proj", "down_proj.weight")):
                param.mul_(0.2)
    return model


def _sampling_pvalue(
    model: torch.nn.Module, heads, batch: int = 1, tree=SAMPLING_TREE, **kwargs
) -> tuple[float, float]:
    """Chi-square of (previous token, token) counts against the summed exact target probabilities of each
    emitted token's context (cells expecting fewer than 5 pooled), over RUNS sequences decoded `batch` at a
    time; and the mean tau. `kwargs` go to `generate`."""
    sequences, taus = [], []
    for run in range(RUNS // batch):
        out = generate(
            model,
            SAMPLING_PROMPT.expand(batch, -1),
            heads,
            max_new_tokens=SAMPLED,
            tree=tree,
            temperature=1.0,
            seed=1000 + run,
            **kwargs,
        )
        sequences += [out.row(b).sequence for b in range(batch)]
        taus += out.tau
    start = len(SAMPLING_PROMPT)
    with torch.no_grad():
        logits = model(torch.stack(sequences)).logits[:, start - 1 : -1]  # (RUNS, SAMPLED, V)
    probs = target_probs(logits, 1.0).double().flatten(0, 1).numpy()
    tokens = torch.stack(sequences)[:, start:].flatten().numpy()
    previous = torch.stack(sequences)[:, start - 1 : -1].flatten().numpy()
    return bigram_pvalue(previous, tokens, probs, SAMPLING_VOCAB), float(np.mean(taus))


def _medusa(std: float = 2.0) -> MedusaHeads:
    """Random heads unlike the target: a small std is a flat draft."""
    torch.manual_seed(11)
    heads = MedusaHeads(MedusaConfig(16, SAMPLING_VOCAB, num_heads=3))
    for projection in heads.lm_heads:
        torch.nn.init.normal_(projection.weight, std=std)
    return heads.eval()


@pytest.mark.parametrize("batch", [1, 4])
@pytest.mark.parametrize("sampled_arch", ["qwen3_moe", "deepseek_v3"])
def test_speculative_sampling_follows_the_target_distribution(sampled_arch, batch):
    pvalue, tau = _sampling_pvalue(_peaky(sampled_arch), _medusa(), batch)
    assert tau >= 1.2, f"drafts were rarely accepted (tau {tau:.2f}): the test would be vacuous"
    assert pvalue > 1e-3, f"{sampled_arch}: sampling deviates from the target (chi-square p={pvalue:.2e})"


def test_negative_control_lossy_acceptance_is_detected_on_the_moe_target():
    """Typical acceptance (lossy on purpose): the test can fail on these targets."""
    pvalue, _ = _sampling_pvalue(_peaky("qwen3_moe"), _medusa(), acceptance="typical")
    assert pvalue < 1e-3, "the chi-square test failed to detect a lossy acceptance rule"


# ---- hybrid targets ---------------------------------------------------------------------------------


@pytest.fixture(scope="module", params=list(HYBRIDS))
def hybrid(request) -> torch.nn.Module:
    return _target(request.param)


@pytest.mark.parametrize("head_type", HEAD_TYPES)
def test_hybrid_targets_train_on_their_hidden_states_and_export(hybrid, head_type, tmp_path):
    _, loss, healthy = _trained(hybrid.config.model_type, head_type)
    assert np.isfinite(loss) and loss > 0 and healthy, loss
    _check_exports(hybrid.config.model_type, head_type, tmp_path)


def test_hybrid_plain_decoding_equals_the_models_own_forward(hybrid):
    arch = hybrid.config.model_type
    for row, prompt in enumerate(_rows()):
        assert _plain(arch, row)[0][: len(prompt) + NEW] == _recomputed(hybrid, prompt, NEW), row


@pytest.mark.parametrize("batch", [1, 2])
@pytest.mark.parametrize("head_type", HEAD_TYPES)
def test_trained_heads_decode_hybrid_targets_losslessly(hybrid, head_type, batch):
    """The default tree on a hybrid: a chain of `HYBRID_CHAIN` drafts (`decode.recurrent`)."""
    arch = hybrid.config.model_type
    replies, _ = _decode(arch, _trained(arch, head_type)[0], batch)
    for row, reply in enumerate(replies):
        prompt = len(_rows()[row])
        assert reply == _plain(arch, row)[0][prompt : prompt + NEW], (head_type, row)


def test_a_prepared_hybrid_decodes_losslessly(hybrid):
    """After `decode.prepare` (the CPU weight layout of the target, an int8 draft where fbgemm runs)."""
    arch = hybrid.config.model_type
    target, head = copy.deepcopy(hybrid), copy.deepcopy(_trained(arch, "eagle3")[0])
    head = prepare(target, head)
    prompt = _rows()[0]
    reply = generate(target, prompt, head, max_new_tokens=NEW).one.sequence.tolist()
    assert reply == _plain(arch, 0)[0][: len(prompt) + NEW]


def _oracle_chain(arch: str, batch: int) -> tuple[list[list[int]], list[float]]:
    """An oracle that drafts the true token first 70% of the time, along chains of 4: most steps accept part
    of their chain (a rollback), some all of it; the rows of a batch accept different lengths."""
    oracles = []
    for row in range(batch):
        sequence, features = _plain(arch, row)
        oracles.append(RankOracle(sequence, V, [0.7], seed=row, features=features))
    return _decode(arch, oracles if batch > 1 else oracles[0], batch, tree=chain(4))


@pytest.mark.parametrize("batch", [1, 2])
def test_partly_accepted_chains_roll_the_recurrent_state_back(hybrid, batch, monkeypatch):
    """Each row takes the state its layers recorded after its last accepted token: no forward is run again."""
    arch = hybrid.config.model_type
    replays = _count_calls(monkeypatch, "replay")
    replies, taus = _oracle_chain(arch, batch)
    for row, reply in enumerate(replies):
        prompt = len(_rows()[row])
        assert reply == _plain(arch, row)[0][prompt : prompt + NEW], row
    assert min(taus) > 1.5, taus
    assert replays == [], "the recorded states were not used"


@pytest.mark.parametrize("batch", [1, 2])
def test_layers_that_record_no_states_are_rolled_back_by_running_the_accepted_tokens_again(
    hybrid, batch, monkeypatch
):
    """A model whose layers compute no intermediate states (recording asked for none here): the rows that
    accepted less than their chain are run again from the state before the pass (`decode.batch.replay`)."""
    generate_module = importlib.import_module("decode.generate")
    record = generate_module.record
    monkeypatch.setattr(generate_module, "record", lambda cache, tokens: record(cache, 0))
    replays = _count_calls(monkeypatch, "replay")
    arch = hybrid.config.model_type
    replies, _ = _oracle_chain(arch, batch)
    for row, reply in enumerate(replies):
        prompt = len(_rows()[row])
        assert reply == _plain(arch, row)[0][prompt : prompt + NEW], row
    assert replays, "nothing was run again"


def _count_calls(monkeypatch, name: str) -> list:
    """Wrap `decode.generate.<name>` to note its calls in the returned list."""
    module = importlib.import_module("decode.generate")
    wrapped, calls = getattr(module, name), []

    def counted(*args):
        calls.append(args)
        return wrapped(*args)

    monkeypatch.setattr(module, name, counted)
    return calls


@pytest.mark.parametrize("arch", ["qwen3_next", "granitemoehybrid"])
def test_negative_control_without_the_rollback_the_replies_change(arch, monkeypatch):
    """Keeping the state that took in the rejected drafts (every row settled at the end of its chain) gives
    other replies: the lossless tests above would catch a rollback that does not happen. (A one-step head's
    drafts are mostly rejected.)"""
    module = importlib.import_module("decode.generate")
    settle = module.settle
    monkeypatch.setattr(module, "settle", lambda cache, kept, n: settle(cache, torch.full_like(kept, n), n))
    replies, _ = _decode(arch, _trained(arch, "eagle3")[0], 2)
    plain = [_plain(arch, row)[0][len(prompt) : len(prompt) + NEW] for row, prompt in enumerate(_rows())]
    assert replies != plain


def test_hybrid_targets_refuse_branching_trees_before_any_work(hybrid, monkeypatch):
    head = _trained(hybrid.config.model_type, "eagle3")[0]
    medusa = _trained(hybrid.config.model_type, "medusa")[0]

    def no_forward(*args, **kwargs):
        raise AssertionError("the target ran before the refusal")

    monkeypatch.setattr(hybrid, "forward", no_forward)
    message = r"is a hybrid target \(layers with recurrent state\): it verifies chains only"
    for heads, tree in (
        (head, DynamicTree(depth=3, top_k=2, total_tokens=6)),
        (medusa, [(0,), (1,), (0, 0)]),
    ):
        with pytest.raises(ValueError, match=message):
            generate(hybrid, PROMPTS, heads, max_new_tokens=4, tree=tree)
    prepare(hybrid)  # nothing to refuse without a tree


@functools.cache
def _peaky_hybrid() -> torch.nn.Module:
    """A 2-layer qwen3_next (one gated delta-net layer, one attention layer), 8 tokens, peaky."""
    sizes = {"hidden_size": 16, "num_hidden_layers": 2, "vocab_size": SAMPLING_VOCAB}
    model = _target("qwen3_next", **sizes, full_attention_interval=2)
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(6.0)
    return model


@pytest.mark.parametrize("batch", [1, 2])
def test_speculative_sampling_on_a_hybrid_follows_the_target_distribution(batch):
    """Chains of 3, each row's recurrent state rolled back after every partial acceptance; B = 1 and 2."""
    arch = "qwen3_next"
    pvalue, tau = _sampling_pvalue(_peaky_hybrid(), _medusa(), batch, tree=chain(3))
    assert tau >= 1.2, f"drafts were rarely accepted (tau {tau:.2f}): the test would be vacuous"
    assert pvalue > 1e-3, f"{arch}: sampling deviates from the target (chi-square p={pvalue:.2e})"


def test_the_recipes_simulated_tau_decodes_hybrids_and_refuses_chunked_attention():
    """The recipes' simulated tau decodes: a target decoding cannot serve (chunked attention) is refused
    when the run starts (not at its first evaluation), naming the way out; a hybrid is served."""
    from train.evaluate import check_tau_target

    for arch in HYBRIDS:
        check_tau_target(_target(arch), 20)
    chunked = _target("llama", attention_chunk_size=4)
    with pytest.raises(ValueError, match=r"chunked attention.*set train.eval_tau_prompts=0"):
        check_tau_target(chunked, 20)
    check_tau_target(chunked, 0)


def test_a_hybrid_draft_model_is_refused():
    """A draft model drafts trees over its own KV cache: a hybrid one is refused, naming its layers."""
    from decode.drafters.model import DraftModel

    with pytest.raises(ValueError, match=r"the draft model's layers \[0, 1, 2\] keep recurrent state"):
        generate(_target("llama"), PROMPTS[:1], DraftModel(_target("qwen3_next")), max_new_tokens=4)
