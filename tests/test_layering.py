"""The layering rule, enforced. From the bottom up:

1. `kvplane.core`: block keys, shared types, configuration, tokenisation, serving helpers.
2. `kvplane.wire`: the generated stubs, the codec and the agent's stream client (core only).
3. `router` and `worker_agent`: the product; each imports only the two above, never
   the other.
4. The tools: `simulations`, then `benchmarks` and `chaos` (which may use simulations).
5. `kvplane.cli`, the `kvplane` command, at the top (it reaches the tools only by name,
   at run time).

Product code never imports a tool; no two packages import each other in a cycle.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from collections import defaultdict
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# Layer -> the layers it may import (besides itself).
ALLOWED: dict[str, set[str]] = {
    "kvplane.core": set(),
    "kvplane.wire": {"kvplane.core"},
    "router": {"kvplane.core", "kvplane.wire"},
    "worker_agent": {"kvplane.core", "kvplane.wire"},
    "simulations": {"kvplane.core", "kvplane.wire", "router", "worker_agent"},
    "benchmarks": {"kvplane.core", "kvplane.wire", "router", "worker_agent", "simulations"},
    "chaos": {"kvplane.core", "kvplane.wire", "router", "worker_agent", "simulations"},
    "kvplane.cli": {"kvplane.core", "kvplane.wire", "router", "worker_agent"},
}
PRODUCT = ("kvplane.core", "kvplane.wire", "router", "worker_agent", "kvplane.cli")
TOOLS = ("simulations", "benchmarks", "chaos")


def layer_of(module: str) -> str | None:
    for layer in sorted(ALLOWED, key=len, reverse=True):
        if module == layer or module.startswith(layer + "."):
            return layer
    if module == "kvplane":
        return "kvplane"
    return None


def node_of(module: str) -> str:
    """The unit the cycle check draws: a sub-package (`router.index`) with its modules,
    or a module that sits directly in a top-level package (`router.metrics`)."""
    parts = module.split(".")
    depth = 3 if parts[0] == "kvplane" else 2  # kvplane's layers are one level down
    if len(parts) > depth or ROOT.joinpath(*parts).is_dir():
        return ".".join(parts[:depth])
    return module


def source_files() -> Iterator[tuple[str, Path]]:
    for top in ("kvplane", *(layer for layer in ALLOWED if "." not in layer)):
        for path in sorted((ROOT / top).rglob("*.py")):
            module = ".".join(path.relative_to(ROOT).with_suffix("").parts)
            yield module.removesuffix(".__init__"), path


def imports_of(path: Path) -> Iterator[str]:
    """Every module an import statement names, at any depth (lazy imports included)."""
    tree = ast.parse(path.read_text(), str(path))
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            yield node.module
            # `from package import module` names a module too.
            yield from (f"{node.module}.{alias.name}" for alias in node.names)


def _resolves(module: str) -> bool:
    parts = module.split(".")
    return (ROOT.joinpath(*parts).with_suffix(".py")).exists() or (
        ROOT.joinpath(*parts) / "__init__.py"
    ).exists()


def test_every_import_points_down_the_layers() -> None:
    violations = []
    for module, path in source_files():
        own = layer_of(module)
        assert own is not None, module
        for imported in imports_of(path):
            target = layer_of(imported)
            if target is None or target == own or not _resolves(imported):
                continue
            if own == "kvplane" or target not in ALLOWED[own]:
                violations.append(f"{module} imports {imported} ({own} -> {target})")
    assert not violations, "\n".join(violations)


def test_no_import_cycle_between_packages() -> None:
    graph: dict[str, set[str]] = defaultdict(set)
    for module, path in source_files():
        source = node_of(module)
        for imported in imports_of(path):
            if layer_of(imported) is None or not _resolves(imported):
                continue
            target = node_of(imported)
            if target != source:
                graph[source].add(target)
    cycles = []
    state: dict[str, int] = {}  # 1: on the current path, 2: done

    def visit(node: str, trail: list[str]) -> None:
        state[node] = 1
        for successor in sorted(graph[node]):
            if state.get(successor) == 1:
                cycles.append(" -> ".join([*trail[trail.index(successor) :], successor]))
            elif successor not in state:
                visit(successor, [*trail, successor])
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node, [node])
    assert not cycles, "\n".join(cycles)


def _loaded_modules(statement: str) -> set[str]:
    script = f"import sys\n{statement}\nprint('\\n'.join(sorted(sys.modules)))"
    result = subprocess.run(
        [sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, check=True
    )
    return set(result.stdout.split())


@pytest.mark.parametrize(
    ("statement", "forbidden"),
    [
        ("import worker_agent.agent", ("router", *TOOLS, "matplotlib", "openai", "numpy")),
        ("import router.app", ("worker_agent", *TOOLS, "matplotlib", "openai")),
        ("import kvplane.cli", ("router", "worker_agent", *TOOLS, "matplotlib")),
    ],
)
def test_importing_a_product_entry_point_loads_no_foreign_package(
    statement: str, forbidden: tuple[str, ...]
) -> None:
    loaded = _loaded_modules(statement)
    strays = sorted(name for name in loaded if name.split(".")[0] in forbidden)
    assert not strays, f"`{statement}` loaded {strays[:10]}"
