"""A target shipped as a GGUF inside PyPI wheels (in one or several chunks): its description, and what the
GGUF lacks that an HF folder needs (a chat template, the end-of-turn stop token).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class WheelGguf:
    """One target: a GGUF carried by PyPI wheels, and the folder it is converted into."""

    target_id: str  # recorded as `base_model` in head exports: "<PyPI package>/<model name>"
    aliases: frozenset[str]  # every name `targets.load_target` accepts for it, target_id included
    folder: str  # the converted folder's name under <cache>/targets/
    package: str  # the PyPI package a user installs to get the GGUF (names the download and the cache)
    version: str  # its pinned version: the one whose GGUF we convert
    parts: tuple[tuple[str, str], ...]  # (PyPI name, file inside its wheel) per chunk; concatenated in order
    gguf_name: str  # the assembled file's name
    sha256: str | None  # of the assembled GGUF, checked before it is kept; None = not published
    licence: str  # the model's licence, as the package states it (recorded in the marker)
    note: str  # what the folder holds, in words (recorded in the marker)


def sha256(path: Path) -> str:
    """Hex sha256 of a file, read in 16 MiB chunks.

    Args:
        path: the file.
    Returns:
        64 hex digits.
    """
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 24):
            digest.update(chunk)
    return digest.hexdigest()


# What a GGUF of a model family may lack, by its `general.architecture`: the turn format (the Gemma 3 270M
# GGUF carries no template) and the end-of-turn token, at which llama.cpp stops by itself but transformers
# only where generation_config lists it.
_GEMMA_TURNS = (
    "{{ bos_token }}"
    "{%- if messages[0]['role'] == 'system' -%}"
    "{%- set system = messages[0]['content'] + '\n\n' -%}{%- set turns = messages[1:] -%}"
    "{%- else -%}{%- set system = '' -%}{%- set turns = messages -%}{%- endif -%}"
    "{%- for message in turns -%}"
    "{%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}"
    "{{ raise_exception('Gemma turns alternate user, assistant, user, ...') }}{%- endif -%}"
    "{{ '<start_of_turn>' + ('model' if message['role'] == 'assistant' else 'user') + '\n' }}"
    "{{ (system if loop.first else '') + message['content'] | trim }}{{ '<end_of_turn>\n' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<start_of_turn>model\n' }}{%- endif -%}"
)
_FAMILY_GAPS: dict[str, tuple[str, tuple[str, ...]]] = {
    "gemma3": (_GEMMA_TURNS, ("<end_of_turn>",)),  # Gemma's documented format: system text opens the 1st turn
}


def chat_defaults(gguf_path: Path) -> tuple[str | None, tuple[str, ...]]:
    """The GGUF's chat template (else its model family's) and the family's extra stop tokens.

    Args:
        gguf_path: a GGUF file (only its metadata is read).
    Returns:
        (chat template or None, tokens that end a reply besides the tokenizer's eos).
    """
    from gguf import GGUFReader

    fields = GGUFReader(gguf_path).fields
    template = fields.get("tokenizer.chat_template")
    family_template, stops = _FAMILY_GAPS.get(fields["general.architecture"].contents(), (None, ()))
    return (family_template if template is None else template.contents()), stops
