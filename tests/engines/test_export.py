"""Tests for engines/export.py: every format round-trips exactly, validators list every defect, mismatches
refuse."""

import json
import re
import runpy
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from decode.generate import generate
from engines.export import FILES, FORMATS, export_head, import_head, validate_export
from heads.dflash import DFlashConfig, DFlashHead
from heads.eagle import EagleConfig, EagleHead
from heads.features import from_input_convention
from heads.io import save_heads
from heads.medusa import MedusaConfig, MedusaHeads
from heads.peagle import PEagleConfig, PEagleHead

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "export.py"
PROMPT = torch.randint(0, 128, (1, 7), generator=torch.Generator().manual_seed(1))
CASES = [
    ("medusa", "medusa"),
    ("medusa", "medusa-vllm"),
    ("eagle1", "eagle1"),
    ("eagle1_bias", "eagle1"),
    ("eagle3", "sglang"),
    ("eagle3", "speculators"),
    ("eagle3.1", "speculators"),  # EAGLE-3.1 norms: norm_before_fc's weight and both flags round-trip
    ("dflash", "dflash"),  # its own lm_head over 64 tokens, d2t and t2d
    ("dflash_shared", "dflash"),  # the target's lm_head: no lm_head, d2t or t2d shipped
    ("peagle", "peagle"),  # mask_hidden, and the mask embedding as a row of the shipped embed_tokens
]
EXPECTED_FILES = {
    "sglang": ["config.json", "model.safetensors"],
    "speculators": ["config.json", "model.safetensors"],
    "eagle1": ["config.json", "model.safetensors"],
    "medusa": ["config.json", "medusa_lm_head.safetensors"],
    "medusa-vllm": ["config.json", "model.safetensors"],
    "dflash": ["config.json", "model.safetensors"],
    "peagle": ["config.json", "model.safetensors"],
}


@pytest.fixture
def llama(build_target):
    return build_target("llama")


def make_head(kind: str, target, **overrides):
    """A head with no default-valued tensors, so a round trip that drops or zeroes any of them shows."""
    torch.manual_seed(0)
    if kind.startswith("medusa"):
        head = MedusaHeads(
            MedusaConfig(
                hidden_size=target.config.hidden_size,
                vocab_size=target.config.vocab_size,
                num_heads=3,
                num_layers=2,
                **overrides,
            )
        )
    elif kind.startswith("dflash"):
        vocab = None if kind == "dflash_shared" else 64
        head = DFlashHead(
            DFlashConfig.from_target(target.config, 7, num_hidden_layers=2, draft_vocab_size=vocab)
        )
        if vocab:
            head.set_draft_vocab(torch.randperm(target.config.vocab_size)[:64])
    elif kind == "peagle":
        config = PEagleConfig.from_target(target.config, mask_token_id=9, draft_vocab_size=64, **overrides)
        head = PEagleHead(config)
        head.set_draft_vocab(torch.randperm(target.config.vocab_size)[:64])
    else:
        head_type = kind.removesuffix("_bias").removesuffix(".1")
        extra = {"draft_vocab_size": 64} if head_type == "eagle3" else {}
        if kind == "eagle3.1":
            extra |= {"norm_before_fc": True, "norm_output": True}
        overrides = {"fc_bias": kind.endswith("_bias"), **extra, **overrides}
        head = EagleHead(EagleConfig.from_target(target.config, head_type, **overrides))
        if head_type == "eagle3":
            head.set_draft_vocab(torch.randperm(target.config.vocab_size)[:64])
    with torch.no_grad():
        for param in head.parameters():
            param.copy_(torch.randn_like(param) * (0.05 if param.dim() > 1 else 1.0) + (param.dim() == 1))
    return head.eval()


def _decode(target, head):
    out = generate(target, PROMPT, head, max_new_tokens=16).one
    return out.sequences.tolist(), out.tau, out.accepted_per_depth


@pytest.mark.parametrize(("kind", "fmt"), CASES)
def test_round_trip_is_exact(tmp_path, llama, kind, fmt):
    head = make_head(kind, llama)
    files = export_head(head, fmt, tmp_path / "out", target=llama, verifier_name="org/tiny-llama")
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == EXPECTED_FILES[fmt]
    assert [p.name for p in files] == list(FILES[fmt])
    back = import_head(tmp_path / "out", target=llama)  # format auto-detected
    assert type(back) is type(head) and back.head_type == head.head_type
    assert back.config.to_dict() == head.config.to_dict()
    ours, theirs = head.state_dict(), back.state_dict()
    assert ours.keys() == theirs.keys()
    for key in ours:
        assert ours[key].dtype == theirs[key].dtype and torch.equal(ours[key], theirs[key]), key
    assert _decode(llama, back) == _decode(llama, head)


def test_speculators_export_ships_target_embedding_and_input_convention_taps(tmp_path, llama):
    head = make_head("eagle3", llama)
    export_head(head, "speculators", tmp_path / "out", target=llama, verifier_name="org/tiny-llama")
    state = load_file(tmp_path / "out" / "model.safetensors")
    assert torch.equal(state["embed_tokens.weight"], llama.get_input_embeddings().weight)
    assert not any(k.startswith("midlayer.") for k in state)
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert config["eagle_aux_hidden_state_layer_ids"] == [i + 1 for i in head.config.aux_layer_ids]
    spec = config["speculators_config"]
    assert spec["algorithm"] == "eagle3" and spec["default_proposal_method"] == "greedy"
    assert spec["proposal_methods"][0]["proposal_type"] == "greedy"
    assert spec["verifier"] == {"name_or_path": "org/tiny-llama", "architectures": ["LlamaForCausalLM"]}
    assert config["transformer_layer_config"]["num_hidden_layers"] == 1


def test_sglang_config_uses_output_convention_and_no_embedding(tmp_path, llama):
    head = make_head("eagle3", llama)
    export_head(head, "sglang", tmp_path / "out")
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLMEagle3"] and config["num_hidden_layers"] == 1
    assert config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == list(head.config.aux_layer_ids)
    assert config["draft_vocab_size"] == 64 and "target_hidden_size" not in config
    state = load_file(tmp_path / "out" / "model.safetensors")
    assert "embed_tokens.weight" not in state and state["fc.weight"].shape == (32, 3 * 32)


def test_sglang_writes_target_hidden_size_when_it_differs(tmp_path, llama):
    head = make_head("eagle3", llama, target_hidden_size=48)
    export_head(head, "sglang", tmp_path / "out")
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert config["target_hidden_size"] == 48
    back = import_head(tmp_path / "out")
    assert back.fc.weight.shape == (32, 3 * 48) and torch.equal(back.fc.weight, head.fc.weight)


def test_export_from_head_folder_and_cli(tmp_path, llama, capsys):
    main = runpy.run_path(str(SCRIPT))["main"]  # scripts/ is not a package; nothing runs at import time
    head = make_head("medusa", llama)
    save_heads(head, tmp_path / "head", base_model="org/tiny-llama", target=llama)
    main([str(tmp_path / "head"), "--to", "medusa", "--out", str(tmp_path / "out")])
    printed = capsys.readouterr().out
    assert "medusa_lm_head.safetensors" in printed and "bytes" in printed
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert config["base_model_name_or_path"] == "org/tiny-llama"
    assert config["medusa_num_heads"] == 3 and config["medusa_num_layers"] == 2
    keys = set(load_file(tmp_path / "out" / "medusa_lm_head.safetensors"))
    assert {"0.0.linear.weight", "0.1.linear.bias", "2.2.weight"} <= keys and len(keys) == 3 * (2 * 2 + 1)


def test_shared_lm_head_medusa_exports_the_target_projection(tmp_path, llama):
    head = make_head("medusa", llama, share_lm_head=True)
    with pytest.raises(ValueError, match="pass target="):
        export_head(head, "medusa-vllm", tmp_path / "refused")
    export_head(head, "medusa-vllm", tmp_path / "out", target=llama)
    back = import_head(tmp_path / "out")
    assert torch.equal(back.lm_heads[1].weight, llama.lm_head.weight)
    assert _decode(llama, back) == _decode(llama, head)


def test_old_eagle1_checkpoint_with_unannounced_bias_imports_with_bias(tmp_path, llama):
    head = make_head("eagle1_bias", llama)
    export_head(head, "eagle1", tmp_path / "out")
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    del config["bias"]
    (tmp_path / "out" / "config.json").write_text(json.dumps(config))
    back = import_head(tmp_path / "out", fmt="eagle1")
    assert back.config.fc_bias and torch.equal(back.fc.bias, head.fc.bias)


# ---------------------------------------------------------------------------------------------- validators
@pytest.fixture
def sglang_export(tmp_path, llama) -> Path:
    export_head(make_head("eagle3", llama), "sglang", tmp_path / "out")
    return tmp_path / "out"


def _edit_weights(path: Path, edit) -> None:
    state = load_file(path / "model.safetensors")
    edit(state)
    save_file(state, path / "model.safetensors")


def _edit_config(path: Path, edit) -> None:
    config = json.loads((path / "config.json").read_text())
    edit(config)
    (path / "config.json").write_text(json.dumps(config))


def test_validator_catches_missing_d2t(sglang_export):
    _edit_weights(sglang_export, lambda s: s.pop("d2t"))
    with pytest.raises(ValueError, match=r"missing tensors \['d2t'\]"):
        validate_export(sglang_export, "sglang")


def test_validator_catches_wrong_fc_width(sglang_export):
    _edit_weights(sglang_export, lambda s: s.update({"fc.weight": torch.zeros(32, 64)}))
    with pytest.raises(ValueError, match=r"fc.weight has shape \(32, 64\), expected \(32, 96\)"):
        validate_export(sglang_export, "sglang")


def test_validator_catches_inconsistent_t2d(sglang_export):
    def flip(state):
        t2d = state["t2d"].clone()
        first_on, first_off = t2d.nonzero()[0], (~t2d).nonzero()[0]
        t2d[first_on], t2d[first_off] = False, True
        state["t2d"] = t2d

    _edit_weights(sglang_export, flip)
    with pytest.raises(ValueError, match=r"nonzero\(t2d\) != d2t \+ arange"):
        validate_export(sglang_export, "sglang")


def test_validator_catches_missing_draft_vocab_size(sglang_export):
    _edit_config(sglang_export, lambda c: c.pop("draft_vocab_size"))
    with pytest.raises(ValueError, match="lacks draft_vocab_size"):
        validate_export(sglang_export, "sglang")


def test_validator_lists_every_problem_at_once(sglang_export):
    _edit_config(
        sglang_export,
        lambda c: (c.pop("draft_vocab_size"), c["eagle_config"].pop("eagle_aux_hidden_state_layer_ids")),
    )
    _edit_weights(sglang_export, lambda s: (s.pop("d2t"), s.update({"extra.weight": torch.zeros(1)})))
    (sglang_export / "notes.txt").write_text("x")
    with pytest.raises(ValueError) as err:
        validate_export(sglang_export, "sglang")
    message = str(err.value)
    for part in ("draft_vocab_size", "tap ids", "missing tensors", "'d2t'", "extra.weight", "notes.txt"):
        assert part in message, part


def test_validator_catches_wrong_tap_convention_and_speculators_fields(tmp_path, llama):
    export_head(make_head("eagle3", llama), "speculators", tmp_path / "out", target=llama)
    _edit_config(
        tmp_path / "out",
        lambda c: (
            c["selfspec"].update(aux_layer_ids_convention="output"),
            c.pop("target_hidden_size"),
            c.pop("speculators_model_type"),
        ),
    )
    with pytest.raises(ValueError) as err:
        validate_export(tmp_path / "out", "speculators")
    for part in ("convention", "target_hidden_size", "speculators_model_type"):
        assert part in str(err.value), part


def test_eagle31_norms_are_validated_and_never_dropped(tmp_path, llama):
    head = make_head("eagle3.1", llama)
    export_head(head, "speculators", tmp_path / "out", target=llama)
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert config["norm_before_fc"] is True and config["norm_output"] is True  # vLLM's speculators fields
    weights = load_file(tmp_path / "out" / "model.safetensors")
    assert torch.equal(weights["input_norm.weight"], head.input_norm.weight)
    save_file(
        {k: v for k, v in weights.items() if k != "input_norm.weight"}, tmp_path / "out" / "model.safetensors"
    )
    with pytest.raises(ValueError, match="input_norm.weight"):  # what an engine would leave at ones
        validate_export(tmp_path / "out", "speculators")
    with pytest.raises(ValueError, match="no EAGLE-3.1 norms"):
        export_head(head, "sglang", tmp_path / "sglang")
    save_file(weights, tmp_path / "out" / "model.safetensors")
    assert import_head(tmp_path / "out", "speculators", target=llama).config.norm_output  # whole again
    _edit_config(tmp_path / "out", lambda c: c.update(fc_norm=True))
    with pytest.raises(
        ValueError, match=r"sets \['fc_norm'\], which selfspec's EagleHead does not implement"
    ):
        import_head(tmp_path / "out", "speculators", target=llama)


def test_validator_checks_medusa_vllm_bias_flag(tmp_path, llama):
    export_head(make_head("medusa", llama), "medusa-vllm", tmp_path / "out")
    _edit_config(tmp_path / "out", lambda c: c.update(medusa_fc_bias=False))
    with pytest.raises(ValueError, match="medusa_fc_bias must be true"):
        validate_export(tmp_path / "out", "medusa-vllm")


# ------------------------------------------------------------------------------------------------ refusals
@pytest.mark.parametrize(
    ("kind", "fmt", "message"),
    [
        ("eagle1", "sglang", "holds eagle3 heads, but this head is eagle1"),
        ("eagle3", "eagle1", "acceptance length 1.0"),
        ("medusa", "speculators", "holds eagle3 heads, but this head is medusa"),
        ("eagle3", "medusa", "holds medusa heads, but this head is eagle3"),
    ],
)
def test_head_format_mismatch_is_refused(tmp_path, llama, kind, fmt, message):
    with pytest.raises(ValueError, match=message):
        export_head(make_head(kind, llama), fmt, tmp_path / "out", target=llama)
    assert not (tmp_path / "out").exists()


def test_eagle3_fc_bias_is_refused(tmp_path, llama):
    with pytest.raises(ValueError, match="fc.bias would be dropped silently"):
        export_head(make_head("eagle3", llama, fc_bias=True), "sglang", tmp_path / "out")


def test_unknown_format_lists_the_valid_ones(tmp_path, llama):
    for call in (
        lambda: export_head(make_head("medusa", llama), "onnx", tmp_path / "out"),
        lambda: validate_export(tmp_path, "onnx"),
        lambda: import_head(tmp_path, fmt="onnx"),
    ):
        with pytest.raises(
            ValueError, match="unknown export format 'onnx'; valid formats: " + ", ".join(FORMATS)
        ):
            call()


def test_speculators_needs_the_target_embedding(tmp_path, llama):
    with pytest.raises(ValueError, match="embed_tokens"):
        export_head(make_head("eagle3", llama), "speculators", tmp_path / "out")


def test_head_for_another_target_is_refused(tmp_path, llama, build_target):
    other = build_target("llama", hidden_size=48)
    with pytest.raises(ValueError, match="hidden_size"):
        export_head(make_head("eagle1", llama), "eagle1", tmp_path / "out", target_config=other.config)


def test_a_head_folder_for_another_depth_is_refused_at_export(tmp_path, llama, build_target):
    """A folder's config.json records its target's depth: exporting it against a deeper target of the same
    width would ship that target's embedding beside taps chosen for the other depth."""
    deeper = build_target("llama", num_hidden_layers=6)
    for kind, fmt in (("eagle3", "speculators"), ("eagle1", "eagle1")):
        save_heads(make_head(kind, llama), tmp_path / kind, base_model="org/tiny-llama", target=llama)
        with pytest.raises(ValueError, match="num_hidden_layers=4, but this target has num_hidden_layers=6"):
            export_head(tmp_path / kind, fmt, tmp_path / f"out-{kind}", target=deeper)
    export_head(tmp_path / "eagle1", "eagle1", tmp_path / "out-same", target=llama)  # its own target: fine


def test_dflash_validator_range_checks_its_ids_and_needs_the_block_size(tmp_path, llama, build_target):
    export_head(make_head("dflash", llama), "dflash", tmp_path / "out", target=llama)
    good = json.loads((tmp_path / "out" / "config.json").read_text())
    for edit, problem in (
        ({"mask_token_id": 10**6}, "mask_token_id must be a token id in [0, 128), got 1000000"),
        ({"mask_token_id": -1}, "mask_token_id must be a token id in [0, 128), got -1"),
        ({"target_layer_ids": [-3, 9]}, "target_layer_ids must be integer layer ids [0, 4), got [-3, 9]"),
        ({"target_layer_ids": [1.5, 2]}, "target_layer_ids must be integer layer ids [0, 4), got [1.5, 2]"),
        ({"target_layer_ids": [3, 0]}, "increasing layer order"),  # vLLM taps in layer order: fc permuted
        ({"block_size": None}, "block_size must be an integer >= 2 (the root and its drafts), got None"),
    ):
        config = json.loads(json.dumps(good))
        if "block_size" in edit:
            del config["block_size"]  # our import read it as 8, whatever the block trained
        else:
            config["dflash_config"].update(edit)
        (tmp_path / "out" / "config.json").write_text(json.dumps(config))
        for check in (
            lambda: validate_export(tmp_path / "out", "dflash"),
            lambda: import_head(tmp_path / "out"),
        ):
            with pytest.raises(ValueError) as raised:
                check()
            assert problem in str(raised.value)
    (tmp_path / "out" / "config.json").write_text(json.dumps(good))
    deeper = build_target("llama", num_hidden_layers=6)  # the depth it records (num_target_layers) is checked
    with pytest.raises(ValueError, match="num_hidden_layers=4, but this target has num_hidden_layers=6"):
        import_head(tmp_path / "out", target=deeper)


def test_input_convention_tap_id_0_is_refused_not_read_as_the_last_layer(tmp_path, llama):
    """Input-to-layer id 0 is the embeddings' output; id - 1 = -1 was our LAST (the final normed state)."""
    export_head(make_head("eagle3", llama), "speculators", tmp_path / "out", target=llama)
    _edit_config(tmp_path / "out", lambda c: c.update(eagle_aux_hidden_state_layer_ids=[0, 2, 3]))
    for check in (
        lambda: validate_export(tmp_path / "out", "speculators"),
        lambda: import_head(tmp_path / "out"),
    ):
        with pytest.raises(ValueError, match=re.escape("tap ids must be integers >= 1 (input-of-layer ids)")):
            check()
    with pytest.raises(ValueError, match="id 0 is the embeddings' output"):
        from_input_convention([0, 2, 3])


def test_eagle3_taps_out_of_layer_order_are_refused_by_the_validator_and_the_import(tmp_path, llama):
    """vLLM sorts the tap ids (and SGLang captures in layer order): a config listing them otherwise ships a
    head whose fc reads its column blocks permuted, with no error."""
    export_head(make_head("eagle3", llama), "speculators", tmp_path / "out", target=llama)
    _edit_config(tmp_path / "out", lambda c: c.update(eagle_aux_hidden_state_layer_ids=[3, 1, 2]))
    for check in (
        lambda: validate_export(tmp_path / "out", "speculators"),
        lambda: import_head(tmp_path / "out"),
    ):
        with pytest.raises(ValueError, match="increasing layer order"):
            check()


def test_medusa_vllm_validator_needs_heads_and_the_full_vocabulary(tmp_path, llama):
    export_head(make_head("medusa", llama), "medusa-vllm", tmp_path / "out")
    good = json.loads((tmp_path / "out" / "config.json").read_text())
    for edit, problem in (
        ({"num_heads": 0}, "num_heads must be an integer >= 1, got 0"),  # the 3 stored heads were not listed
        ({"num_heads": 2.0}, "num_heads must be an integer >= 1, got 2.0"),
        ({"truncated_vocab_size": 50}, "truncated_vocab_size 50 must equal vocab_size"),
    ):
        (tmp_path / "out" / "config.json").write_text(json.dumps({**good, **edit}))
        with pytest.raises(ValueError, match=re.escape(problem)):
            validate_export(tmp_path / "out", "medusa-vllm")


def test_a_bf16_head_exports_one_dtype_as_its_config_states(tmp_path, llama):
    head = make_head("eagle3", llama).to(torch.bfloat16)
    export_head(head, "speculators", tmp_path / "out", target=llama)
    state = load_file(tmp_path / "out" / "model.safetensors")
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert config["transformer_layer_config"]["torch_dtype"] == "float32"
    assert {t.dtype for t in state.values() if t.is_floating_point()} == {torch.float32}


def test_failed_validation_leaves_nothing(tmp_path, llama, monkeypatch):
    import engines.export

    def broken(*_args):
        raise ValueError("simulated validation failure")

    monkeypatch.setattr(engines.export, "validate_export", broken)
    with pytest.raises(ValueError, match="simulated"):
        export_head(make_head("eagle3", llama), "sglang", tmp_path / "out")
    assert list(tmp_path.iterdir()) == []


def test_refuses_to_overwrite_a_non_empty_folder(tmp_path, llama):
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "keep.txt").write_text("x")
    with pytest.raises(FileExistsError):
        export_head(make_head("medusa", llama), "medusa", tmp_path / "out")
    assert [p.name for p in (tmp_path / "out").iterdir()] == ["keep.txt"]


def test_import_refuses_speculators_variants_we_do_not_implement(tmp_path, llama):
    export_head(make_head("eagle3", llama), "speculators", tmp_path / "out", target=llama)
    _edit_config(tmp_path / "out", lambda c: c.update(norm_before_residual=True))
    with pytest.raises(ValueError, match="norm_before_residual"):
        import_head(tmp_path / "out")


def test_import_takes_a_hub_snapshot_with_readme_but_not_stray_weights(tmp_path, llama, sglang_export):
    """A published folder carries README.md and .gitattributes: import reads it; export validation stays exact
    (engines may read whatever else is there); a second weight file is refused on import (it could hold
    weights import would not read)."""
    (sglang_export / "README.md").write_text("# a draft head\n")
    (sglang_export / ".gitattributes").write_text("*.safetensors filter=lfs\n")
    back = import_head(sglang_export, target=llama)
    assert back.head_type == "eagle3"
    with pytest.raises(ValueError, match="expected exactly"):
        validate_export(sglang_export, "sglang")
    (sglang_export / "model-00002-of-00002.safetensors").write_bytes(b"")
    with pytest.raises(
        ValueError, match=r"no other weight files \(found \['model-00002-of-00002.safetensors'\]\)"
    ):
        import_head(sglang_export, target=llama)


def test_dflash_export_is_what_vllms_dflash_reads_and_its_validator_lists_each_problem(tmp_path, llama):
    head = make_head("dflash", llama)
    export_head(head, "dflash", tmp_path / "out", target=llama)
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert (config["architectures"], config["model_type"]) == (["DFlashDraftModel"], "qwen3")
    assert config["dflash_config"] == {
        "mask_token_id": 7,
        "target_layer_ids": list(head.config.aux_layer_ids),
    }
    assert (config["block_size"], config["num_target_layers"], config["draft_vocab_size"]) == (8, 4, 64)
    assert config["rope_theta"] == head.config.rope_parameters["rope_theta"]
    assert "eagle_aux_hidden_state_layer_ids" not in config  # vLLM would read it first, as input-to-layer ids
    keys = set(load_file(tmp_path / "out" / "model.safetensors"))
    assert {"layers.1.self_attn.k_norm.weight", "fc.weight", "hidden_norm.weight", "d2t"} <= keys
    assert not any("embed_tokens" in key for key in keys)  # vLLM shares the target's

    def damage(config):
        config["eagle_aux_hidden_state_layer_ids"] = [2, 3]
        del config["rope_theta"], config["rope_parameters"]
        config["dflash_config"]["mask_token_id"] = "7"

    _edit_config(tmp_path / "out", damage)
    _edit_weights(tmp_path / "out", lambda state: state.pop("layers.0.self_attn.q_norm.weight"))
    with pytest.raises(ValueError) as raised:
        validate_export(tmp_path / "out", "dflash")
    message = str(raised.value)
    for problem in (
        "eagle_aux_hidden_state_layer_ids must not be set",
        "lacks rope_theta",
        "mask_token_id must be a token id in [0, 128), got '7'",
        "missing tensors ['layers.0.self_attn.q_norm.weight']",
    ):
        assert problem in message, message


def test_peagle_export_is_what_vllms_parallel_drafting_reads_and_its_validator_lists_each_problem(
    tmp_path, llama
):
    """speculators' P-EAGLE layout: model type and algorithm `peagle`, `mask_token_id` (vLLM's placeholder
    token), the drafts per step = the trained depths, `mask_hidden` in speculators' (1, 1, taps x Ht) shape,
    and the trained mask embedding as the mask token's row of the shipped embed_tokens (every other row the
    target's)."""
    head = make_head("peagle", llama)
    export_head(head, "peagle", tmp_path / "out", target=llama, verifier_name="org/tiny-llama")
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert (config["speculators_model_type"], config["speculators_config"]["algorithm"]) == ("peagle",) * 2
    assert config["architectures"] == ["PEagleSpeculator"] and config["mask_token_id"] == 9
    assert config["speculators_config"]["proposal_methods"][0]["speculative_tokens"] == 4
    assert config["eagle_aux_hidden_state_layer_ids"] == [i + 1 for i in head.config.aux_layer_ids]
    state = load_file(tmp_path / "out" / "model.safetensors")
    assert torch.equal(state["mask_hidden"], head.mask_hidden.detach().reshape(1, 1, -1))
    embed = llama.get_input_embeddings().weight
    assert torch.equal(state["embed_tokens.weight"][9], head.mask_embedding.detach())
    others = torch.arange(embed.shape[0]) != 9
    assert torch.equal(state["embed_tokens.weight"][others], embed[others])
    assert "mask_embedding" not in state

    def damage(config):
        config["mask_token_id"] = 128
        config["speculators_config"]["algorithm"] = "eagle3"

    _edit_config(tmp_path / "out", damage)
    _edit_weights(tmp_path / "out", lambda state: state.pop("mask_hidden"))
    with pytest.raises(ValueError) as raised:
        validate_export(tmp_path / "out", "peagle")
    message = str(raised.value)
    for problem in (
        "mask_token_id must be a token id in [0, 128), got 128",
        "speculators_config needs algorithm 'peagle'",
        "missing tensors ['mask_hidden']",
    ):
        assert problem in message, message


def test_a_peagle_head_with_a_normed_output_is_refused(tmp_path, llama):
    """vLLM's P-EAGLE config adapter passes no norm_output: the head would draft differently there."""
    head = make_head("peagle", llama, norm_output=True)
    with pytest.raises(ValueError, match="passes no norm_output"):
        export_head(head, "peagle", tmp_path / "out", target=llama)
