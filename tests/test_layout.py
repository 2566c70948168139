"""The package's shape, kept (issue 37): layers that import only downward (no circle among acceltrain's modules,
imports inside functions included), modules short enough to read in one sitting, a core loop of one screenful."""

from __future__ import annotations

import ast
from pathlib import Path

from conftest import REPO

PACKAGE = REPO / "acceltrain"
# today's figures (issue 44): growth past them is a decision, made here with its reason, not a drift
LIMITS = {"module": 406, "Run": 129, "loop.py": 326, "fit": 45}


def module_name(path: Path) -> str:
    parts = path.relative_to(REPO).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports(path: Path) -> set[str]:
    """The acceltrain modules ``path`` imports, anywhere in it."""
    package = module_name(path) if path.name == "__init__.py" else module_name(path).rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            base = package.split(".")[: len(package.split(".")) - node.level + 1] if node.level else []
            target = ".".join([*base, *(node.module.split(".") if node.module else [])])
            names = [f"{target}.{alias.name}" for alias in node.names]
            found.update(name for name in [target, *names] if name.startswith("acceltrain"))
        elif isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names if alias.name.startswith("acceltrain"))
    return found


def graph() -> dict[str, set[str]]:
    modules = {module_name(path): path for path in PACKAGE.rglob("*.py")}
    edges = {}
    for name, path in modules.items():
        # a name imported from a package resolves to its module when there is one; a package's __init__ re-exports
        # lazily
        edges[name] = {target for target in imports(path) if target in modules and target != name}
    return edges


def test_no_module_imports_one_that_imports_it_back():
    edges, state, cycles = graph(), {}, []

    def visit(node, stack):
        state[node] = "open"
        for target in sorted(edges[node]):
            if target.startswith(node + "."):  # a package importing its own submodules (lazy __getattr__ maps)
                continue
            if state.get(target) == "open":
                cycles.append(" -> ".join([*stack[stack.index(target) :], target]))
            elif target not in state:
                visit(target, [*stack, target])
        state[node] = "done"

    for node in sorted(edges):
        if node not in state:
            visit(node, [node])
    assert not cycles, "\n".join(cycles)


def test_modules_and_the_core_loop_stay_short():
    long = [
        f"{path.relative_to(REPO)}: {n}"
        for path in PACKAGE.rglob("*.py")
        if (n := len(path.read_text().splitlines())) > LIMITS["module"]
    ]
    assert not long, long
    assert len((PACKAGE / "train" / "loop.py").read_text().splitlines()) <= LIMITS["loop.py"]
    for file, name in ((PACKAGE / "train" / "run.py", "Run"), (PACKAGE / "train" / "loop.py", "fit")):
        node = next(n for n in ast.parse(file.read_text()).body if getattr(n, "name", None) == name)
        assert node.end_lineno - node.lineno + 1 <= LIMITS[name], f"{name}: {node.end_lineno - node.lineno + 1} lines"


def test_only_the_engines_and_the_compat_module_know_accelerates_engine_types():
    """Issue 44: a new engine is its own module under acceltrain/engines/; nothing else branches on Accelerate's
    DistributedType. And nothing loads a checkpoint through Accelerate's load_state: each engine reads back the parts
    it writes, the compat module Accelerate's own files."""
    allowed = {PACKAGE / "accelerate_compat.py", *(PACKAGE / "engines").glob("*.py")}
    knowing = sorted(
        str(path.relative_to(REPO))
        for path in PACKAGE.rglob("*.py")
        if path not in allowed and "DistributedType" in path.read_text()
    )
    assert not knowing, knowing
    loading = sorted(
        str(path.relative_to(REPO)) for path in PACKAGE.rglob("*.py") if ".load_state(" in path.read_text()
    )
    assert not loading, loading


def test_at_most_four_modules_stay_at_the_top_level():
    top = sorted(path.name for path in PACKAGE.glob("*.py"))
    assert len(top) <= 4, top
