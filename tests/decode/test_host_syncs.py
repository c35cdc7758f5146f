"""Host round trips per decoding step (a decode loop fit for a GPU): `generate` may wait for the device, or
copy host data to it, a fixed number of times per step, whatever the tree's size and the target's depth.

Counted on the CPU while decoding: torch.profiler's aten::_local_scalar_dense (`item()`, `int()`, `float()` or
`bool()` of a tensor), aten::nonzero (its output size is read back) and aten::lift_fresh (a tensor made from
Python data, an upload once the target is on a GPU), plus calls of Tensor.tolist / Tensor.numpy (no aten op
of their own). Per step = the difference between a long and a short run over the difference in their steps, so
the prefill and the last step cancel out. The target always accepts the draft's first choice
(input-independent logits), so every step accepts a deep path off the node order: per-node, per-level and
per-layer round trips would all show (the loop this replaced made 45-79 per step with tree (5, 4, 12), 63-115
with (8, 8, 32), one more per target layer, and 11 in plain decoding).
"""

import copy

import pytest
import torch
from torch import nn
from torch.profiler import ProfilerActivity, profile

from decode import BestFirstTree, DynamicTree, generate
from heads.eagle import EagleConfig, EagleHead
from heads.medusa import MedusaConfig, MedusaHeads
from heads.peagle import PEagleConfig, PEagleHead

ROUND_TRIP_OPS = ("aten::_local_scalar_dense", "aten::nonzero", "aten::lift_fresh")
BOUND = 1  # round trips per step: the one read of the accepted path and the tokens it emits
TREES = [DynamicTree(depth=5, top_k=4, total_tokens=12), DynamicTree(depth=8, top_k=8, total_tokens=32)]
PROMPT = torch.tensor([[5, 17, 99, 3, 42, 8, 61]])


class RoundTrips:
    """Context manager counting host round trips (see the module docstring) in `self.count`."""

    def __enter__(self):
        self.count, self._saved = 0, {name: getattr(torch.Tensor, name) for name in ("tolist", "numpy")}
        for name, method in self._saved.items():

            def counted(tensor, *args, _method=method, **kwargs):
                self.count += 1
                return _method(tensor, *args, **kwargs)

            setattr(torch.Tensor, name, counted)
        self._profile = profile(activities=[ProfilerActivity.CPU])
        self._profile.__enter__()
        return self

    def __exit__(self, *exc):
        self._profile.__exit__(*exc)
        for name, method in self._saved.items():
            setattr(torch.Tensor, name, method)
        # the profiler's raw records (nested ops included, as events() gives them): events() would build a
        # Python event tree first, 90% of this module's time (1.4-3.5 s a run against 0.04 s of these)
        results = getattr(self._profile.profiler, "kineto_results", None)
        if results is None:  # a torch without the raw records: the slow path, the same counts
            names = [event.name for event in self._profile.events()]
        else:
            names = [event.name() for event in results.events()]
        self.count += sum(1 for name in names if name in ROUND_TRIP_OPS)


def _constant_logits(hidden_size: int, vocab_size: int) -> nn.Linear:
    """Logits that ignore the input: token 0 far ahead, the rest in decreasing order (a fixed p)."""
    layer = nn.Linear(hidden_size, vocab_size).requires_grad_(False)
    layer.weight.zero_()
    layer.bias.copy_(-10.0 - 0.01 * torch.arange(vocab_size, dtype=torch.float32))
    layer.bias[0] = 0.0
    return layer


def _always_accepting(build_target, layers: int, kind: str) -> tuple[nn.Module, nn.Module]:
    """A tiny llama target and random heads whose first choice is always the target's own."""
    target = copy.deepcopy(build_target("llama", num_hidden_layers=layers))
    target.lm_head = _constant_logits(target.config.hidden_size, target.config.vocab_size)
    torch.manual_seed(0)
    if kind == "medusa":
        heads = MedusaHeads(MedusaConfig(target.config.hidden_size, target.config.vocab_size, num_heads=8))
        heads.lm_heads = nn.ModuleList(
            _constant_logits(target.config.hidden_size, target.config.vocab_size) for _ in range(8)
        )
    elif kind == "peagle":  # every depth from one forward (a block drafter), 8 of them
        config = PEagleConfig.from_target(
            target.config, mask_token_id=5, parallel_depths=8, draft_vocab_size=64
        )
        heads = PEagleHead(config)
        heads.set_draft_vocab(torch.arange(64))
        heads.lm_head = _constant_logits(heads.config.hidden_size, 64)
    else:
        heads = EagleHead(EagleConfig.from_target(target.config, "eagle3", draft_vocab_size=64))
        heads.set_draft_vocab(torch.arange(64))
        heads.lm_head = _constant_logits(heads.config.hidden_size, 64)
    return target, heads.eval().requires_grad_(False)


def _per_step(model: nn.Module, heads: nn.Module | None, tree, temperature: float) -> tuple[float, float]:
    """(round trips per step, tau) of `generate`, from a run of 8 and one of 40 new tokens."""
    runs = []
    for new_tokens in (8, 40):
        with RoundTrips() as trips:
            out = generate(
                model, PROMPT, heads, max_new_tokens=new_tokens, tree=tree, temperature=temperature, seed=0
            ).one
        runs.append((trips.count, out.steps, out.tau))
    (short, short_steps, _), (long, long_steps, tau) = runs
    assert long_steps > short_steps
    return (long - short) / (long_steps - short_steps), tau


@pytest.mark.parametrize(
    "kind, temperature",
    [("eagle3", 0.0), ("eagle3", 1.0), ("medusa", 0.0), ("medusa", 1.0), ("peagle", 0.0)],
    ids=["eagle3-greedy", "eagle3-sampling", "medusa-greedy", "medusa-sampling", "peagle-greedy"],
)
def test_round_trips_per_step_do_not_grow_with_tree_or_layers(build_target, kind, temperature):
    counts = {}
    for layers in (2, 6):
        target, heads = _always_accepting(build_target, layers, kind)
        for tree in TREES:
            counts[(layers, tree.total_tokens)], tau = _per_step(target, heads, tree, temperature)
            assert tau >= 0.6 * (tree.depth + 1), f"drafts were rarely accepted (tau {tau:.2f}): vacuous"
    assert len(set(counts.values())) == 1, f"round trips per step vary with the tree or the layers: {counts}"
    assert max(counts.values()) <= BOUND, f"{counts} round trips per step, bound {BOUND}"


def _per_batched_step(model: nn.Module, heads: nn.Module, batch: int, tree, temperature: float) -> float:
    """Round trips per step of `generate` over `batch` left-padded prompts of different lengths (an attention
    mask given, so even B = 1 takes the masked path; rows drafting together), from a run of 8 and one of 24
    new tokens after a warm-up run (a static tree's levels are made once per tree: not per step)."""
    from decode.batch import left_padded

    ids, mask = left_padded([PROMPT[0, : 7 - row % 3] for row in range(batch)], 0)
    kwargs = {"attention_mask": mask, "tree": tree, "temperature": temperature, "seed": 0, "eos_token_id": []}
    generate(model, ids, heads, max_new_tokens=4, **kwargs)
    runs = []
    for new_tokens in (8, 24):
        with RoundTrips() as trips:
            out = generate(model, ids, heads, max_new_tokens=new_tokens, **kwargs)
        assert len(set(out.steps)) == 1  # every row stepped alike: the runs differ by whole steps
        runs.append((trips.count, out.steps[0]))
    (short, short_steps), (long, long_steps) = runs
    assert long_steps > short_steps
    return (long - short) / (long_steps - short_steps)


@pytest.mark.parametrize("temperature", [0.0, 1.0], ids=["greedy", "sampling"])
@pytest.mark.parametrize("kind", ["eagle3", "medusa"])
def test_batched_round_trips_per_step_do_not_grow_with_the_batch_or_the_tree(build_target, kind, temperature):
    """The batched loop reads the device once per step for all rows (every row's path, bonus token and tree),
    moves every row's accepted KV in a few batched ops, and keeps its bookkeeping on the host."""
    target, heads = _always_accepting(build_target, 2, kind)
    trees = TREES if kind == "eagle3" else [None, [(0,), (1,), (0, 0)]]
    counts = {
        (b, i): _per_batched_step(target, heads, b, t, temperature)
        for b in (1, 3, 6)
        for i, t in enumerate(trees)
    }
    assert len(set(counts.values())) == 1, f"round trips per step vary with the batch or the tree: {counts}"
    assert max(counts.values()) <= BOUND, f"{counts} round trips per step, bound {BOUND}"


def test_plain_decoding_round_trips(build_target):
    per_step, _ = _per_step(build_target("llama"), None, None, 0.0)
    assert per_step <= BOUND


@pytest.mark.parametrize("sync", ["item", "int", "bool", "tolist", "nonzero", "upload"])
def test_the_counter_sees_each_kind_of_round_trip(sync):
    """The negative control: each way of reading the device (or writing Python data to it) is counted."""
    x = torch.arange(6.0)
    run = {
        "item": lambda: x[2].item(),
        "int": lambda: int(x.argmax()),
        "bool": lambda: bool((x > 2).any()),
        "tolist": lambda: x.tolist(),
        "nonzero": lambda: (x > 2).nonzero(),
        "upload": lambda: x[[0, 3]],
    }[sync]
    with RoundTrips() as idle:
        x.mul(2).argmax(-1)
    with RoundTrips() as trips:
        run()
    assert idle.count == 0 and trips.count >= 1


@pytest.mark.parametrize("temperature", [0.0, 1.0], ids=["greedy", "sampling"])
def test_a_min_prob_bound_reads_the_device_once_per_draft_level_and_once_for_the_cut(
    build_target, temperature
):
    """The documented price of `DynamicTree.min_prob`: whether to draft the next level and how many nodes
    pass the floor are read back (one round trip per level drafted past the first, one for the cut), alone
    and in a batch; still nothing per node or per target layer."""
    counts = {}
    for layers in (2, 6):
        target, heads = _always_accepting(build_target, layers, "eagle3")
        for depth in (3, 6):
            tree = DynamicTree(depth=depth, top_k=4, total_tokens=4 * depth, min_prob=0.5)
            per_step, tau = _per_step(target, heads, tree, temperature)
            assert tau >= 0.6 * (depth + 1), f"drafts were rarely accepted (tau {tau:.2f}): vacuous"
            counts[(layers, depth)] = per_step - depth  # the first choice passes the floor at every level
    assert set(counts.values()) == {BOUND}, f"round trips per step beyond one per level: {counts}"
    target, heads = _always_accepting(build_target, 2, "eagle3")
    batched = {
        b: _per_batched_step(target, heads, b, DynamicTree(4, 4, 16, min_prob=0.5), temperature)
        for b in (1, 3)
    }
    assert set(batched.values()) == {BOUND + 4}, f"batched: {batched}"


@pytest.mark.parametrize("temperature", [0.0, 1.0], ids=["greedy", "sampling"])
def test_a_best_first_tree_adds_one_read_and_one_upload_per_step(build_target, temperature):
    """DDTree's proposal reads each depth's top log-probabilities once and uploads the rows' node arrays once,
    whatever its budget, the target's depth or the batch; acceptance adds nothing (`accept_chosen` when
    sampling runs on the device as the others do)."""
    counts = {}
    for layers in (2, 6):
        target, heads = _always_accepting(build_target, layers, "medusa")
        for budget in (4, 12):
            counts[(layers, budget, 1)], tau = _per_step(target, heads, BestFirstTree(budget), temperature)
            assert tau >= 3.0, f"drafts were rarely accepted (tau {tau:.2f}): vacuous"
    for batch in (1, 3):
        counts[(2, 8, batch)] = _per_batched_step(target, heads, batch, BestFirstTree(8), temperature)
    assert len(set(counts.values())) == 1, (
        f"round trips per step vary with the budget, layers or batch: {counts}"
    )
    assert max(counts.values()) <= BOUND + 2, f"{counts} round trips per step, bound {BOUND} + 2"
