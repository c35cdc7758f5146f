"""The sixth training pool (`scripts/prepare_data.py --varied`; licences in data/SOURCES.md): the kinds of the
held-out-source benchmark that heads still lose tau on (summaries and rewrites of a given text, open
questions about named things, long-form writing, long system prompts, follow-ups), asked in this module's own
words about material no earlier pool (nor `train.heldout`) reads:

- `varied_passage`: passages of three public-domain texts of the Canterbury compression corpus that brotli's
  sdist tests with: the proceedings of the Library of Congress "Workshop on Electronic Texts" (1992, prose),
  Milton's *Paradise Lost* (verse) and Shakespeare's *As You Like It* (a play), to summarise, paraphrase,
  list the points of or explain.
- `varied_explain`, `varied_compare`, `varied_writing`, `varied_system`: terms of five topic lists (the names
  of pygments' lexers: programming languages and file formats; the dog breeds and the man-made objects of
  the ImageNet classes in timm; films of bokeh-sampledata's CC0 Wikidata table; the ID3 music genres of
  tinytag), asked about, compared in pairs, written about at length (300-500 words), and asked after a long
  system prompt of one of five personas.
- `varied_quote`: the Sun Tzu quotations (Lionel Giles' 1910 translation) of nltk's `suntsu` chatbot, to
  explain or apply.
- `varied_followup`: a committed first-turn chat of the fifth pool (`regen_wide/`) that ended on its own,
  then a follow-up of this module's list.

Terms that name a held-out topic (a chemical element or a country, whole words) are left out; every prompt is
checked against the evaluation prompts by `drop_near_duplicates` and against every earlier pool's prompts
word for word (`build_varied_pool`).
"""

from __future__ import annotations

import ast
import random
import re
import sqlite3
import tempfile
from pathlib import Path

from train.heldout import _a, country_names, element_names, passages
from train.prompts import fetch, read_member
from train.wide import PoolRows, TopicDraw, followed_up, names_held_out, screened, user

BROTLI = ("brotli", "1.2.1", True)  # tests/testdata/{lcet10,plrabn12,asyoulik}.txt (Canterbury corpus)
PYGMENTS = ("pygments", "2.21.0", False)  # pygments/lexers/_mapping.py
TIMM = ("timm", "1.0.31", False)  # timm/data/_info/imagenet_synsets.txt, imagenet_synset_to_lemma.txt
BOKEH_SAMPLEDATA = ("bokeh-sampledata", "2026.1", False)  # bokeh_sampledata/_data/movies.db (CC0 there)
TINYTAG = ("tinytag", "2.3.2", False)  # tinytag/tinytag.py
NLTK = ("nltk", "3.10.4", False)  # nltk/chat/suntsu.py
PINS = (BROTLI, PYGMENTS, TIMM, BOKEH_SAMPLEDATA, TINYTAG, NLTK)
# bokeh-sampledata's licences/datasets.json records this movies.db (the Wikidata snapshot that replaced the
# CC BY-NC OMDb one) as CC0-1.0; `films` refuses any other file
MOVIES_SHA256 = "1d9c6a02e488d0354b2309e16130c58820a91ac2ce417e814c5964f9579a65ac"

VARIED_FILE = "prompts_train_varied.jsonl"
FOLLOWED_FOLDER = "regen_wide"  # the chats the follow-ups continue
EARLIER_POOLS = (
    "prompts_train.jsonl",
    "prompts_train_domains.jsonl",
    "prompts_train_broad.jsonl",
    "prompts_train_broad2.jsonl",
    "prompts_train_wide.jsonl",
)
SIZES = {
    "explain": 420,
    "compare": 100,
    "writing": 280,
    "system": 200,
    "passage": 300,
    "quote": 40,
    "followup": 260,
}
EXPLAIN = {  # questions per topic, asked in turn
    "language": (
        "What is {term}, and what kind of programs or files is it used for?",
        "Show me a short example of {term} and explain it line by line.",
        "What are the strengths and weaknesses of {term}?",
    ),
    "dog breed": (
        "Tell me about the {term}: where the breed comes from, its temperament and its care.",
        "Is the {term} a good dog for a family with young children?",
        "How much exercise and grooming does a {term} need?",
    ),
    "object": (
        "What is {a_term}, and how does it work?",
        "Describe {a_term}: what it looks like, what it is made of and what it is for.",
        "What is the history of the {term}?",
    ),
    "film": (
        "What is the film {term} about?",
        "Who would enjoy the film {term}, and why?",
        "Why do people still talk about the film {term}?",
    ),
    "genre": (
        "What is {term} music, and where did it come from?",
        "What instruments and features are typical of {term} music?",
        "How would you introduce a friend to {term} music?",
    ),
}
COMPARE = (
    "What are the main differences between {x} and {y}?",
    "Should a beginner start with {x} or {y}? Compare the two.",
    "Compare {x} and {y} in a short table, then sum up in two sentences.",
)
COMPARED = ("language", "dog breed", "genre")  # pairs that invite a comparison
PHRASES = {  # a term as a writing or comparison task names it
    "language": "{term}",
    "dog breed": "the {term}",
    "object": "the {term}",
    "film": "the film {term}",
    "genre": "{term} music",
}
STORIED = ("dog breed", "object", "film", "genre")  # the topics written about at length (not a file format)
WRITING = (
    "Write a short story of about 400 words in which {term} plays an important part.",
    "Write an essay of about 350 words on {term} and why people care about it.",
    "Write a poem of six stanzas inspired by {term}.",
    "Write a magazine feature of about 450 words about {term}.",
    "Write a dialogue of about 300 words between two friends who disagree about {term}.",
    "Write the opening of a mystery novel, about 500 words, in which {term} turns out to be a clue.",
    "Write a speech of about 300 words for a school assembly about {term}.",
    "Write a blog post of about 400 words about a weekend spent learning about {term}.",
)
PERSONAS = {
    "language": "a senior software engineer who mentors junior developers",
    "dog breed": "a veterinarian who advises new dog owners",
    "object": "a guide at a museum of science and technology",
    "film": "a film critic who hosts a weekly radio programme",
    "genre": "a music historian who teaches an evening class",
}
GUIDELINES = (
    "Open with the direct answer in one or two sentences, then explain.",
    "Write for a curious adult with no special training in the subject.",
    "Explain every technical word the first time you use it.",
    "Use headings only when the answer runs to several parts.",
    "Give at least one concrete example.",
    "Say plainly when something is a matter of taste or debate.",
    "Do not invent dates, names or numbers; leave out what you are unsure of.",
    "Keep a calm, respectful tone, also with rude messages.",
    "Never recommend a product or a shop by name.",
    "If the question is unclear, answer the most likely reading and say which one you chose.",
    "Do not repeat the question back to the user.",
    "Offer a short further reading or listening suggestion at the end.",
    "Keep answers under 300 words unless the user asks for more.",
    "Avoid slang and abbreviations.",
)
SYSTEM = (
    "You are {persona}. You answer messages that members of the public send through a website. The people "
    "who write to you range from curious teenagers to retired professionals; many read your answers on a "
    "phone and want something they can use straight away. Your aim is to be accurate, clear and kind, and "
    "to leave the reader knowing more than before.\n\nGuidelines:\n{rules}\n\nIf a question falls outside "
    "your field, say so in one sentence and then help as well as you can."
)
PASSAGE_ASKS = {
    "workshop": (
        "Summarise the main argument of this passage in a few sentences.",
        "List the key points of this passage as bullet points.",
        "Explain this passage to a student who knows nothing about the subject.",
        "Write a headline and a one-paragraph summary for this text.",
        "What questions does this passage raise? List three and answer them from the text.",
    ),
    "milton": (
        "Paraphrase these lines of Paradise Lost in plain modern English.",
        "What is happening in this passage from Paradise Lost? Summarise it.",
        "Explain the images and comparisons the poet uses in these lines.",
    ),
    "shakespeare": (
        "Rewrite this scene from As You Like It as modern prose.",
        "Summarise what happens in this scene, then describe each character in it.",
        "Explain what the characters mean in this exchange, in everyday English.",
    ),
}
# the prose (the nearest to a passage users paste) before the verse and the play
PASSAGE_SHARES = {"workshop": 0.44, "milton": 0.3, "shakespeare": 0.26}
QUOTE_ASKS = (
    'What does this saying from Sun Tzu\'s The Art of War mean, and how does it apply to daily life? "{q}"',
    'Explain this quotation and give a modern example of it: "{q}"',
    'Is this still good advice today? Discuss: "{q}"',
    'How could a team leader at work use this idea? "{q}"',
)
FOLLOW_UPS = (
    "Can you go into more detail on the second point?",
    "How would you explain that to a ten-year-old?",
    "What are the arguments against that?",
    "Could you give me a step-by-step version?",
    "Boil that down to a single sentence.",
    "What should I read or watch to learn more?",
    "Is there anything important you left out?",
    "Can you rewrite that as an email to a colleague?",
    "How has this changed over the years?",
    "Give me an example from everyday life.",
)
# names of the lexer list that are not a language or a format people ask about
LEXER_SKIP = re.compile(
    r"[+/]|session|console|template|traceback|output|token|\bdata\b|\blexer\b", re.IGNORECASE
)
# the non-ID3 entries of the genre list (a placeholder, jokes, sound effects, media types, a band)
GENRE_SKIP = {
    "Other", "Pranks", "Sound Clip", "Porn Groove", "Primus", "Podcast", "Audiobook", "Audio Theatre",
    "Speech", "Trailer", "Game", "Cult", "Terror", "Humour", "Satire", "Comedy", "Drum Solo", "Duet",
    "Revival", "Retro", "Abstract", "Eclectic", "Vocal", "Instrumental", "Bass", "Space", "Dream", "Acid",
    "AlternRock", "Bebob", "Psychadelic",  # misspelt there
}  # fmt: skip
QUOTE_SKIP = {"Please consider whether you can answer your own question."}  # the bot's, not Sun Tzu's


def workshop_passages() -> list[str]:
    """Passages of 150-320 words of the Workshop on Electronic Texts proceedings (`lcet10.txt`): its prose
    from the introduction to the closing END, paragraphs of 12 words or more (headings and rules left out)."""
    text = read_member(fetch(*BROTLI), "tests/testdata/lcet10.txt").decode("ascii").replace("\r", "")
    start = re.search(r"^\s*INTRODUCTION\s*$", text, re.MULTILINE).end()
    end = re.search(r"^\s*END\s*$", text, re.MULTILINE).start()
    paragraphs = [" ".join(p.split()) for p in re.split(r"\n\s*\n", text[start:end])]
    return passages([p for p in paragraphs if len(p.split()) >= 12])


def verse_passages(lines: list[str], low: int = 150, high: int = 320) -> list[str]:
    """Runs of consecutive lines of `low` to `high` words, each ending where a line closes a sentence (., ! or
    ?) once `low` words are in; a run that passes `high` first is dropped."""
    out, run, words = [], [], 0
    for line in lines:
        run.append(line)
        words += len(line.split())
        if words >= low and re.search(r"[.!?]['\"]?$", line.strip()):
            if words <= high:
                out.append("\n".join(run).strip("\n"))
            run, words = [], 0
        elif words > high:
            run, words = [], 0
    return out


def milton_passages() -> list[str]:
    """Passages of *Paradise Lost* (`plrabn12.txt`, from "Book I" to "[The End]"), book headings left out."""
    text = read_member(fetch(*BROTLI), "tests/testdata/plrabn12.txt").decode("ascii").replace("\r", "")
    body = text[text.index("\nBook I \n") : text.index("[The End]")]
    lines = [line.rstrip() for line in body.split("\n") if not re.fullmatch(r"\s*Book [IVX]+\s*", line)]
    return verse_passages([line for line in lines if line.strip()])


def shakespeare_passages() -> list[str]:
    """Passages of *As You Like It* (`asyoulik.txt`): its speeches from the first scene on, one line each
    ("ORLANDO: ...", stage directions in brackets), in runs of 150-320 words."""
    text = read_member(fetch(*BROTLI), "tests/testdata/asyoulik.txt").decode("ascii")
    body = text[re.search(r"^ACT I\s*$", text, re.MULTILINE).start() :]
    speeches = []
    for block in re.split(r"\n\s*\n", body):
        first, *rest = block.split("\n")
        if re.fullmatch(r"\s*(ACT|SCENE) [IVX]+.*", first):
            continue
        speaker, _, line = first.partition("\t")
        words = " ".join([line, *rest]).split()
        if words:
            speeches.append(f"{speaker.strip()}: {' '.join(words)}" if speaker.strip() else " ".join(words))
    return verse_passages(speeches)


def lexer_names() -> list[str]:
    """The names of pygments' lexers (`LEXERS` of its generated map, read with `ast`), less sessions,
    templates, tracebacks and combined lexers."""
    tree = ast.parse(read_member(fetch(*PYGMENTS), "pygments/lexers/_mapping.py").decode())
    for node in tree.body:
        if isinstance(node, ast.Assign) and getattr(node.targets[0], "id", None) == "LEXERS":
            names = [entry[1] for entry in ast.literal_eval(node.value).values()]
            return sorted({n for n in names if not LEXER_SKIP.search(n)})
    raise ValueError(f"{'=='.join(PYGMENTS[:2])} lexers/_mapping.py: no LEXERS map")


def imagenet_names() -> tuple[list[str], list[str]]:
    """(dog breeds, man-made objects): the first lemma of ImageNet-1k classes 151-268 and 398-999 (timm's
    synset list in class order and its lemma table; the other classes are animals and natural things)."""
    archive = fetch(*TIMM)
    synsets = read_member(archive, "timm/data/_info/imagenet_synsets.txt").decode().split()
    lemmas = dict(
        line.split("\t", 1)
        for line in read_member(archive, "timm/data/_info/imagenet_synset_to_lemma.txt").decode().splitlines()
    )
    names = [lemmas[s].split(", ")[0].strip() for s in synsets]
    if len(names) != 1000:
        raise ValueError(f"{'=='.join(TIMM[:2])}: {len(names)} ImageNet classes, expected 1000")
    return list(dict.fromkeys(names[151:269])), list(dict.fromkeys(names[398:]))


def films() -> list[str]:
    """ "Title (year)" of every film with a title and a director in bokeh-sampledata's CC0 `movies.db`."""
    import hashlib

    data = read_member(fetch(*BOKEH_SAMPLEDATA), "bokeh_sampledata/_data/movies.db")
    digest = hashlib.sha256(data).hexdigest()
    if digest != MOVIES_SHA256:
        raise ValueError(f"movies.db has sha256 {digest}, expected the CC0 snapshot's {MOVIES_SHA256}")
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "movies.db"
        path.write_bytes(data)
        with sqlite3.connect(path) as db:
            rows = db.execute("SELECT Title, Year FROM omdb WHERE Title != '' AND Director != ''").fetchall()
    return sorted({f"{title.strip()} ({year})" for title, year in rows if title.strip() and title.isascii()})


def genres() -> list[str]:
    """tinytag's ID3v1 genre names (its `_ID3V1_GENRES`, read with `ast`), less `GENRE_SKIP`."""
    tree = ast.parse(read_member(fetch(*TINYTAG), "tinytag/tinytag.py").decode())
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign) and getattr(node.targets[0], "id", None) == "_ID3V1_GENRES":
            return [g for g in ast.literal_eval(node.value) if g not in GENRE_SKIP]
    raise ValueError(f"{'=='.join(TINYTAG[:2])} tinytag.py: no _ID3V1_GENRES")


def sun_tzu() -> list[str]:
    """The chatbot's replies of nltk's `suntsu.py` that are quotations: eight words or more, each once, less
    `QUOTE_SKIP`."""
    tree = ast.parse(read_member(fetch(*NLTK), "nltk/chat/suntsu.py").decode())
    for node in tree.body:
        if isinstance(node, ast.Assign) and getattr(node.targets[0], "id", None) == "pairs":
            replies = [r.strip() for _, answers in ast.literal_eval(node.value) for r in answers]
            return list(dict.fromkeys(r for r in replies if len(r.split()) >= 8 and r not in QUOTE_SKIP))
    raise ValueError(f"{'=='.join(NLTK[:2])} chat/suntsu.py: no `pairs`")


def topic_terms() -> dict[str, list[str]]:
    """{topic: terms} of the five lists."""
    dogs, objects = imagenet_names()
    return {
        "language": lexer_names(),
        "dog breed": dogs,
        "object": objects,
        "film": films(),
        "genre": genres(),
    }


def varied_prompts(
    chats: list[dict], exclude: set[str], seed: int = 0, sizes: dict[str, int] | None = None
) -> list[dict]:
    """The pool, shuffled: `sizes` rows per kind at most (default `SIZES`), ids `varied_<kind>/<i>`, sources
    `varied_<kind>`; rows about terms name them and their topic (`terms`, `topic`: each term once per kind),
    passages their text (`text`).

    Args:
        chats: committed chats to follow up (`FOLLOWED_FOLDER`); those that hold one reply, ended on their
            own, and are not themselves follow-ups are drawn from.
        exclude: held-out topic names, lower-cased.
    """
    sizes = {**SIZES, **(sizes or {})}
    rng = random.Random(seed)
    rows = PoolRows("varied")
    add = rows.add

    pairs = [(t, topic) for topic, ts in topic_terms().items() for t in ts if not names_held_out(t, exclude)]
    # each kind draws from the whole lists (a term once per kind), so that the short ones (118 dog breeds,
    # 158 genres) are in every kind
    draw = TopicDraw(rng.sample(pairs, len(pairs)))
    for i in range(sizes["explain"]):
        term, topic = draw.take(i)
        asks = EXPLAIN[topic]
        text = asks[(i // len(draw.order)) % len(asks)].format(term=term, a_term=_a(term))
        add("explain", user(text), terms=[term], topic=topic)
    draw = TopicDraw(rng.sample(pairs, len(pairs)))
    for i in range(sizes["compare"]):
        (x, topic), (y, _) = draw.take(i, list(COMPARED)), draw.take(i, list(COMPARED))
        if _ != topic:  # a topic ran out between the two draws
            raise ValueError(f"compare: no second {topic} term left")
        phrase = PHRASES[topic]
        text = COMPARE[i % len(COMPARE)].format(x=phrase.format(term=x), y=phrase.format(term=y))
        add("compare", user(text), terms=[x, y], topic=topic)
    draw = TopicDraw(rng.sample(pairs, len(pairs)))
    for i in range(sizes["writing"]):
        term, topic = draw.take(i, list(STORIED))
        text = WRITING[i % len(WRITING)].format(term=PHRASES[topic].format(term=term))
        add("writing", user(text), terms=[term], topic=topic)
    draw = TopicDraw(rng.sample(pairs, len(pairs)))
    for i in range(sizes["system"]):
        term, topic = draw.take(i)
        rules = "\n".join(f"{k + 1}. {rule}" for k, rule in enumerate(rng.sample(GUIDELINES, 8)))
        system = SYSTEM.format(persona=PERSONAS[topic], rules=rules)
        asks = EXPLAIN[topic]
        question = asks[(i // len(draw.order)) % len(asks)].format(term=term, a_term=_a(term))
        add("system", [{"role": "system", "content": system}, *user(question)], terms=[term], topic=topic)
    texts = {
        "workshop": workshop_passages(),
        "milton": milton_passages(),
        "shakespeare": shakespeare_passages(),
    }
    drawn = [
        (name, passage)
        for name, found in texts.items()
        for passage in rng.sample(found, min(round(sizes["passage"] * PASSAGE_SHARES[name]), len(found)))
    ]
    for i, (name, passage) in enumerate(rng.sample(drawn, len(drawn))):
        asks = PASSAGE_ASKS[name]
        add("passage", user(f"{asks[i % len(asks)]}\n\n{passage}"), text=name)
    quotes = sun_tzu()
    for i, quote in enumerate(rng.sample(quotes, min(sizes["quote"], len(quotes)))):
        add("quote", user(QUOTE_ASKS[i % len(QUOTE_ASKS)].format(q=quote)))
    for messages, chat_id in followed_up(chats, FOLLOW_UPS, sizes["followup"], rng):
        add("followup", messages, **{"from": chat_id})
    rng.shuffle(rows.rows)
    return rows.rows


def build_varied_pool(folder: Path, seed: int = 0) -> tuple[list[dict], dict[str, int]]:
    """(rows, near duplicates dropped per source): the sixth pool from the committed files under `folder`
    (data/smollm2), less near duplicates of every evaluation prompt.

    Raises:
        RuntimeError: a prompt repeats one of an earlier pool word for word.
    """
    from train.broad import committed_chats

    held = {name.lower() for name in element_names() + country_names()}
    pool = varied_prompts(committed_chats(folder, (FOLLOWED_FOLDER,)), held, seed)
    return screened(pool, folder, EARLIER_POOLS, "sixth-pool")
