"""Imports flow one way (docs/layout.md): no import cycle between the modules of the packages, and each
package imports only the layers below it, counting imports inside functions (lazy imports) and under
`if TYPE_CHECKING:` as well as the module-level ones; decode/layout.py is a leaf. The graph is read from the
source with `ast`, so nothing is imported.
"""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("heads", "targets", "decode", "engines", "train", "benchmarks")
# what each package may import besides itself: the layers of docs/layout.md
LAYERS = {
    "heads": set(),
    "targets": {"heads"},
    "decode": {"heads"},
    "engines": {"heads", "targets"},
    "train": {"heads", "targets", "decode", "benchmarks"},
    "benchmarks": {"heads", "targets", "decode"},
}


def _module_names() -> dict[str, Path]:
    names = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).glob("*.py")):
            names[package if path.stem == "__init__" else f"{package}.{path.stem}"] = path
    return names


def imports_of(source: str, module: str, known: set[str]) -> set[str]:
    """The modules among `known` that `source` (the text of `module`) imports, at any depth of its syntax
    tree: module level, inside functions and classes, under `if TYPE_CHECKING:`. `from package import name`
    counts as importing the submodule `package.name` when there is one, else the package itself; a parent
    package's `__init__`, which Python runs first, is not counted (it would make every package a cycle)."""
    package = module if module in PACKAGES else module.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: from the package, one level up per extra dot
                parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(parts + ([base] if base else []))
            for alias in node.names:
                found.add(f"{base}.{alias.name}" if f"{base}.{alias.name}" in known else base)
    return {name for name in found if name in known and name != module}


def import_graph() -> dict[str, set[str]]:
    """module -> the package modules it imports, for every module of the packages."""
    modules = _module_names()
    return {name: imports_of(path.read_text(), name, set(modules)) for name, path in modules.items()}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle as [a, b, ..., a], or None (depth-first search, modules in sorted order)."""
    state: dict[str, str] = {}  # "open": on the current path, "done": fully explored
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = "open"
        path.append(node)
        for successor in sorted(graph.get(node, ())):
            if state.get(successor) == "open":
                return path[path.index(successor) :] + [successor]
            if successor not in state and (cycle := visit(successor)):
                return cycle
        state[node] = "done"
        path.pop()
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def test_the_packages_have_no_import_cycle():
    graph = import_graph()
    assert {"decode.generate", "decode.layout", "heads.io", "train"} <= set(graph)  # the walk found them
    assert "decode.tree" in graph["decode.generate"] and "heads.eagle" in graph["heads.io"]
    cycle = find_cycle(graph)
    assert cycle is None, f"import cycle: {' -> '.join(cycle)}"


def test_decode_layout_is_a_leaf_and_the_tree_is_at_the_bottom():
    graph = import_graph()
    assert graph["decode.layout"] == set()
    assert graph["decode.tree"] == set()


def test_each_package_imports_only_the_layers_below_it():
    graph = import_graph()
    assert {m.split(".")[0] for m in graph} == set(LAYERS)
    wrong = sorted(
        f"{module} -> {name}"
        for module, names in graph.items()
        for name in names
        if name.split(".")[0] not in LAYERS[module.split(".")[0]] | {module.split(".")[0]}
    )
    assert not wrong, wrong


def test_a_lazy_import_inside_a_function_closes_a_cycle():
    """decode/'s former cycle, since removed: generate -> propose -> fused -> layout -> generate, the last
    edge an import inside `layout.pack_for_tree`. Module-level imports alone would miss it."""
    sources = {
        "decode.generate": "from decode.propose import make_drafter\n",
        "decode.propose": "from decode.fused import fused_step\n",
        "decode.fused": "from decode.layout import _ATTR, pack_linears\n",
        "decode.layout": (
            "import torch\n\n\ndef pack_for_tree(target, heads, tree):\n"
            "    from decode.generate import resolve_tree\n\n    return resolve_tree(heads, tree)\n"
        ),
    }
    known = set(sources)
    graph = {name: imports_of(text, name, known) for name, text in sources.items()}
    assert graph["decode.layout"] == {"decode.generate"}
    assert find_cycle(graph) == [
        "decode.fused",
        "decode.layout",
        "decode.generate",
        "decode.propose",
        "decode.fused",
    ]
    graph["decode.layout"] = set()  # the lazy import gone: no cycle
    assert find_cycle(graph) is None


def test_imports_are_resolved_to_the_modules_they_name():
    known = {"decode", "decode.tree", "decode.generate", "heads.eagle", "heads"}
    source = (
        "from typing import TYPE_CHECKING\nimport torch\nfrom decode import generate, DEFAULT_TREES\n"
        "from . import tree\nif TYPE_CHECKING:\n    from heads.eagle import EagleHead\n"
    )
    assert imports_of(source, "decode.sizing", known) == {
        "decode.generate",
        "decode",
        "decode.tree",
        "heads.eagle",
    }
