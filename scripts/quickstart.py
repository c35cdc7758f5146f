"""Main job, end to end on the default target: fetch SmolLM2-135M-Instruct, draft, decode, print tau and speedup.

    python scripts/quickstart.py [--max-new-tokens 64] [--head eagle3|eagle1|medusa]

Training recipes are not in this release yet, so the head is UNTRAINED (random weights): the numbers show
the machinery is lossless and what drafting costs, not the speedup a trained head gives. The output is
checked token for token against plain decoding.
"""

from __future__ import annotations

import argparse
import statistics

import torch

from decode import generate
from heads import EagleConfig, EagleHead, MedusaConfig, MedusaHeads
from heads.target import DEFAULT_TARGET, load_target

PROMPTS = [  # held-out chat prompts (never used for training)
    "Give me three tips for staying focused while studying.",
    "Explain what a hash table is to a beginner.",
    "Write a short, friendly email inviting a colleague to lunch.",
]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=DEFAULT_TARGET)
    parser.add_argument("--head", choices=["eagle3", "eagle1", "medusa"], default="eagle3")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    args = parser.parse_args()

    print(f"[1/3] target: {args.model}", flush=True)
    model, tokenizer = load_target(args.model)
    print(f"[2/3] head: {args.head} with RANDOM weights (training is not implemented yet)", flush=True)
    torch.manual_seed(0)
    if args.head == "medusa":
        head = MedusaHeads(MedusaConfig(model.config.hidden_size, model.config.vocab_size, num_heads=3))
        head.init_from_lm_head(model.get_output_embeddings().weight)
    else:
        head = EagleHead(EagleConfig.from_target(model.config, args.head))
    head.eval()

    print(f"[3/3] decoding {len(PROMPTS)} held-out prompts, greedy, {args.max_new_tokens} new tokens", flush=True)
    rows = []
    for prompt in PROMPTS:
        ids = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                            return_tensors="pt", return_dict=True)["input_ids"]
        plain = generate(model, ids, max_new_tokens=args.max_new_tokens)
        spec = generate(model, ids, head, max_new_tokens=args.max_new_tokens)
        if not torch.equal(plain.sequences, spec.sequences):
            raise SystemExit(f"LOSSLESS CHECK FAILED on prompt {prompt!r}")
        rows.append((spec.tau, plain.seconds / spec.seconds, plain.tokens_per_second, spec.tokens_per_second))
    print("\n| prompts | tau (tokens per target pass, bonus incl.) | speedup (plain / spec) | plain tok/s | spec tok/s |")
    print("|---|---|---|---|---|")
    med = [statistics.median(col) for col in zip(*rows)]
    print(f"| {len(rows)} | {med[0]:.2f} | {med[1]:.2f}x | {med[2]:.1f} | {med[3]:.1f} |")
    print("\nmedians over prompts; identical tokens to plain decoding on every prompt. "
          "Head untrained: expect tau ~1 and a slowdown until training lands.")


if __name__ == "__main__":
    main()
