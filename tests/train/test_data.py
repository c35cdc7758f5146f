"""Tests for train/data.py: row formats and their errors, loss masks on three template families, batching,
the EAGLE-3 draft vocabulary."""

from __future__ import annotations

import json
import re

import pytest
import torch
from datasets import Dataset
from tokenizers import Tokenizer, models, pre_tokenizers, trainers
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from targets import materialize_default_target
from train.data import (
    BadRow,
    build_dataset,
    collate,
    draft_vocab_from_frequencies,
    pad_token_id,
    read_rows,
    render_with_mask,
    split_eval,
    to_messages,
    token_frequencies,
)

# Two more template families, written for these tests: Llama-3 style (headers, a default system prompt,
# trimmed content) and Gemma style (role "model", system folded into the first user turn, strict alternation).
LLAMA3_TEMPLATE = (
    "{{ bos_token }}{% if messages[0]['role'] == 'system' %}{% set system = messages[0]['content'] %}"
    "{% set rest = messages[1:] %}{% else %}{% set system = 'Cutting Knowledge Date: December 2023' %}"
    "{% set rest = messages %}{% endif %}<|start_header_id|>system<|end_header_id|>\n\n{{ system }}<|eot_id|>"
    "{% for m in rest %}<|start_header_id|>{{ m['role'] }}<|end_header_id|>\n\n{{ m['content'] | trim }}"
    "<|eot_id|>{% endfor %}{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n"
    "{% endif %}"
)
GEMMA_TEMPLATE = (
    "{{ bos_token }}{% if messages[0]['role'] == 'system' %}{% set first = messages[0]['content'] + '\n\n' %}"
    "{% set rest = messages[1:] %}{% else %}{% set first = '' %}{% set rest = messages %}{% endif %}"
    "{% for m in rest %}{% if (m['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
    "{% set role = 'model' if m['role'] == 'assistant' else m['role'] %}<start_of_turn>{{ role }}\n"
    "{{ (first if loop.first else '') + m['content'] | trim }}<end_of_turn>\n{% endfor %}"
    "{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}"
)
CHATML_TEMPLATE = (  # plain ChatML, no default system prompt
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
END_OF_TURN = {
    "smollm2": "<|im_end|>",
    "llama3": "<|eot_id|>",
    "gemma": "<end_of_turn>",
    "tiny": "<|im_end|>",
}
TRIMS = {"smollm2": False, "llama3": True, "gemma": True, "tiny": False}  # does the template trim content?

CHAT = [
    {"role": "user", "content": "Hi, who are you?"},
    {"role": "assistant", "content": "I am a small model.\nNice to meet you!"},
    {"role": "user", "content": "Name three colours."},
    {"role": "assistant", "content": " Red, green and blue. "},
]


@pytest.fixture(scope="module")
def tokenizers() -> dict:
    """The SmolLM2 tokenizer (ChatML with a default system prompt), Llama-3 and Gemma style templates on
    copies of it, and a tiny BPE tokenizer trained here with plain ChatML."""
    path = materialize_default_target()
    smollm2, llama3, gemma = (AutoTokenizer.from_pretrained(path) for _ in range(3))
    llama3.add_special_tokens(
        {
            "bos_token": "<|begin_of_text|>",
            "eos_token": "<|eot_id|>",
            "additional_special_tokens": ["<|start_header_id|>", "<|end_header_id|>"],
        }
    )
    llama3.chat_template = LLAMA3_TEMPLATE
    gemma.add_special_tokens(
        {"bos_token": "<bos>", "eos_token": "<end_of_turn>", "additional_special_tokens": ["<start_of_turn>"]}
    )
    gemma.chat_template = GEMMA_TEMPLATE
    bpe = Tokenizer(models.BPE(unk_token="<unk>"))
    bpe.pre_tokenizer = pre_tokenizers.Whitespace()
    specials = ["<unk>", "<|im_start|>", "<|im_end|>"]
    corpus = [m["content"] for m in CHAT] + ["user assistant system hello world"]
    bpe.train_from_iterator(corpus, trainers.BpeTrainer(vocab_size=120, special_tokens=specials))
    tiny = PreTrainedTokenizerFast(tokenizer_object=bpe, unk_token="<unk>", eos_token="<|im_end|>")
    tiny.chat_template = CHATML_TEMPLATE
    return {"smollm2": smollm2, "llama3": llama3, "gemma": gemma, "tiny": tiny}


def _write(path, rows) -> str:
    path.write_text("\n".join(r if isinstance(r, str) else json.dumps(r) for r in rows) + "\n")
    return str(path)


def _masked_text(tokenizer, example) -> str:
    return tokenizer.decode([t for t, m in zip(example["input_ids"], example["loss_mask"]) if m])


def _expected(messages, name) -> str:
    """Assistant contents, each followed by the end-of-turn marker: what the mask must cover."""
    contents = [
        m["content"].strip() if TRIMS[name] else m["content"] for m in messages if m["role"] == "assistant"
    ]
    return "".join(content + END_OF_TURN[name] for content in contents)


# ---- reading rows -----------------------------------------------------------------------------------------


def test_read_rows_jsonl_reports_bad_lines_and_continues(tmp_path):
    path = _write(tmp_path / "a.jsonl", [{"text": "a"}, "{not json", "", "[1, 2]", {"text": "b"}])
    rows = list(read_rows(path))
    assert [n for n, _ in rows] == [1, 2, 4, 5]  # line 3 is blank
    assert rows[0][1] == {"text": "a"} and rows[3][1] == {"text": "b"}
    assert isinstance(rows[1][1], json.JSONDecodeError)
    assert isinstance(rows[2][1], BadRow) and "not an object" in str(rows[2][1])


def test_read_rows_json_list(tmp_path):
    good = tmp_path / "good.json"
    good.write_text(json.dumps([{"text": "a"}, "oops", {"text": "b"}], indent=2))
    rows = list(read_rows(good))
    assert [n for n, _ in rows] == [1, 2, 3] and isinstance(rows[1][1], BadRow)
    broken = tmp_path / "broken.json"
    broken.write_text('[\n  {"text": "a"},\n  {"text": \n]')
    # one slip loses the whole list: an error, never one skipped row that max_bad_fraction could absorb
    with pytest.raises(ValueError, match=re.escape(f"{broken}:4: not valid JSON") + ".*every row of this"):
        list(read_rows(broken))


def test_read_rows_splits_jsonl_at_newlines_only(tmp_path):
    """U+2028, U+2029 and \\x85 are valid inside JSON strings; str.splitlines cut such a row in two bad halves
    and shifted every later line number."""
    rows = [{"text": "a\u2028b"}, {"text": "c\u2029d\x85e"}, {"text": "f"}]
    path = tmp_path / "a.jsonl"
    path.write_text("\n".join(json.dumps(row, ensure_ascii=False) for row in rows) + "\n", encoding="utf-8")
    assert list(read_rows(path)) == [(1, rows[0]), (2, rows[1]), (3, rows[2])]


# ---- normalising rows -------------------------------------------------------------------------------------


def test_to_messages_formats():
    sharegpt = {
        "conversations": [
            {"from": "system", "value": "s"},
            {"from": "human", "value": "q"},
            {"from": "gpt", "value": "a"},
            {"from": "user", "value": "q2"},
            {"from": "chatgpt", "value": "a2"},
            {"from": "human", "value": "q3"},
            {"from": "bing", "value": "a3"},
        ]
    }
    assert [m["role"] for m in to_messages(sharegpt)] == ["system"] + ["user", "assistant"] * 3
    openai = {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]}
    assert to_messages(openai) == openai["messages"]
    assert to_messages({"text": "plain text"}) == [{"role": "text", "content": "plain text"}]
    assert (
        to_messages({"messages": [{"role": "user", "content": "q"}]}, require_assistant=False)[0]["content"]
        == "q"
    )


@pytest.mark.parametrize(
    "row, message",
    [
        ({"prompt": "x"}, "no 'conversations', 'messages' or 'text' key"),
        ({"conversations": [{"from": "foo", "value": "x"}]}, "'conversations'[0].from: unknown role 'foo'"),
        ({"messages": []}, "'messages': empty conversation"),
        ({"messages": [{"role": "user", "content": "q"}]}, "'messages': no assistant turn"),
        (
            {"messages": [{"role": "user", "content": [{"type": "text"}]}]},
            "'messages'[0].content: non-string",
        ),
        (
            {"conversations": [{"from": "human"}]},
            "'conversations'[0] must be an object with 'from' and 'value'",
        ),
        ({"conversations": "hello"}, "'conversations' is a str, expected a list"),
        ({"text": 3}, "'text': expected a non-empty string"),
        ({"messages": [{"role": ["user"], "content": "q"}]}, "'messages'[0].role: unknown role ['user']"),
        (
            {"messages": [{"role": "user", "content": "q"}, *[{"role": "assistant", "content": "a"}] * 2]},
            "'messages'[2].role: expected role 'user' here, found 'assistant'",
        ),
        (
            {"messages": [{"role": "system", "content": "s"}, {"role": "assistant", "content": "a"}]},
            "'messages'[1].role: expected role 'user' here, found 'assistant'",
        ),
        (
            {"messages": [{"role": "user", "content": "q"}, {"role": "user", "content": "q"}]},
            "'messages'[1].role: expected role 'assistant' here, found 'user'",
        ),
        (
            {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": " "}]},
            "'messages'[1].content: empty assistant reply",
        ),
    ],
)
def test_to_messages_errors_name_key_and_problem(row, message):
    with pytest.raises(BadRow, match=re.escape(message)):
        to_messages(row)


# ---- loss masks -------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["smollm2", "llama3", "gemma", "tiny"])
@pytest.mark.parametrize("turns", [2, 4], ids=["single_turn", "multi_turn"])
def test_mask_covers_exactly_assistant_tokens(tokenizers, name, turns):
    tokenizer, messages = tokenizers[name], CHAT[:turns]
    example = render_with_mask(tokenizer, messages, max_length=10_000)
    full = tokenizer.apply_chat_template(messages, tokenize=False)
    encoding = tokenizer(full, add_special_tokens=False, return_offsets_mapping=True)
    assert example["input_ids"] == encoding["input_ids"]  # the template's own tokens, rendered once
    runs = re.findall(r"1+", "".join(map(str, example["loss_mask"])))
    assert len(runs) == turns // 2  # one contiguous span per assistant turn
    if name == "tiny":  # word-level pre-tokenizer: compare the covered characters, whitespace aside
        covered = "".join(
            full[s:e] for (s, e), m in zip(encoding["offset_mapping"], example["loss_mask"]) if m
        )
        assert covered == re.sub(r"\s", "", _expected(messages, name))
    else:
        assert _masked_text(tokenizer, example) == _expected(messages, name)


@pytest.mark.parametrize("name", ["smollm2", "llama3", "gemma"])
@pytest.mark.parametrize("turns", [2, 4], ids=["single_turn", "multi_turn"])
def test_a_cut_reply_trains_its_tokens_but_not_the_end_of_turn_marker(tokenizers, name, turns):
    """A regenerated reply that hit the length cap (finish_reason "length") never chose to stop: the marker
    the template writes after it is no target; earlier, finished replies keep theirs."""
    tokenizer, messages = tokenizers[name], CHAT[:turns]
    normal = render_with_mask(tokenizer, messages, max_length=10_000)
    cut = render_with_mask(tokenizer, messages, max_length=10_000, cut_reply=True)
    assert cut["input_ids"] == normal["input_ids"]  # the same tokens (an offline dump stays valid)
    assert _masked_text(tokenizer, cut) == _expected(messages, name).removesuffix(END_OF_TURN[name])
    dropped = [t for t, a, b in zip(cut["input_ids"], normal["loss_mask"], cut["loss_mask"]) if a and not b]
    assert tokenizer.decode(dropped) == END_OF_TURN[name]


def test_build_dataset_reads_finish_reason(tmp_path, tokenizers):
    rows = [
        {"messages": CHAT[:2], "finish_reason": "length"},
        {"messages": CHAT[:2], "finish_reason": "stop"},
        {"messages": CHAT[:2], "finish_reason": "loop"},  # ended by regenerate's stop_loops: cut too
    ]
    dataset, _ = build_dataset(_write(tmp_path / "regen.jsonl", rows), tokenizers["smollm2"], max_length=128)
    assert sum(dataset[1]["loss_mask"]) - sum(dataset[0]["loss_mask"]) == 1  # <|im_end|> is one token
    assert dataset[2]["loss_mask"] == dataset[0]["loss_mask"]
    # any other value trained the end-of-turn as a stop the target chose ("max_tokens", "Length", 7 were kept)
    odd = [{"messages": CHAT[:2], "finish_reason": reason} for reason in ("max_tokens", "Length", 7)]
    path = _write(tmp_path / "odd.jsonl", [*rows, *odd])
    _, report = build_dataset(path, tokenizers["smollm2"], max_length=128, max_bad_fraction=1.0)
    assert report.kept == 3 and report.bad == {"bad_row": 3}
    assert report.examples[0] == (
        f"{path}:4: bad_row: 'finish_reason': expected one of ('stop', 'length', 'loop'), got 'max_tokens'"
    )


@pytest.mark.parametrize("name", ["smollm2", "llama3", "gemma"])
def test_system_prompts_are_not_trained(tokenizers, name):
    tokenizer = tokenizers[name]
    for messages in (CHAT, [{"role": "system", "content": "Be terse."}] + CHAT):  # default / explicit system
        example = render_with_mask(tokenizer, messages, max_length=10_000)
        assert _masked_text(tokenizer, example) == _expected(messages, name)
    if name == "smollm2":  # the template injects its default system prompt
        assert "You are a helpful AI assistant named SmolLM" in tokenizer.apply_chat_template(
            CHAT, tokenize=False
        )


def test_template_rejection_is_a_bad_row(tokenizers):
    messages = [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}, CHAT[1]]
    with pytest.raises(BadRow, match="chat template rejected.*roles must alternate"):
        render_with_mask(tokenizers["gemma"], messages, max_length=100)


def test_assistant_first_is_a_bad_row(tokenizers):
    with pytest.raises(BadRow, match="opens with an assistant turn"):
        render_with_mask(tokenizers["smollm2"], [CHAT[1], CHAT[2], CHAT[3]], max_length=100)


def test_template_that_is_not_prefix_stable_raises(tokenizers):
    tokenizer = AutoTokenizer.from_pretrained(materialize_default_target())
    tokenizer.chat_template = CHATML_TEMPLATE.replace(
        "assistant\n{% endif %}", "assistant\n<think></think>{% endif %}"
    )
    with pytest.raises(ValueError, match="chat template problem at message 1"):
        render_with_mask(tokenizer, CHAT[:2], max_length=100)


def test_truncation_cuts_ids_and_mask_together(tokenizers):
    tokenizer = tokenizers["smollm2"]
    full = render_with_mask(tokenizer, CHAT, max_length=10_000)
    cut = render_with_mask(tokenizer, CHAT, max_length=30)
    assert cut == {"input_ids": full["input_ids"][:30], "loss_mask": full["loss_mask"][:30]}


def test_raw_text_trains_every_token(tokenizers):
    tokenizer = tokenizers["smollm2"]
    example = render_with_mask(tokenizer, to_messages({"text": "Once upon a time"}), max_length=100)
    assert example["input_ids"][-1] == tokenizer.eos_token_id and all(example["loss_mask"])
    assert tokenizer.decode(example["input_ids"], skip_special_tokens=True) == "Once upon a time"


# ---- building the dataset ---------------------------------------------------------------------------------


def test_build_dataset_skips_and_reports_bad_rows(tmp_path, tokenizers):
    good = {"messages": CHAT}
    long_prompt = {
        "conversations": [{"from": "human", "value": "word " * 200}, {"from": "gpt", "value": "ok"}]
    }
    rows = [good] * 6 + [
        "{broken",
        {"messages": [{"role": "foo", "content": "x"}]},
        long_prompt,
        {"text": "raw"},
    ]
    path = _write(tmp_path / "mixed.jsonl", rows)
    listed = tmp_path / "listed.json"
    listed.write_text(json.dumps([good, good]))
    dataset, report = build_dataset(
        [path, listed], tokenizers["smollm2"], max_length=64, max_bad_fraction=0.5
    )
    assert dataset.column_names == ["input_ids", "loss_mask"] and len(dataset) == 9
    assert (report.total, report.kept) == (12, 9)
    assert report.bad == {"invalid_json": 1, "bad_row": 1, "empty_loss_mask": 1}
    assert report.examples[0].startswith(f"{path}:7: invalid_json")
    assert report.examples[1] == f"{path}:8: bad_row: 'messages'[0].role: unknown role 'foo'"
    assert report.examples[2].startswith(f"{path}:9: empty_loss_mask")
    assert all(len(ids) <= 64 for ids in dataset["input_ids"])


def test_build_dataset_stops_on_too_many_bad_rows(tmp_path, tokenizers):
    path = _write(tmp_path / "bad.jsonl", [{"messages": CHAT}] * 8 + ["{", '{"foo": 1}'])
    with pytest.raises(
        ValueError, match=re.escape(f"{path}: 2 of 10 rows skipped (20.0% > max_bad_fraction=0.1)")
    ):
        build_dataset(path, tokenizers["smollm2"], max_length=128, max_bad_fraction=0.1)
    _, report = build_dataset(path, tokenizers["smollm2"], max_length=128, max_bad_fraction=0.2)
    assert report.kept == 8


def test_build_dataset_keeps_only_the_named_sources(tmp_path, tokenizers):
    """data.sources: rows of other sources are left out and counted (not bad, not in the bad fraction); a
    named source that no row has is an error, so a misspelt filter cannot train on less than it says."""
    rows = [{"source": "a", "messages": CHAT}] * 3 + [{"source": "b", "messages": CHAT}] * 5 + ["{"]
    path = _write(tmp_path / "mixed.jsonl", rows)
    dataset, report = build_dataset(path, tokenizers["smollm2"], 128, max_bad_fraction=0.3, sources=["a"])
    assert (len(dataset), report.kept, report.total, report.left_out) == (3, 3, 4, 5)
    assert report.bad == {"invalid_json": 1} and "rows of other sources left out: 5" in str(report)
    _, whole = build_dataset(path, tokenizers["smollm2"], 128, max_bad_fraction=0.3)
    assert (whole.kept, whole.left_out) == (8, 0)
    with pytest.raises(ValueError, match=r"data.sources names \['alpaca'\], which no row .* has"):
        build_dataset(path, tokenizers["smollm2"], 128, max_bad_fraction=0.3, sources=["a", "alpaca"])


def test_a_source_that_is_not_a_string_is_a_bad_row(tmp_path, tokenizers):
    """A list as `source` raised "unhashable type: 'list'" out of the whole build, naming nothing."""
    rows = [{"source": "a", "messages": CHAT}] * 9 + [{"source": ["a"], "messages": CHAT}]
    path = _write(tmp_path / "mixed.jsonl", rows)
    for sources in ((), ("a",)):
        dataset, report = build_dataset(
            path, tokenizers["smollm2"], 128, max_bad_fraction=0.2, sources=sources
        )
        assert len(dataset) == 9 and report.examples == [
            f"{path}:10: bad_row: 'source': expected a string, got list"
        ]


def test_split_eval():
    train, held_out = split_eval(Dataset.from_dict({"input_ids": [[i] for i in range(20)]}), 0.25, seed=1)
    assert (len(train), len(held_out)) == (15, 5)
    assert {row[0] for row in train["input_ids"]}.isdisjoint(row[0] for row in held_out["input_ids"])


# ---- batching and the draft vocabulary --------------------------------------------------------------------


def test_collate_right_pads():
    rows = [{"input_ids": [5, 6, 7], "loss_mask": [0, 1, 1]}, {"input_ids": [8], "loss_mask": [1]}]
    batch = collate(rows, pad_token_id=0)
    assert {k: v.shape for k, v in batch.items()} == {
        k: (2, 3) for k in ("input_ids", "attention_mask", "loss_mask")
    }
    assert batch["input_ids"].tolist() == [[5, 6, 7], [8, 0, 0]]
    assert batch["attention_mask"].tolist() == [[1, 1, 1], [1, 0, 0]]
    assert batch["loss_mask"].tolist() == [[0, 1, 1], [1, 0, 0]]
    assert all(v.dtype == torch.long for v in batch.values())


def test_token_frequencies_count_only_masked_tokens():
    dataset = Dataset.from_dict(
        {"input_ids": [[1, 2, 2, 3], [3, 3, 4]], "loss_mask": [[0, 1, 1, 1], [1, 0, 1]]}
    )
    assert token_frequencies(dataset, vocab_size=6).tolist() == [0, 0, 2, 2, 1, 0]
    with pytest.raises(ValueError, match="vocab_size"):
        token_frequencies(dataset, vocab_size=4)


def test_draft_vocab_from_frequencies():
    counts = torch.tensor([0, 5, 3, 5, 0, 9, 1, 0])
    assert draft_vocab_from_frequencies(counts, 3).tolist() == [1, 3, 5]  # 9, 5, 5
    assert draft_vocab_from_frequencies(counts, 4).tolist() == [1, 2, 3, 5]
    assert draft_vocab_from_frequencies(counts, 7).tolist() == [
        0,
        1,
        2,
        3,
        4,
        5,
        6,
    ]  # unseen: smallest ids first
    with pytest.raises(ValueError, match="draft vocab size"):
        draft_vocab_from_frequencies(counts, 9)


def test_pad_token_id_falls_back_to_the_end_of_sequence_token():
    from types import SimpleNamespace

    assert pad_token_id(SimpleNamespace(pad_token_id=3, eos_token_id=2)) == 3
    assert pad_token_id(SimpleNamespace(pad_token_id=None, eos_token_id=2)) == 2
    assert pad_token_id(SimpleNamespace(pad_token_id=0, eos_token_id=2)) == 0  # id 0 is a pad token too
    with pytest.raises(ValueError, match="'tok' has neither a pad nor an end-of-sequence token"):
        pad_token_id(SimpleNamespace(pad_token_id=None, eos_token_id=None, name_or_path="tok"))


def test_trim_loop_cuts_a_looping_reply_after_its_kth_repeat():
    from train.data import trim_loop

    loop = "It is a topic that is often overlooked. "
    text = "The airforce matters. " + loop * 10
    cut = trim_loop(text, 3)
    assert cut is not None and text.startswith(cut)
    # the first 8-word run repeats at word 11 (3 + 8): the third repeat ends 8 + 2 words further
    assert len(cut.split()) == 3 + 8 + 2 + 8
    assert trim_loop("a b c d e f g h i j k l", 1) is None  # nothing repeats
    assert trim_loop(text, 1000) is None  # repeats less than that


def test_build_dataset_trims_looping_replies_into_cut_replies(tmp_path, tokenizers):
    """A looping reply is cut and trains no end-of-turn token; a reply that does not loop keeps it."""
    loop = "It is a topic that is often overlooked. "
    rows = [
        {"messages": [{"role": "user", "content": "Why?"}, {"role": "assistant", "content": loop * 12}]},
        {"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello there."}]},
    ]
    tokenizer = tokenizers["smollm2"]
    path = _write(tmp_path / "chats.jsonl", rows)
    whole, _ = build_dataset(path, tokenizer, 512)
    trimmed, report = build_dataset(path, tokenizer, 512, trim_loops=4)
    assert report.loops_trimmed == 1 and "cut inside a repetition loop: 1" in str(report)
    assert sum(trimmed[0]["loss_mask"]) < sum(whole[0]["loss_mask"])
    assert trimmed[1] == whole[1]
    end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    masked = [t for t, m in zip(trimmed[0]["input_ids"], trimmed[0]["loss_mask"]) if m]
    assert end not in masked and end in [t for t, m in zip(whole[0]["input_ids"], whole[0]["loss_mask"]) if m]
