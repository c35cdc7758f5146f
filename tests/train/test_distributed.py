"""train/eagle.py on 2 CPU processes through `accelerate launch`: DDP over gloo and DeepSpeed ZeRO-1/2/3, each
checked against a 1-process run of the same global batch (2 x 1 sequences per step vs 1 x 2).

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
import textwrap
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoTokenizer

from heads import load_heads
from heads.target import load_target
from train.checkpoint import PROGRESS_FILE, latest_state
from train.data import build_dataset

pytestmark = pytest.mark.distributed

COMMON = ["train.eval_tau_prompts=0", "data.eval_fraction=0", "eagle.draft_vocab_size=256",
          "train.max_steps=3"]
TWO_RANKS = [*COMMON, "train.per_device_batch_size=1"]  # global batch 2 = 2 processes x 1
ONE_RANK = [*COMMON, "train.per_device_batch_size=2"]   # global batch 2 = 1 process x 2
ATOL = 1e-5  # float32 sums in another order (gradient all-reduce, ZeRO partitions): ~1e-7 seen here

# Runs a recipe as `__main__` and, at every export, also saves the head THIS rank holds (out/rank<i>), so the
# test can compare the ranks' own weights; the recipe itself writes the export from the main process only.
PER_RANK = '''
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
'''


def weights(path: Path) -> dict[str, torch.Tensor]:
    return load_file(path if path.suffix == ".safetensors" else path / "head" / "model.safetensors")


def max_difference(a: dict, b: dict) -> float:
    assert sorted(a) == sorted(b)
    return max((a[k].float() - b[k].float()).abs().max().item() for k in a)


@pytest.fixture(scope="module")
def uniform_chats(tmp_path_factory, tiny_target_dir) -> Path:
    """40 chats with one prompt and long, different replies: every example fills max_length (64) and has the
    same loss mask, so per-rank and per-batch token means weigh each sequence alike (module docstring)."""
    rows = [{"messages": [{"role": "user", "content": "Count for me, please."},
                          {"role": "assistant", "content": " ".join(str(7 * i + j) for j in range(40))}]}
            for i in range(40)]
    path = tmp_path_factory.mktemp("uniform") / "train.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in rows), encoding="utf-8")
    dataset, _ = build_dataset(path, AutoTokenizer.from_pretrained(tiny_target_dir), max_length=64)
    assert len(dataset) == 40 and len({tuple(mask) for mask in dataset["loss_mask"]}) == 1
    assert {len(ids) for ids in dataset["input_ids"]} == {64}
    return path


@pytest.fixture(scope="module")
def per_rank_script(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("scripts") / "per_rank.py"
    path.write_text(textwrap.dedent(PER_RANK))
    return str(path)


@pytest.fixture(scope="module")
def single(tmp_path_factory, overrides, uniform_chats, run_recipe) -> Path:
    out = tmp_path_factory.mktemp("single") / "run"
    run_recipe(overrides(out, *ONE_RANK, train_file=uniform_chats))
    return out


@pytest.fixture(scope="module")
def ddp(tmp_path_factory, overrides, uniform_chats, per_rank_script, cli) -> tuple[Path, str]:
    out = tmp_path_factory.mktemp("ddp") / "run"
    args = overrides(out, *TWO_RANKS, train_file=uniform_chats)
    command = cli.command([per_rank_script, "train/eagle.py"], args, accelerate_config="ddp_cpu.yaml")
    return out, cli.run(command, out.parent / "log.txt", timeout=300)


def test_ddp_matches_one_process_with_the_same_global_batch(ddp, single, tmp_path, overrides, uniform_chats,
                                                            run_recipe):
    out, log = ddp
    assert "2 process(es), DistributedType.MULTI_CPU" in log  # a real 2-rank group, not 2 lone processes
    assert json.loads((out / "head" / "config.json").read_text())["train_step"] == 3
    assert max_difference(weights(out), weights(single)) < ATOL

    # negative control: the same run on another data order ends elsewhere, so the match above means something
    other = tmp_path / "other_order"
    run_recipe(overrides(other, *ONE_RANK, "data.shuffle_seed=1", train_file=uniform_chats))
    assert max_difference(weights(other), weights(single)) > 100 * ATOL


def test_ddp_ranks_end_with_identical_weights(ddp):
    out, _ = ddp
    rank0, rank1 = weights(out / "rank0.safetensors"), weights(out / "rank1.safetensors")
    assert max_difference(rank0, rank1) == 0.0
    assert max_difference(rank0, weights(out)) == 0.0  # and the export is what the ranks hold


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_deepspeed_zero_trains_exports_and_matches_ddp(stage, ddp, tmp_path, overrides, uniform_chats,
                                                       per_rank_script, cli, tiny_target_dir):
    out = tmp_path / f"zero{stage}"
    # ZeRO-3 shards the head itself, so no rank holds whole weights to dump: run the plain recipe there
    script = "train/eagle.py" if stage == 3 else [per_rank_script, "train/eagle.py"]
    command = cli.command(script, overrides(out, *TWO_RANKS, train_file=uniform_chats),
                          accelerate_config=f"deepspeed_zero{stage}.yaml")
    log = cli.run(command, tmp_path / "log.txt", timeout=600)  # 600: the first launch compiles an op
    assert "2 process(es), DistributedType.DEEPSPEED" in log

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
