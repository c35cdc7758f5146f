"""Training data for draft heads: chats rendered with the target's own template and masked to assistant
tokens, batching, the EAGLE-3 draft vocabulary (2503.01840 §3), and self-distillation (Medusa 2401.10774
§3.3.1)."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch
from datasets import Dataset, Features, Value
from datasets import Sequence as SequenceFeature
from jinja2.exceptions import TemplateError
from torch import Tensor
from torch.nn.utils.rnn import pad_sequence
from transformers import PreTrainedTokenizerBase

_ROLES = {  # ShareGPT and OpenAI role names -> the names chat templates expect
    "human": "user", "user": "user", "system": "system",
    "gpt": "assistant", "assistant": "assistant", "chatgpt": "assistant", "bing": "assistant",
}  # fmt: skip
# a row's "finish_reason": none (a chat from elsewhere), "stop" (its reply ended itself), or how
# `train.regen` cut it ("length": the cap; "loop": a loop); the end-of-turn after a cut is no target
FINISH_REASONS = (None, "stop", "length", "loop")


class BadRow(ValueError):
    """A row that cannot become a training example; the message names the key and the problem."""


def read_rows(path: str | Path) -> Iterator[tuple[int, dict | Exception]]:
    """Read a JSON list (first non-blank character `[`) or JSONL file, yielding errors instead of stopping.

    Args:
        path: the file.
    Yields:
        (number, row or error): JSONL: 1-based line number (blank lines skipped) and the row or its
        `json.JSONDecodeError`; JSON list: 1-based element index, or once the error's line and the error if
        the file does not parse. Valid JSON that is not an object comes as a `BadRow`.
    """
    text = Path(path).read_text(encoding="utf-8")
    if text.lstrip().startswith("["):
        try:
            items = json.loads(text)
        except json.JSONDecodeError as error:  # one slip loses every row of the file: never a skipped row
            raise ValueError(
                f"{path}:{error.lineno}: not valid JSON ({error.msg}); a JSON list parses as a whole, so "
                f"every row of this {len(text):,}-character file would be lost (JSONL keeps the other rows)"
            ) from error
        yield from ((number, _as_row(item)) for number, item in enumerate(items, start=1))
        return
    # "\n" only: str.splitlines also splits a row at U+2028, U+2029, \x85 ... (valid in JSON strings)
    for number, line in enumerate(text.split("\n"), start=1):
        if line.strip():
            try:
                yield number, _as_row(json.loads(line))
            except json.JSONDecodeError as error:
                yield number, error


def _as_row(item: object) -> dict | BadRow:
    """The item if it is a JSON object, else the error to report."""
    return item if isinstance(item, dict) else BadRow(f"row is a JSON {type(item).__name__}, not an object")


def _turns(row: dict, key: str, role_key: str, content_key: str) -> list[dict]:
    """Normalise one list of turns (ShareGPT or OpenAI style) to [{"role", "content"}]."""
    if not isinstance(row[key], list):
        raise BadRow(f"'{key}' is a {type(row[key]).__name__}, expected a list of turns")
    messages = []
    for i, turn in enumerate(row[key]):
        if not isinstance(turn, dict) or role_key not in turn or content_key not in turn:
            raise BadRow(f"'{key}'[{i}] must be an object with '{role_key}' and '{content_key}' keys")
        if not isinstance(turn[role_key], str) or turn[role_key] not in _ROLES:
            raise BadRow(f"'{key}'[{i}].{role_key}: unknown role {turn[role_key]!r}")
        if not isinstance(turn[content_key], str):
            raise BadRow(f"'{key}'[{i}].{content_key}: non-string content")
        messages.append({"role": _ROLES[turn[role_key]], "content": turn[content_key]})
    if not messages:
        raise BadRow(f"'{key}': empty conversation")
    # an optional system turn first, then user and assistant turns in turn from a user's: a reply with no
    # question before it, or a system turn later, would be trained as if the template had rendered a chat
    first = 1 if messages[0]["role"] == "system" else 0
    for i, message in enumerate(messages[first:], start=first):
        expected = "user" if (i - first) % 2 == 0 else "assistant"
        if message["role"] != expected:
            raise BadRow(
                f"'{key}'[{i}].{role_key}: expected role {expected!r} here, found {message['role']!r}"
            )
        if expected == "assistant" and not message["content"].strip():
            raise BadRow(
                f"'{key}'[{i}].{content_key}: empty assistant reply (it would train only end-of-turn)"
            )
    return messages


def to_messages(row: dict, require_assistant: bool = True) -> list[dict]:
    """Normalise a row to a list of {"role", "content"} messages.

    Formats: ShareGPT (`conversations`: [{"from", "value"}], from in human/user/gpt/assistant/chatgpt/bing/
    system), OpenAI (`messages`: [{"role", "content"}], the same names) and raw text (`text`). Raw text
    becomes the one message [{"role": "text", "content": text}], which `render_with_mask` tokenizes without
    a chat template and trains on every token (plain language modelling).

    Args:
        row: one JSON object.
        require_assistant: a chat must hold an assistant turn (False for prompts to regenerate).
    Returns:
        Messages with roles in {"system", "user", "assistant"}, or the single "text" message.
    Raises:
        BadRow: missing key, wrong type, unknown role, empty conversation, no assistant turn.
    """
    if "conversations" in row:
        key, messages = "conversations", _turns(row, "conversations", "from", "value")
    elif "messages" in row:
        key, messages = "messages", _turns(row, "messages", "role", "content")
    elif "text" in row:
        if not isinstance(row["text"], str) or not row["text"]:
            raise BadRow(f"'text': expected a non-empty string, got {type(row['text']).__name__}")
        return [{"role": "text", "content": row["text"]}]
    else:
        raise BadRow(f"no 'conversations', 'messages' or 'text' key (keys: {sorted(row)})")
    if require_assistant and not any(m["role"] == "assistant" for m in messages):
        raise BadRow(f"'{key}': no assistant turn")
    return messages


def _render(tokenizer: PreTrainedTokenizerBase, messages: list[dict], generation_prompt: bool) -> str:
    """The chat template's text; a conversation the template rejects is a bad row."""
    try:
        return tokenizer.apply_chat_template(
            messages, add_generation_prompt=generation_prompt, tokenize=False
        )
    except TemplateError as error:
        raise BadRow(f"the chat template rejected the conversation: {error}") from error


def _assistant_spans(
    tokenizer: PreTrainedTokenizerBase, messages: list[dict], cut_reply: bool = False
) -> tuple[str, list[tuple]]:
    """The full rendering and one (start, end) character span per assistant turn (see `render_with_mask`)."""
    full, spans = _render(tokenizer, messages, generation_prompt=False), []
    last = max(i for i, m in enumerate(messages) if m["role"] == "assistant") if cut_reply else -1
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        if i == 0:
            raise BadRow("'messages'[0]: the conversation opens with an assistant turn")
        prefix = _render(tokenizer, messages[:i], generation_prompt=True)
        through = _render(tokenizer, messages[: i + 1], generation_prompt=False)
        if not through.startswith(prefix) or not full.startswith(through):
            raise ValueError(
                f"chat template problem at message {i}: the text through this assistant turn does not extend "
                "the text of the turns before it with add_generation_prompt=True (or the full chat does not "
                f"extend it), so assistant tokens cannot be found by offsets. Prefix ends {prefix[-60:]!r}, "
                f"the longer text there reads {through[max(0, len(prefix) - 60) :][:80]!r}"
            )
        end = len(prefix) + len(through[len(prefix) :].rstrip())
        if i == last:  # a reply cut by a length cap: the template's end-of-turn marker was never generated
            for content in (str(message["content"]), str(message["content"]).strip()):  # as is, or trimmed
                at = through.find(content, len(prefix))
                if at >= 0:
                    end = at + len(content)
                    break
            else:
                raise BadRow(
                    f"'messages'[{i}]: the chat template rewrites the reply text, so the end of a cut "
                    "reply cannot be found"
                )
        spans.append((len(prefix), end))
    return full, spans


def render_with_mask(
    tokenizer: PreTrainedTokenizerBase, messages: list[dict], max_length: int, cut_reply: bool = False
) -> dict:
    """Tokenize a conversation with the tokenizer's own chat template and mark its assistant tokens.

    Reply i spans the characters from the end of render(messages[:i], add_generation_prompt=True) to the
    end of render(messages[:i+1]), trailing whitespace dropped: the reply plus the template's end-of-turn
    marker (`<|im_end|>`, `<|eot_id|>`, `<end_of_turn>`, ...), so the heads also learn to stop. No separator
    is hard-coded, and templates that inject a default system prompt need nothing special. The full
    rendering is tokenized once with `add_special_tokens=False` (the template writes BOS and the like); a
    token is an assistant token when its characters overlap a reply span. A raw-text message is tokenized
    with the tokenizer's special tokens plus EOS, and every token is trained.

    Args:
        tokenizer: a fast tokenizer (offsets are needed) with a chat template.
        messages: from `to_messages`.
        max_length: keep the first max_length tokens (ids and mask alike).
        cut_reply: the last reply was cut (a regenerated row with finish_reason "length" or "loop"):
            its tokens are targets, the end-of-turn marker after it is not (the target never chose to stop
            there, so nothing may learn to).
    Returns:
        {"input_ids": list[int], "loss_mask": list[int]}, equal lengths: loss_mask[t] = 1 when token t is a
        target the heads must predict (an assistant token, or any raw-text token).
    Raises:
        BadRow: the template rejects the chat, or it opens with an assistant turn.
        ValueError: a slow tokenizer, or a template that is not prefix-stable (it rewrites earlier turns,
            or its generation prompt differs from the header it renders before a reply).
    """
    if messages[0]["role"] == "text":
        ids = tokenizer(messages[0]["content"], add_special_tokens=True)["input_ids"]
        if tokenizer.eos_token_id is not None and ids[-1:] != [tokenizer.eos_token_id]:
            ids = ids + [tokenizer.eos_token_id]  # the end of the document is a target too
        return {"input_ids": ids[:max_length], "loss_mask": [1] * min(len(ids), max_length)}
    if not tokenizer.is_fast:
        raise ValueError(f"{type(tokenizer).__name__} is a slow tokenizer; loss masks need offset mappings")
    full, spans = _assistant_spans(tokenizer, messages, cut_reply)
    encoding = tokenizer(full, add_special_tokens=False, return_offsets_mapping=True)
    mask = [int(any(s < end and e > start for start, end in spans)) for s, e in encoding["offset_mapping"]]
    return {"input_ids": encoding["input_ids"][:max_length], "loss_mask": mask[:max_length]}


@dataclass
class DataReport:
    """What `build_dataset` read, kept and skipped, over all its files."""

    total: int = 0  # rows read, good and bad
    kept: int = 0  # rows in the dataset
    truncated: int = 0  # kept rows that reached max_length (cut, or exactly that long)
    loops_trimmed: int = 0  # kept rows whose last reply was cut inside a repetition loop (`trim_loop`)
    left_out: int = 0  # rows of a source the `sources` filter does not name (not read further, not bad)
    bad: dict[str, int] = field(default_factory=dict)  # reason -> rows skipped
    examples: list[str] = field(default_factory=list)  # the first 10 "file:line: reason: detail"

    def skip(self, where: str, reason: str, detail: str) -> None:
        """Count one skipped row."""
        self.bad[reason] = self.bad.get(reason, 0) + 1
        if len(self.examples) < 10:
            self.examples.append(f"{where}: {reason}: {detail}")

    def __str__(self) -> str:
        head = f"{self.kept}/{self.total} rows kept ({self.truncated} truncated), skipped: {self.bad}"
        if self.loops_trimmed:
            head += f", replies cut inside a repetition loop: {self.loops_trimmed}"
        if self.left_out:
            head += f", rows of other sources left out: {self.left_out}"
        return "\n".join([head] + [f"  {example}" for example in self.examples])


LOOP_GRAM = 8  # words: a run of this many words already seen in the same reply is a repeat


def trim_loop(text: str, keep: int) -> str | None:
    """`text` cut at the end of its `keep`-th repeated run of `LOOP_GRAM` words (a run already seen earlier
    in it), or None when it repeats less. A small target's greedy reply that runs to its length cap is most
    often one sentence or paragraph over and over (76 of the 80 capped replies of the first 128 answered with
    512 tokens, data/smollm2/regen_broad); the head learns that the target loops from the first repeats, and
    the rest would fill the loss with them."""
    words = list(re.finditer(r"\S+", text))
    seen: set[tuple[str, ...]] = set()
    repeats = 0
    for i in range(len(words) - LOOP_GRAM + 1):
        gram = tuple(w.group() for w in words[i : i + LOOP_GRAM])
        if gram in seen:
            repeats += 1
            if repeats >= keep:
                return text[: words[i + LOOP_GRAM - 1].end()]
        else:
            seen.add(gram)
    return None


def build_dataset(
    files: str | Path | Sequence[str | Path],
    tokenizer: PreTrainedTokenizerBase,
    max_length: int,
    max_bad_fraction: float = 0.05,
    trim_loops: int = 0,
    sources: Sequence[str] = (),
) -> tuple[Dataset, DataReport]:
    """Read chat files and render and mask every row, skipping and reporting bad rows: "invalid_json",
    "bad_row" (a `BadRow`, e.g. a chat the template rejects), "empty_loss_mask" (no reply within max_length).

    Args:
        files: JSON / JSONL files (see `read_rows`, `to_messages`).
        tokenizer: the target's fast tokenizer, with its chat template.
        max_length: tokens per example; longer ones are truncated.
        max_bad_fraction: stop when more than this fraction of one file's rows is skipped.
        trim_loops: > 0: cut a last reply that loops after its `trim_loops`-th repeated run of words
            (`trim_loop`); it is then a cut reply (no end-of-turn target). 0: replies as they are.
        sources: when given, only the rows whose `source` field is one of these (the rest are left out and
            counted, not bad); a named source that no row of `files` has is an error (a misspelt filter
            would otherwise train on less than it says).
    Returns:
        (dataset with columns input_ids (int32 lists) and loss_mask (int8 lists), report).
    Raises:
        ValueError: a file over max_bad_fraction (named, with counts and the first problems), a template
            that is not prefix-stable, or a source of `sources` that no row has.
    """
    files = [files] if isinstance(files, (str, Path)) else list(files)
    report, columns = DataReport(), {"input_ids": [], "loss_mask": []}
    wanted, found = set(sources), set()
    for path in files:
        total, bad = 0, 0
        for number, row in read_rows(path):
            source = row.get("source") if isinstance(row, dict) else None
            if not (source is None or isinstance(source, str)):
                row, source = BadRow(f"'source': expected a string, got {type(source).__name__}"), None
            if wanted and isinstance(row, dict) and source not in wanted:
                report.left_out += 1
                continue
            found.add(source)
            total += 1
            try:
                if isinstance(row, Exception):
                    raise row
                reason = row.get("finish_reason")
                if reason not in FINISH_REASONS:  # an unknown one trained the end-of-turn after a cut reply
                    raise BadRow(f"'finish_reason': expected one of {FINISH_REASONS[1:]}, got {reason!r}")
                messages, cut = to_messages(row), reason in ("length", "loop")
                trimmed = None
                if trim_loops and messages[-1]["role"] == "assistant":
                    trimmed = trim_loop(str(messages[-1]["content"]), trim_loops)
                if trimmed is not None:
                    messages, cut = [*messages[:-1], {**messages[-1], "content": trimmed}], True
                example = render_with_mask(tokenizer, messages, max_length, cut_reply=cut)
            except (json.JSONDecodeError, BadRow) as error:
                reason = "invalid_json" if isinstance(error, json.JSONDecodeError) else "bad_row"
                report.skip(f"{path}:{number}", reason, str(error))
                bad += 1
                continue
            if not any(example["loss_mask"]):
                report.skip(f"{path}:{number}", "empty_loss_mask", f"no reply in {max_length} tokens")
                bad += 1
                continue
            report.truncated += len(example["input_ids"]) == max_length
            report.loops_trimmed += trimmed is not None
            for key, column in columns.items():
                column.append(example[key])
        report.total, report.kept = report.total + total, len(columns["input_ids"])
        if bad > max_bad_fraction * total:
            raise ValueError(
                f"{path}: {bad} of {total} rows skipped ({bad / total:.1%} > max_bad_fraction="
                f"{max_bad_fraction}); so far: {report}"
            )
    if wanted - found:
        raise ValueError(
            f"data.sources names {sorted(wanted - found)}, which no row of {[str(f) for f in files]} has "
            f"(their rows' sources: {sorted(s for s in found if s)} and {report.left_out} rows of others)"
        )
    features = Features(input_ids=SequenceFeature(Value("int32")), loss_mask=SequenceFeature(Value("int8")))
    return Dataset.from_dict(columns, features=features), report


def split_eval(dataset: Dataset, fraction: float, seed: int = 0) -> tuple[Dataset, Dataset]:
    """Random (train, eval) split with `fraction` in (0, 1) of the rows in eval, shuffled with `seed`."""
    if not 0 < fraction < 1:
        raise ValueError(f"eval fraction must be in (0, 1), got {fraction}")
    parts = dataset.train_test_split(test_size=fraction, seed=seed)
    return parts["train"], parts["test"]


def length_grouped_order(lengths: Sequence[int], batch: int, seed: int, megabatch: int = 50) -> list[int]:
    """An order of rows whose consecutive `batch`-sized groups hold rows of similar lengths: the rows, in
    their given (already shuffled) order, are cut into megabatches of `megabatch` x `batch` rows, each sorted
    by length, cut into batches, and those batches shuffled within their megabatch (seeded). Padding then
    costs a few percent of a batch's tokens instead of a third (random batches of chats of 40-384 tokens),
    while every row still comes once per epoch and the order still depends on the shuffle."""
    generator = torch.Generator().manual_seed(seed)
    size = megabatch * batch
    order: list[int] = []
    for start in range(0, len(lengths), size):
        rows = sorted(range(start, min(start + size, len(lengths))), key=lambda i: -lengths[i])
        groups = [rows[i : i + batch] for i in range(0, len(rows), batch)]
        full = [g for g in groups if len(g) == batch]
        for k in torch.randperm(len(full), generator=generator).tolist():
            order += full[k]
        order += [i for g in groups if len(g) < batch for i in g]  # the short tail batch stays last
    return order


def collate(rows: Sequence[dict], pad_token_id: int) -> dict[str, Tensor]:
    """Right-pad a batch of examples.

    Args:
        rows: dicts with "input_ids" and "loss_mask" lists (rows of a `build_dataset` dataset).
        pad_token_id: id written into the padding.
    Returns:
        {"input_ids", "attention_mask", "loss_mask"}: int64 (B, T), T the longest row; attention_mask is 1
        on real tokens; loss_mask is 0 on padding.
    """
    ids = [torch.as_tensor(row["input_ids"], dtype=torch.long) for row in rows]
    input_ids = pad_sequence(ids, batch_first=True, padding_value=pad_token_id)  # (B, T)
    attention_mask = pad_sequence([torch.ones_like(x) for x in ids], batch_first=True)  # (B, T)
    masks = [torch.as_tensor(row["loss_mask"], dtype=torch.long) for row in rows]
    loss_mask = pad_sequence(masks, batch_first=True)  # (B, T)
    return {"input_ids": input_ids, "attention_mask": attention_mask, "loss_mask": loss_mask}


def pad_token_id(tokenizer: PreTrainedTokenizerBase) -> int:
    """The id to pad batches with: the tokenizer's pad token, else its end-of-sequence token (many chat
    tokenizers have no pad token; padding is masked out, so any id serves).

    Raises:
        ValueError: the tokenizer has neither.
    """
    if tokenizer.pad_token_id is not None:
        return tokenizer.pad_token_id
    if tokenizer.eos_token_id is not None:
        return tokenizer.eos_token_id
    raise ValueError(
        f"tokenizer {getattr(tokenizer, 'name_or_path', '')!r} has neither a pad nor an end-of-sequence "
        "token to pad batches with"
    )


def token_frequencies(dataset: Dataset, vocab_size: int) -> Tensor:
    """(V,) int64 count of each target token under the loss mask (the tokens the draft must predict).

    Args:
        dataset: with input_ids and loss_mask columns.
        vocab_size: the target's vocabulary size V.
    """
    counts = torch.zeros(vocab_size, dtype=torch.long)
    for batch in dataset.iter(batch_size=1024):
        ids = torch.tensor([t for row in batch["input_ids"] for t in row], dtype=torch.long)
        mask = torch.tensor([m for row in batch["loss_mask"] for m in row], dtype=torch.bool)
        if ids.numel() and int(ids.max()) >= vocab_size:
            raise ValueError(f"token id {int(ids.max())} >= vocab_size {vocab_size}")
        counts += torch.bincount(ids[mask], minlength=vocab_size)
    return counts


def draft_vocab_from_frequencies(counts: Tensor, size: int) -> Tensor:
    """EAGLE-3 draft vocabulary: (Vd,) int64 ids of the `size` most frequent tokens, ascending (d2t = ids -
    arange(Vd)); ties, and the fill when fewer than `size` tokens were seen, go to the smaller id.

    Args:
        counts: (V,) from `token_frequencies`.
        size: draft vocabulary size Vd, 1 <= Vd <= V.
    """
    if not 0 < size <= counts.numel():
        raise ValueError(f"draft vocab size must be in [1, {counts.numel()}], got {size}")
    return torch.sort(counts, descending=True, stable=True).indices[:size].sort().values  # stable: ties by id
