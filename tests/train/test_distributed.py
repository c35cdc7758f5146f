"""train/distributed.py: the precision settings it checks or sets (in this process), and train/eagle.py on 2
CPU processes through `accelerate launch` (marked distributed): DDP over gloo, DeepSpeed ZeRO-1/2/3 and
FSDP2, each checked against a 1-process run of the same global batch (2 x 1 sequences per step vs 1 x 2). The
2-process runs also evaluate at every step (eval loss on every rank, simulated tau on the main process with
the head gathered from the shards): a rank left waiting would hang the run past the launch timeout.

Equal weights need equal losses, and the recipe's loss is a token mean per process: with 2 ranks the step
averages two per-sequence means, with 1 process it averages over all tokens of both sequences. These differ
unless both sequences have as many loss tokens, so the runs here train on chats that all fill max_length with
the same prompt (`uniform_chats`). The data order is the same by construction: every rank shuffles an epoch
with the same seed and accelerate deals its batches round-robin, so global step k sees sequences 2k and 2k+1
in both settings; `test_ddp_matches_one_process_with_the_same_global_batch` also shows that a different order
would be caught. The first DeepSpeed launch on a machine compiles its shared-memory comm op (~3 min, cached).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from accelerate.utils import DistributedType
from safetensors.torch import load_file

from heads import load_heads
from targets import load_target
from train.checkpoint import PROGRESS_FILE, latest_state
from train.config import ModelConfig
from train.distributed import (
    _fsdp2_fp32_reduction,
    check_deepspeed_precision,
    shard_fsdp2_units,
    shards_trained_weights,
    whole_parameters,
)

FSDP_ON_CPU = "tests/train/fsdp_on_cpu.py"  # test-only: accelerate's FSDP2 path on CPU processes

COMMON = [
    "train.eval_tau_prompts=0",
    "data.eval_fraction=0",
    "eagle.draft_vocab_size=256",
    "train.max_steps=3",
]
ONE_RANK = [*COMMON, "train.per_device_batch_size=2"]  # global batch 2 = 1 process x 2

ATOL = 1e-5  # float32 sums in another order (gradient all-reduce, ZeRO partitions): ~1e-7 seen here


def assert_evaluated(log: str, steps: int = 3) -> None:
    """Every step printed an eval loss and a simulated tau (the main process's line)."""
    lines = [line for line in log.splitlines() if "eval_loss" in line and "eval_tau" in line]
    assert len(lines) == steps, log[-3000:]


def weights(path: Path) -> dict[str, torch.Tensor]:
    return load_file(path if path.suffix == ".safetensors" else path / "head" / "model.safetensors")


def max_difference(a: dict, b: dict) -> float:
    assert sorted(a) == sorted(b)
    return max((a[k].float() - b[k].float()).abs().max().item() for k in a)


@pytest.fixture(scope="module")
def single(tmp_path_factory, overrides, uniform_chats, run_recipe) -> Path:
    out = tmp_path_factory.mktemp("single") / "run"
    run_recipe(overrides(out, *ONE_RANK, train_file=uniform_chats))
    return out


@pytest.mark.distributed
def test_ddp_matches_one_process_with_the_same_global_batch(
    ddp, single, tmp_path, overrides, uniform_chats, run_recipe
):
    out, log = ddp
    assert "2 process(es), DistributedType.MULTI_CPU" in log  # a real 2-rank group, not 2 lone processes
    assert_evaluated(log)
    assert json.loads((out / "head" / "config.json").read_text())["train_step"] == 3
    assert max_difference(weights(out), weights(single)) < ATOL

    # negative control: the same run on another data order ends elsewhere, so the match above means something
    other = tmp_path / "other_order"
    run_recipe(overrides(other, *ONE_RANK, "data.shuffle_seed=1", train_file=uniform_chats))
    assert max_difference(weights(other), weights(single)) > 100 * ATOL


@pytest.mark.distributed
def test_ddp_ranks_end_with_identical_weights(ddp):
    out, _ = ddp
    rank0, rank1 = weights(out / "rank0.safetensors"), weights(out / "rank1.safetensors")
    assert max_difference(rank0, rank1) == 0.0
    assert max_difference(rank0, weights(out)) == 0.0  # and the export is what the ranks hold


@pytest.mark.distributed
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_deepspeed_zero_trains_exports_and_matches_ddp(
    stage, ddp, tmp_path, two_rank_args, per_rank_script, cli, tiny_target_dir
):
    out = tmp_path / f"zero{stage}"
    # ZeRO-3 shards the head itself, so no rank holds whole weights to dump: run the plain recipe there
    script = "train/eagle.py" if stage == 3 else [per_rank_script, "train/eagle.py"]
    evaluate = stage == 3  # ZeRO-3: the sharded head is gathered for tau
    command = cli.command(
        script, two_rank_args(out, evaluate=evaluate), accelerate_config=f"deepspeed_zero{stage}.yaml"
    )
    log = cli.run(command, tmp_path / "log.txt", timeout=600)  # 600: the first launch compiles an op
    assert "2 process(es), DistributedType.DEEPSPEED" in log
    if evaluate:
        assert_evaluated(log)

    assert sorted(p.name for p in (out / "head").iterdir()) == ["config.json", "model.safetensors"]
    assert json.loads((out / "head" / "config.json").read_text())["train_step"] == 3
    head = load_heads(out / "head", target=load_target(str(tiny_target_dir))[0])
    assert head.head_type == "eagle3" and head.config.draft_vocab_size == 256
    state = latest_state(out)
    assert json.loads((state / PROGRESS_FILE).read_text())["step"] == 3
    assert len(list(state.rglob("*optim_states.pt"))) == 2  # one optimizer partition per rank

    assert max_difference(weights(out), weights(ddp[0])) < ATOL
    if stage != 3:
        assert max_difference(weights(out / "rank0.safetensors"), weights(out / "rank1.safetensors")) == 0.0


def fsdp2_command(cli, args: list[str]) -> list[str]:
    """configs/accelerate/fsdp2.yaml with a wrapping threshold the tiny head crosses, so that parts of it get
    shard units of their own (the real threshold, 1e8 parameters, would leave one unit: the root)."""
    command = cli.command([FSDP_ON_CPU, "train/eagle.py"], args, accelerate_config="fsdp2.yaml")
    at = command.index("--config_file") + 2
    return command[:at] + ["--fsdp_min_num_params", "2000"] + command[at:]


@pytest.mark.distributed
def test_fsdp2_shards_the_head_trains_evaluates_resumes_and_matches_ddp(ddp, tmp_path, two_rank_args, cli):
    """configs/accelerate/fsdp2.yaml as GPU users launch it, on 2 CPU processes. accelerate does not pick FSDP
    without a GPU, so the test-only wrapper tests/train/fsdp_on_cpu.py flips the gloo group it
    builds to accelerate's FSDP2 path; that choice is all it bypasses. The log must show FSDP and the resume
    state must be FSDP's sharded checkpoint, so a run that fell back to DDP fails here."""
    out = tmp_path / "fsdp2"
    args = two_rank_args(out, "train.save_every_steps=2", "train.keep_checkpoints=2", evaluate=True)
    log = cli.run(fsdp2_command(cli, args), tmp_path / "log.txt", timeout=600)
    assert "2 process(es), DistributedType.FSDP" in log
    assert "FSDP2: 7 shard unit(s) over 2000 parameters (head.lm_head, head.midlayer.mlp.down_proj" in log
    assert_evaluated(log)
    state = latest_state(out)
    assert json.loads((state / PROGRESS_FILE).read_text())["step"] == 3
    assert (state / "pytorch_model_fsdp_0").is_dir()  # torch.distributed.checkpoint shards, one per rank
    assert len(list((state / "pytorch_model_fsdp_0").glob("*.distcp"))) == 2
    assert max_difference(weights(out), weights(ddp[0])) < ATOL

    # resume: a run that stopped at step 2 (its step-3 state deleted) continues to the same head
    resumed = tmp_path / "resumed"
    shutil.copytree(out, resumed, ignore=shutil.ignore_patterns("step-3", "head"))
    args = two_rank_args(resumed, "train.save_every_steps=2", "train.keep_checkpoints=2", evaluate=True)
    log = cli.run(fsdp2_command(cli, args), tmp_path / "log2.txt", timeout=600)
    assert "resumed from" in log and "at step 2/3" in log
    assert max_difference(weights(resumed), weights(out)) < ATOL


@pytest.mark.distributed
def test_deepspeed_bf16_trains_online_and_from_an_offline_dump(tmp_path, two_rank_args, cli):
    """Under DeepSpeed, bf16 means the engine holds the head in bf16 and runs no autocast: the recipe must
    hand it bf16 inputs, online (a bf16 target) and offline (the dump reader gives float32 features)."""
    bf16 = ["train.mixed_precision=bf16", "model.dtype=bfloat16"]
    online = tmp_path / "online"
    log = cli.run(
        cli.command(
            "train/eagle.py",
            two_rank_args(online, *bf16, evaluate=True),
            accelerate_config="deepspeed_zero2.yaml",
        ),
        tmp_path / "online.txt",
        timeout=600,
    )
    assert "2 process(es), DistributedType.DEEPSPEED" in log
    assert_evaluated(log)
    states = tmp_path / "states"
    dump = two_rank_args(tmp_path / "unused", *bf16, f"data.offline_dir='{states}'")
    cli.run(
        cli.command("scripts/dump_hidden_states.py", [*dump, "--shard-size", "8"]), tmp_path / "dump.txt", 300
    )
    offline = tmp_path / "offline"
    args = two_rank_args(offline, *bf16, "data.hidden_states=offline", f"data.offline_dir='{states}'")
    cli.run(
        cli.command("train/eagle.py", args, accelerate_config="deepspeed_zero2.yaml"),
        tmp_path / "offline.txt",
        timeout=600,
    )
    for run in (online, offline):
        state = weights(run)
        assert json.loads((run / "head" / "config.json").read_text())["train_step"] == 3
        assert all(torch.isfinite(v).all() for v in state.values() if v.is_floating_point())
    # the same batches in the same order: online and offline heads end close (bf16 rounding apart)
    assert max_difference(weights(online), weights(offline)) < 1e-2


@pytest.mark.parametrize(
    "distributed_type, precision, dtype, refused",
    [
        # the engine's bf16 head would meet a float32 embedding / lm_head
        (
            "DEEPSPEED",
            "bf16",
            "float32",
            True,
        ),
        ("DEEPSPEED", "bf16", "bfloat16", False),
        ("DEEPSPEED", "no", "float32", False),
        ("MULTI_CPU", "bf16", "float32", False),  # autocast reconciles them there
    ],
)
def test_deepspeed_half_precision_needs_a_target_of_that_dtype(distributed_type, precision, dtype, refused):
    accelerator = SimpleNamespace(
        distributed_type=DistributedType[distributed_type], mixed_precision=precision
    )
    model = ModelConfig(dtype=dtype)
    if refused:
        with pytest.raises(
            ValueError, match=f"under DeepSpeed, train.mixed_precision={precision} casts the head"
        ):
            check_deepspeed_precision(accelerator, model)
    else:
        check_deepspeed_precision(accelerator, model)


def test_fsdp2_reduces_gradients_in_fp32_under_bf16():
    """accelerate's FSDP2 policy for bf16 would reduce-scatter (and accumulate) gradients in bf16 too."""
    from accelerate.utils import FullyShardedDataParallelPlugin

    plugin = FullyShardedDataParallelPlugin(fsdp_version=2)
    plugin.set_mixed_precision("bf16")  # what accelerate does when it builds an FSDP run with bf16
    assert plugin.mixed_precision_policy.reduce_dtype == torch.bfloat16
    _fsdp2_fp32_reduction(plugin, "bf16")
    policy = plugin.mixed_precision_policy
    assert (policy.param_dtype, policy.reduce_dtype) == (torch.bfloat16, torch.float32)


def test_one_process_shards_nothing_and_keeps_weights_whole():
    accelerator = SimpleNamespace(distributed_type=DistributedType.NO, print=print)
    module = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
    assert shard_fsdp2_units(accelerator, module) == [] and not shards_trained_weights(accelerator)
    params = list(module.parameters())
    with whole_parameters(params) as whole:  # no ZeRO-3 partitioning: the parameters themselves
        assert all(a is b for a, b in zip(whole, params))
