"""The fifth training pool (`scripts/prepare_data.py --wide`; licences in data/SOURCES.md): many sources with
few prompts each. The third and fourth pools drew most of their prompts from two word lists and a few texts,
and the held-out-source benchmark shows heads still meet sources they were not trained on; this pool adds
eleven distributions none of the earlier pools (nor `train.heldout`) reads:

- `wide_chat`: the openers of chatterbot-corpus' English conversations (small talk, science, history,
  money, psychology ...), as a user would type them.
- `wide_joke`: pyjokes' English one-liners, to explain, rate or answer in kind.
- `wide_explain`, `wide_writing`, `wide_system`: terms of nine topic lists (dishes, drinks, fruits, spices and
  vegetables from mimesis; languages from mimesis; units of measurement from pint; General MIDI instruments
  from pretty_midi; cities from the tz database's zone names in tzdata; public holidays from the English
  translations in holidays; emoji from emoji's names), asked about in this module's own words, written about
  in forms the other pools do not ask for, and asked after one of six personas' system prompts.
- `wide_passage`: passages of the documentation of flask, click and sphinx (reStructuredText prose) to
  summarise, explain or question.
- `wide_followup`: a committed first-turn chat of the fourth pool (`regen_broad2/`) that ended on its own,
  then a follow-up of this module's list.

Terms that name a held-out topic (a chemical element or a country, whole words) are left out; every prompt is
checked against the evaluation prompts by `drop_near_duplicates` (`build_wide_pool`).
"""

from __future__ import annotations

import ast
import json
import random
import re
import tarfile
import zipfile
from pathlib import Path

from train.broad import committed_chats, rst_paragraphs
from train.heldout import _a, country_names, element_names, passages
from train.prompts import drop_near_duplicates, fetch, read_member

CHATTERBOT = ("chatterbot-corpus", "1.2.0", False)  # chatterbot_corpus/data/english/*.yml
PYJOKES = ("pyjokes", "0.8.3", False)  # pyjokes/jokes_en.py
MIMESIS = ("mimesis", "18.0.0", False)  # mimesis/datasets/en/{food,person}.json
PINT = ("pint", "0.24.4", False)  # pint/default_en.txt
PRETTY_MIDI = ("pretty_midi", "0.2.10", True)  # pretty_midi/constants.py
TZDATA = ("tzdata", "2025.2", False)  # tzdata/zoneinfo/<Region>/<City>
HOLIDAYS = ("holidays", "0.60", False)  # holidays/locale/en_US/LC_MESSAGES/*.po
EMOJI = ("emoji", "2.14.0", False)  # emoji/unicode_codes/emoji.json
DOCS = (("flask", "3.1.0", True), ("click", "8.1.8", True), ("sphinx", "8.1.3", True))  # docs/**/*.rst
PINS = (CHATTERBOT, PYJOKES, MIMESIS, PINT, PRETTY_MIDI, TZDATA, HOLIDAYS, EMOJI, *DOCS)

WIDE_FILE = "prompts_train_wide.jsonl"
FOLLOWED_FOLDER = "regen_broad2"  # the chats the follow-ups continue
SIZES = {
    "chat": 300,
    "joke": 100,
    "explain": 450,
    "writing": 280,
    "system": 220,
    "passage": 180,
    "followup": 300,
}
EXPLAIN = {  # two questions per topic, asked in turn
    "dish": ("What is {term}, and how is it usually prepared?", "Where does {term} come from?"),
    "drink": ("What is {term}, and how is it made?", "Tell me about the drink called {term}."),
    "fruit": ("What is {term}? Describe how it looks and tastes.", "How is the fruit {term} grown?"),
    "spice": ("What is the spice {term}, and which dishes use it?", "How should I cook with {term}?"),
    "vegetable": ("What are the health benefits of {term}?", "Give me three simple ways to cook {term}."),
    "language": (
        "Tell me about the {term} language: who speaks it and how it is written.",
        "What makes {term} hard or easy to learn for an English speaker?",
    ),
    "unit": (
        "What is a {term}, and what is it used to measure?",
        "How does the {term} compare with other units?",
    ),
    "instrument": ("How does the {term} produce its sound?", "What kind of music is the {term} used in?"),
    "city": ("What is {term} known for?", "I am visiting {term} for a weekend. What should I see?"),
    "holiday": ("What is {term}, and how do people celebrate it?", "What is the history behind {term}?"),
    "emoji": (
        "What does the {term} emoji usually mean in a message?",
        "When would someone send the {term} emoji?",
    ),
}
WRITING = (
    "Write a limerick about {term}.",
    "Write a radio advertisement, about 150 words, for {a_term}-themed event.",
    "Write a short scene for a play in which two strangers meet because of {term}.",
    "Write a review, about 250 words, of a museum exhibition about {term}.",
    "Write an interview with an expert on {term}: six questions and their answers.",
    "Write a story for children about {a_term} that goes on an adventure.",
    "Write a thank-you note to a neighbour who introduced you to {term}.",
    "Write a social media thread of five posts about {term}.",
)
PERSONAS = {
    "dish": "a chef who runs cooking classes for beginners",
    "drink": "a friendly bartender and drinks historian",
    "fruit": "a market gardener who sells at a farmers' market",
    "spice": "a chef who runs cooking classes for beginners",
    "vegetable": "a nutritionist writing for a family magazine",
    "language": "a language coach who has taught dozens of languages",
    "unit": "a science teacher at a secondary school",
    "instrument": "a music teacher who plays in an orchestra",
    "city": "a travel writer who has lived in many cities",
    "holiday": "a cultural historian who writes about festivals",
    "emoji": "a communication coach who helps people write better messages",
}
RULES = (
    "Start with a one-sentence answer, then add detail.",
    "Use everyday words; define any technical term you need.",
    "Keep the answer under 250 words unless asked for more.",
    "Mention one common misconception when there is one.",
    "Use a short list when you give more than three items.",
    "Be honest about uncertainty instead of inventing facts.",
    "Do not ask the user personal questions.",
    "Suggest one thing the user could try or look up next.",
    "Write in a warm, encouraging voice.",
    "Avoid humour about religion or politics.",
)
PERSONA_SYSTEM = "You are {persona}. You answer questions from the public on a help line.\nRules:\n{rules}"
JOKE_ASKS = (
    "Explain this joke: {joke}",
    "Why is this funny? {joke}",
    "Here is a joke: {joke}\nWrite three more in the same style.",
    "Would a non-programmer understand this joke? {joke}",
)
PASSAGE_ASKS = (
    "Summarise this documentation for someone who has never used the tool.",
    "Explain the following passage step by step.",
    "What problem does this passage solve? Answer in a short paragraph.",
    "Write three quiz questions, with answers, about this text.",
)
FOLLOW_UPS = (
    "Can you give me a real-world example?",
    "What is the most surprising part of that?",
    "Could you put that in a table?",
    "What would a beginner get wrong here?",
    "Please make it more formal.",
    "And what about the opposite case?",
    "Can you turn that into a short quiz for me?",
    "Which part is the most important to remember?",
)


def chat_openers() -> list[str]:
    """The first line of every English chatterbot-corpus conversation of three words or more, capitalised,
    each once, in file order."""
    import yaml

    out, seen = [], set()
    with zipfile.ZipFile(fetch(*CHATTERBOT)) as wheel:
        for name in sorted(n for n in wheel.namelist() if re.search(r"/data/english/\w+\.yml$", n)):
            for conversation in yaml.safe_load(wheel.read(name)).get("conversations") or []:
                text = str(conversation[0]).strip()
                if len(text.split()) >= 3 and text.lower() not in seen:
                    seen.add(text.lower())
                    out.append(text[0].upper() + text[1:])
    return out


def jokes() -> list[str]:
    """pyjokes' English `neutral` one-liners (its `chuck` list left out)."""
    tree = ast.parse(read_member(fetch(*PYJOKES), "pyjokes/jokes_en.py").decode())
    for node in tree.body:
        if isinstance(node, ast.Assign) and getattr(node.targets[0], "id", None) == "neutral":
            return list(ast.literal_eval(node.value))
    raise ValueError(f"{'=='.join(PYJOKES[:2])} jokes_en.py: no `neutral` list")


def topic_terms() -> dict[str, list[str]]:
    """{topic: terms} of the nine lists, each term once per topic, in source order."""
    food = json.loads(read_member(fetch(*MIMESIS), "datasets/en/food.json"))
    person = json.loads(read_member(fetch(*MIMESIS), "datasets/en/person.json"))
    terms = {
        "dish": food["dishes"],
        "drink": food["drinks"],
        "fruit": food["fruits"],
        "spice": food["spices"],
        "vegetable": food["vegetables"],
        "language": person["language"],
    }
    units = read_member(fetch(*PINT), "pint/default_en.txt").decode()
    terms["unit"] = [
        u.replace("_", " ")
        for u in re.findall(r"^([a-z][a-z_]+) = ", units, re.MULTILINE)
        if "_unit_" not in u
    ]
    with tarfile.open(fetch(*PRETTY_MIDI)) as sdist:
        (member,) = [m for m in sdist.getmembers() if m.name.endswith("pretty_midi/constants.py")]
        source = sdist.extractfile(member).read().decode()
    found = re.search(r"INSTRUMENT_MAP = (\[.*?\])", source, re.DOTALL)
    terms["instrument"] = [re.sub(r" \d$", "", n).lower() for n in ast.literal_eval(found.group(1))]
    with zipfile.ZipFile(fetch(*TZDATA)) as wheel:
        zones = [
            n for n in sorted(wheel.namelist()) if re.fullmatch(r"tzdata/zoneinfo/[A-Z]\w+/[A-Z][\w-]+", n)
        ]
    terms["city"] = [z.rsplit("/", 1)[1].replace("_", " ") for z in zones if "/Etc/" not in z]
    holidays = []
    with zipfile.ZipFile(fetch(*HOLIDAYS)) as wheel:
        for name in sorted(n for n in wheel.namelist() if re.search(r"/en_US/LC_MESSAGES/\w+\.po$", n)):
            holidays += re.findall(r'^msgstr "([^"%]{4,})"$', wheel.read(name).decode(), re.MULTILINE)
    terms["holiday"] = [h for h in holidays if not re.search(r"\d|[()]", h)]
    emoji = json.loads(read_member(fetch(*EMOJI), "emoji/unicode_codes/emoji.json"))
    names = [row["en"].strip(":").replace("_", " ") for row in emoji.values() if row.get("status") == 2]
    terms["emoji"] = [n for n in names if "flag" not in n and "skin tone" not in n and n.isascii()]
    return {
        topic: list(dict.fromkeys(t.strip() for t in found if t.strip())) for topic, found in terms.items()
    }


def doc_passages() -> list[str]:
    """Passages of 150-320 words of the reStructuredText prose in flask's, click's and sphinx's docs."""
    out = []
    for pin in DOCS:
        with tarfile.open(fetch(*pin)) as sdist:
            for member in sorted(sdist.getmembers(), key=lambda m: m.name):
                if re.search(r"/docs?/.+\.rst$", member.name) and member.isfile():
                    text = sdist.extractfile(member).read().decode("utf-8", errors="replace")
                    out += passages(rst_paragraphs(text))
    return out


def names_held_out(term: str, held: set[str]) -> bool:
    """Whether `term` holds a held-out topic name (lower-cased, `held`) as whole words."""
    words = re.findall(r"[a-z]+", term.lower())
    return any(
        " ".join(words[i:j]) in held
        for i in range(len(words))
        for j in range(i + 1, min(len(words), i + 4) + 1)
    )


class TopicDraw:
    """Terms drawn topic by topic in turn, each once, so that small lists (spices, instruments) are not
    crowded out by large ones (holidays): `take(i)` pops the next term of topic `order[i % len(order)]`, or
    of the next topic along that still has terms."""

    def __init__(self, pairs: list[tuple[str, str]]) -> None:
        """`pairs`: (term, topic), already shuffled; each topic's terms are popped from its end."""
        self.by_topic: dict[str, list[str]] = {}
        for term, topic in pairs:
            self.by_topic.setdefault(topic, []).append(term)
        self.order = sorted(self.by_topic)

    def take(self, i: int, topics: list[str] | None = None) -> tuple[str, str]:
        """(term, topic) for draw `i` among `topics` (default: every topic)."""
        topics = self.order if topics is None else topics
        for k in range(len(topics)):
            topic = topics[(i + k) % len(topics)]
            if self.by_topic[topic]:
                return self.by_topic[topic].pop(), topic
        raise ValueError("the topic lists ran out of terms")


def wide_prompts(
    chats: list[dict], exclude: set[str], seed: int = 0, sizes: dict[str, int] | None = None
) -> list[dict]:
    """The pool, shuffled: `sizes` rows per kind at most (default `SIZES`), ids `wide_<kind>/<i>`, sources
    `wide_<kind>`; rows about a term name it and its topic (`terms`, `topic`).

    Args:
        chats: committed chats to follow up (`FOLLOWED_FOLDER`); those that hold one reply, ended on their
            own, and are not themselves follow-ups are drawn from.
        exclude: held-out topic names, lower-cased.
    """
    sizes = {**SIZES, **(sizes or {})}
    rng = random.Random(seed)
    rows = PoolRows("wide")
    add = rows.add

    openers = [t for t in chat_openers() if not names_held_out(t, exclude)]
    for text in rng.sample(openers, min(sizes["chat"], len(openers))):
        add("chat", user(text))
    one_liners = jokes()
    for i, joke in enumerate(rng.sample(one_liners, min(sizes["joke"], len(one_liners)))):
        add("joke", user(JOKE_ASKS[i % len(JOKE_ASKS)].format(joke=joke)))
    pairs = [(t, topic) for topic, ts in topic_terms().items() for t in ts if not names_held_out(t, exclude)]
    rng.shuffle(pairs)
    draw = TopicDraw(pairs)
    order, take = draw.order, draw.take
    for i in range(sizes["explain"]):
        term, topic = take(i)
        asks = EXPLAIN[topic]
        add("explain", user(asks[(i // len(order)) % len(asks)].format(term=term)), terms=[term], topic=topic)
    storied = [t for t in order if t not in ("unit", "emoji")]  # nobody writes a limerick about a kelvin
    for i in range(sizes["writing"]):
        term, topic = take(i, storied)
        text = WRITING[i % len(WRITING)].format(term=term, a_term=_a(term))
        add("writing", user(text), terms=[term], topic=topic)
    for i in range(sizes["system"]):
        term, topic = take(i)
        rules = "\n".join(f"- {r}" for r in rng.sample(RULES, 6))
        system = PERSONA_SYSTEM.format(persona=PERSONAS[topic], rules=rules)
        asks = EXPLAIN[topic]
        question = asks[(i // len(order)) % len(asks)].format(term=term)
        add("system", [{"role": "system", "content": system}, *user(question)], terms=[term], topic=topic)
    texts = doc_passages()
    for i, passage in enumerate(rng.sample(texts, min(sizes["passage"], len(texts)))):
        add("passage", user(f"{PASSAGE_ASKS[i % len(PASSAGE_ASKS)]}\n\n{passage}"))
    for messages, chat_id in followed_up(chats, FOLLOW_UPS, sizes["followup"], rng):
        add("followup", messages, **{"from": chat_id})
    rng.shuffle(rows.rows)
    return rows.rows


def user(text: str) -> list[dict]:
    """One user turn."""
    return [{"role": "user", "content": text}]


class PoolRows:
    """The rows of one pool as they are added: ids `<prefix>_<kind>/<i>` numbered per kind, sources
    `<prefix>_<kind>`."""

    def __init__(self, prefix: str) -> None:
        self.prefix, self.rows, self.counts = prefix, [], {}

    def add(self, kind: str, messages: list[dict], **extra) -> None:
        """Append a row of `kind` holding `messages` and the fields `extra`."""
        n = self.counts[kind] = self.counts.get(kind, 0) + 1
        source = f"{self.prefix}_{kind}"
        self.rows.append({"id": f"{source}/{n - 1}", "source": source, "messages": messages} | extra)


def followed_up(
    chats: list[dict], asks: tuple[str, ...], size: int, rng: random.Random
) -> list[tuple[list[dict], str]]:
    """(messages, id of the chat followed up) of `size` chats at most drawn from `chats` that hold one reply,
    ended on their own and are not themselves follow-ups, each then the next of `asks` in turn."""
    finished = [
        c
        for c in chats
        if c.get("finish_reason") == "stop"
        and not c["source"].endswith("_followup")
        and [m["role"] for m in c["messages"]].count("assistant") == 1
        and c["messages"][-1]["role"] == "assistant"
    ]
    drawn = rng.sample(finished, min(size, len(finished)))
    return [
        ([*chat["messages"], {"role": "user", "content": asks[i % len(asks)]}], chat["id"])
        for i, chat in enumerate(drawn)
    ]


def screened(pool: list[dict], folder: Path, earlier: tuple[str, ...], name: str) -> tuple[list[dict], dict]:
    """(pool, near duplicates dropped per source): `pool` less near duplicates of every evaluation prompt of
    the committed files under `folder`.

    Raises:
        RuntimeError: a prompt repeats one of the pool files `earlier` word for word (`name` the pool's).
    """
    from train.broad import EVALUATION_FILES

    def rows(file_name: str) -> list[dict]:
        return [json.loads(line) for line in (folder / file_name).read_text().splitlines()]

    evaluation = [row for file_name in EVALUATION_FILES for row in rows(file_name)]
    pool, near = drop_near_duplicates(pool, evaluation)
    asked = {json.dumps(row["messages"]) for file_name in earlier for row in rows(file_name)}
    repeated = [row["id"] for row in pool if json.dumps(row["messages"]) in asked]
    if repeated:
        raise RuntimeError(f"{name} prompts repeating an earlier pool's: {repeated[:10]}")
    return pool, near


def build_wide_pool(folder: Path, seed: int = 0) -> tuple[list[dict], dict[str, int]]:
    """(rows, near duplicates dropped per source): the fifth pool from the committed files under `folder`
    (data/smollm2), less near duplicates of every evaluation prompt.

    Raises:
        RuntimeError: a prompt repeats one of an earlier pool word for word.
    """
    from train.broad import POOL_FILES

    held = {name.lower() for name in element_names() + country_names()}
    pool = wide_prompts(committed_chats(folder, (FOLLOWED_FOLDER,)), held, seed)
    earlier = ("prompts_train.jsonl", "prompts_train_domains.jsonl", *POOL_FILES)
    return screened(pool, folder, earlier, "fifth-pool")
