"""scripts/dump_hidden_states.py under `accelerate launch` on 2 CPU processes (configs/accelerate/
ddp_cpu.yaml): the same shards, byte for byte, as one process, so both train the same head; a dump stopped
part way resumes under another number of processes, keeping the shards it has.

Both dumps run one thread per process (conftest's subprocess settings), so a shard's batches give the same
bits whichever process runs them; the 40 chats make 5 shards of 8 (3 written by rank 0, 2 by rank 1), 3
batches each.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from targets import load_target
from train.data import build_dataset
from train.offline import INDEX_FILE, dump_hidden_states

pytestmark = pytest.mark.distributed

DUMP = ["--shard-size", "8", "--batch-size", "3"]
SHARDS = [f"shard-{n:05d}.safetensors" for n in range(5)]
FAST = ["train.eval_tau_prompts=0", "eagle.draft_vocab_size=256", "data.eval_fraction=0", "train.max_steps=3"]


def _dump(cli, overrides, out: Path, accelerate_config: str | None = None) -> str:
    """Run the script into `out` (one process, or under `accelerate_config`); returns its log."""
    args = overrides(out.parent / "unused", "data.eval_fraction=0", f"data.offline_dir='{out}'")
    command = cli.command("scripts/dump_hidden_states.py", [*args, *DUMP], accelerate_config)
    return cli.run(command, out.parent / f"{out.name}.log", timeout=180)


def _offline(states: Path) -> list[str]:
    return ["data.hidden_states=offline", f"data.offline_dir='{states}'"]


def _stopped_copy(source: Path, destination: Path, missing: list[str]) -> Path:
    """A copy of a finished dump as a killed run leaves it: some shards absent, the index not complete."""
    shutil.copytree(source, destination)
    for name in missing:
        (destination / name).unlink()
    index = json.loads((destination / INDEX_FILE).read_text())
    (destination / INDEX_FILE).write_text(json.dumps({**index, "complete": False}))
    return destination


@pytest.fixture(scope="module")
def one(tmp_path_factory, cli, overrides) -> Path:
    out = tmp_path_factory.mktemp("one") / "states"
    assert "process 0/1: 5 shard(s) written, 0 kept" in _dump(cli, overrides, out)
    return out


@pytest.fixture(scope="module")
def two(tmp_path_factory, cli, overrides) -> tuple[Path, str]:
    out = tmp_path_factory.mktemp("two") / "states"
    return out, _dump(cli, overrides, out, accelerate_config="ddp_cpu.yaml")


def test_two_processes_write_the_one_process_dump_byte_for_byte(one, two):
    out, log = two
    assert "(2 process(es), 3 per forward)" in log  # one process group of 2, not 2 lone processes
    assert "process 0/2: 3 shard(s) written, 0 kept" in log
    assert "process 1/2: 2 shard(s) written, 0 kept" in log
    assert sorted(p.name for p in out.iterdir()) == sorted(p.name for p in one.iterdir())
    assert sorted(p.name for p in out.iterdir()) == [INDEX_FILE, *SHARDS]
    index = json.loads((out / INDEX_FILE).read_text())
    assert index == json.loads((one / INDEX_FILE).read_text()) and index["complete"] is True
    for name in SHARDS:
        mine, theirs = load_file(one / name), load_file(out / name)
        assert mine.keys() == theirs.keys() and len(mine) == 4 * 8  # ids, mask, features, last per example
        assert all(torch.equal(mine[key], theirs[key]) for key in mine), name
        assert (one / name).read_bytes() == (out / name).read_bytes(), name


def test_both_dumps_train_the_same_head(one, two, tmp_path, overrides, run_recipe):
    heads = []
    for name, states in (("one", one), ("two", two[0])):
        run_recipe(overrides(tmp_path / name, *FAST, *_offline(states)))
        assert json.loads((tmp_path / name / "head" / "config.json").read_text())["train_step"] == 3
        heads.append(load_file(tmp_path / name / "head" / "model.safetensors"))
    assert heads[0].keys() == heads[1].keys()
    assert all(torch.equal(heads[0][key], heads[1][key]) for key in heads[0])

    # negative control: features 0.1% off train another head, so the equality above means something
    nudged = tmp_path / "nudged"
    shutil.copytree(one, nudged)
    for name in SHARDS:
        tensors = load_file(nudged / name)
        tensors = {k: v * 1.001 if k.startswith("features.") else v for k, v in tensors.items()}
        save_file(tensors, nudged / name)
    run_recipe(overrides(tmp_path / "nudged_run", *FAST, *_offline(nudged)))
    other = load_file(tmp_path / "nudged_run" / "head" / "model.safetensors")
    assert not all(torch.equal(heads[0][key], other[key]) for key in heads[0])


def test_a_stopped_dump_resumes_under_another_number_of_processes(
    one, two, tmp_path, cli, overrides, tiny_target_dir, chat_file, capsys
):
    # a 1-process dump stopped without shards 0 and 2, finished by 2 processes: one missing shard each
    missing = [SHARDS[0], SHARDS[2]]
    stopped = _stopped_copy(one, tmp_path / "from_one" / "states", missing)
    kept = {name: (stopped / name).stat().st_mtime_ns for name in SHARDS if name not in missing}
    log = _dump(cli, overrides, stopped, accelerate_config="ddp_cpu.yaml")
    assert "process 0/2: 1 shard(s) written, 2 kept" in log  # checks shards 1 and 4, writes 0
    assert "process 1/2: 1 shard(s) written, 1 kept" in log  # checks shard 3, writes 2
    assert {name: (stopped / name).stat().st_mtime_ns for name in kept} == kept  # not rewritten
    assert json.loads((stopped / INDEX_FILE).read_text())["complete"] is True
    assert all((stopped / name).read_bytes() == (one / name).read_bytes() for name in SHARDS)

    # a 2-process dump stopped before shard 3, finished by one process (in this one, at one thread)
    stopped = _stopped_copy(two[0], tmp_path / "from_two" / "states", SHARDS[3:4])
    model, tokenizer = load_target(str(tiny_target_dir))
    dataset, _ = build_dataset([str(chat_file)], tokenizer, 64, 0.5)  # tiny_test's data settings, no eval
    layer_ids = tuple(json.loads((stopped / INDEX_FILE).read_text())["layer_ids"])
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as in the subprocesses, so the rewritten shard compares bit for bit
    try:
        dump_hidden_states(model, dataset, layer_ids, stopped, shard_size=8, batch_size=3)
    finally:
        torch.set_num_threads(threads)
    assert "process 0/1: 1 shard(s) written, 4 kept" in capsys.readouterr().out
    assert all((stopped / name).read_bytes() == (one / name).read_bytes() for name in SHARDS)
