"""heads/registry.py: every registered kind's parts exist and fit together, lookups name what is known, and a
new drafter is one module plus one registration (docs/drafters.md's worked example, run as written)."""

import importlib
import re
import sys
from pathlib import Path

import pytest
import torch

from decode import generate
from decode.batch import left_padded
from decode.drafter import Drafter
from decode.drafters import make_drafter
from engines.formats import FORMATS, HEAD_TYPE
from engines.serving import VLLM_EXPORT
from heads import registry
from heads.io import build_head

DOC = Path(__file__).resolve().parents[2] / "docs" / "drafters.md"


@pytest.mark.parametrize("name", list(registry.KINDS))
def test_every_part_of_every_kind_resolves(name):
    kind = registry.KINDS[name]
    assert isinstance(kind.source_class(), type)
    assert issubclass(registry.resolve(kind.drafter), Drafter)
    for part in ("config", "loss"):
        assert (kind.part(part) is None) == (getattr(kind, part) is None)
    if kind.recipe is not None:
        assert (DOC.parents[1] / kind.recipe).is_file()
    assert set(kind.formats) <= set(FORMATS)
    if kind.head_types:  # a checkpoint kind: its config builds its module, which the registry finds again
        assert kind.config is not None and kind.loss is not None
        for head_type in kind.head_types:
            assert registry.kind_for_head_type(head_type) is kind


def test_formats_and_vllm_methods_come_from_the_kinds():
    assert HEAD_TYPE == {
        "sglang": "eagle3",
        "speculators": "eagle3",
        "eagle1": "eagle1",
        "medusa": "medusa",
    } | {"medusa-vllm": "medusa", "dflash": "dflash", "peagle": "peagle"}
    assert VLLM_EXPORT == {
        "eagle3": ("speculators", "eagle3"),
        "eagle1": ("eagle1", "eagle"),
        "medusa": ("medusa-vllm", "medusa"),
        "dflash": ("dflash", "dflash"),
        "peagle": ("peagle", "eagle3"),
    }


def test_lookups_name_what_is_registered():
    with pytest.raises(
        ValueError,
        match=(
            r"unknown head_type 'hydra'; expected one of "
            r"\('eagle3', 'eagle1', 'medusa', 'dflash', 'peagle'\)"
        ),
    ):
        registry.kind_for_head_type("hydra")
    with pytest.raises(
        TypeError, match="no drafter is registered for str; registered: eagle3 .EagleHead., eagle1"
    ):
        registry.kind_of("medusa")
    with pytest.raises(ValueError, match="a drafter kind named 'ngram' is registered already"):
        registry.register(registry.Kind(name="ngram", source="x:Y", drafter="x:Z"))
    with pytest.raises(ValueError, match=r"head types \['eagle3'\] are registered already"):
        registry.register(registry.Kind(name="other", source="x:Y", drafter="x:Z", head_types=("eagle3",)))


def test_a_checkpoint_kind_builds_its_module_and_finds_it_again(build_target):
    model = build_target("llama")
    from heads import EagleConfig, MedusaConfig

    configs = {
        "eagle3": EagleConfig.from_target(model.config, "eagle3").to_dict(),
        "eagle1": EagleConfig.from_target(model.config, "eagle1").to_dict(),
        "medusa": MedusaConfig(hidden_size=32, vocab_size=128, num_heads=2).to_dict(),
    }
    for head_type, config in configs.items():
        head = build_head(head_type, config)
        assert registry.kind_of(head).name == head_type
        assert make_drafter(head, model, 2).limits() is not None


@pytest.fixture
def bigram_module(tmp_path, monkeypatch):
    """docs/drafters.md's example as a module of its own (`bigram_example`); its kind unregistered after."""
    code = re.search(r"```python\n(.*?)```", DOC.read_text(), re.DOTALL).group(1)
    (tmp_path / "bigram_example.py").write_text(code)
    monkeypatch.syspath_prepend(str(tmp_path))
    try:
        yield importlib.import_module("bigram_example")
    finally:
        registry.KINDS.pop("bigram", None)
        sys.modules.pop("bigram_example", None)


def test_the_documented_bigram_drafter_plugs_in_with_one_registration(build_target, bigram_module):
    model = build_target("qwen2")
    prompt = torch.randint(0, 128, (11,), generator=torch.Generator().manual_seed(2))
    plain = generate(model, prompt, max_new_tokens=60).one
    out = generate(model, prompt, bigram_module.Bigram(), max_new_tokens=60).one
    assert out.sequences.tolist() == plain.sequences.tolist()
    assert out.draft_nodes > 0 and sum(out.accepted_per_depth) > 0  # it drafted, and was taken at times
    prompts = [prompt, prompt[:5], prompt[3:]]
    ids, mask = left_padded(prompts, 0)
    batch = generate(model, ids, bigram_module.Bigram(), max_new_tokens=20, attention_mask=mask)
    for row, p in enumerate(prompts):
        assert batch.replies[row] == generate(model, p, max_new_tokens=20).replies[0]
    sampled = generate(model, prompt, bigram_module.Bigram(), max_new_tokens=20, temperature=1.0, seed=0).one
    assert sampled.new_tokens == 20
