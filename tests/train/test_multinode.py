"""train/eagle.py over 2 "machines" of 1 process each, on 127.0.0.1: two `accelerate launch` commands with
configs/accelerate/multi_node.yaml and `--num_machines 2 --machine_rank 0|1 --main_process_ip 127.0.0.1`, as
the README's multi-node recipe runs them on real machines. Without CUDA they join one gloo group; the head
must equal the 2-process DDP run's (same global batch, same data order: see test_distributed.py's docstring).
"""

from __future__ import annotations

import json
import socket
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

pytestmark = pytest.mark.distributed

ATOL = 1e-5  # as in test_distributed.py: float32 sums in another order


def weights(path: Path) -> dict[str, torch.Tensor]:
    return load_file(path if path.suffix == ".safetensors" else path / "head" / "model.safetensors")


def max_difference(a: dict, b: dict) -> float:
    assert sorted(a) == sorted(b)
    return max((a[k].float() - b[k].float()).abs().max().item() for k in a)


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def machine_command(rank: int, port: int, script: list[str], args: list[str]) -> list[str]:
    """The per-machine launch line of docs/gpu.md, 1 process per machine, all on the loopback address."""
    return [
        sys.executable,
        "-m",
        "accelerate.commands.launch",
        "--config_file",
        "configs/accelerate/multi_node.yaml",
        "--num_machines",
        "2",
        "--num_processes",
        "2",
        "--machine_rank",
        str(rank),
        "--main_process_ip",
        "127.0.0.1",
        "--main_process_port",
        str(port),
        *script,
        "configs/tiny_test.yaml",
        *args,
    ]


def run_machines(cli, commands: list[list[str]], logs: list[Path], timeout: float) -> list[str]:
    """Start every command at once; when one fails or time runs out, kill all process groups and fail."""
    processes = [cli.start(command, log) for command, log in zip(commands, logs)]
    deadline = time.monotonic() + timeout
    try:
        while any(p.poll() is None for p in processes):
            failed = any(p.returncode not in (None, 0) for p in processes)
            if failed or time.monotonic() > deadline:
                break
            time.sleep(0.5)
    finally:
        for process in processes:
            cli.stop(process)  # a no-op for those that ended; kills a rank left waiting for a dead peer
    texts = [log.read_text(errors="replace") for log in logs]
    report = "\n".join(
        f"--- machine {i} (exit {p.returncode}):\n{text[-4000:]}"
        for i, (p, text) in enumerate(zip(processes, texts))
    )
    failed = any(p.returncode != 0 for p in processes)
    assert not failed, f"multi-node launch failed or ran past {timeout} s:\n{report}"
    return texts


def test_two_machines_train_the_same_head_as_two_process_ddp(
    ddp, tmp_path, two_rank_args, per_rank_script, cli, run_recipe
):
    out = tmp_path / "multinode"
    args, port = two_rank_args(out), free_port()
    commands = [machine_command(rank, port, [per_rank_script, "train/eagle.py"], args) for rank in (0, 1)]
    logs = [tmp_path / f"machine{rank}.txt" for rank in (0, 1)]
    log0, log1 = run_machines(cli, commands, logs, timeout=300)

    for log in (log0, log1):  # each machine's first process prints the group it joined: one of 2 ranks
        assert "2 process(es), DistributedType.MULTI_CPU" in log
    assert json.loads((out / "head" / "config.json").read_text())["train_step"] == 3
    head = weights(out)
    assert max_difference(weights(out / "rank1.safetensors"), head) == 0.0  # machine 1 holds the export
    assert max_difference(head, weights(ddp[0])) < ATOL

    # negative control: what each machine would train if the two never joined (1 process, 1 chat per step)
    # ends elsewhere, so the match above means the gradients were all-reduced across the two launches
    lone = tmp_path / "lone"
    run_recipe(two_rank_args(lone))
    assert max_difference(weights(lone), weights(ddp[0])) > 100 * ATOL
