"""train/medusa.py (Medusa-2: heads + LoRA on the target) on 2 CPU processes under DDP, DeepSpeed ZeRO-2 and
ZeRO-3 and FSDP2, each checked against a 1-process run of the same global batch, as test_distributed.py does
for EAGLE (same uniform data, same reasoning). The heads AND the LoRA adapter, which the main process writes
from weights gathered from the shards, must equal the 1-process run's. Every 2-process run evaluates after
each step (eval loss on every rank, simulated tau on the main process), so a rank left waiting hangs it.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from safetensors.torch import load_file

pytestmark = pytest.mark.distributed

# LoRA dropout off: 2 ranks draw their masks apart, 1 process draws one (2, ...) mask, so they would differ
COMMON = [
    "medusa.lora_r=4",
    "medusa.lora_dropout=0.0",
    "medusa.num_heads=2",
    "train.max_steps=3",
    "data.eval_fraction=0",
    "train.eval_tau_prompts=0",
]
ONE_RANK = [*COMMON, "train.per_device_batch_size=2"]
TWO_RANKS = [*COMMON, "train.per_device_batch_size=1", "train.eval_tau_prompts=1", "train.eval_every_steps=1"]
HEADS_ONLY = ["medusa.heads_only_steps=3"]  # the whole run is the heads-only stage
ATOL = 1e-5
FSDP_UNIT_PARAMS = 5000
FSDP_ON_CPU = "tests/train/fsdp_on_cpu.py"  # test-only: accelerate's FSDP2 path on CPU processes


def heads_and_lora(run: Path) -> tuple[dict, dict]:
    return load_file(run / "head" / "model.safetensors"), load_file(
        run / "lora" / "adapter_model.safetensors"
    )


def max_difference(a: dict, b: dict) -> float:
    assert sorted(a) == sorted(b) and a
    return max((a[k].float() - b[k].float()).abs().max().item() for k in a)


@pytest.fixture(scope="module")
def single(tmp_path_factory, overrides, uniform_chats, run_recipe) -> Path:
    out = tmp_path_factory.mktemp("medusa_single") / "run"
    run_recipe(overrides(out, *ONE_RANK, train_file=uniform_chats), "medusa")
    return out


def launch(cli, overrides, uniform_chats, out: Path, accelerate_config: str, *extra: str) -> str:
    args = overrides(
        out,
        *TWO_RANKS,
        f"data.eval_files=['{uniform_chats.with_name('eval.jsonl')}']",
        *extra,
        train_file=uniform_chats,
    )
    script = [FSDP_ON_CPU, "train/medusa.py"] if accelerate_config == "fsdp2.yaml" else "train/medusa.py"
    command = cli.command(script, args, accelerate_config=accelerate_config)
    # a threshold the tiny model crosses, so units are really made: each
    if accelerate_config == "fsdp2.yaml":
        # decoder layer and lm_head inside ModuleLists, and a tied embedding / lm_head that must stay together
        at = command.index("--config_file") + 2
        command[at:at] = ["--fsdp_min_num_params", str(FSDP_UNIT_PARAMS)]
    return cli.run(command, out.parent / f"{out.name}.log", timeout=300)  # a hung rank fails here


@pytest.mark.parametrize(
    "accelerate_config, distributed_type",
    [
        ("ddp_cpu.yaml", "MULTI_CPU"),
        ("deepspeed_zero2.yaml", "DEEPSPEED"),
        ("deepspeed_zero3.yaml", "DEEPSPEED"),
        ("fsdp2.yaml", "FSDP"),
    ],
)
def test_medusa2_heads_and_lora_match_one_process(
    accelerate_config, distributed_type, single, tmp_path, overrides, uniform_chats, cli
):
    out = tmp_path / "run"
    log = launch(cli, overrides, uniform_chats, out, accelerate_config)
    assert f"2 process(es), DistributedType.{distributed_type}" in log
    if accelerate_config == "fsdp2.yaml":
        assert "FSDP2: 6 shard unit(s) over 5000 parameters" in log, log[-3000:]
    assert len([line for line in log.splitlines() if "eval_loss" in line and "eval_tau" in line]) == 3, log[
        -3000:
    ]
    heads, lora = heads_and_lora(out)
    expected_heads, expected_lora = heads_and_lora(single)
    assert any(".lora_A." in k for k in lora) and any(".lora_B." in k for k in lora)
    assert max_difference(heads, expected_heads) < ATOL
    assert max_difference(lora, expected_lora) < ATOL
    assert max(v.abs().max().item() for k, v in lora.items() if ".lora_B." in k) > 0  # LoRA trained


def test_heads_only_stage_keeps_lora_bit_identical_under_deepspeed(
    tmp_path, overrides, uniform_chats, cli, single, run_recipe
):
    """DeepSpeed reduces gradients into buffers of its own, so dropping `.grad` would not hold the LoRA
    weights: in the heads-only stage they must get zero gradients. After 3 heads-only steps under ZeRO-2 the
    adapter is bit for bit the one a 1-process heads-only run keeps (whose Adam skips parameters without
    gradients), while the heads trained."""
    reference = tmp_path / "one_process"
    run_recipe(overrides(reference, *ONE_RANK, *HEADS_ONLY, train_file=uniform_chats), "medusa")
    out = tmp_path / "zero2"
    launch(cli, overrides, uniform_chats, out, "deepspeed_zero2.yaml", *HEADS_ONLY)
    heads, lora = heads_and_lora(out)
    reference_heads, reference_lora = heads_and_lora(reference)
    assert max_difference(lora, reference_lora) == 0.0
    assert all(v.abs().max().item() == 0 for k, v in lora.items() if ".lora_B." in k)  # peft's zero init
    assert max_difference(heads, reference_heads) < ATOL
    assert max_difference(heads, heads_and_lora(single)[0]) > 100 * ATOL  # other loss: the heads moved apart
