"""train/regen.py (self-distillation) on a tiny random Llama with the SmolLM2 tokenizer: reading the prompts,
shards, greedy output, resume after a finished run, after a killed run, and past a half-written shard, and
scripts/regenerate.py over it."""

from __future__ import annotations

import copy
import json

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from targets import materialize_default_target
from train import regen
from train.data import BadRow, read_rows, trim_loop
from train.regen import batched_generate, read_prompts, regenerate

NONE_TRIMMED = {"partial_characters": 0}
PROMPTS = [
    {"id": f"p{i}", "source": "test", "messages": [{"role": "user", "content": text}]}
    for i, text in enumerate(
        ["Hi!", "What is 2 + 2?", "Name a colour.", "Tell me a long story about a cat.", "Bye"]
    )
]


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(materialize_default_target())


@pytest.fixture(scope="module")
def model(tokenizer):
    config = AutoConfig.for_model(
        "llama",
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        vocab_size=len(tokenizer),
    )
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="eager").eval()
    model.generation_config.eos_token_id = None  # regenerate falls back to the tokenizer's EOS
    return model


def _shards(folder) -> dict[str, list[dict]]:
    return {p.name: [row for _, row in read_rows(p)] for p in sorted(folder.glob("shard-*.jsonl"))}


def test_writes_shards_of_prompt_plus_greedy_reply(tmp_path, model, tokenizer):
    stats = regenerate(model, tokenizer, PROMPTS, tmp_path, batch_size=2, max_new_tokens=5, shard_size=2)
    assert stats == {"skipped": 0, "generated": 5, "shards": 3, "too_long": 0, "loops_cut": 0, **NONE_TRIMMED}
    shards = _shards(tmp_path)
    assert list(shards) == ["shard-00000.jsonl", "shard-00001.jsonl", "shard-00002.jsonl"]
    rows = {row["id"]: row for rows in shards.values() for row in rows}
    assert sorted(rows) == [p["id"] for p in PROMPTS]
    assert not list(tmp_path.glob(".*"))  # no temp files left
    assert tokenizer.padding_side == "right"  # restored
    for prompt in PROMPTS:
        row = rows[prompt["id"]]
        assert row["source"] == "test" and row["finish_reason"] in ("stop", "length")
        assert row["messages"][:-1] == prompt["messages"] and row["messages"][-1]["role"] == "assistant"
    # Batched replies (p2 left-padded next to the longer p3) equal unpadded greedy runs of the same prompts.
    for prompt in PROMPTS[2:4]:
        text = tokenizer.apply_chat_template(prompt["messages"], add_generation_prompt=True, tokenize=False)
        ids = tokenizer(text, add_special_tokens=False, return_tensors="pt")["input_ids"]
        # An explicit mask: SmolLM2's pad token is <|im_end|>, which prompts contain; generate would hide it.
        alone = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=5, do_sample=False)
        new_tokens = alone[0, ids.shape[1] :].tolist()
        if tokenizer.eos_token_id in new_tokens:
            new_tokens = new_tokens[: new_tokens.index(tokenizer.eos_token_id)]
        reply = rows[prompt["id"]]["messages"][-1]["content"]
        assert reply == tokenizer.decode(new_tokens, skip_special_tokens=True)


def test_second_run_skips_finished_ids_and_adds_new_ones(tmp_path, model, tokenizer):
    regenerate(model, tokenizer, PROMPTS[:3], tmp_path, batch_size=2, max_new_tokens=3, shard_size=2)
    before = _shards(tmp_path)
    again = regenerate(model, tokenizer, PROMPTS[:3], tmp_path, batch_size=2, max_new_tokens=3, shard_size=2)
    assert (
        again == {"skipped": 3, "generated": 0, "shards": 0, "too_long": 0, "loops_cut": 0, **NONE_TRIMMED}
        and _shards(tmp_path) == before
    )
    more = regenerate(model, tokenizer, PROMPTS, tmp_path, batch_size=2, max_new_tokens=3, shard_size=2)
    assert more == {"skipped": 3, "generated": 2, "shards": 1, "too_long": 0, "loops_cut": 0, **NONE_TRIMMED}
    after = _shards(tmp_path)
    assert {k: v for k, v in after.items() if k in before} == before
    assert [row["id"] for row in after["shard-00002.jsonl"]] == ["p3", "p4"]


def test_drop_stale_answers_again_the_prompts_that_changed(tmp_path, model, tokenizer):
    regenerate(model, tokenizer, PROMPTS, tmp_path, batch_size=2, max_new_tokens=3, shard_size=2)
    before = _shards(tmp_path)
    changed = [dict(p) for p in PROMPTS]
    changed[1] = {**changed[1], "messages": [{"role": "user", "content": "What is 3 + 3?"}]}
    stats = regenerate(model, tokenizer, changed, tmp_path, batch_size=2, max_new_tokens=3, shard_size=2)
    assert stats["generated"] == 0  # without drop_stale a finished id is never looked at again
    stats = regenerate(
        model, tokenizer, changed[:4], tmp_path, batch_size=2, max_new_tokens=3, shard_size=2, drop_stale=True
    )
    assert stats == {"skipped": 3, "generated": 1, "shards": 1, "too_long": 0, "loops_cut": 0, **NONE_TRIMMED}
    after = _shards(tmp_path)
    assert [r["id"] for r in after["shard-00000.jsonl"]] == ["p0"]  # p1 left its shard
    assert after["shard-00001.jsonl"] == before["shard-00001.jsonl"]
    assert [r["id"] for r in after["shard-00002.jsonl"]] == ["p4"]  # not among the rows given: kept
    (answer,) = after["shard-00003.jsonl"]
    assert answer["id"] == "p1" and answer["messages"][:-1] == changed[1]["messages"]


def test_killed_run_resumes(tmp_path, model, tokenizer, monkeypatch):
    calls = {"n": 0}
    generate = regen.batched_generate

    def dies_on_second_call(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 2:
            raise KeyboardInterrupt("killed")
        return generate(*args, **kwargs)

    monkeypatch.setattr(regen, "batched_generate", dies_on_second_call)
    with pytest.raises(KeyboardInterrupt):
        regenerate(model, tokenizer, PROMPTS, tmp_path, batch_size=2, max_new_tokens=3, shard_size=2)
    assert list(_shards(tmp_path)) == ["shard-00000.jsonl"]  # the shard in progress was never written
    monkeypatch.undo()
    resumed = regenerate(model, tokenizer, PROMPTS, tmp_path, batch_size=2, max_new_tokens=3, shard_size=2)
    assert resumed == {
        "skipped": 2,
        "generated": 3,
        "shards": 2,
        "too_long": 0,
        "loops_cut": 0,
        **NONE_TRIMMED,
    }
    ids = [row["id"] for rows in _shards(tmp_path).values() for row in rows]
    assert sorted(ids) == sorted(p["id"] for p in PROMPTS)  # each exactly once
    assert tokenizer.padding_side == "right"  # restored after the crash too


def test_half_written_shard_is_ignored(tmp_path, model, tokenizer):
    (tmp_path / ".shard-00000.jsonl.tmp").write_text(json.dumps({"id": "p0"}) + "\n")  # a write cut short
    stats = regenerate(model, tokenizer, PROMPTS[:1], tmp_path, batch_size=2, max_new_tokens=2)
    assert stats["generated"] == 1 and list(_shards(tmp_path)) == ["shard-00000.jsonl"]


def test_prompt_rows_are_checked_and_trailing_replies_dropped(tmp_path, model, tokenizer):
    with pytest.raises(BadRow, match="without 'id'"):
        regenerate(model, tokenizer, [{"messages": PROMPTS[0]["messages"]}], tmp_path)
    with pytest.raises(BadRow, match="no user turn"):
        regenerate(
            model, tokenizer, [{"id": "s", "messages": [{"role": "system", "content": "x"}]}], tmp_path
        )
    old = {
        "id": "old",
        "conversations": [{"from": "human", "value": "Hi"}, {"from": "gpt", "value": "stale"}],
    }
    regenerate(model, tokenizer, [old], tmp_path, max_new_tokens=2)
    ((row,),) = _shards(tmp_path).values()
    assert row["messages"][0] == {"role": "user", "content": "Hi"} and len(row["messages"]) == 2
    assert row["messages"][1]["content"] != "stale" and row["source"] is None


def test_batched_generate_drops_finished_rows_and_matches_row_by_row(model, tokenizer):
    """Rows that stop early leave the batch; every row equals its own unpadded greedy decode, and a stop id
    that fires mid-batch ends exactly that row."""
    texts = [
        tokenizer.apply_chat_template(p["messages"], add_generation_prompt=True, tokenize=False)
        for p in PROMPTS
    ]
    singles = []
    for text in texts:
        ids = tokenizer(text, add_special_tokens=False, return_tensors="pt")["input_ids"]
        singles.append(
            model.generate(ids, max_new_tokens=8, do_sample=False, eos_token_id=None)[0, ids.shape[1] :]
        )
    stop = int(singles[1][3])  # row 1 stops at its 4th token; other rows stop wherever that token appears
    tokenizer.padding_side = "left"
    try:
        batch = tokenizer(texts, add_special_tokens=False, padding=True, return_tensors="pt")
    finally:
        tokenizer.padding_side = "right"
    outputs = batched_generate(model, batch["input_ids"], batch["attention_mask"], 8, {stop})
    for single, (reply, reason) in zip(singles, outputs):
        single = single.tolist()
        expected = single[: single.index(stop)] if stop in single else single
        assert reply == expected and reason == ("stop" if stop in single else "length")
    assert outputs[1] == (singles[1][:3].tolist(), "stop")
    seeded = [
        batched_generate(
            model,
            batch["input_ids"],
            batch["attention_mask"],
            6,
            set(),
            temperature=1.0,
            generator=torch.Generator().manual_seed(3),
        )
        for _ in range(2)
    ]
    assert seeded[0] == seeded[1] and all(len(reply) == 6 and why == "length" for reply, why in seeded[0])
    with pytest.raises(ValueError, match="max_new_tokens"):
        batched_generate(model, batch["input_ids"], batch["attention_mask"], 0, {stop})


def test_script_answers_the_prompts_between_start_and_limit(tmp_path, tiny_target_dir, monkeypatch):
    """scripts/regenerate.py --start S --limit L answers prompts S..L-1 of the file (ids name their lines)."""
    import runpy
    import sys
    from pathlib import Path

    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({k: v for k, v in p.items() if k != "id"}) + "\n" for p in PROMPTS))
    script = str(Path(__file__).resolve().parents[2] / "scripts" / "regenerate.py")
    common = [
        "--prompts",
        str(prompts),
        "--model",
        str(tiny_target_dir),
        "--max-new-tokens",
        "3",
        "--device",
        "cpu",
    ]
    monkeypatch.setattr(
        sys, "argv", [script, *common, "--out", str(tmp_path / "out"), "--start", "1", "--limit", "3"]
    )
    runpy.run_path(script, run_name="__main__")
    ids = sorted(row["id"] for rows in _shards(tmp_path / "out").values() for row in rows)
    assert ids == ["prompts.jsonl:2", "prompts.jsonl:3"]  # lines are numbered from 1
    monkeypatch.setattr(sys, "argv", [script, *common, "--out", str(tmp_path / "none"), "--start", "5"])
    with pytest.raises(SystemExit, match=r"no prompts in \[5, None\) of 5 rows"):
        runpy.run_path(script, run_name="__main__")


def test_prompts_over_max_prompt_tokens_are_left_out_and_counted(tmp_path, model, tokenizer):
    long = {"id": "long", "source": "test", "messages": [{"role": "user", "content": "word " * 300}]}
    stats = regenerate(
        model, tokenizer, [*PROMPTS[:2], long], tmp_path, max_new_tokens=2, max_prompt_tokens=100
    )
    assert stats["too_long"] == 1 and stats["generated"] == 2
    assert sorted(row["id"] for rows in _shards(tmp_path).values() for row in rows) == ["p0", "p1"]


def test_read_prompts_names_rows_by_line_and_refuses_a_bad_line_or_an_empty_range(tmp_path):
    path = tmp_path / "prompts.jsonl"
    path.write_text("".join(json.dumps({"messages": p["messages"]}) + "\n" for p in PROMPTS))
    rows = read_prompts(path, start=1, limit=3)
    assert [row["id"] for row in rows] == ["prompts.jsonl:2", "prompts.jsonl:3"]  # lines count from 1
    path.write_text("".join(json.dumps(p) + "\n" for p in PROMPTS))
    assert [row["id"] for row in read_prompts(path, limit=2)] == ["p0", "p1"]  # a row's own id wins
    path.write_text("".join(json.dumps({"messages": p["messages"]}) + "\n" for p in PROMPTS))
    assert rows[0]["messages"] == PROMPTS[1]["messages"]
    assert len(read_prompts(path)) == len(PROMPTS)
    with pytest.raises(ValueError, match=r"prompts.jsonl: no prompts in \[5, None\) of 5 rows"):
        read_prompts(path, start=5)
    path.write_text(path.read_text() + "{not json\n")
    with pytest.raises(BadRow, match=r"prompts.jsonl:6: "):
        read_prompts(path)


def test_stop_loops_ends_looping_replies_and_cuts_finished_ones_where_it_would_have(
    tmp_path, model, tokenizer
):
    """With stop_loops=K a reply ends at the first multiple of LOOP_CHECK_EVERY tokens at which it holds K
    repeated word runs, marked "loop": a prefix of the whole reply that trimming below K cuts where it cuts
    the whole one. Chats answered before are cut the same way on the next run (the random target loops on
    some prompts within 96 tokens)."""
    whole, stopped = tmp_path / "whole", tmp_path / "stopped"
    regenerate(model, tokenizer, PROMPTS, whole, batch_size=5, max_new_tokens=96)
    stats = regenerate(model, tokenizer, PROMPTS, stopped, batch_size=5, max_new_tokens=96, stop_loops=2)
    full = {row["id"]: row for rows in _shards(whole).values() for row in rows}
    cut = {row["id"]: row for rows in _shards(stopped).values() for row in rows}
    loops = sorted(i for i, row in cut.items() if row["finish_reason"] == "loop")
    assert stats["loops_cut"] == 0 and loops and len(loops) < len(PROMPTS)  # some loop, some do not
    for i, row in full.items():
        text, short = row["messages"][-1]["content"], cut[i]["messages"][-1]["content"]
        if i not in loops:
            assert cut[i] == row and trim_loop(text, 2) is None
            continue
        length = len(tokenizer(short, add_special_tokens=False)["input_ids"])
        assert text.startswith(short) and len(short) < len(text) and length % regen.LOOP_CHECK_EVERY == 0
        assert trim_loop(short, 2) is not None and trim_loop(short, 1) == trim_loop(text, 1)
        earlier = tokenizer.decode(tokenizer(short, add_special_tokens=False)["input_ids"][:-16])
        assert trim_loop(earlier, 2) is None  # not one check later than needed
    again = regenerate(model, tokenizer, PROMPTS, whole, batch_size=5, max_new_tokens=96, stop_loops=2)
    assert again["generated"] == 0 and again["loops_cut"] == len(loops)
    assert {row["id"]: row for rows in _shards(whole).values() for row in rows} == cut
    assert regenerate(model, tokenizer, PROMPTS, whole, max_new_tokens=96, stop_loops=2)["loops_cut"] == 0


def test_a_cut_reply_ends_on_a_whole_character(tmp_path, model, tokenizer, monkeypatch):
    """A cap (or a loop) that falls inside a character left its bytes as U+FFFD in the text, which training
    tokenizes again into tokens the target never produced: the partial tokens are dropped, in new replies
    and in chats answered before; a reply that ended itself is kept as the target wrote it."""
    ids = tokenizer("Great job 🌟🌟", add_special_tokens=False)["input_ids"]
    partial = ids[:-1]  # the last star's last byte cut off
    assert tokenizer.decode(partial, **regen.DECODING).endswith("\ufffd")
    assert regen.whole_characters(partial, tokenizer) == ids[: len(ids) - 3]  # the star's first two tokens go
    assert regen.whole_characters(ids, tokenizer) == ids

    def cut_inside(model, input_ids, *args, **kwargs):
        return [(partial, "length"), (partial, "stop")][: input_ids.shape[0]]

    monkeypatch.setattr(regen, "batched_generate", cut_inside)
    regenerate(model, tokenizer, PROMPTS[:2], tmp_path / "new", batch_size=2, max_new_tokens=9)
    rows = {row["finish_reason"]: row for rows in _shards(tmp_path / "new").values() for row in rows}
    assert rows["length"]["messages"][-1]["content"] == "Great job 🌟"
    assert rows["stop"]["messages"][-1]["content"].endswith("\ufffd")  # as generated: it chose to stop there
    monkeypatch.undo()
    old = [
        {"id": "a", "messages": [*PROMPTS[0]["messages"], {"role": "assistant", "content": "Hi 🌟\ufffd"}]},
        {"id": "b", "messages": [*PROMPTS[1]["messages"], {"role": "assistant", "content": "4\ufffd"}]},
    ]
    (tmp_path / "old").mkdir()
    regen.write_jsonl(
        tmp_path / "old" / "shard-00000.jsonl",
        [{**old[0], "finish_reason": "loop"}, {**old[1], "finish_reason": "stop"}],
    )
    assert regen.trim_partial_characters(tmp_path / "old") == ["a"]
    ((a, b),) = _shards(tmp_path / "old").values()
    assert a["messages"][-1]["content"] == "Hi 🌟" and b["messages"][-1]["content"] == "4\ufffd"


def test_an_id_naming_two_prompts_is_refused(tmp_path, model, tokenizer):
    # the second prompt was dropped without a word (one row of the two answered)
    twice = [PROMPTS[0], {**PROMPTS[1], "id": PROMPTS[0]["id"]}]
    with pytest.raises(BadRow, match="prompt id 'p0' names two different prompts"):
        regenerate(model, tokenizer, twice, tmp_path, max_new_tokens=2)
    assert not any(tmp_path.iterdir())  # refused before anything was written
    regenerate(model, tokenizer, [PROMPTS[0], PROMPTS[0]], tmp_path, max_new_tokens=2)  # the same prompt: one


def test_a_resume_under_other_settings_is_refused(tmp_path, model, tokenizer, capsys):
    """A rerun into a folder answered with another reply cap, temperature or target mixed two kinds of reply
    in it without a word; a folder from before the settings file is adopted with a note."""
    regenerate(model, tokenizer, PROMPTS[:2], tmp_path, max_new_tokens=3)
    for change, named in (
        ({"max_new_tokens": 20}, "max_new_tokens 3 -> 20"),
        ({"max_new_tokens": 3, "temperature": 1.0}, "temperature 0.0 -> 1.0"),
    ):
        with pytest.raises(ValueError, match=f"answered with other settings \\({named}"):
            regenerate(model, tokenizer, PROMPTS, tmp_path, **change)
    other = copy.deepcopy(model)
    with torch.no_grad():
        other.model.layers[1].mlp.down_proj.weight.mul_(2.0)
    with pytest.raises(ValueError, match="target_digest"):
        regenerate(other, tokenizer, PROMPTS, tmp_path, max_new_tokens=3)
    assert len(_shards(tmp_path)) == 1  # nothing added by the refused runs
    (tmp_path / regen.SETTINGS_FILE).unlink()  # a folder of chats from before the file
    stats = regenerate(model, tokenizer, PROMPTS, tmp_path, max_new_tokens=3)
    assert (
        stats["skipped"] == 2 and "no regen.json; its chats are taken as answered" in capsys.readouterr().out
    )
    assert json.loads((tmp_path / regen.SETTINGS_FILE).read_text())["max_new_tokens"] == 3


def test_a_reply_that_looped_on_and_then_stopped_is_cut_under_the_loop_rule(tmp_path, tokenizer):
    """Chats answered before stop_loops: a reply that looped for hundreds of tokens and then ended itself
    kept its whole loop and its end-of-turn target; it is cut where the rule would have ended it. A stop
    within one loop check of that point is how generation under the rule ends too: kept."""
    loop = "The cat sat on the mat and looked at the door. " * 40
    short = "The cat sat on the mat and looked at the door. " * 3
    prompt = PROMPTS[0]["messages"]
    chats = [
        {"id": i, "messages": [*prompt, {"role": "assistant", "content": text}], "finish_reason": "stop"}
        for i, text in (("long", loop), ("short", short))
    ]
    regen.write_jsonl(tmp_path / "shard-00000.jsonl", chats)
    assert regen.cut_looping_chats(tmp_path, tokenizer, 2) == ["long"]
    ((long, kept),) = _shards(tmp_path).values()
    assert long["finish_reason"] == "loop" and loop.startswith(long["messages"][-1]["content"])
    assert len(long["messages"][-1]["content"]) < len(loop) / 4
    assert kept == chats[1]
