"""The vLLM `speculators` package itself loads our `speculators` export on CPU and drafts exactly as our head
does.

speculators 0.9.0 pulls a CUDA torch and pins transformers<=5.19, so it lives in its own venv
(train/venv.py), built once under ~/.cache/selfspec/venvs/speculators (~2 min here) and reused; the check
itself runs there as a subprocess (tests/engines/speculators_check.py) on inputs this test writes.
"""

import os
import subprocess
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from engines.export import export_head
from heads.eagle import EagleConfig, EagleHead
from train.venv import cached_venv, venv_folder, venv_stamp

VENV = venv_folder("speculators", "SELFSPEC_SPECULATORS_VENV")
CHECK = Path(__file__).with_name("speculators_check.py")
STAMP = "speculators==0.9.0"
INSTALL_STEPS = [
    ["torch==2.13.0"],  # first, so nothing below pulls a CUDA build
    [
        "transformers==5.19.0",
        "datasets<=5.1.0",
        "safetensors",
        "loguru",
        "pydantic",
        "pydantic-settings",
        "rich",
        "typer",
        "click",
        "httpx",
        "huggingface-hub",
        "psutil",
        "protobuf",
        "openai",
        "aiohttp",
    ],
    [
        "--no-deps",
        "speculators==0.9.0",
        "hs-connectors==0.9.0",
    ],  # their declared deps include torchvision etc.
]


@pytest.fixture(scope="session")
def venv_python(say) -> Path:
    """The venv's python; built when absent or when a previous build did not finish (the build time is
    printed)."""
    python, seconds = cached_venv(VENV, INSTALL_STEPS, check="import speculators.models.eagle3", stamp=STAMP)
    if seconds is None:
        say(f"speculators venv: reused {VENV} ({venv_stamp(VENV)})")
    else:
        say(f"speculators venv: built {STAMP} in {seconds:.0f} s at {VENV}")
    return python


def test_speculators_package_loads_and_drafts_like_ours(tmp_path, build_target, venv_python):
    target = build_target("llama")
    torch.manual_seed(0)
    head = EagleHead(EagleConfig.from_target(target.config, "eagle3", draft_vocab_size=64))
    head.set_draft_vocab(torch.randperm(target.config.vocab_size)[:64])
    with torch.no_grad():
        for param in head.parameters():
            param.copy_(torch.randn_like(param) * (0.1 if param.dim() > 1 else 1.0) + (param.dim() == 1))
    head.eval()
    target.save_pretrained(tmp_path / "verifier")  # speculators checks taps and fills verifier_* from it
    export_head(
        head, "speculators", tmp_path / "export", target=target, verifier_name=str(tmp_path / "verifier")
    )

    generator = torch.Generator().manual_seed(0)
    seq = 9
    taps = torch.randn(1, seq, 3 * target.config.hidden_size, generator=generator)  # (1, T, 3H)
    input_ids = torch.randint(0, target.config.vocab_size, (1, seq), generator=generator)
    position_ids = torch.arange(seq)[None]
    save_file(
        {"hidden_states": taps, "input_ids": input_ids, "position_ids": position_ids}, tmp_path / "in.st"
    )

    run = subprocess.run(
        [
            str(venv_python),
            str(CHECK),
            str(tmp_path / "export"),
            str(tmp_path / "in.st"),
            str(tmp_path / "out.st"),
        ],
        check=False,
        capture_output=True,
        text=True,
        timeout=600,
        env={k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")},
    )
    assert run.returncode == 0, run.stderr[-4000:]
    theirs = load_file(tmp_path / "out.st")

    # 1. what speculators loaded is exactly what we hold (its names: layers.0.* and the target's embedding)
    ours = {k.replace("midlayer.", "layers.0."): v for k, v in head.state_dict().items()}
    ours["embed_tokens.weight"] = target.get_input_embeddings().weight
    loaded = {k.removeprefix("state."): v for k, v in theirs.items() if k.startswith("state.")}
    assert loaded.keys() == ours.keys()
    for key, value in ours.items():
        assert torch.equal(loaded[key], value), key
    # 2. it reads the taps as input-to-layer ids, ours + 1
    assert theirs["tap_ids"].tolist() == [i + 1 for i in head.config.aux_layer_ids]
    # 3. one draft step: same layer output, logits and draft tokens
    with torch.no_grad():
        embeds = target.get_input_embeddings()(input_ids)
        hidden = head(head.project_features(taps), embeds, position_ids)
        logits = head.logits(hidden, target.lm_head)
    torch.testing.assert_close(theirs["layer_out"], hidden, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(theirs["logits"], logits, rtol=1e-5, atol=1e-5)
    assert torch.equal(theirs["draft_tokens"], logits.argmax(-1))
