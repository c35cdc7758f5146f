"""train/config.py: every shipped YAML loads; overrides, unknown keys, wrong types, bad choices, round trip.

Which run config a file holds is decided by its name: `medusa*.yaml` -> MedusaRunConfig, every other file
(`eagle*.yaml`, `tiny_test.yaml`) -> EagleRunConfig. `tiny_test.yaml` has no head section, so it loads into
both, and its smoke tests can drive either recipe.
"""

from __future__ import annotations

import dataclasses
import inspect
import json
import re
from pathlib import Path

import pytest
import yaml

from train import config as config_module
from train.config import (
    ConfigError,
    EagleRunConfig,
    EagleTrainConfig,
    MedusaRunConfig,
    flatten,
    load_config,
    save_config,
    to_dict,
)

ROOT = Path(__file__).resolve().parents[2]
RUN_YAMLS = sorted((ROOT / "configs").glob("*.yaml"))
ACCELERATE_YAMLS = sorted((ROOT / "configs" / "accelerate").glob("*.yaml"))
REQUIRED = ["data.train_files=[train.jsonl]", "train.output_dir=runs/test"]


def run_config_classes(path: Path) -> list[type]:
    """The run config(s) a shipped YAML must load into, by file name (see the module docstring)."""
    if path.name.startswith("medusa"):
        return [MedusaRunConfig]
    if path.name == "tiny_test.yaml":
        return [EagleRunConfig, MedusaRunConfig]
    return [EagleRunConfig]


def write_yaml(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "run.yaml"
    path.write_text(text, encoding="utf-8")
    return path


def test_shipped_configs_exist():
    names = {p.name for p in RUN_YAMLS}
    assert {
        "eagle3_smollm2.yaml",
        "eagle1_smollm2.yaml",
        "medusa1_smollm2.yaml",
        "medusa2_smollm2.yaml",
        "tiny_test.yaml",
        "eagle3_llama3_8b.yaml",
        "eagle3_qwen2_7b.yaml",
        "medusa1_llama3_8b.yaml",
    } <= names
    assert {p.name for p in ACCELERATE_YAMLS} >= {
        "ddp_cpu.yaml",
        "deepspeed_zero1.yaml",
        "deepspeed_zero2.yaml",
        "deepspeed_zero3.yaml",
        "fsdp2.yaml",
    }


@pytest.mark.parametrize("path", RUN_YAMLS, ids=lambda p: p.name)
def test_every_yaml_loads_into_its_run_config(path):
    for cls in run_config_classes(path):
        cfg = load_config(cls, path)
        assert isinstance(cfg, cls)
        assert cfg.train.output_dir and cfg.data.train_files
    if path.name.startswith("eagle"):
        assert cfg.eagle.head_type == path.name[:6]  # eagle1_* / eagle3_* hold that head type
    if path.name.startswith("medusa"):
        assert (cfg.medusa.lora_r > 0) == path.name.startswith("medusa2")  # lora_r > 0 is Medusa-2


@pytest.mark.parametrize("path", RUN_YAMLS, ids=lambda p: p.name)
def test_every_yaml_starts_with_its_launch_command(path):
    first = path.read_text(encoding="utf-8").splitlines()[0]
    match = re.fullmatch(
        r"# accelerate launch (?:--\S+ \S+ |--multi_gpu )*train/(eagle|medusa)\.py (\S+)", first
    )
    assert match, f"{path.name}: first line must be its launch command, got {first!r}"
    recipe, config_path = match.groups()
    assert config_path == f"configs/{path.name}"
    assert {"eagle": EagleRunConfig, "medusa": MedusaRunConfig}[recipe] in run_config_classes(path)
    for flag_file in re.findall(r"--config_file (\S+)", first):
        assert (ROOT / flag_file).is_file(), f"{path.name} launches with a missing {flag_file}"


def test_tiny_test_is_tiny():
    cfg = load_config(EagleRunConfig, ROOT / "configs" / "tiny_test.yaml")
    assert cfg.train.max_steps == 2 and cfg.data.max_length <= 128 and cfg.train.per_device_batch_size <= 2


def test_overrides_are_parsed_and_typed():
    cfg = load_config(
        EagleRunConfig,
        ROOT / "configs" / "eagle3_smollm2.yaml",
        [
            "train.learning_rate=1e-4",  # PyYAML alone reads 1e-4 as a str
            "train.max_grad_norm=1",  # an int where a float is expected: widened
            "eagle.aux_layer_ids=[1,14,26]",
            "eagle.fc_bias=true",
            "model.revision=null",
            "model.revision='0123'",  # quoted: a str, not the int 123 (last override wins)
            "data.train_files=[a.jsonl, b.jsonl]",
            "train.max_steps=7",
        ],
    )
    assert cfg.train.learning_rate == 1e-4 and isinstance(cfg.train.learning_rate, float)
    assert cfg.train.max_grad_norm == 1.0 and isinstance(cfg.train.max_grad_norm, float)
    assert cfg.eagle.aux_layer_ids == [1, 14, 26]
    assert cfg.eagle.fc_bias is True
    assert cfg.model.revision == "0123"
    assert cfg.data.train_files == ["a.jsonl", "b.jsonl"]
    assert cfg.train.max_steps == 7


def test_yaml_exponent_floats_and_no_file(tmp_path):
    path = write_yaml(
        tmp_path, "data: {train_files: [x.jsonl]}\ntrain: {output_dir: out, learning_rate: 3e-5}\n"
    )
    assert load_config(EagleRunConfig, path).train.learning_rate == 3e-5
    cfg = load_config(MedusaRunConfig, None, REQUIRED + ["medusa.lora_r=8"])
    assert cfg.medusa.lora_r == 8 and cfg.train.output_dir == "runs/test"


def test_unknown_key_in_yaml_names_key_file_and_valid_keys(tmp_path):
    path = write_yaml(
        tmp_path, "data: {train_files: [x.jsonl]}\ntrain: {output_dir: out, learnin_rate: 1.0}\n"
    )
    with pytest.raises(ConfigError) as info:
        load_config(EagleRunConfig, path)
    message = str(info.value)
    assert "train.learnin_rate" in message and str(path) in message
    assert "learning_rate" in message and "warmup_ratio" in message  # the section's valid keys


def test_unknown_section_and_wrong_head_section(tmp_path):
    with pytest.raises(
        ConfigError, match=r"unknown key medusa .*valid keys of the top level: model, data, eagle"
    ):
        load_config(EagleRunConfig, write_yaml(tmp_path, "medusa: {num_heads: 3}\n"), REQUIRED)


def test_unknown_key_in_override_names_key_and_override():
    with pytest.raises(ConfigError) as info:
        load_config(EagleRunConfig, ROOT / "configs" / "eagle3_smollm2.yaml", ["eagle.ttt_step=5"])
    message = str(info.value)
    assert "eagle.ttt_step" in message and "override 'eagle.ttt_step=5'" in message
    assert "eagle3_smollm2.yaml" in message and "ttt_steps" in message


@pytest.mark.parametrize(
    "override, key, expected",
    [
        ("train.max_steps=ten", "train.max_steps", "expected int"),
        ("train.max_steps=true", "train.max_steps", "expected int"),  # bool is not an int
        ("train.max_steps=2.5", "train.max_steps", "expected int"),
        ("train.learning_rate=fast", "train.learning_rate", "expected float"),
        ("train.learning_rate=true", "train.learning_rate", "expected float"),
        ("eagle.fc_bias=1", "eagle.fc_bias", "expected bool"),
        ("model.target=123", "model.target", "expected str"),
        ("model.revision=[a]", "model.revision", "expected str | None"),
        ("data.train_files=x.jsonl", "data.train_files", "expected list[str]"),
        ("eagle.aux_layer_ids=[1,x,3]", "eagle.aux_layer_ids[1]", "expected int"),  # names the index
        ("eagle.aux_layer_ids=5", "eagle.aux_layer_ids", "expected list[int] | None"),
        ("train=5", "train", "expected a mapping"),
    ],
)
def test_wrong_type_names_key_and_expected_type(override, key, expected):
    with pytest.raises(ConfigError) as info:
        load_config(EagleRunConfig, None, REQUIRED + [override])
    message = str(info.value)
    assert message.startswith(f"{key}:") and expected in message, message
    assert f"override {override!r}" in message


def test_wrong_type_in_yaml_names_file(tmp_path):
    path = write_yaml(
        tmp_path, "data: {train_files: [x.jsonl]}\ntrain: {output_dir: out, mixed_precision: no}\n"
    )
    with pytest.raises(ConfigError, match=r"train\.mixed_precision: expected str, got False .*run\.yaml"):
        load_config(EagleRunConfig, path)  # bare `no` is a YAML bool: the shipped files quote it


@pytest.mark.parametrize(
    "cls, override, allowed",
    [
        (EagleRunConfig, "model.dtype=fp32", config_module.DTYPES),
        (EagleRunConfig, "model.attn_implementation=flash", config_module.ATTN_IMPLEMENTATIONS),
        (EagleRunConfig, "data.hidden_states=disk", config_module.HIDDEN_STATES),
        (EagleRunConfig, "train.lr_scheduler=cosin", config_module.LR_SCHEDULERS),
        (EagleRunConfig, "train.report_to=all", config_module.REPORT_TO),
        (MedusaRunConfig, "train.mixed_precision=fp8", config_module.MIXED_PRECISIONS),
        (EagleRunConfig, "eagle.head_type=eagle2", config_module.RECIPE_HEAD_TYPES),
        (EagleRunConfig, "eagle.distill_loss=kl", config_module.DISTILL_LOSSES),
    ],
)
def test_bad_choice_lists_allowed_values(cls, override, allowed):
    with pytest.raises(ConfigError) as info:
        load_config(cls, None, REQUIRED + [override])
    message = str(info.value)
    assert message.startswith(override.split("=")[0]) and str(list(allowed)) in message
    assert f"override {override!r}" in message


def test_cross_field_checks():
    with pytest.raises(ConfigError, match="eagle.aux_layer_ids must be null for eagle1"):
        load_config(EagleRunConfig, ROOT / "configs" / "eagle1_smollm2.yaml", ["eagle.aux_layer_ids=[1,2,3]"])
    with pytest.raises(ConfigError, match="heads_only_steps needs lora_r > 0"):
        load_config(
            MedusaRunConfig, ROOT / "configs" / "medusa1_smollm2.yaml", ["medusa.heads_only_steps=10"]
        )
    with pytest.raises(ConfigError, match="offline_dir must be set"):
        load_config(EagleRunConfig, None, REQUIRED + ["data.hidden_states=offline"])
    with pytest.raises(ConfigError, match="distill_loss 'forward_kl' is for eagle3"):
        load_config(
            EagleRunConfig, ROOT / "configs" / "eagle1_smollm2.yaml", ["eagle.distill_loss=forward_kl"]
        )
    with pytest.raises(ConfigError, match="EAGLE-3.1 options: eagle.head_type must be eagle3"):
        load_config(EagleRunConfig, ROOT / "configs" / "eagle1_smollm2.yaml", ["eagle.norm_output=true"])
    for extra in ([], ["eagle.head_type=dflash", "eagle.init_from=pretrained/x"]):
        with pytest.raises(
            ConfigError, match="redraw_vocab redraws the vocabulary of the eagle3 / peagle head"
        ):
            load_config(EagleRunConfig, None, REQUIRED + ["eagle.redraw_vocab=true", *extra])
    with pytest.raises(ConfigError, match="set train.eval_tau_prompts > 0"):
        load_config(EagleRunConfig, None, REQUIRED + ["train.keep_best_tau=true", "train.eval_tau_prompts=0"])


def test_missing_required_keys_are_named():
    with pytest.raises(ConfigError, match=r"missing required key\(s\) data\.train_files"):
        load_config(EagleRunConfig, None, ["train.output_dir=out"])
    with pytest.raises(ConfigError, match=r"missing required key\(s\) train\.output_dir"):
        load_config(MedusaRunConfig, None, ["data.train_files=[x.jsonl]"])


def test_malformed_override():
    with pytest.raises(ConfigError, match="dotted.key=value"):
        load_config(EagleRunConfig, None, REQUIRED + ["train.learning_rate"])
    with pytest.raises(ConfigError, match="train.output_dir is not a section"):
        load_config(EagleRunConfig, None, REQUIRED + ["train.output_dir.x=1"])


@pytest.mark.parametrize("path", RUN_YAMLS, ids=lambda p: p.name)
def test_save_config_round_trip(path, tmp_path):
    for cls in run_config_classes(path):
        cfg = load_config(cls, path, ["train.learning_rate=2.5e-5", "data.eval_files=[e.jsonl]"])
        save_config(cfg, tmp_path / cls.__name__ / "config.yaml")
        again = load_config(cls, tmp_path / cls.__name__ / "config.yaml")
        assert again == cfg
        assert to_dict(again) == to_dict(cfg) == yaml.safe_load(yaml.safe_dump(to_dict(cfg)))


def test_a_key_or_section_given_twice_is_refused_with_both_lines(tmp_path):
    """PyYAML keeps the last of two equal keys: a second `train:` section silently dropped the first."""
    path = tmp_path / "twice.yaml"
    path.write_text(
        "data:\n  train_files: [a]\ntrain:\n  output_dir: o\n  learning_rate: 1e-3\ntrain:\n  max_steps: 3\n"
    )
    with pytest.raises(
        ConfigError, match=re.escape(f"{path}: key 'train' is given twice in one section (lines 3 and 6)")
    ):
        load_config(EagleRunConfig, path)
    path.write_text(
        "data:\n  train_files: [a]\ntrain:\n  output_dir: o\n  learning_rate: 1e-3\n  learning_rate: 1e-5\n"
    )
    with pytest.raises(
        ConfigError, match="key 'learning_rate' is given twice in one section \\(lines 5 and 6\\)"
    ):
        load_config(EagleRunConfig, path)


def test_a_section_override_sets_its_keys_and_keeps_the_others(tmp_path):
    """`eagle={ce_loss_weight: 0.2}` replaced the YAML's whole eagle section: head_type and the noise went
    back to their defaults without a word."""
    path = tmp_path / "run.yaml"
    path.write_text(
        "data:\n  train_files: [a]\ntrain:\n  output_dir: o\n"
        "eagle:\n  head_type: eagle1\n  noise_width: 0.5\n"
    )
    cfg = load_config(EagleRunConfig, path, ["eagle={ce_loss_weight: 0.2}"])
    assert (cfg.eagle.head_type, cfg.eagle.noise_width, cfg.eagle.ce_loss_weight) == ("eagle1", 0.5, 0.2)


def test_a_saved_string_that_reads_as_a_float_is_quoted(tmp_path):
    """A short commit hash of digits and one e (`12e4567`) was saved bare and read back as inf."""
    cfg = load_config(EagleRunConfig, None, REQUIRED + ["model.revision='12e4567'", "data.sources=['1e3']"])
    save_config(cfg, tmp_path / "config.yaml")
    assert load_config(EagleRunConfig, tmp_path / "config.yaml") == cfg


def test_defaults_follow_the_papers():
    eagle = load_config(EagleRunConfig, None, REQUIRED)
    assert (eagle.train.adam_beta1, eagle.train.adam_beta2, eagle.train.max_grad_norm) == (0.9, 0.95, 0.5)
    assert eagle.eagle == EagleTrainConfig() and eagle.eagle.aux_layer_ids is None
    medusa = load_config(MedusaRunConfig, ROOT / "configs" / "medusa1_smollm2.yaml")
    assert (medusa.train.learning_rate, medusa.train.lr_scheduler, medusa.train.warmup_ratio) == (
        1e-3,
        "cosine",
        0.1,
    )
    assert (medusa.medusa.decay, medusa.medusa.head_loss_weight, medusa.medusa.head_lr_multiplier) == (
        0.8,
        0.2,
        4.0,
    )


def test_every_field_has_a_comment():
    """docs/design.md, Configs: each field carries a trailing comment (units and reason)."""
    source = inspect.getsource(config_module)
    for cls in [c for c in vars(config_module).values() if dataclasses.is_dataclass(c)]:
        for f in dataclasses.fields(cls):
            lines = [ln for ln in source.splitlines() if re.match(rf"\s+{f.name}: ", ln)]
            assert lines and all("  # " in ln for ln in lines), f"{cls.__name__}.{f.name} has no comment"


@pytest.mark.parametrize("path", ACCELERATE_YAMLS, ids=lambda p: p.name)
def test_accelerate_yaml_parses_and_names_a_distributed_type(path):
    from accelerate.commands.config.config_args import load_config_from_file
    from accelerate.commands.launch import launch_command_parser

    raw = yaml.safe_load(path.read_text(encoding="utf-8"))
    assert raw["distributed_type"] in {"MULTI_GPU", "DEEPSPEED", "FSDP"}
    # no hyperparams
    assert not {"mixed_precision", "gradient_accumulation_steps", "gradient_clipping"} & set(raw)
    cluster = load_config_from_file(str(path))  # accelerate's own schema: unknown top-level keys raise
    launch_options = {action.dest for action in launch_command_parser()._actions}
    for key in list(cluster.deepspeed_config) + list(cluster.fsdp_config):
        assert key in launch_options, f"{path.name}: {key} is not an `accelerate launch` option"
    if raw["distributed_type"] == "DEEPSPEED":
        ds_file = ROOT / raw["deepspeed_config"]["deepspeed_config_file"]
        ds = json.loads(ds_file.read_text(encoding="utf-8"))
        assert ds["zero_optimization"]["stage"] == int(path.stem[-1])
        for key in ("train_micro_batch_size_per_gpu", "gradient_accumulation_steps", "gradient_clipping"):
            assert ds[key] == "auto", f"{ds_file.name}: {key} must come from the run YAML"
        assert "optimizer" not in ds and "scheduler" not in ds  # the recipe builds them from the run YAML


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_deepspeed_json_accepted_by_accelerate(stage, monkeypatch):
    from accelerate.utils import DeepSpeedPlugin

    # as the launcher
    monkeypatch.setenv("ACCELERATE_CONFIG_DS_FIELDS", "deepspeed_config_file,zero3_init_flag")
    plugin = DeepSpeedPlugin(
        hf_ds_config=str(ROOT / "configs" / "deepspeed" / f"zero{stage}.json"), zero3_init_flag=False
    )
    plugin.set_mixed_precision("bf16")
    assert plugin.zero_stage == stage and plugin.deepspeed_config["bf16"]["enabled"] is True


def test_flatten_gives_the_dotted_override_keys_and_scalar_values():
    cfg = load_config(EagleRunConfig, None, REQUIRED)
    flat = flatten(to_dict(cfg))
    assert flat["train.output_dir"] == "runs/test" and flat["train.learning_rate"] == 1e-4
    assert flat["data.train_files"] == "['train.jsonl']" and flat["model.revision"] == "None"
    assert all(isinstance(v, (int, float, str, bool)) for v in flat.values())  # what trackers accept
    assert set(flat) == {f"{section}.{key}" for section, fields in to_dict(cfg).items() for key in fields}
