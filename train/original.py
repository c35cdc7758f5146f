"""The first pool's chats with the replies their datasets hold instead of the target's own (issue: heads
that hold on prompts unlike their training data, "on-policy regeneration"): the llamafactory demo sets carry
a reply to every prompt we take, so the same prompts can train a head once on the target's regenerated
replies and once on the dataset's, and the two heads are judged side by side (configs/ablation/onpolicy.yaml).

    python scripts/prepare_data.py --original   # writes data/smollm2/original/shard-*.jsonl

The reply is the turn right after the first user turn (glaive's may be a function call, as JSON text),
dpo's `chosen` reply, and kto's reply whatever its label (150 of its 300 rows are labelled undesirable). Each
is cut to the reply budget the regenerated first pool had (128 tokens of the target's tokenizer), and a cut
reply is marked `finish_reason: "length"` as the regenerated ones are, so the two arms differ in whose words
the replies are, not in how long they may be.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path

from transformers import PreTrainedTokenizerBase

from train.prompts import LLAMAFACTORY_SETS, read_member

REPLY_BUDGET = 128  # max new tokens of the first pool's regeneration (data/smollm2/regen, regen_extra)
REPLY_ROLES = ("gpt", "assistant", "function_call")


def llamafactory_replies(archive: Path) -> dict[str, str]:
    """The dataset's reply to each prompt `train.prompts.llamafactory_prompts` takes from the llamafactory
    sdist `archive`, by the same row id ("alpaca_en_demo/12").

    Raises:
        ValueError: a row with no reply after its first user turn (named by set and index).
    """
    replies = {}
    for name in LLAMAFACTORY_SETS:
        for i, item in enumerate(json.loads(read_member(archive, f"/data/{name}.json"))):
            if "instruction" in item:
                reply = item["output"]
            elif "chosen" in item:
                reply = item["chosen"].get("value") or item["chosen"].get("content")
            else:
                turns = item.get("conversations") or item["messages"]
                roles = [turn.get("from") or turn.get("role") for turn in turns]
                first = next(k for k, role in enumerate(roles) if role in ("human", "user"))
                after = turns[first + 1] if first + 1 < len(turns) else None
                reply = (after.get("value") or after.get("content")) if after else None
                if after is not None and roles[first + 1] not in REPLY_ROLES:
                    reply = None
            if not reply or not str(reply).strip():
                raise ValueError(f"llamafactory {name}.json row {i}: no reply after the first user turn")
            replies[f"{name}/{i}"] = str(reply)
    return replies


def cut_reply(text: str, tokenizer: PreTrainedTokenizerBase, budget: int) -> tuple[str, bool]:
    """`text` cut at a token boundary of `tokenizer` to the longest prefix that still encodes to at most
    `budget` tokens (a cut prefix may encode to more tokens than it held inside the whole text, at
    multi-byte characters), and whether it was cut."""
    count = lambda piece: len(tokenizer(piece, add_special_tokens=False)["input_ids"])
    ends = [
        end
        for _, end in tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)["offset_mapping"]
    ]
    if len(ends) <= budget and count(text) <= budget:
        return text, False
    keep = min(budget, len(ends))
    while keep > 1 and count(text[: ends[keep - 1]]) > budget:
        keep -= 1
    return text[: ends[keep - 1]], True


def original_chats(
    regenerated: Iterable[dict], replies: dict[str, str], tokenizer: PreTrainedTokenizerBase, budget: int
) -> list[dict]:
    """The regenerated chats whose id has a dataset reply, each with its prompt as it was and the dataset's
    reply (cut to `budget` tokens) in place of the target's, in the order given."""
    rows = []
    for row in regenerated:
        if row["id"] not in replies:
            continue
        prompt = [m for m in row["messages"] if m["role"] != "assistant"]
        if len(prompt) != len(row["messages"]) - 1 or row["messages"][-1]["role"] != "assistant":
            roles = [m["role"] for m in row["messages"]]
            raise ValueError(f"chat {row['id']}: expected a prompt then one reply, found the roles {roles}")
        reply, cut = cut_reply(replies[row["id"]], tokenizer, budget)
        rows.append(
            {
                "id": row["id"],
                "source": row["source"],
                "messages": [*prompt, {"role": "assistant", "content": reply}],
                "finish_reason": "length" if cut else "stop",
            }
        )
    return rows
