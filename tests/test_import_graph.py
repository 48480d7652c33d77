"""The package's import graph has no cycle, counting imports inside functions too (read with `ast`)."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "glm_training"


def module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph(package: Path) -> dict[str, set[str]]:
    """Module -> the project modules it imports anywhere in its body (absolute imports only)."""
    files = {module_name(p): p for p in package.rglob("*.py")}
    graph: dict[str, set[str]] = {name: set() for name in files}
    for name, path in files.items():
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                # `from pkg import mod` imports the module pkg.mod when there is one.
                targets = [node.module] + [f"{node.module}.{alias.name}" for alias in node.names]
            else:
                continue
            graph[name].update(t for t in targets if t in files and t != name)
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle as a list of modules (first == last), or None; depth-first search with colours."""
    state: dict[str, int] = {}  # 1 = on the current path, 2 = finished
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return path[path.index(nxt) :] + [nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        state[node] = 2
        path.pop()
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def test_cycle_finder_finds_a_planted_cycle():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert find_cycle(graph) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_no_import_cycle_in_the_package():
    graph = import_graph(PACKAGE)
    assert "glm_training.engine.trainer" in graph  # the walk saw the package
    assert find_cycle(graph) is None, f"import cycle: {' -> '.join(find_cycle(graph))}"


def test_entry_point_helpers_import_no_trainer():
    graph = import_graph(PACKAGE)
    trainers = {
        name for name in graph if name.startswith(("glm_training.engine", "glm_training.algorithms."))
    }
    assert not graph["glm_training.cli"] & trainers
    assert not graph["glm_training.evaluate"] & (trainers | {"glm_training.cli"})


# The package's layers, lowest first: a module imports only from its own layer and the ones below. A module is
# in the layer of its top-level name, but for the algorithms' config sections and table rows
# (`algorithms/<name>/config.py`, `algorithms/<name>/__init__.py`): those are config, torch-free, below
# everything that trains.
LAYERS = [
    (
        "base",
        {"errors", "logs", "image_grid", "image_stats", "data", "prompts", "metrics", "guards", "tracking"},
    ),
    ("config", {"config"}),
    ("models", {"models", "environment"}),
    ("checkpoint", {"checkpoint"}),
    ("distributed", {"distributed", "preemption"}),
    ("pipeline and rewards", {"pipeline", "rewards"}),
    ("weights", {"export", "frozen_weights"}),
    ("evaluation, priors and plan", {"evaluate", "evaluation", "text_benchmarks", "priors", "plan"}),
    ("engine", {"engine"}),
    ("algorithms", {"algorithms"}),
    ("joint", {"joint"}),
    ("tools", {"gpu_check", "cli", "build", ""}),
]


def layer_of(module: str) -> int:
    """The index in `LAYERS` of `module` (a dotted name under glm_training)."""
    names = module.split(".")[1:]
    if names[:1] == ["algorithms"]:
        folder_init = len(names) == 2 and (PACKAGE / "algorithms" / names[1]).is_dir()
        if len(names) == 1 or folder_init or names[2:] == ["config"]:
            return 1  # config
    top = names[0] if names else ""
    matches = [index for index, (_, tops) in enumerate(LAYERS) if top in tops]
    assert matches, f"{module} is in no layer of LAYERS"
    return matches[0]


def test_layer_of_knows_each_kind_of_module():
    assert LAYERS[layer_of("glm_training.algorithms.nft.config")][0] == "config"
    assert LAYERS[layer_of("glm_training.algorithms.nft")][0] == "config"
    assert LAYERS[layer_of("glm_training.algorithms.nft.algorithm")][0] == "algorithms"
    assert LAYERS[layer_of("glm_training.algorithms.base")][0] == "algorithms"
    assert LAYERS[layer_of("glm_training.distributed.sharding")][0] == "distributed"
    assert LAYERS[layer_of("glm_training")][0] == "tools"


def test_no_module_imports_from_a_higher_layer():
    graph = import_graph(PACKAGE)
    upward = [
        f"{a} ({LAYERS[layer_of(a)][0]}) -> {b} ({LAYERS[layer_of(b)][0]})"
        for a, targets in graph.items()
        for b in targets
        if layer_of(b) > layer_of(a)
    ]
    assert not upward, "imports from a higher layer:\n" + "\n".join(sorted(upward))


def test_no_module_over_500_lines_and_no_long_function_in_the_engine_or_the_algorithms():
    too_long = []
    for path in PACKAGE.rglob("*.py"):
        text = path.read_text(encoding="utf-8")
        if len(text.splitlines()) > 500:
            too_long.append(f"{path.relative_to(PACKAGE)}: {len(text.splitlines())} lines")
        if path.relative_to(PACKAGE).parts[0] in ("engine", "algorithms", "joint"):
            for node in ast.walk(ast.parse(text)):
                if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                    length = node.end_lineno - node.lineno + 1
                    if length > 60:
                        where = f"{path.relative_to(PACKAGE)}:{node.lineno}"
                        too_long.append(f"{where} {node.name}: {length} lines")
    assert not too_long, "\n".join(too_long)


# Imports each module of the package first, in a fresh import of the package (torch and the other libraries
# stay loaded): a cycle through a package's `__init__`, which the graph above does not see, fails here.
IMPORT_EACH_FIRST = """
import importlib, sys, traceback
failed = []
for name in sys.argv[1:]:
    for loaded in [m for m in sys.modules if m == "glm_training" or m.startswith("glm_training.")]:
        del sys.modules[loaded]
    try:
        importlib.import_module(name)
    except Exception:
        failed.append(name + ": " + traceback.format_exc().strip().splitlines()[-1])
print("\\n".join(failed))
sys.exit(1 if failed else 0)
"""


def test_every_module_imports_first():
    modules = sorted(name for name in import_graph(PACKAGE) if not name.endswith(".__main__"))  # commands
    result = subprocess.run(
        [sys.executable, "-c", IMPORT_EACH_FIRST, *modules],
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "HF_HUB_OFFLINE": "1"},
    )
    assert result.returncode == 0, (
        f"modules that fail to import first:\n{result.stdout}{result.stderr[-2000:]}"
    )
