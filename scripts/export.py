"""Export a trained head folder to a serving engine's layout (thin wrapper over engines.export.export_head).

python scripts/export.py <head dir> --to {sglang,speculators,eagle1,medusa,medusa-vllm} --out DIR [--target
NAME]
"""

from __future__ import annotations

import argparse

from engines.export import FORMATS, export_head


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "head_dir", help="folder written by heads.io.save_heads (config.json + model.safetensors)"
    )
    parser.add_argument("--to", dest="fmt", required=True, choices=FORMATS, help="export format")
    parser.add_argument("--out", required=True, help="new folder to write")
    parser.add_argument(
        "--target",
        default=None,
        help="the target's HF folder or hub id: needed by speculators (embedding) and by Medusa "
        "heads that share the target's lm_head; also checks sizes",
    )
    parser.add_argument(
        "--verifier-name",
        default=None,
        help="target name written into the config (default: the head's base_model)",
    )
    parser.add_argument(
        "--speculative-tokens", type=int, default=3, help="speculators: draft tokens per step"
    )
    args = parser.parse_args(argv)
    files = export_head(
        args.head_dir,
        args.fmt,
        args.out,
        target=args.target,
        verifier_name=args.verifier_name,
        num_speculative_tokens=args.speculative_tokens,
    )
    for file in files:
        print(f"{file}  {file.stat().st_size:,} bytes")


if __name__ == "__main__":
    main()
