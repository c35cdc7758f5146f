"""benchmarks/ab.py: an earlier revision's decode package, extracted and renamed, decodes beside the working
tree's in one process."""

import pytest
import torch

from benchmarks.ab import IMPORT, old_decode, one
from decode import generate


def test_old_decode_is_a_renamed_copy_that_decodes_as_the_working_tree(build_target, tmp_path):
    old_generate, old_tree, name = old_decode("HEAD", tmp_path)
    assert name.startswith("decode_") and old_generate.__name__ == f"{name}.generate"
    assert old_tree.__name__ == f"{name}.tree"
    files = list((tmp_path / name).rglob("*.py"))
    assert files and not [path for path in files if IMPORT.search(path.read_text())]
    model = build_target("llama")
    ids = torch.tensor([[5, 9, 3, 7]])
    before = one(old_generate.generate(model, ids, None, max_new_tokens=8))
    after = generate(model, ids, None, max_new_tokens=8).one
    assert before.sequences.tolist() == after.sequences.tolist() and after.new_tokens == 8


def test_old_decode_names_a_revision_that_does_not_exist(tmp_path):
    with pytest.raises(SystemExit, match="no-such-revision: not a revision"):
        old_decode("no-such-revision", tmp_path)
