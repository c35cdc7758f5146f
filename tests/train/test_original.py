"""Tests for train/original.py: the dataset's own replies to the first pool's llamafactory prompts (the
on-policy ablation's off-policy arm), read from a small archive laid out as the llamafactory sdist."""

from __future__ import annotations

import io
import json
import tarfile
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from targets import materialize_default_target
from train.original import cut_reply, llamafactory_replies, original_chats
from train.prompts import llamafactory_prompts

SETS = {
    "alpaca_en_demo": [
        {"instruction": "Add the numbers.", "input": "2, 3", "output": "The sum is 5."},
        {"instruction": "Name a colour.", "input": "", "output": "Blue."},
    ],
    "glaive_toolcall_en_demo": [
        {
            "conversations": [
                {"from": "human", "value": "Area of a 5 by 3 rectangle?"},
                {"from": "function_call", "value": '{"name": "area", "arguments": {"w": 5, "h": 3}}'},
                {"from": "observation", "value": '{"area": 15}'},
                {"from": "gpt", "value": "It is 15."},
            ],
            "tools": "[]",
        }
    ],
    "dpo_en_demo": [
        {
            "conversations": [{"from": "human", "value": "How do I prepare for an interview?"}],
            "chosen": {"from": "gpt", "value": "Research the company."},
            "rejected": {"from": "gpt", "value": "Don't."},
        }
    ],
    "kto_en_demo": [
        {
            "messages": [{"role": "user", "content": "Say hi."}, {"role": "assistant", "content": "Hi!"}],
            "label": False,
        }
    ],
}


def _archive(tmp_path, sets: dict) -> object:
    path = tmp_path / "llamafactory-0.9.5.tar.gz"
    with tarfile.open(path, "w:gz") as archive:
        for name, rows in sets.items():
            data = json.dumps(rows).encode()
            info = tarfile.TarInfo(f"llamafactory-0.9.5/data/{name}.json")
            info.size = len(data)
            archive.addfile(info, io.BytesIO(data))
    return path


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(materialize_default_target())


def test_replies_answer_the_prompts_the_pool_takes(tmp_path):
    archive = _archive(tmp_path, SETS)
    replies = llamafactory_replies(archive)
    assert replies == {
        "alpaca_en_demo/0": "The sum is 5.",
        "alpaca_en_demo/1": "Blue.",
        "glaive_toolcall_en_demo/0": '{"name": "area", "arguments": {"w": 5, "h": 3}}',
        "dpo_en_demo/0": "Research the company.",
        "kto_en_demo/0": "Hi!",
    }
    assert [row["id"] for row in llamafactory_prompts(archive)] == list(replies)


def test_a_row_without_a_reply_is_named(tmp_path):
    sets = SETS | {"kto_en_demo": [{"messages": [{"role": "user", "content": "Say hi."}], "label": True}]}
    with pytest.raises(ValueError, match=r"kto_en_demo.json row 0: no reply after the first user turn"):
        llamafactory_replies(_archive(tmp_path, sets))


def test_chats_keep_the_prompt_and_take_the_datasets_reply_cut_to_the_budget(tokenizer):
    prompt = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Tell me a story."}]
    regenerated = [
        {
            "id": "chitchat/x",
            "source": "chitchat",
            "messages": [prompt[1], {"role": "assistant", "content": "?"}],
        },
        {
            "id": "alpaca_en_demo/7",
            "source": "alpaca_en_demo",
            "messages": [*prompt, {"role": "assistant", "content": "The target's own words."}],
            "finish_reason": "length",
        },
        {
            "id": "dpo_en_demo/0",
            "source": "dpo_en_demo",
            "messages": [prompt[1], {"role": "assistant", "content": "Once."}],
            "finish_reason": "stop",
        },
    ]
    long = "Once upon a time there was a small robot who liked to count the stars. " * 10
    rows = original_chats(regenerated, {"alpaca_en_demo/7": long, "dpo_en_demo/0": "The end."}, tokenizer, 32)
    assert [row["id"] for row in rows] == ["alpaca_en_demo/7", "dpo_en_demo/0"]
    first, second = rows
    assert first["messages"][:2] == prompt and first["finish_reason"] == "length"
    reply = first["messages"][2]["content"]
    assert long.startswith(reply) and len(tokenizer(reply, add_special_tokens=False)["input_ids"]) == 32
    assert second["messages"][1] == {"role": "assistant", "content": "The end."}
    assert second["finish_reason"] == "stop"
    assert cut_reply("The end.", tokenizer, 32) == ("The end.", False)


def test_a_chat_that_is_not_one_prompt_then_one_reply_is_refused(tokenizer):
    chat = {"id": "dpo_en_demo/0", "source": "dpo_en_demo", "messages": [{"role": "user", "content": "Hi"}]}
    with pytest.raises(ValueError, match=r"chat dpo_en_demo/0: expected a prompt then one reply"):
        original_chats([chat], {"dpo_en_demo/0": "Hello."}, tokenizer, 32)


def test_the_committed_original_chats_pair_with_the_regenerated_ones(tokenizer):
    """data/smollm2/original (`scripts/prepare_data.py --original`): one chat per regenerated llamafactory
    chat of the first pool, the same id, source and prompt, a reply within the 128-token budget, marked cut
    when it was cut; so the on-policy ablation's two arms train on the same prompts."""
    data = Path(__file__).resolve().parents[2] / "data" / "smollm2"
    read = lambda folder: [
        json.loads(line) for path in sorted((data / folder).glob("shard-*.jsonl")) for line in path.open()
    ]
    regenerated = {row["id"]: row for row in read("regen") + read("regen_extra") if row["source"] in SETS}
    original = read("original")
    assert len(original) == len(regenerated) == 1566
    assert [row["id"] for row in original] == list(regenerated)
    for row in original:
        theirs = regenerated[row["id"]]
        assert row["source"] == theirs["source"] and row["messages"][:-1] == theirs["messages"][:-1]
        reply = tokenizer(row["messages"][-1]["content"], add_special_tokens=False)["input_ids"]
        assert 0 < len(reply) <= 128 and row["finish_reason"] in ("stop", "length")
    assert sum(row["finish_reason"] == "length" for row in original) == 790
