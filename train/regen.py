"""Self-distillation: answer training prompts with the target itself (docs/design.md, Self-distillation: the
biggest lever on acceptance), batched, as resumable JSONL shards. Used by `scripts/regenerate.py`."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Iterable
from pathlib import Path

import torch
from torch import Tensor
from tqdm.auto import tqdm
from transformers import DynamicCache, PreTrainedModel, PreTrainedTokenizerBase

from heads.files import write_json, write_jsonl
from train.data import BadRow, _render, pad_token_id, read_rows, to_messages, trim_loop
from train.offline import weights_digest

LOOP_CHECK_EVERY = 16  # tokens: how often a growing reply is checked for a loop (`stop_loops`)
DECODING = {"skip_special_tokens": True, "clean_up_tokenization_spaces": False}  # a reply's text as generated
PARTIAL = "\ufffd"  # what decoding makes of the bytes of a character that a cut reply holds only part of
SETTINGS_FILE = "regen.json"  # in a regeneration folder: what answered its chats (`check_settings`)


@torch.no_grad()
def batched_generate(
    model: PreTrainedModel,
    input_ids: Tensor,
    attention_mask: Tensor,
    max_new_tokens: int,
    stop_ids: set[int],
    temperature: float = 0.0,
    generator: torch.Generator | None = None,
    looping: Callable[[list[int]], bool] | None = None,
) -> list[tuple[list[int], str]]:
    """Decode a left-padded batch, dropping each row from the batch (and its KV cache) as soon as it stops.

    `model.generate` keeps finished rows in the batch until the longest reply ends; on a CPU, where a step's
    cost grows with the rows in it, dropping them saves the long tail (replies vary from a few tokens to the
    cap). Greedy rows equal unpadded greedy decoding of the same prompt up to floating-point ties.

    Args:
        model: the target, in eval mode.
        input_ids, attention_mask: (B, L) left-padded prompts and their mask (1 = token, 0 = padding).
        max_new_tokens: reply length cap.
        stop_ids: tokens that end a reply (kept out of the returned reply).
        temperature: 0 = greedy; > 0 samples softmax(logits / temperature), nothing else applied.
        generator: random source for sampling.
        looping: called on a row's reply so far whenever its length is a multiple of `LOOP_CHECK_EVERY`;
            True ends the row there (a reply stuck in a repetition loop, `reply_loops`).
    Returns:
        per row, (reply token ids without the stop token, why it ended: "stop" (a stop token), "loop"
        (`looping`) or "length" (max_new_tokens)).
    """
    if input_ids.shape != attention_mask.shape or input_ids.dim() != 2:
        raise ValueError(
            f"input_ids {tuple(input_ids.shape)} and attention_mask {tuple(attention_mask.shape)} "
            "must be the same (B, L) shape"
        )
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    device = input_ids.device
    mask = attention_mask.to(device=device, dtype=torch.long)
    position = (mask.cumsum(-1) - 1).clamp(min=0)  # left padding: each row's positions start at 0
    cache = DynamicCache(config=model.config)
    replies: list[list[int]] = [[] for _ in range(input_ids.shape[0])]
    ended = ["length"] * input_ids.shape[0]
    alive = torch.arange(input_ids.shape[0], device=device)
    step_input, step_position = input_ids, position
    stop = torch.tensor(sorted(stop_ids), device=device)
    for step in range(max_new_tokens):
        logits = (
            model(
                input_ids=step_input,
                attention_mask=mask,
                position_ids=step_position,
                cache=cache,
                use_cache=True,
                logits_to_keep=1,
            )
            .logits[:, -1]
            .float()
        )
        if temperature > 0:
            probs = torch.softmax(logits / temperature, dim=-1)
            token = torch.multinomial(probs, 1, generator=generator).squeeze(-1)
        else:
            token = logits.argmax(-1)
        ends = torch.isin(token, stop)
        check = looping is not None and (step + 1) % LOOP_CHECK_EVERY == 0
        for i, (row, value, end) in enumerate(zip(alive.tolist(), token.tolist(), ends.tolist())):
            if end:
                ended[row] = "stop"
            else:
                replies[row].append(value)
                if check and looping(replies[row]):
                    ended[row], ends[i] = "loop", True
        keep = (~ends).nonzero().squeeze(-1)
        if keep.numel() == 0:
            break
        if keep.numel() < alive.numel():  # drop finished rows from the batch and the cache
            alive, token, mask = alive[keep], token[keep], mask[keep]
            step_position = step_position[keep]
            cache.batch_select_indices(keep)
        step_input = token[:, None]
        step_position = step_position[:, -1:] + 1
        mask = torch.cat([mask, mask.new_ones(mask.shape[0], 1)], dim=1)
    return list(zip(replies, ended))


def reply_loops(ids: list[int], tokenizer: PreTrainedTokenizerBase, keep: int) -> bool:
    """Whether the reply `ids` decodes to text with at least `keep` repeated runs of words (`trim_loop`)."""
    return trim_loop(tokenizer.decode(ids, **DECODING), keep) is not None


def loop_cut(ids: list[int], tokenizer: PreTrainedTokenizerBase, keep: int) -> list[int] | None:
    """The prefix of a finished reply at which `batched_generate` with `looping=reply_loops(keep)` would
    have ended it (to whole characters, `whole_characters`), or None where it would not have: how chats
    answered before `stop_loops` was set are brought under the same rule."""
    for length in range(LOOP_CHECK_EVERY, len(ids) + 1, LOOP_CHECK_EVERY):
        if reply_loops(ids[:length], tokenizer, keep):
            return whole_characters(ids[:length], tokenizer)
    return None


def whole_characters(ids: list[int], tokenizer: PreTrainedTokenizerBase) -> list[int]:
    """A cut reply's ids without the trailing tokens that hold only part of a character (a byte-level
    tokenizer splits an emoji or a CJK character over tokens): decoded, that part is U+FFFD, which training
    would tokenize again into tokens the target never produced."""
    ids = list(ids)
    while ids and tokenizer.decode(ids, **DECODING).endswith(PARTIAL):
        ids.pop()
    return ids


def read_prompts(path: str | Path, start: int = 0, limit: int | None = None) -> list[dict]:
    """Rows `start` to `limit` - 1 of a JSON/JSONL chat file, each with its own "id", or "<file name>:<line>"
    when it has none (the prompt pools' rows have theirs: the same chat whatever its line).

    Raises:
        BadRow: a line that is not a JSON object (naming the file and line).
        ValueError: no rows in the range.
    """
    path, rows = Path(path), []
    for number, row in read_rows(path):
        if isinstance(row, Exception):
            raise BadRow(f"{path}:{number}: {row}") from row
        rows.append({"id": f"{path.name}:{number}", **row})
    chosen = rows[start:limit]
    if not chosen:
        raise ValueError(f"{path}: no prompts in [{start}, {limit}) of {len(rows)} rows")
    return chosen


def _prompt(row: dict) -> list[dict]:
    """A prompt row's messages through its last user turn (a trailing reply is dropped)."""
    messages = to_messages(row, require_assistant=False)
    users = [i for i, message in enumerate(messages) if message["role"] == "user"]
    if not users:
        raise BadRow("no user turn to answer")
    return messages[: users[-1] + 1]


@torch.no_grad()
def regenerate(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    rows: Iterable[dict],
    out_dir: str | Path,
    batch_size: int = 16,
    max_new_tokens: int = 256,
    temperature: float = 0.0,
    shard_size: int = 256,
    seed: int = 0,
    max_prompt_tokens: int | None = None,
    drop_stale: bool = False,
    stop_loops: int = 0,
) -> dict[str, int]:
    """Answer every prompt with the target itself and write the chats as JSONL shards (self-distillation).

    Resumable: ids in finished shards are skipped and new shards continue the numbering. Output rows are
    {"id", "source", "messages": prompt + [{"role": "assistant", "content": reply}], "finish_reason"}, with
    finish_reason "stop" (an end-of-sequence token ended the reply), "length" (max_new_tokens hit) or "loop"
    (`stop_loops`).

    Args:
        model: the target, in eval mode.
        tokenizer: its tokenizer, with the chat template the heads will be trained on.
        rows: chat rows (`to_messages` formats) with a unique "id"; the prompt is everything through the last
            user turn (a reply after it is dropped); "source" is copied if present.
        out_dir: folder for shard-00000.jsonl, shard-00001.jsonl, ... (created).
        batch_size: prompts decoded together (left-padded; finished rows leave the batch, `batched_generate`).
        max_new_tokens: reply length cap.
        temperature: 0 = greedy; > 0 samples softmax(logits / temperature).
        shard_size: rows per shard; a killed run loses at most the shard in progress.
        seed: sampling seed.
        max_prompt_tokens: prompts longer than this (rendered, in tokens) are left out and counted, not
            answered: eager attention over a batch of them needs batch x heads x length^2 floats (one
            14k-token prompt in a batch of 48 asks for tens of GiB). None: no limit.
        drop_stale: first remove the finished chats whose prompt is no longer the prompt of their id in
            `rows` (`drop_stale_chats`), so they are answered again.
        stop_loops: > 0: end a reply once it holds this many repeated runs of words (`reply_loops`, checked
            every `LOOP_CHECK_EVERY` tokens), and first cut the finished "length" chats in `out_dir` where
            that rule would have ended them (`cut_looping_chats`). A small target's long greedy replies
            mostly loop to the cap; set it above the `data.trim_loops` the heads train with, so that trimming
            cuts these replies where it cuts the whole ones. 0: replies run to a stop token or the cap.
    Returns:
        {"skipped": rows already done, "generated": rows written now, "shards": shards written now,
        "too_long": prompts left out for max_prompt_tokens, "loops_cut": finished chats cut now,
        "partial_characters": finished chats whose cut reply ended in part of a character, trimmed now}.
    Raises:
        BadRow: a row without "id" or without a user turn, or not a chat, or an id naming two prompts.
        ValueError: `out_dir` holds chats answered with other settings (`check_settings`).
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    rows = list(rows)
    prompts = {}  # id -> prompt, every row checked before anything is written
    for row in rows:
        if "id" not in row:
            raise BadRow(f"prompt row without 'id' (keys: {sorted(row)})")
        prompt = _prompt(row)
        if prompts.setdefault(row["id"], prompt) != prompt:  # the second was dropped without a word
            raise BadRow(f"prompt id {row['id']!r} names two different prompts")
    check_settings(
        out,
        {
            "target_digest": weights_digest(model),  # (not its path: another machine's differs)
            "chat_template": hashlib.sha256(str(tokenizer.chat_template).encode()).hexdigest()[:16],
            "max_new_tokens": max_new_tokens,
            "temperature": temperature,
            "seed": seed if temperature > 0 else None,
        },
    )
    if drop_stale:
        drop_stale_chats(out, rows)
    partial = len(trim_partial_characters(out))
    loops_cut = len(cut_looping_chats(out, tokenizer, stop_loops)) if stop_loops > 0 else 0
    done = {row["id"] for path in out.glob("shard-*.jsonl") for _, row in read_rows(path)}
    todo, skipped = {}, 0
    for row in rows:
        skipped += row["id"] in done
        if row["id"] not in done and row["id"] not in todo:
            todo[row["id"]] = {"id": row["id"], "source": row.get("source"), "messages": prompts[row["id"]]}
    todo, too_long = list(todo.values()), 0
    if max_prompt_tokens is not None:
        lengths = [
            len(
                tokenizer(
                    _render(tokenizer, row["messages"], generation_prompt=True), add_special_tokens=False
                )["input_ids"]
            )
            for row in todo
        ]
        too_long = sum(n > max_prompt_tokens for n in lengths)
        todo = [row for row, n in zip(todo, lengths) if n <= max_prompt_tokens]
    next_shard = max((int(p.stem.removeprefix("shard-")) for p in out.glob("shard-*.jsonl")), default=-1) + 1
    eos = model.generation_config.eos_token_id
    stop_ids = set(eos if isinstance(eos, list) else [tokenizer.eos_token_id if eos is None else eos])
    pad_id = pad_token_id(tokenizer)
    generator = torch.Generator(device=model.device).manual_seed(seed)
    padding_side, tokenizer.padding_side = tokenizer.padding_side, "left"  # decoder-only: pad on the left
    pad_token, tokenizer.pad_token_id = tokenizer.pad_token_id, pad_id
    looping = (lambda ids: reply_loops(ids, tokenizer, stop_loops)) if stop_loops > 0 else None
    bar = tqdm(total=len(todo), desc="regenerate", unit="prompt")
    try:
        for start in range(0, len(todo), shard_size):
            chunk = todo[start : start + shard_size]
            texts = [_render(tokenizer, row["messages"], generation_prompt=True) for row in chunk]
            order = sorted(range(len(chunk)), key=lambda i: len(texts[i]))  # similar lengths: less padding
            for b in range(0, len(order), batch_size):
                batch = order[b : b + batch_size]
                inputs = tokenizer(
                    [texts[i] for i in batch], add_special_tokens=False, padding=True, return_tensors="pt"
                ).to(model.device)
                outputs = batched_generate(
                    model,
                    inputs["input_ids"],
                    inputs["attention_mask"],
                    max_new_tokens,
                    stop_ids,
                    temperature=temperature,
                    generator=generator,
                    looping=looping,
                )
                for i, (new_tokens, reason) in zip(batch, outputs):
                    if reason != "stop":  # cut by the cap or a loop: maybe inside a character
                        new_tokens = whole_characters(new_tokens, tokenizer)
                    reply = tokenizer.decode(new_tokens, **DECODING)
                    chunk[i]["messages"] = chunk[i]["messages"] + [{"role": "assistant", "content": reply}]
                    chunk[i]["finish_reason"] = reason
                bar.update(len(batch))
            write_jsonl(out / f"shard-{next_shard:05d}.jsonl", chunk)
            next_shard += 1
    finally:
        tokenizer.padding_side, tokenizer.pad_token_id = padding_side, pad_token
        bar.close()
    return {
        "skipped": skipped,
        "generated": len(todo),
        "shards": -(-len(todo) // shard_size),
        "too_long": too_long,
        "loops_cut": loops_cut,
        "partial_characters": partial,
    }


def _rewrite_chats(out_dir: str | Path, change: Callable[[dict], dict | None]) -> list[str]:
    """Pass every finished chat in `out_dir` through `change` (the chat itself: kept as it is; another dict:
    kept in its place; None: removed), rewriting atomically each shard where one changed; returns the ids of
    the chats changed or removed."""
    changed = []
    for path in sorted(Path(out_dir).glob("shard-*.jsonl")):
        chats, before = [], len(changed)
        for number, chat in read_rows(path):
            if isinstance(chat, Exception):
                raise BadRow(f"{path}:{number}: {chat}") from chat
            new = change(chat)
            if new is not chat:
                changed.append(chat["id"])
            if new is not None:
                chats.append(new)
        if len(changed) > before:
            write_jsonl(path, chats)
    return changed


def drop_stale_chats(out_dir: str | Path, rows: list[dict]) -> list[str]:
    """Remove from the shards in `out_dir` every chat whose id is among `rows` but whose prompt (its messages
    before the reply) differs from that row's prompt now; each shard is rewritten atomically. Chats of ids
    not in `rows` are kept.

    Returns:
        the ids removed.
    """
    prompts = {row["id"]: _prompt(row) for row in rows}

    def keep_current(chat: dict) -> dict | None:
        now = prompts.get(chat.get("id"))
        return None if now is not None and chat["messages"][:-1] != now else chat

    return _rewrite_chats(out_dir, keep_current)


def cut_looping_chats(out_dir: str | Path, tokenizer: PreTrainedTokenizerBase, keep: int) -> list[str]:
    """Cut every finished chat in `out_dir` where `stop_loops=keep` would have ended it (`loop_cut` on the
    reply's tokens), marking it "loop": replies that ran to the cap ("length"), and those that looped on and
    ended with a stop token later than one loop check after the cut; each shard that changes is rewritten
    atomically.

    Returns:
        the ids cut.
    """

    def cut(chat: dict) -> dict:
        reason = chat.get("finish_reason")
        if reason not in ("length", "stop") or chat["messages"][-1]["role"] != "assistant":
            return chat
        ids = tokenizer(chat["messages"][-1]["content"], add_special_tokens=False)["input_ids"]
        prefix = loop_cut(ids, tokenizer, keep)
        if prefix is None or (reason == "stop" and len(prefix) + LOOP_CHECK_EVERY > len(ids)):
            return chat  # (a stop within one check of where the rule would cut: as generation ends it)
        reply = {**chat["messages"][-1], "content": tokenizer.decode(prefix, **DECODING)}
        return {**chat, "messages": [*chat["messages"][:-1], reply], "finish_reason": "loop"}

    return _rewrite_chats(out_dir, cut)


def trim_partial_characters(out_dir: str | Path) -> list[str]:
    """Drop the part of a character that ends a cut reply ("length" or "loop") in `out_dir` (U+FFFD, how
    chats answered before `whole_characters` store it), rewriting each shard that changes atomically.

    Returns:
        the ids trimmed.
    """

    def trim(chat: dict) -> dict:
        reply = chat["messages"][-1] if chat.get("messages") else {}
        content = reply.get("content")
        cut = chat.get("finish_reason") in ("length", "loop") and reply.get("role") == "assistant"
        if not (cut and isinstance(content, str) and content.endswith(PARTIAL)):
            return chat
        return {**chat, "messages": [*chat["messages"][:-1], {**reply, "content": content.rstrip(PARTIAL)}]}

    return _rewrite_chats(out_dir, trim)


def check_settings(out_dir: str | Path, settings: dict) -> None:
    """Refuse to add chats to `out_dir` under other settings than its chats were answered with (another
    target, template, reply cap, temperature or seed: the folder would mix two kinds of reply without a
    word); the first run writes them (`SETTINGS_FILE`). A folder of chats from before this file is adopted
    as it is (its settings cannot be read back), with a note."""
    file = Path(out_dir) / SETTINGS_FILE
    if not file.is_file():
        if any(Path(out_dir).glob("shard-*.jsonl")):
            print(f"{out_dir}: no {SETTINGS_FILE}; its chats are taken as answered with these settings")
        write_json(file, settings)
        return
    recorded = json.loads(file.read_text())
    changed = [f"{k} {recorded.get(k)!r} -> {v!r}" for k, v in settings.items() if recorded.get(k) != v]
    if changed:
        raise ValueError(
            f"{out_dir}: its chats were answered with other settings ({'; '.join(changed)}): answer into "
            f"another folder, or remove {file.name} and the shards to start again"
        )
