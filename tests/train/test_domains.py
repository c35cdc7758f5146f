"""train/domains.py: the code prompts read from library wheels built here (no PyPI), and the reasoning-gym
plumbing against a stand-in generator module (no venv build)."""

import json
import sys
import zipfile
from pathlib import Path

import pytest

from train import domains
from train.domains import WORDED_INSTRUCTION, code_prompts, library_functions, reasoning_gym_prompts
from train.prompts import CODE_INSTRUCTION

LIBRARY = '''"""Module docstring."""
from typing import overload


@overload
def pick(x: int) -> int: ...


@cache
def pick(x, y=2):
    """Return the larger of x and y, or x when they are equal.

    >>> pick(1)
    2
    """
    return max(x, y)


def _private(a):
    """A private helper that is documented at length but never asked about."""


def terse(a):
    """Too short."""


class Thing:
    def method(self):
        """A method documented at length, which is not a top-level function."""
'''


def _wheel(path, members):
    with zipfile.ZipFile(path, "w") as archive:
        for name, text in members.items():
            archive.writestr(name, text)
    return path


def test_library_functions_keep_documented_public_top_level_functions_without_decorators(tmp_path):
    archive = _wheel(
        tmp_path / "lib-1.0-py3-none-any.whl",
        {
            "lib/core.py": LIBRARY,
            "lib/tests/test_core.py": 'def test_pick():\n    """A test function with a long docstring."""\n',
            "lib/test_util.py": 'def check():\n    """Another test module, with a long docstring too."""\n',
            "other/mod.py": 'def foreign():\n    """Another package\'s function, documented at length."""\n',
        },
    )
    (function,) = library_functions(archive, "lib")
    assert function["key"] == "lib/core.py:pick" and function["name"] == "pick"
    assert function["args"] == "x, y=2"
    # from `def` through the docstring: no decorator, no body, no overload stub
    assert function["stub"] == (
        'def pick(x, y=2):\n    """Return the larger of x and y, or x when they are equal.\n\n'
        '    >>> pick(1)\n    2\n    """\n'
    )
    assert function["summary"] == "Return the larger of x and y, or x when they are equal."


def test_code_prompts_ask_like_humaneval_and_in_words_for_the_worded_libraries(tmp_path, monkeypatch):
    long_doc = "x" * (domains.MAX_STUB + 10)
    members = {
        "algorithms/a.py": LIBRARY,
        "algorithms/b.py": f'def huge(a):\n    """{long_doc}"""\n',  # over MAX_STUB: not asked as code
    }
    archives = {
        "algorithms": _wheel(tmp_path / "algorithms.whl", members),
        "toolz": _wheel(tmp_path / "toolz.whl", {"toolz/t.py": LIBRARY.replace("pick", "choose")}),
    }
    libraries = (("algorithms", "1", "algorithms", "MIT"), ("toolz", "1", "toolz", "BSD-3-Clause"))
    monkeypatch.setattr(domains, "CODE_LIBRARIES", libraries)
    monkeypatch.setattr(domains, "fetch", lambda name, version, sdist: archives[name])
    rows = {row["id"]: row for row in code_prompts()}
    assert sorted(rows) == [
        "code_algorithms/algorithms/a.py:pick",
        "code_toolz/toolz/t.py:choose",
        "code_worded_algorithms/algorithms/a.py:pick",
        "code_worded_algorithms/algorithms/b.py:huge",  # the words fit even when the code does not
    ]
    stub = library_functions(archives["algorithms"], "algorithms")[0]["stub"]
    assert rows["code_algorithms/algorithms/a.py:pick"]["messages"] == [
        {"role": "user", "content": CODE_INSTRUCTION.format(prompt=stub)}
    ]
    worded = rows["code_worded_algorithms/algorithms/a.py:pick"]["messages"][0]["content"]
    assert worded == WORDED_INSTRUCTION.format(
        name="pick", args="x, y=2", summary="Return the larger of x and y, or x when they are equal."
    )


def test_reasoning_gym_prompts_run_the_generators_in_the_side_venv(tmp_path, monkeypatch):
    fake = tmp_path / "site" / "reasoning_gym"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text(
        "def create_dataset(name, size, seed):\n"
        "    return [{'question': f' {name} #{i} seed {seed} '} for i in range(size)]\n"
    )
    calls = []

    def venv(folder, steps, **kwargs):
        calls.append((folder, steps, kwargs))
        return sys.executable, None

    monkeypatch.setattr(domains, "cached_venv", venv)
    monkeypatch.setattr(domains, "clean_env", lambda: {"PYTHONPATH": str(tmp_path / "site")})
    rows = reasoning_gym_prompts({"sums": ("math_sums", 2), "sort": ("task_sort", 1)}, seed=7)
    assert [r["id"] for r in rows] == ["math_sums/0", "math_sums/1", "task_sort/0"]
    assert rows[1]["messages"] == [{"role": "user", "content": "sums #1 seed 7"}]  # stripped
    ((folder, (steps,), kwargs),) = calls
    assert folder.name == "reasoning-gym" and "reasoning_gym==0.1.25" in steps
    assert all("==" in pin for pin in steps)  # every package pinned: the questions depend on them
    assert kwargs["check"] == "import reasoning_gym"


def test_reasoning_gym_failures_name_the_generator_error(tmp_path, monkeypatch):
    fake = tmp_path / "site" / "reasoning_gym"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text("def create_dataset(name, size, seed):\n    raise KeyError(name)\n")
    monkeypatch.setattr(domains, "cached_venv", lambda folder, steps, **kwargs: (sys.executable, None))
    monkeypatch.setattr(domains, "clean_env", lambda: {"PYTHONPATH": str(tmp_path / "site")})
    with pytest.raises(RuntimeError, match="KeyError: 'nope'"):
        reasoning_gym_prompts({"nope": ("math_nope", 1)})


def test_committed_domain_pool_covers_code_maths_and_tasks():
    path = Path(__file__).resolve().parents[2] / "data/smollm2/prompts_train_domains.jsonl"
    rows = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]
    kinds = {row["source"].split("_")[0] for row in rows}
    assert kinds == {"code", "math", "task"} and len(rows) > 2000
