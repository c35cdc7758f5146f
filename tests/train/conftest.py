"""Shared fixtures of the recipe tests: a tiny saved target with the real SmolLM2 tokenizer, a chat file, and
helpers that run a recipe in-process (`main(load_config(...))`) or as a subprocess (`python` / `accelerate
launch`, from the repository root, like a user would)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoTokenizer

from train.checkpoint import PROGRESS_FILE
from train.data import build_dataset

ROOT = Path(__file__).resolve().parents[2]
TINY_YAML = ROOT / "configs" / "tiny_test.yaml"


@pytest.fixture(scope="session")
def chat_file(tmp_path_factory) -> Path:
    """40 one-turn chats of varied length (most are truncated at tiny_test's max_length of 64)."""
    rows = [
        {
            "messages": [
                {"role": "user", "content": f"Question {i}: what is {i} plus {i}?"},
                {"role": "assistant", "content": f"The answer is {2 * i}. " * (1 + i % 7)},
            ]
        }
        for i in range(40)
    ]
    path = tmp_path_factory.mktemp("chats") / "train.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in rows), encoding="utf-8")
    return path


@pytest.fixture(scope="session")
def overrides(tiny_target_dir, chat_file):
    """`overrides(output_dir, *extra, train_file=None)`: CLI overrides pointing tiny_test.yaml at the
    fixtures."""

    def make(output_dir, *extra: str, train_file: Path | None = None) -> list[str]:
        return [
            f"model.target='{tiny_target_dir}'",
            f"data.train_files=['{train_file or chat_file}']",
            f"train.output_dir='{output_dir}'",
            *extra,
        ]

    return make


def _reset_accelerate() -> None:
    """Forget the process-wide accelerate singletons, so the next in-process run starts clean."""
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()


@pytest.fixture(scope="session")
def run_recipe():
    """`run_recipe(overrides, recipe="eagle")`: train/<recipe>.py's `main` on tiny_test.yaml in this process,
    one thread. The recipe module is looked up when called, so a test may monkeypatch its names first."""
    import train.eagle
    import train.medusa
    from train.config import EagleRunConfig, MedusaRunConfig, load_config

    recipes = {"eagle": (train.eagle, EagleRunConfig), "medusa": (train.medusa, MedusaRunConfig)}

    def run(args: list[str], recipe: str = "eagle") -> None:
        module, cls = recipes[recipe]
        cfg = load_config(cls, TINY_YAML, args)
        threads = torch.get_num_threads()
        torch.set_num_threads(1)  # as in the subprocesses (OMP_NUM_THREADS=1), so results compare bit for bit
        _reset_accelerate()
        try:
            module.main(cfg)
        finally:
            _reset_accelerate()
            torch.set_num_threads(threads)

    return run


@pytest.fixture
def fresh_accelerate():
    """Clean accelerate singletons and one thread around a test that builds its own Accelerator in this
    process (as `run_recipe` does for a recipe)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    _reset_accelerate()
    yield
    _reset_accelerate()
    torch.set_num_threads(threads)


def _subprocess_env() -> dict[str, str]:
    """One thread per process (2 cores, up to 2 processes) and no inherited accelerate settings."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("ACCELERATE_")}
    env.update(OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false", PYTHONUNBUFFERED="1")
    return env


def _launch_command(
    script: str | list[str], args: list[str], accelerate_config: str | None = None
) -> list[str]:
    """`python <script> configs/tiny_test.yaml <args>`, or the same under `accelerate launch --config_file
    configs/accelerate/<accelerate_config>`; paths relative to the repository root, as a user types them.
    `script` may be a list: a wrapper script and its arguments (the recipe it runs)."""
    script = [script] if isinstance(script, str) else list(script)
    if accelerate_config is None:
        return [sys.executable, *script, "configs/tiny_test.yaml", *args]
    return [
        sys.executable,
        "-m",
        "accelerate.commands.launch",
        "--config_file",
        f"configs/accelerate/{accelerate_config}",
        *script,
        "configs/tiny_test.yaml",
        *args,
    ]


def _start(command: list[str], log: Path) -> subprocess.Popen:
    """Start `command` from the repository root in its own process group, output to `log`."""
    with open(log, "w") as out:
        return subprocess.Popen(
            command,
            cwd=ROOT,
            env=_subprocess_env(),
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )


def _stop(process: subprocess.Popen) -> None:
    """SIGKILL the process group we started (accelerate's workers included) and reap it."""
    if process.poll() is None:
        os.killpg(process.pid, signal.SIGKILL)
    process.wait()


def _run_command(command: list[str], log: Path, timeout: float) -> str:
    """Run to the end; fail with the log's tail on a non-zero exit or after `timeout` s. Returns the log."""
    process = _start(command, log)
    try:
        process.wait(timeout)
    except subprocess.TimeoutExpired:
        _stop(process)
        pytest.fail(f"{' '.join(command)} ran past {timeout} s:\n{log.read_text(errors='replace')[-6000:]}")
    text = log.read_text(errors="replace")
    assert process.returncode == 0, f"{' '.join(command)} exited {process.returncode}:\n{text[-6000:]}"
    return text


@pytest.fixture(scope="session")
def cli():
    """Subprocess helpers: `cli.command(script, args, accelerate_config=None)` builds a command line;
    `cli.run(command, log, timeout)` runs it to success; `cli.start(command, log)` / `cli.stop(process)`
    start one in the background and SIGKILL its process group."""
    return SimpleNamespace(command=_launch_command, run=_run_command, start=_start, stop=_stop)


# 2-rank runs on uniform data, shared by the multi-process tests (test_distributed*.py, test_multinode.py).
# Why uniform data: test_distributed.py's docstring (per-rank token means weigh every sequence alike only
# when all sequences have as many loss tokens).
TWO_RANK_ARGS = [
    "train.eval_tau_prompts=0",
    "data.eval_fraction=0",
    "eagle.draft_vocab_size=256",
    "train.max_steps=3",
    "train.per_device_batch_size=1",
]  # global batch 2 = 2 processes x 1
# Evaluation after every step (held-out loss on every rank, simulated tau of one 8-token prompt on the main
# process), added to 2-rank runs: it draws nothing from the training RNG, so the weights do not change.
EVAL_EVERY_STEP = ["train.eval_tau_prompts=1", "train.eval_every_steps=1"]

# Runs a recipe as `__main__` and, at every export, also saves the head THIS rank holds (out/rank<i>), so a
# test can compare the ranks' own weights; the recipe itself writes the export from the main process only.
PER_RANK = """
    import runpy
    import sys
    from pathlib import Path

    from safetensors.torch import save_file

    import train.checkpoint

    export_head = train.checkpoint.export_head


    def export_and_dump(accelerator, wrapper, output_dir, *args, **kwargs):
        head = accelerator.unwrap_model(wrapper).head
        state = {k: v.detach().clone().contiguous() for k, v in head.state_dict().items()}
        save_file(state, str(Path(output_dir) / f"rank{accelerator.process_index}.safetensors"))
        return export_head(accelerator, wrapper, output_dir, *args, **kwargs)


    train.checkpoint.export_head = export_and_dump  # the recipe imports it when runpy executes it below
    sys.argv = sys.argv[1:]
    runpy.run_path(sys.argv[0], run_name="__main__")
"""


@pytest.fixture(scope="session")
def uniform_chats(tmp_path_factory, tiny_target_dir) -> Path:
    """40 chats with one prompt and long, different replies: every example fills max_length (64) and has the
    same loss mask, so per-rank and per-batch token means weigh each sequence alike."""
    rows = [
        {
            "messages": [
                {"role": "user", "content": "Count for me, please."},
                {"role": "assistant", "content": " ".join(str(7 * i + j) for j in range(40))},
            ]
        }
        for i in range(40)
    ]
    path = tmp_path_factory.mktemp("uniform") / "train.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in rows), encoding="utf-8")
    # the same rows as an eval file of its own (a file that is both train and eval data is refused)
    path.with_name("eval.jsonl").write_text(path.read_text(encoding="utf-8"), encoding="utf-8")
    dataset, _ = build_dataset(path, AutoTokenizer.from_pretrained(tiny_target_dir), max_length=64)
    assert len(dataset) == 40 and len({tuple(mask) for mask in dataset["loss_mask"]}) == 1
    assert {len(ids) for ids in dataset["input_ids"]} == {64}
    return path


@pytest.fixture(scope="session")
def two_rank_args(overrides, uniform_chats):
    """`two_rank_args(output_dir, *extra, evaluate=False)`: tiny_test.yaml overrides, 3 steps of 1 uniform
    chat per rank; `evaluate` adds EVAL_EVERY_STEP on a held-out file (a copy of the training rows: any rows
    do)."""

    def make(output_dir, *extra: str, evaluate: bool = False) -> list[str]:
        held_out = uniform_chats.with_name("eval.jsonl")
        evaluation = [*EVAL_EVERY_STEP, f"data.eval_files=['{held_out}']"] if evaluate else []
        return overrides(output_dir, *TWO_RANK_ARGS, *evaluation, *extra, train_file=uniform_chats)

    return make


@pytest.fixture(scope="session")
def per_rank_script(tmp_path_factory) -> str:
    """Path of the PER_RANK wrapper: `[per_rank_script, "train/eagle.py"]` as `cli.command`'s script."""
    path = tmp_path_factory.mktemp("scripts") / "per_rank.py"
    path.write_text(textwrap.dedent(PER_RANK))
    return str(path)


@pytest.fixture(scope="session")
def ddp(tmp_path_factory, two_rank_args, per_rank_script, cli) -> tuple[Path, str]:
    """The 2-process DDP reference (configs/accelerate/ddp_cpu.yaml, gloo), evaluating after every step:
    (run folder, log)."""
    out = tmp_path_factory.mktemp("ddp") / "run"
    command = cli.command(
        [per_rank_script, "train/eagle.py"],
        two_rank_args(out, evaluate=True),
        accelerate_config="ddp_cpu.yaml",
    )
    return out, cli.run(command, out.parent / "log.txt", timeout=300)


def head_weights(run: Path) -> dict[str, torch.Tensor]:
    return load_file(run / "head" / "model.safetensors")


def assert_same_weights(actual: dict, expected: dict, atol: float = 0.0) -> None:
    assert sorted(actual) == sorted(expected)
    for key, value in expected.items():
        torch.testing.assert_close(actual[key], value, rtol=0, atol=atol, msg=lambda m, k=key: f"{k}: {m}")


def state_step(state: Path) -> int:
    return json.loads((state / PROGRESS_FILE).read_text())["step"]


@pytest.fixture(scope="session")
def ckpt() -> SimpleNamespace:
    """Readers of a run folder: `head_weights(run)`, `assert_same_weights(actual, expected, atol)`,
    `state_step(state)` (conftest modules are not importable from tests under --import-mode=importlib)."""
    return SimpleNamespace(
        head_weights=head_weights, assert_same_weights=assert_same_weights, state_step=state_step
    )
