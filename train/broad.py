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

Every prompt is checked against the held-out and benchmark prompts by `drop_near_duplicates` like the other
pools (scripts/prepare_data.py).
"""

from __future__ import annotations

import json
import random
import re
import tarfile
from pathlib import Path

from train.heldout import _a, passages
from train.prompts import fetch, read_member

DOCUTILS = ("docutils", "0.23.1", True)  # docs/**/*.rst, public-domain files only
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
    sizes = {**SIZES, **(sizes or {})}
    rng = random.Random(seed)
    rows = []
    texts = docutils_passages()
    for i, passage in enumerate(rng.sample(texts, min(sizes["summary"], len(texts)))):
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
    for i, chat in enumerate(rng.sample(finished, min(sizes["followup"], len(finished)))):
        messages = [*chat["messages"], {"role": "user", "content": FOLLOW_UPS[i % len(FOLLOW_UPS)]}]
        rows.append(_row("followup", i, messages) | {"from": chat["id"]})
    rng.shuffle(rows)
    return rows


SIZES = {"summary": 160, "explain": 700, "writing": 500, "system": 300, "followup": 400}


def committed_chats(folder: Path) -> list[dict]:
    """Every committed chat under `folder`'s regen*/ shards."""
    return [
        json.loads(line) for shard in sorted(folder.glob("regen*/shard-*.jsonl")) for line in shard.open()
    ]
