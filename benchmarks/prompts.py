"""The benchmark's prompts (`scripts/bench.py`, the ablation harness, the quickstart): the held-out
evaluation files by category, in-source (chat, instruction, code: kinds the training pools hold, other
prompts) and held-out-source (`--heldout`: kinds from sources no training file reads, train/heldout.py); the
columns of several reply lengths; and the loop test the tables report beside them.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import torch

CHAT_SOURCES = {"chitchat", "chitchat_starter"}  # prompts_eval.jsonl sources of the "chat" category
CATEGORIES = ("chat", "instruction", "code")  # in-source: kinds the training pools hold (other prompts)
HELDOUT_FILE = "prompts_eval_heldout.jsonl"  # held-out-source categories (train/heldout.py builds them)
HELDOUT_CATEGORIES = ("summary", "open_qa", "creative", "system", "followup")  # train.heldout's
IN_SOURCE, HELD_OUT = "in-source", "held-out"  # the pooled columns of each kind
ALL = "all"  # the column pooling every category of one reply length
# Each held-out kind's counterpart in the third training pool (train/broad.py): prompts of that kind that the
# shipped heads were trained on. A head's tau on them, beside its tau on the held-out prompts, splits the gap
# to the in-source kinds into what the kind of text costs and what not having seen the prompt's source costs.
SEEN_SOURCES = {
    "summary": "broad_summary",
    "open_qa": "broad_explain",
    "creative": "broad_writing",
    "system": "broad_system",
    "followup": "broad_followup",
}
SEEN = "seen"  # the pooled column of the seen categories ("seen_<kind>")


def load_prompts(
    data_dir: Path, n: int, calibration: int, skip: int = 0, heldout: bool = False
) -> tuple[dict[str, list[dict]], list[dict]]:
    """{category: n rows after the first `skip`} of prompts_eval.jsonl (chat, instruction) and
    prompts_code_eval.jsonl (code), and the calibration rows: the last chat rows, disjoint from the benchmark
    rows. `skip` picks rows that a run with skip=0 never reports, to choose trees or bounds on. With
    `heldout`, also the held-out-source categories of prompts_eval_heldout.jsonl (`HELDOUT_CATEGORIES`)."""
    rows = [json.loads(line) for line in (data_dir / "prompts_eval.jsonl").read_text().splitlines()]
    chat = [r for r in rows if r["source"] in CHAT_SOURCES]
    instruction = [r for r in rows if r["source"] not in CHAT_SOURCES]
    code = [json.loads(line) for line in (data_dir / "prompts_code_eval.jsonl").read_text().splitlines()]
    if skip + n + calibration > len(chat):
        raise SystemExit(
            f"--skip-prompts {skip} + --prompts {n} + --calibration-prompts {calibration} exceed the "
            f"{len(chat)} chat prompts"
        )
    for name, found in (("instruction", instruction), ("code", code)):
        if skip + n > len(found):
            raise SystemExit(f"--skip-prompts {skip} + --prompts {n} exceed the {len(found)} {name} prompts")
    window = slice(skip, skip + n)
    prompts = {"chat": chat[window], "instruction": instruction[window], "code": code[window]}
    if heldout:
        path = data_dir / HELDOUT_FILE
        if not path.is_file():
            raise SystemExit(f"{path} is missing: build it with python scripts/prepare_data.py --heldout")
        rows = [json.loads(line) for line in path.read_text().splitlines()]
        for category in HELDOUT_CATEGORIES:
            found = [r for r in rows if r["source"] == f"heldout_{category}"]
            if skip + n > len(found):
                raise SystemExit(
                    f"--skip-prompts {skip} + --prompts {n} exceed the {len(found)} {category} prompts"
                )
            prompts[category] = found[window]
    return prompts, chat[len(chat) - calibration :]


def at_lengths(prompts: dict[str, list[dict]], lengths: list[int], long_prompts: int | None = None):
    """The benchmark's columns: {label: (rows, new tokens)}. The first length keeps the category names;
    each further length N adds "<category>@N" columns over the first `long_prompts` rows (all: None)."""
    columns = {category: (rows, lengths[0]) for category, rows in prompts.items()}
    for n in lengths[1:]:
        columns |= {f"{category}@{n}": (rows[:long_prompts], n) for category, rows in prompts.items()}
    return columns


def pooled_labels(label: str) -> list[str]:
    """The pooled columns a category column also counts in: its kind (in-source or held-out) and "all", both
    at its length (replies of other lengths are pooled apart: "all@256")."""
    category, _, length = label.partition("@")
    kind = IN_SOURCE if category in CATEGORIES else HELD_OUT
    suffix = f"@{length}" if length else ""
    return [kind + suffix, ALL + suffix]


def prompt_ids(tokenizer, row: dict) -> torch.Tensor:
    """(1, T) chat-template ids of a prompt row's messages."""
    return tokenizer.apply_chat_template(
        row["messages"], add_generation_prompt=True, return_dict=True, return_tensors="pt"
    )["input_ids"]


def load_seen_prompts(files: list[Path], n: int, seed: int = 0) -> dict[str, list[dict]]:
    """{"seen_<kind>": n prompt rows} for each held-out kind, drawn (seeded) from the regenerated chats in
    `files` whose source is the kind's training counterpart (`SEEN_SOURCES`): each chat's messages before its
    last reply, the reply the head learnt from left out. ValueError naming the source, the files and the count
    when a source has fewer than n chats."""
    by_source: dict[str, list[dict]] = {}
    for path in files:
        for line in Path(path).read_text().splitlines():
            chat = json.loads(line)
            if chat.get("source") in SEEN_SOURCES.values() and chat["messages"][-1]["role"] == "assistant":
                by_source.setdefault(chat["source"], []).append(chat)
    rng, out = random.Random(seed), {}
    for kind, source in SEEN_SOURCES.items():
        found = sorted(by_source.get(source, []), key=lambda c: c["id"])
        if len(found) < n:
            names = ", ".join(str(f) for f in files) or "no files"
            raise ValueError(f"{n} {source!r} chats wanted for seen_{kind}, found {len(found)} in {names}")
        rows = rng.sample(found, n)
        out[f"seen_{kind}"] = [
            {"id": c["id"], "source": source, "messages": c["messages"][:-1]} for c in rows
        ]
    return out


LOOP_RUN = 8  # tokens


def loops(reply: list[int], run: int = LOOP_RUN) -> bool:
    """Whether a reply ends in a repetition loop: fewer than half the `run`-token runs of its second half are
    distinct (a small target's long greedy replies often repeat one sentence to the length cap, which drafts
    predict easily: tau on such replies says little about other text)."""
    half = reply[len(reply) // 2 :]
    runs = [tuple(half[i : i + run]) for i in range(len(half) - run + 1)]
    return bool(runs) and len(set(runs)) < len(runs) / 2
