"""The one way selfspec writes a file: to a temporary name in the same folder, then renamed into place.

A killed process leaves either the old file or the new one, never half of one (`os.replace` is atomic within
a file system), and a failed write leaves no stray temporary file behind.
"""

from __future__ import annotations

import json
import os
import re
import tempfile
from collections.abc import Callable, Iterable
from pathlib import Path

import yaml


def atomic_write(dest: str | Path, write: Callable[[Path], object]) -> Path:
    """Call `write(tmp)` to fill a temporary file next to `dest`, then rename it to `dest`.

    Args:
        dest: the final path; its folder must exist.
        write: writes the whole content to the path it is given (for example `lambda p: save_file(t, p)`).
    Returns:
        `dest`, as a Path.
    """
    dest = Path(dest)
    fd, tmp = tempfile.mkstemp(dir=dest.parent, prefix=f".{dest.name}.", suffix=".tmp")
    os.close(fd)
    try:
        write(Path(tmp))
        os.chmod(tmp, 0o666 & ~UMASK)  # mkstemp makes 0600: give the file the mode any new file gets
        os.replace(tmp, dest)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)
    return dest


def _umask() -> int:
    """This process's umask (read by setting it and setting it back: once, at import, before any thread)."""
    mask = os.umask(0)
    os.umask(mask)
    return mask


UMASK = _umask()


def write_text(dest: str | Path, text: str) -> Path:
    """`dest` holds exactly `text` (UTF-8), written atomically."""
    return atomic_write(dest, lambda tmp: tmp.write_text(text, encoding="utf-8"))


def write_json(dest: str | Path, obj) -> Path:
    """`dest` holds `obj` as indented JSON, written atomically."""
    return write_text(dest, json.dumps(obj, indent=2) + "\n")


def write_jsonl(dest: str | Path, rows: Iterable[dict]) -> Path:
    """`dest` holds one JSON object per line (non-ASCII kept as is), written atomically."""
    return write_text(dest, "".join(json.dumps(row, ensure_ascii=False) + "\n" for row in rows))


# what selfspec's YAML reader resolves as a float beside PyYAML's own (YAML 1.1 wants a dot: `1e-4` is a str
# there): `train.config.load_config`'s loader adds it, and `dump_yaml` quotes the strings it would match
YAML_FLOAT = re.compile(r"^[-+]?[0-9][0-9_]*(?:\.[0-9_]*)?[eE][-+]?[0-9]+$")


class YamlDumper(yaml.SafeDumper):
    """SafeDumper that quotes the strings selfspec's config loader would read as floats (a revision
    `12e4567`), so a saved config reads back as it was."""


YamlDumper.add_implicit_resolver("tag:yaml.org,2002:float", YAML_FLOAT, list("-+0123456789"))


def dump_yaml(data) -> str:
    """`data` as YAML, keys in their order, that `train.config.load_config` reads back unchanged."""
    return yaml.dump(data, Dumper=YamlDumper, sort_keys=False)
