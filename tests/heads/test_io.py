"""Tests for heads/io.py: the export folder (config.json + model.safetensors), strict loading, target
checks."""

import copy
import json
import os
import re
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from heads.dflash import DFlashConfig, DFlashHead
from heads.eagle import EagleConfig, EagleHead
from heads.io import CONFIG_NAME, FORMAT_VERSION, WEIGHTS_NAME, load_heads, save_heads
from heads.medusa import MedusaConfig, MedusaHeads
from heads.peagle import PEagleConfig, PEagleHead

HEAD_TYPES = ["medusa", "eagle1", "eagle3", "dflash", "peagle"]


def _head(kind: str, target_config):
    torch.manual_seed(0)
    if kind == "medusa":
        head = MedusaHeads(
            MedusaConfig(
                hidden_size=target_config.hidden_size,
                vocab_size=target_config.vocab_size,
                num_heads=2,
                num_layers=2,
            )
        )
        for block in head.blocks:  # non-zero weights, so a round trip that drops them would show
            torch.nn.init.normal_(block[0].linear.weight)
        return head
    if kind == "dflash":
        head = DFlashHead(
            DFlashConfig.from_target(target_config, 5, num_hidden_layers=2, draft_vocab_size=64)
        )
        head.set_draft_vocab(torch.randperm(target_config.vocab_size)[:64])
        return head
    if kind == "peagle":
        head = PEagleHead(PEagleConfig.from_target(target_config, mask_token_id=9, draft_vocab_size=64))
        head.set_draft_vocab(torch.randperm(target_config.vocab_size)[:64])
        torch.nn.init.normal_(head.mask_embedding)  # non-zero, so a round trip that drops it would show
        return head
    head = EagleHead(
        EagleConfig.from_target(target_config, kind, **({"draft_vocab_size": 64} if kind == "eagle3" else {}))
    )
    if kind == "eagle3":
        head.set_draft_vocab(torch.randperm(target_config.vocab_size)[:64])
    return head


@pytest.fixture
def llama(build_target):
    return build_target("llama")


def _export(tmp_path: Path, kind: str, target) -> tuple[torch.nn.Module, Path]:
    head = _head(kind, target.config)
    path = save_heads(
        head,
        tmp_path / kind,
        base_model="org/tiny-llama",
        base_revision="abc123",
        target=target,
        extra={"note": "unit test"},
    )
    return head, path


def _rewrite_weights(path: Path, edit) -> None:
    state = load_file(path / WEIGHTS_NAME)
    edit(state)
    save_file(state, path / WEIGHTS_NAME)


@pytest.mark.parametrize("kind", HEAD_TYPES)
def test_export_holds_exactly_two_files(tmp_path, llama, kind):
    _, path = _export(tmp_path, kind, llama)
    assert sorted(os.listdir(path)) == [CONFIG_NAME, WEIGHTS_NAME]  # no temp files, no pickles
    _export(tmp_path, kind, llama)  # overwriting an export leaves no debris either
    assert sorted(os.listdir(path)) == [CONFIG_NAME, WEIGHTS_NAME]


@pytest.mark.parametrize("kind", HEAD_TYPES)
def test_round_trip_is_exact(tmp_path, llama, kind):
    head, path = _export(tmp_path, kind, llama)
    loaded = load_heads(path, llama)
    assert type(loaded) is type(head) and loaded.head_type == head.head_type and not loaded.training
    assert loaded.config == head.config
    expected, actual = head.state_dict(), loaded.state_dict()
    assert set(actual) == set(expected)
    for key, tensor in expected.items():
        assert actual[key].dtype == tensor.dtype, key
        assert torch.equal(actual[key], tensor), key
    halves = load_heads(path, llama, dtype=torch.bfloat16)
    assert (halves.lm_heads[0] if kind == "medusa" else halves.fc).weight.dtype == torch.bfloat16
    if kind in ("eagle3", "dflash", "peagle"):  # the maps keep their integer / bool dtypes
        assert halves.d2t.dtype == torch.int64 and halves.t2d.dtype == torch.bool
        assert torch.equal(loaded.to_target_ids(torch.arange(64)), head.to_target_ids(torch.arange(64)))


@pytest.mark.parametrize("kind", HEAD_TYPES)
def test_config_records_provenance(tmp_path, llama, kind):
    _, path = _export(tmp_path, kind, llama)
    config = json.loads((path / CONFIG_NAME).read_text())
    assert config["head_type"] == kind
    assert config["format_version"] == FORMAT_VERSION == 1
    assert (config["base_model"], config["base_revision"]) == ("org/tiny-llama", "abc123")
    assert (config["hidden_size"], config["vocab_size"]) == (32, 128)
    assert (config["base_model_type"], config["base_num_hidden_layers"]) == ("llama", 4)
    assert config["note"] == "unit test"
    if kind == "eagle3":
        assert config["head_config"]["aux_layer_ids"] == [0, 1, 2]
        assert config["head_config"]["draft_vocab_size"] == 64
        assert "output of decoder layer" in config["aux_layer_ids_convention"]
    if kind == "medusa":
        assert (config["head_config"]["num_heads"], config["head_config"]["num_layers"]) == (2, 2)
    if kind == "peagle":
        head_config = config["head_config"]
        assert (head_config["parallel_depths"], head_config["mask_token_id"]) == (4, 9)
    if kind == "dflash":  # two layers, two taps spread over the 4 target layers
        assert (config["head_config"]["aux_layer_ids"], config["head_config"]["mask_token_id"]) == ([0, 3], 5)
        assert "output of decoder layer" in config["aux_layer_ids_convention"]


@pytest.mark.parametrize("kind", HEAD_TYPES)
@pytest.mark.parametrize(
    "other, key, ours, theirs",
    [
        (("llama", {"hidden_size": 48, "head_dim": 12}), "hidden_size", "32", "48"),
        (("llama", {"vocab_size": 256}), "vocab_size", "128", "256"),
        (("qwen2", {}), "model_type", "'llama'", "'qwen2'"),
        (("llama", {"num_hidden_layers": 6}), "num_hidden_layers", "4", "6"),  # taps in range, other depth
    ],
)
def test_loading_for_another_target_names_both_values(
    tmp_path, llama, build_target, kind, other, key, ours, theirs
):
    _, path = _export(tmp_path, kind, llama)
    target = build_target(other[0], **other[1])
    with pytest.raises(ValueError, match=f"{key}={ours}.*{key}={theirs}"):
        load_heads(path, target)
    with pytest.raises(ValueError, match=f"{key}={ours}.*{key}={theirs}"):
        load_heads(path, target.config)  # a bare config is checked the same way


def test_eagle3_taps_beyond_the_target_depth(tmp_path, llama):
    head = EagleHead(EagleConfig.from_target(llama.config, "eagle3", aux_layer_ids=(0, 2, 7)))
    path = save_heads(head, tmp_path / "deep", base_model="x")
    with pytest.raises(ValueError, match="taps layer 7.*4 layers"):
        load_heads(path, llama)


@pytest.mark.parametrize("damage", ["truncate", "garbage", "empty"])
def test_corrupt_weights_name_the_file(tmp_path, llama, damage):
    _, path = _export(tmp_path, "eagle1", llama)
    weights = path / WEIGHTS_NAME
    data = weights.read_bytes()
    weights.write_bytes(
        {"truncate": data[: len(data) // 2], "garbage": b"\x00not a safetensors file", "empty": b""}[damage]
    )
    with pytest.raises(ValueError, match=re.escape(str(weights))):
        load_heads(path, llama)


@pytest.mark.parametrize("kind", HEAD_TYPES)
def test_missing_extra_and_misshaped_keys_are_named(tmp_path, llama, kind):
    _, path = _export(tmp_path, kind, llama)
    victim = max(load_file(path / WEIGHTS_NAME))
    _rewrite_weights(path, lambda state: state.pop(victim))
    with pytest.raises(ValueError, match=rf"missing \['{re.escape(victim)}'\]"):
        load_heads(path, llama)
    _, path = _export(tmp_path, kind, llama)
    _rewrite_weights(path, lambda state: state.update({"embed_tokens.weight": torch.zeros(128, 32)}))
    with pytest.raises(ValueError, match=r"unexpected \['embed_tokens.weight'\]"):
        load_heads(path, llama)
    _, path = _export(tmp_path, kind, llama)
    _rewrite_weights(path, lambda state: state.update({victim: torch.zeros(3, 5)}))
    with pytest.raises(ValueError, match=rf"{re.escape(victim)} has shape \(3, 5\), expected"):
        load_heads(path, llama)


def test_bad_config_files_are_named(tmp_path, llama):
    _, path = _export(tmp_path, "medusa", llama)
    config_file = path / CONFIG_NAME
    good = config_file.read_text()
    config_file.write_text("{not json")
    with pytest.raises(ValueError, match=re.escape(str(config_file)) + ".*not valid JSON"):
        load_heads(path, llama)
    config_file.write_text(json.dumps({**json.loads(good), "format_version": FORMAT_VERSION + 1}))
    with pytest.raises(ValueError, match="format_version 2 is newer"):
        load_heads(path)
    config_file.write_text(json.dumps({k: v for k, v in json.loads(good).items() if k != "head_type"}))
    with pytest.raises(ValueError, match="missing key 'head_type'"):
        load_heads(path)
    config_file.write_text(json.dumps({**json.loads(good), "head_type": "hydra"}))
    with pytest.raises(ValueError, match="unknown head_type 'hydra'"):
        load_heads(path)
    config_file.unlink()
    with pytest.raises(FileNotFoundError, match=CONFIG_NAME):
        load_heads(path)


@pytest.mark.parametrize(
    "edit, message",
    [
        ({"format_version": "1"}, "format_version must be an integer >= 1, got '1'"),
        ({"format_version": True}, "format_version must be an integer >= 1, got True"),
        ({"format_version": 0}, "format_version must be an integer >= 1, got 0"),
        # a slip of a key loading reads is not a free-form note: the depth check would be skipped
        (
            {"base_num_hidden_layer": 6},
            "'base_num_hidden_layer' looks like a slip of 'base_num_hidden_layers'",
        ),
        ({"vocab_size": 999}, "vocab_size is 999 but head_config.vocab_size is 128"),
    ],
)
def test_top_level_config_keys_are_checked_where_loading_reads_them(tmp_path, llama, edit, message):
    _, path = _export(tmp_path, "eagle1", llama)
    config_file = path / CONFIG_NAME
    config = json.loads(config_file.read_text())
    if "base_num_hidden_layer" in edit:
        del config["base_num_hidden_layers"]
    config_file.write_text(json.dumps({**config, **edit}))
    with pytest.raises(ValueError, match=re.escape(str(config_file)) + ".*" + re.escape(message)):
        load_heads(path, llama)
    config_file.write_text(json.dumps({**config, "my_run_notes": "kept"}))  # other keys stay free-form notes
    load_heads(path, llama)


@pytest.mark.parametrize("kind", ["eagle3", "dflash"])
def test_a_slip_in_the_rope_parameters_is_refused(tmp_path, llama, kind):
    """transformers only logs an unknown rope key and fills rope_theta with 10000: a head for a target with
    another theta would draft with other positions, silently."""
    _, path = _export(tmp_path, kind, llama)
    config_file = path / CONFIG_NAME
    config = json.loads(config_file.read_text())
    for rope, message in (
        ({"rope_type": "default", "rope_thetaa": 5e5}, "'rope_thetaa': a slip of 'rope_theta'"),
        ({"rope_type": "default"}, "and a rope_theta, got {'rope_type': 'default'}"),
        ({"rope_type": "default", "rope_theta": True}, "needs a positive rope_theta, got .*True"),
        ({"rope_theta": 1e4}, "needs a rope_type \\(a string\\) and a rope_theta"),
        ({"rope_type": "default", "rope_theta": -1.0}, "needs a positive rope_theta"),
    ):
        config["head_config"]["rope_parameters"] = rope
        config_file.write_text(json.dumps(config))
        with pytest.raises(ValueError, match=message):
            load_heads(path)


def test_integer_tensors_for_float_weights_are_refused(tmp_path, llama):
    """load_state_dict would cast an int32 fc.weight into the float parameter without a word."""
    _, path = _export(tmp_path, "eagle3", llama)
    _rewrite_weights(path, lambda state: state.update({"fc.weight": state["fc.weight"].to(torch.int32)}))
    with pytest.raises(ValueError, match="fc.weight holds torch.int32 values, expected floating-point"):
        load_heads(path, llama)


def _edited(config: dict, kind: str, edit: str) -> dict:
    """`config` with one field of its head_config broken as `edit` says."""
    head = dict(config["head_config"])
    if edit == "missing field":
        del head["vocab_size"]
    elif edit == "size as a string":
        head["hidden_size"] = str(head["hidden_size"])
    elif edit == "unknown field":
        head["num_hedas"] = 3
    elif edit == "float count":
        head["num_heads" if kind == "medusa" else "num_attention_heads"] = 4.0
    elif edit == "other head type":
        return {**config, "head_type": "eagle1" if kind != "eagle1" else "eagle3", "head_config": head}
    return {**config, "head_config": head}


CONFIG_EDITS = {  # edit: what the message says besides naming config.json
    "missing field": r"missing required key\(s\) head_config.vocab_size",
    "size as a string": r"head_config.hidden_size: expected int, got '32' \(str\)",
    "unknown field": r"unknown key head_config.num_hedas",
    "float count": r"head_config.num_(heads|attention_heads): expected int, got 4.0 \(float\)",
    "other head type": (
        r"head_type 'eagle\d' but head_config.head_type '(eagle\d|peagle)'|unknown key head_config"
    ),
}


@pytest.mark.parametrize("edit", CONFIG_EDITS)
@pytest.mark.parametrize("kind", HEAD_TYPES)
def test_a_head_config_of_wrong_keys_or_types_is_refused_naming_the_key(tmp_path, llama, kind, edit):
    """Checked field by field against the head's config class before anything is built or compared with the
    target: a clear error naming config.json and the key, not a TypeError from a constructor or a size
    mismatch against '576'."""
    _, path = _export(tmp_path, kind, llama)
    config_file = path / CONFIG_NAME
    config_file.write_text(json.dumps(_edited(json.loads(config_file.read_text()), kind, edit)))
    for target in (None, llama):
        with pytest.raises(ValueError, match=CONFIG_EDITS[edit]) as raised:
            load_heads(path, target)
        assert str(config_file) in str(raised.value)


@pytest.mark.parametrize("kind", HEAD_TYPES)
def test_head_follows_the_target_dtype_and_device_unless_told(tmp_path, llama, kind):
    _, path = _export(tmp_path, kind, llama)
    bf16_target = copy.deepcopy(llama).to(torch.bfloat16)
    follows = load_heads(path, bf16_target)
    floats = {p.dtype for p in follows.parameters() if p.is_floating_point()}
    assert floats == {torch.bfloat16} and {p.device for p in follows.parameters()} == {bf16_target.device}
    assert {p.dtype for p in load_heads(path, bf16_target, dtype=torch.float32).parameters()} == {
        torch.float32
    }
    meta = load_heads(path, bf16_target, device="meta")  # an explicit device wins over the target's
    assert {p.device.type for p in meta.parameters()} == {"meta"}
    # a bare config carries no device or dtype: fp32 on the CPU, also for weights saved in bf16 (heads train
    # and export in fp32)
    _rewrite_weights(
        path, lambda state: state.update({k: v.bfloat16() for k, v in state.items() if v.is_floating_point()})
    )
    saved = load_heads(path, bf16_target.config)
    assert {p.dtype for p in saved.parameters() if p.is_floating_point()} == {torch.float32}
    assert {p.device.type for p in saved.parameters()} == {"cpu"}


@pytest.mark.parametrize("kind", ["eagle3", "dflash", "peagle"])
def test_a_bf16_head_keeps_its_rotary_frequencies_in_fp32(tmp_path, llama, kind):
    """`load_heads(dtype=bf16)` cast the rotary `inv_freq` too: the angles drift by up to 1.4 rad at position
    1,024 for SmolLM2's head size, where the target (and training) keep fp32 frequencies."""
    head, path = _export(tmp_path, kind, llama)
    halves = load_heads(path, llama, dtype=torch.bfloat16)
    rotary = {
        n: b for n, b in halves.named_buffers() if n.rpartition(".")[2] in ("inv_freq", "original_inv_freq")
    }
    assert rotary and {b.dtype for b in rotary.values()} == {torch.float32}
    assert all(torch.equal(rotary[n], b) for n, b in head.named_buffers() if n in rotary)
    assert halves.fc.weight.dtype == torch.bfloat16


def test_a_save_killed_between_its_two_files_is_refused(tmp_path, llama, monkeypatch):
    """The weights are renamed into place before config.json is written: a save killed between them left the
    new weights beside the old config, and that pair loaded without an error."""
    from heads import io as io_module

    old = EagleHead(EagleConfig.from_target(llama.config, "eagle3", draft_vocab_size=64))
    old.set_draft_vocab(torch.randperm(128)[:64])
    save_heads(old, tmp_path / "head", base_model="org/tiny-llama", target=llama)
    new = EagleHead(EagleConfig.from_target(llama.config, "eagle3", draft_vocab_size=64, rms_norm_eps=1e-5))
    new.set_draft_vocab(torch.randperm(128)[:64])

    def killed(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(io_module, "write_json", killed)
    with pytest.raises(KeyboardInterrupt):
        save_heads(new, tmp_path / "head", base_model="org/tiny-llama", target=llama)
    with pytest.raises(ValueError, match="come from different saves"):
        load_heads(tmp_path / "head", llama)
    monkeypatch.undo()
    save_heads(new, tmp_path / "head", base_model="org/tiny-llama", target=llama)  # saved again: whole
    assert load_heads(tmp_path / "head", llama).config.rms_norm_eps == 1e-5


def test_saved_files_take_the_mode_any_new_file_gets(tmp_path, llama):
    # mkstemp made every head file 0600 (and export folders 0700): a server running as another user failed
    from heads.files import UMASK

    _, path = _export(tmp_path, "eagle3", llama)
    for name in (CONFIG_NAME, WEIGHTS_NAME):
        assert (path / name).stat().st_mode & 0o777 == 0o666 & ~UMASK, name


@pytest.mark.parametrize("kind", ["eagle3", "dflash"])
def test_taps_out_of_layer_order_are_refused(llama, kind):
    """vLLM sorts a head's tap ids and SGLang captures in layer order: a head trained on (2, 0, 1) would read
    its fc's column blocks permuted there, with no error."""
    with pytest.raises(ValueError, match="increasing layer order"):
        if kind == "eagle3":
            EagleConfig.from_target(llama.config, "eagle3", aux_layer_ids=(2, 0, 1))
        else:
            DFlashConfig.from_target(llama.config, 5, aux_layer_ids=(3, 0))
