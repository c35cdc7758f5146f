"""decode/batch.py: B sequences in one target forward per step. Batched verification of B trees equals each
tree verified alone (over two steps, with accepted paths that are not tree prefixes, so the KV moves), and
batched greedy plain decoding equals per-prompt decoding and transformers' own batched generate, with prompts
of different lengths (left padding) and rows that finish early."""

import copy

import pytest
import torch
from transformers import DynamicCache

from decode import generate
from decode.batch import commit, left_padded, prefill, verify_batch
from decode.drafters.eagle import EagleDrafter
from decode.generate import decode_prompts
from decode.tree import DraftTree, DynamicTree
from decode.verify import compact_cache, verify
from heads import EagleConfig, EagleHead

ARCHS = ["llama", "qwen2", "mistral", "gemma", "gemma2", "gemma3_text"]


def _random_tree(generator: torch.Generator, size: int, vocab: int, root: int) -> DraftTree:
    parents = [-1] + [int(torch.randint(0, i, (1,), generator=generator)) for i in range(1, size)]
    ranks, seen = [0], {}
    for parent in parents[1:]:
        ranks.append(seen.get(parent, 0))
        seen[parent] = ranks[-1] + 1
    tokens = torch.randint(0, vocab, (size,), generator=generator)
    tokens[0] = root
    return DraftTree(tokens=tokens, parents=torch.tensor(parents), ranks=torch.tensor(ranks))


def _path(tree: DraftTree, node: int) -> list[int]:
    path = [node]
    while tree.parents[path[-1]] >= 0:
        path.append(int(tree.parents[path[-1]]))
    return path[::-1]


@pytest.mark.parametrize("arch", ARCHS)
def test_batched_verify_equals_each_tree_alone_over_two_steps(build_target, arch):
    model = build_target(arch)
    generator = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 128, (n,), generator=generator) for n in (5, 9, 2)]
    ids, mask = left_padded(prompts, 0)
    state, last, _ = prefill(model, ids, mask)
    alone = []  # per row: (cache, committed length), the single-sequence path of decode/verify.py
    for row, prompt in enumerate(prompts):
        cache = DynamicCache(config=model.config)
        out = model(input_ids=prompt[None], cache=cache, use_cache=True)
        torch.testing.assert_close(last[row], out.logits[0, -1], atol=1e-4, rtol=1e-4)
        alone.append([cache, len(prompt)])
    roots = [int(r) for r in last.argmax(-1)]
    for step in range(2):
        trees = [_random_tree(generator, 6, 128, root) for root in roots]
        logits, _ = verify_batch(
            model,
            state,
            torch.stack([t.tokens for t in trees]),
            torch.stack([t.depths for t in trees]),
            torch.stack([t.ancestors for t in trees]),
        )
        keeps = []
        for row, tree in enumerate(trees):
            cache, past = alone[row]
            expected, _ = verify(model, cache, tree, past)
            torch.testing.assert_close(logits[row], expected, atol=1e-4, rtol=1e-4, msg=f"{arch} row {row}")
            keep = _path(tree, [5, 4, 0][row] if step == 0 else 3)  # deep, other branch, root only
            compact_cache(cache, past, keep)
            alone[row][1] += len(keep)
            keeps.append(keep)
        commit(state, keeps, 6)
        assert state.lengths.tolist() == [past for _, past in alone]
        assert (
            state.columns == int(state.ends.max()) and state.valid.sum(-1).tolist() == state.lengths.tolist()
        )
        roots = [int(trees[row].tokens[keeps[row][-1]]) for row in range(3)]  # any token serves as next root


@pytest.mark.parametrize("arch", ARCHS)
def test_prefill_row_by_row_lays_out_the_batched_pass(build_target, arch, monkeypatch):
    """Prompts of very different lengths are prefilled one row at a time (no padding computed); the cache,
    the last logits and the features equal the batched pass's, column for column."""
    from decode import batch as batch_module
    from heads.features import FeatureCapture

    model = build_target(arch)
    generator = torch.Generator().manual_seed(8)
    ids, mask = left_padded([torch.randint(1, 128, (n,), generator=generator) for n in (3, 30, 7)], 0)
    layers = (0, 1)
    results, calls, real = {}, [], batch_module._prefill_rows
    monkeypatch.setattr(batch_module, "_prefill_rows", lambda *a: calls.append(1) or real(*a))
    for name, threshold in (("rows", 1.5), ("batched", 1e9)):
        monkeypatch.setattr(batch_module, "PER_ROW_PREFILL", threshold)
        with FeatureCapture(model, layers) as capture:
            results[name] = prefill(model, ids, mask, capture)
    assert calls == [1]  # 3 rows x 30 columns > 1.5 x 40 tokens: row by row; then the batched pass
    (rows, last, feats), (batched, last_b, feats_b) = results["rows"], results["batched"]
    torch.testing.assert_close(last, last_b, atol=1e-4, rtol=1e-4)
    valid = mask.bool()
    torch.testing.assert_close(feats[valid], feats_b[valid], atol=1e-4, rtol=1e-4)
    assert torch.equal(rows.valid, batched.valid) and torch.equal(rows.lengths, batched.lengths)
    for a, b in zip(rows.cache.layers, batched.cache.layers):
        assert a.keys.shape == b.keys.shape
        for r in range(3):
            torch.testing.assert_close(
                a.keys[r][..., valid[r], :], b.keys[r][..., valid[r], :], atol=1e-4, rtol=1e-4
            )
            torch.testing.assert_close(
                a.values[r][..., valid[r], :], b.values[r][..., valid[r], :], atol=1e-4, rtol=1e-4
            )


@pytest.mark.parametrize("arch", ["llama", "gemma2"])
def test_batched_plain_decoding_equals_each_prompt_alone_and_transformers(build_target, arch):
    model = build_target(arch)
    generator = torch.Generator().manual_seed(1)
    prompts = [torch.randint(1, 128, (n,), generator=generator) for n in (7, 3, 11, 5)]
    ids, mask = left_padded(prompts, 0)
    batched = generate(model, ids, None, attention_mask=mask, max_new_tokens=12, eos_token_id=[])
    assert batched.new_tokens == [12] * 4 and batched.target_forwards == 12 and batched.tau == [1.0] * 4
    for row, prompt in enumerate(prompts):
        alone = generate(model, prompt, None, max_new_tokens=12, eos_token_id=[]).one
        assert batched.replies[row] == alone.sequences[0, len(prompt) :].tolist(), f"row {row}"
    reference = model.generate(
        ids, attention_mask=mask, max_new_tokens=12, do_sample=False, pad_token_id=0, eos_token_id=None
    )
    assert torch.equal(reference, batched.sequences)


def _oracles(model, rank_oracle, prompts, new_tokens, seed=0):
    """One RankOracle per row, knowing its prompt's plain greedy continuation."""
    oracles = []
    for row, prompt in enumerate(prompts):
        plain = generate(model, prompt, None, max_new_tokens=new_tokens + 8, eos_token_id=[]).one
        oracles.append(rank_oracle(plain.sequences[0].tolist(), 128, [0.6, 0.2], seed=seed + row))
        oracles[-1].max_depth = None
    return oracles


@pytest.mark.parametrize("arch", ARCHS[:4])
def test_batched_speculation_is_lossless_per_row_at_temperature_0(build_target, rank_oracle, arch):
    """Each row drafts its own tree (a drafter that knows that row's continuation, ranked imperfectly), one
    forward verifies all rows, rows accept different path lengths: every row equals its prompt decoded alone,
    and the drafts were right often enough for the check to mean something."""
    model = build_target(arch)
    generator = torch.Generator().manual_seed(3)
    prompts = [torch.randint(1, 128, (n,), generator=generator) for n in (6, 2, 9)]
    ids, mask = left_padded(prompts, 0)
    out = generate(
        model,
        ids,
        _oracles(model, rank_oracle, prompts, 20),
        attention_mask=mask,
        max_new_tokens=20,
        eos_token_id=[],
        tree=DynamicTree(depth=3, top_k=2, total_tokens=6),
    )
    for row, prompt in enumerate(prompts):
        alone = generate(model, prompt, None, max_new_tokens=20, eos_token_id=[]).one
        assert out.replies[row] == alone.sequences[0, len(prompt) :].tolist(), f"{arch} row {row}"
    assert all(t > 1.2 for t in out.tau) and out.target_forwards < 20
    assert len({tuple(d) for d in out.accepted_per_depth}) > 1  # the rows accepted differently


def test_batched_speculation_with_a_real_head_equals_plain_and_batch_one(build_target):
    """An EAGLE-3 head shared by the rows (one batch drafter): B = 3 equals each prompt alone with the head
    (same tau per row: the same trees are drafted) and without it."""
    from heads import EagleConfig, EagleHead

    model = build_target("llama")
    torch.manual_seed(0)
    head = EagleHead(EagleConfig.from_target(model.config, "eagle3")).eval()
    generator = torch.Generator().manual_seed(4)
    prompts = [torch.randint(1, 128, (n,), generator=generator) for n in (5, 8, 3)]
    ids, mask = left_padded(prompts, 0)
    out = generate(model, ids, head, attention_mask=mask, max_new_tokens=10, eos_token_id=[])
    for row, prompt in enumerate(prompts):
        alone = generate(model, prompt, head, max_new_tokens=10, eos_token_id=[]).one
        assert out.replies[row] == alone.sequences[0, len(prompt) :].tolist()
        assert out.tau[row] == pytest.approx(alone.tau) and out.steps[row] == alone.steps
        assert out.accepted_ranks[row] == alone.accepted_ranks
        assert out.offered_ranks[row] == alone.offered_ranks and sum(alone.offered_ranks[0]) > 0


def test_rows_that_stop_leave_the_batch(build_target):
    model = build_target("llama")
    generator = torch.Generator().manual_seed(2)
    prompts = [torch.randint(1, 128, (n,), generator=generator) for n in (4, 6, 8)]
    ids, mask = left_padded(prompts, 0)
    free = generate(model, ids, None, attention_mask=mask, max_new_tokens=10, eos_token_id=[]).replies
    stop = free[1][3]  # row 1's fourth token ends its reply (and any other row's that meets it)
    stopped = generate(model, ids, None, attention_mask=mask, max_new_tokens=10, eos_token_id=stop)
    for row in range(3):
        expected = free[row][: free[row].index(stop) + 1] if stop in free[row] else free[row]
        assert stopped.replies[row] == expected
    assert stopped.new_tokens[1] <= 4 and stopped.steps[1] == stopped.new_tokens[1] - 1


@pytest.mark.parametrize("arch", [a for a in ARCHS if a != "gemma"])  # tiny gemma repeats one token forever
def test_a_row_that_stops_early_leaves_no_trace_in_the_rows_that_go_on(build_target, rank_oracle, arch):
    """Rows that accept at different rates and stop at different steps: row 0 drafts nothing right and stops
    at its third token, the last row accepts every draft and so holds the most cache columns. Every row must
    equal its prompt decoded alone. Would fail if a finished row's state were kept anywhere (its committed
    end, say: the rows after it would inherit the wrong ends and lose cache columns, or index past them)."""
    model, new = build_target(arch), 40
    generator = torch.Generator().manual_seed(5)
    prompts = [torch.randint(1, 128, (n,), generator=generator) for n in (5, 3, 7, 4)]
    free = [
        generate(model, p, None, max_new_tokens=new, eos_token_id=[]).one.sequences[0, len(p) :].tolist()
        for p in prompts
    ]
    # row 0's stop: a token of its reply, first seen at its 3rd token or later and not early in the last row's
    at = next(j for j in range(2, new) if free[0][j] not in free[0][:j] + free[3][:20])
    stops = [free[0][at]]
    drafters = [
        rank_oracle(p.tolist() + f, 128, ranks, seed=i)
        for i, (p, f, ranks) in enumerate(zip(prompts, free, [[0.0], [0.5], [0.3], [1.0]]))
    ]
    ids, mask = left_padded(prompts, 0)
    tree = DynamicTree(depth=4, top_k=2, total_tokens=8)
    out = generate(
        model, ids, drafters, attention_mask=mask, max_new_tokens=new, eos_token_id=stops, tree=tree
    )
    for row, prompt in enumerate(prompts):
        alone = generate(model, prompt, None, max_new_tokens=new, eos_token_id=stops).one
        assert out.replies[row] == alone.sequences[0, len(prompt) :].tolist(), f"{arch} row {row}"
    assert 1 <= out.steps[0] < out.steps[3] and out.tau[3] > 4 > out.tau[0]  # the case the test is about


def test_bad_batches_are_refused(build_target):
    model = build_target("llama")
    ids, mask = left_padded([torch.tensor([1, 2, 3]), torch.tensor([4])], 0)
    with pytest.raises(ValueError, match="left-padded"):
        prefill(model, ids, mask.flip(-1))
    with pytest.raises(ValueError, match="one \\(B, T\\) shape"):
        prefill(model, ids, mask[:, 1:])
    with pytest.raises(ValueError, match="max_new_tokens must be >= 1"):
        generate(model, ids, attention_mask=mask, max_new_tokens=0)
    state, _, _ = prefill(model, ids, mask)
    with pytest.raises(ValueError, match="the cache holds 3 columns, expected 3 \\+ a tree of 1"):
        commit(state, [[0], [0]], 1)  # no verify_batch ran: there is no tree to commit
    with pytest.raises(ValueError, match="keep has 1 rows, the batch 2"):
        commit(state, [[0]], 0)
    with pytest.raises(ValueError, match="2 drafters for a batch of 3"):
        generate(model, torch.ones(3, 2, dtype=torch.long), [None, None], max_new_tokens=2)


def test_typical_acceptance_decodes_a_batch(build_target):
    """Typical acceptance (lossy, sampling only), once refused for more than one sequence, decodes a batch:
    every row accepts by its own rule in the one loop."""
    model = build_target("llama")
    ids, mask = left_padded([torch.tensor([1, 2, 3]), torch.tensor([4])], 0)
    head = EagleHead(EagleConfig.from_target(model.config, "eagle3")).eval()
    kwargs = {"max_new_tokens": 5, "eos_token_id": [], "temperature": 1.0, "seed": 0, "acceptance": "typical"}
    for heads in (None, head):
        out = generate(model, ids, heads, attention_mask=mask, **kwargs)
        assert out.new_tokens == [5, 5] and all(len(reply) == 5 for reply in out.replies)


def test_one_drafter_instance_drafts_for_the_whole_batch(build_target):
    """A `Drafter` instance (once refused for B > 1: a drafter held one sequence) is the batch's drafter: an
    EAGLE-3 drafter made for two rows decodes them as the head module itself does, and as each prompt
    alone."""
    model = build_target("llama")
    torch.manual_seed(0)
    head = EagleHead(EagleConfig.from_target(model.config, "eagle3")).eval()
    prompts = [torch.tensor([1, 2, 3]), torch.tensor([4])]
    ids, mask = left_padded(prompts, 0)
    kwargs = {"attention_mask": mask, "max_new_tokens": 6, "eos_token_id": []}
    shared = generate(model, ids, EagleDrafter(head, model, 2), **kwargs)
    own = generate(model, ids, head, **kwargs)
    assert shared.replies == own.replies and shared.steps == own.steps
    for row, prompt in enumerate(prompts):
        alone = generate(model, prompt, None, max_new_tokens=6, eos_token_id=[]).one
        assert shared.replies[row] == alone.sequences[0, len(prompt) :].tolist()


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_decode_prompts_in_batches_equals_one_prompt_at_a_time(build_target, temperature):
    """`decode_prompts`: 5 prompts in batches of 2 (2 + 2 + 1) give each prompt's reply, steps and tau as one
    `generate` per prompt, with an EAGLE-3 head and without (greedy); sampling stays a distribution per row,
    so there only the shapes and the per-row bookkeeping are compared (replies of the right lengths)."""
    model = build_target("qwen2")
    torch.manual_seed(1)
    head = EagleHead(EagleConfig.from_target(model.config, "eagle3")).eval()
    generator = torch.Generator().manual_seed(5)
    prompts = [torch.randint(1, 128, (n,), generator=generator) for n in (4, 7, 2, 9, 5)]
    for heads in (head, None):
        kwargs = {"max_new_tokens": 8, "eos_token_id": [], "temperature": temperature, "seed": 0}
        one = decode_prompts(model, prompts, heads, batch_size=1, **kwargs)
        two = decode_prompts(model, prompts, heads, batch_size=2, **kwargs)
        assert len(one) == len(two) == 5
        assert all(len(r.reply) == 8 and r.steps >= 1 for r in one + two)
        if temperature == 0:
            assert [(r.reply, r.steps) for r in two] == [(r.reply, r.steps) for r in one]
            assert [r.tau for r in two] == pytest.approx([r.tau for r in one])
            alone = generate(model, prompts[3], heads, max_new_tokens=8, eos_token_id=[]).one
            assert one[3].reply == alone.sequences[0, 9:].tolist()
    with pytest.raises(ValueError, match="batch_size must be >= 1, got 0"):
        decode_prompts(model, prompts, None, max_new_tokens=2, batch_size=0)


def test_a_per_step_policy_switches_trees_and_plain_steps_and_stays_lossless(build_target, rank_oracle):
    """A policy drafting while more than two rows decode and decoding plainly after: the rows still equal
    each prompt alone, the drafters (which check every token they are fed) stay in step through plain steps,
    and the policy was asked with the shrinking batch."""
    model = build_target("llama")
    generator = torch.Generator().manual_seed(5)
    prompts = [torch.randint(1, 128, (n,), generator=generator) for n in (4, 7, 2, 5)]
    ids, mask = left_padded(prompts, 0)
    oracles = _oracles(model, rank_oracle, prompts, 16)
    stop = [15]  # ends rows 2, 0 and 1 after 2, 7 and 9 tokens (this seed); row 3 decodes all 16
    asked = []

    def policy(rows):
        asked.append(rows)
        return DynamicTree(depth=3, top_k=2, total_tokens=6) if rows > 2 else None

    out = generate(
        model, ids, oracles, attention_mask=mask, max_new_tokens=16, eos_token_id=stop, tree=policy
    )
    for row, prompt in enumerate(prompts):
        alone = generate(model, prompt, None, max_new_tokens=16, eos_token_id=stop).one
        assert out.replies[row] == alone.sequences[0, len(prompt) :].tolist(), f"row {row}"
    assert asked == sorted(asked, reverse=True) and asked[-1] <= 2 < asked[0]  # drafted, then plain steps
    one = generate(model, prompts[3], oracles[3], max_new_tokens=16, eos_token_id=stop, tree=policy)
    assert one.replies == [out.replies[3]]  # one prompt with a policy: the batched loop, B = 1


def test_batch_verify_costs_are_measured_per_batch_size_and_leave_no_trace(build_target):
    from decode.calibrate import measure_batch_verify_cost

    model = copy.deepcopy(build_target("llama"))
    seen = []  # (rows, tokens, columns cached before the forward) of every forward
    original = model.forward

    def spy(*args, **kwargs):
        cache = kwargs.get("cache")
        columns = cache.get_seq_length() if cache is not None else 0
        seen.append((*kwargs["input_ids"].shape, columns))
        return original(*args, **kwargs)

    model.forward = spy
    costs = measure_batch_verify_cost(model, torch.randint(0, 128, (1, 6)), [1, 3], [1, 4], repeats=2)
    assert sorted(costs) == [1, 3] and all(sorted(c) == [1, 4] for c in costs.values())
    assert all(c[1] > 0 for c in costs.values())
    # per batch size: its prefill, then every timed verify (a warm-up and a timed pass per size and round)
    # above the same 6 cached columns: each verify's tokens are dropped before the next
    rounds = [(n, 6) for _ in range(2) for n in (1, 1, 4, 4)]
    assert seen == [(1, 6, 0)] + [(1, *r) for r in rounds] + [(3, 6, 0)] + [(3, *r) for r in rounds]


def test_an_adaptive_policy_sees_every_rows_acceptance_and_turns_speculation_off(build_target):
    """A random EAGLE-3 head (it drafts almost nothing the target takes) under an `AdaptivePolicy` calibrated
    as if it drafted well: the policy starts with a tree, is told each step's counts (summed, they are the
    rows' own) and time, switches to plain steps, probes, and the replies stay plain decoding's."""
    from decode.sizing import AdaptivePolicy

    model = build_target("mistral")
    torch.manual_seed(3)
    head = EagleHead(EagleConfig.from_target(model.config, "eagle3")).eval()
    generator = torch.Generator().manual_seed(6)
    prompts = [torch.randint(1, 128, (n,), generator=generator) for n in (5, 3, 8)]
    ids, mask = left_padded(prompts, 0)
    flat = {n: 0.01 for n in (1, 2, 4, 8)}
    policy = AdaptivePolicy(
        [[0.9, 0.5], [0.9, 0.5], [0.9]],
        {1: flat},
        lambda b, n, d, k: 0.002 * d,
        dynamic=True,
        budgets=range(1, 8),
        depths=[1, 2, 3],
        top_ks=[1, 2],
        prior_weight=1.0,
        decay=1.0,
        refit_every=1,
        probe_every=4,
        time_prior=None,  # decide on the calibrated costs alone: the steps' times would make it machine-bound
    )
    seen, timed = [], []
    observe, record_time = policy.observe, policy.record_time
    policy.observe = lambda accepted, offered: (seen.append((accepted, offered)), observe(accepted, offered))
    policy.record_time = lambda seconds: (timed.append(seconds), record_time(seconds))
    out = generate(model, ids, head, attention_mask=mask, max_new_tokens=24, eos_token_id=[], tree=policy)
    plain = generate(model, ids, None, attention_mask=mask, max_new_tokens=24, eos_token_id=[])
    assert out.replies == plain.replies
    assert policy.chosen[None] >= 8 and sum(t is not None for t in policy.chosen.elements()) >= 3
    assert len(seen) == sum(t is not None for t in policy.chosen.elements())  # one call per drafted step
    assert len(timed) == sum(policy.chosen.values()) == out.target_forwards - 1  # one per step, plain too
    assert all(seconds > 0 for seconds in timed)
    assert _pooled([o for _, o in seen]) == _pooled(out.offered_ranks) and _pooled(out.offered_ranks)
    assert _pooled([a for a, _ in seen]) == _pooled(out.accepted_ranks)


def test_a_policy_is_told_each_steps_time_without_the_drafters_one_off_catch_up(build_target, monkeypatch):
    """A drafter whose every `advance` takes 1,000 s more on the loop's clock (a fake clock that only such a
    call moves, so the machine's load cannot blur the check): the step times a policy is told include it
    where the drafters lagged one step (the last step drafted), and leave it out where they caught up on the
    prompt or on plain steps."""
    import importlib
    import types

    from decode.policy import TreePolicy

    generate_module = importlib.import_module("decode.generate")  # `decode.generate` is the function
    model = build_target("qwen2")
    torch.manual_seed(4)
    head = EagleHead(EagleConfig.from_target(model.config, "eagle3")).eval()
    made, clock = generate_module.make_drafter, [0.0]
    monkeypatch.setattr(generate_module, "time", types.SimpleNamespace(perf_counter=lambda: clock[0]))

    def slow_drafter(source, target, batch):
        drafter = made(source, target, batch)
        advance = drafter.advance

        def slow_advance(*a, **k):
            clock[0] += 1000.0
            return advance(*a, **k)

        drafter.advance = slow_advance
        return drafter

    monkeypatch.setattr(generate_module, "make_drafter", slow_drafter)
    tree = DynamicTree(2, 2, 3)

    class Pattern(TreePolicy):  # drafts, drafts, plain, drafts, drafts, plain, ...
        def __init__(self):
            self.handed, self.times = [], []

        def tree(self, rows):
            self.handed.append(tree if len(self.handed) % 3 != 2 else None)
            return self.handed[-1]

        def record_time(self, seconds):
            self.times.append(seconds)

    policy = Pattern()
    ids, mask = left_padded([torch.tensor([5, 9, 2, 7]), torch.tensor([3, 8])], 0)
    out = generate(model, ids, head, attention_mask=mask, max_new_tokens=9, eos_token_id=[], tree=policy)
    plain = generate(model, ids, None, attention_mask=mask, max_new_tokens=9, eos_token_id=[])
    assert out.replies == plain.replies and len(policy.times) == len(policy.handed) >= 5
    for step, (handed, seconds) in enumerate(zip(policy.handed, policy.times)):
        lagging = handed is not None and step % 3 == 1  # the step before drafted: one step to catch up
        assert seconds == (1000.0 if lagging else 0.0), (step, handed, seconds)


def _pooled(tables: list[list[list[int]]]) -> dict[tuple[int, int], int]:
    """Counts per (depth, rank) summed over tables (zeros left out)."""
    total: dict[tuple[int, int], int] = {}
    for table in tables:
        for d, row in enumerate(table):
            for r, count in enumerate(row):
                if count:
                    total[d, r] = total.get((d, r), 0) + count
    return total
