"""Imports point one way: every module of src/axon imports only from its own floor or a lower
one (docs/architecture.md, "Layers", draws the same table), and no packages or modules import
each other in a circle.

Read with `ast`, not by importing: module-level imports, imports inside functions, relative
imports and `from package import submodule` all count. Imports under `if TYPE_CHECKING:` count
for the floors (a type is a dependency too) but not for cycles, since they never run. An import
inside a function is allowed only where it keeps heavy modules (torch, the engine stack, the
server stack) out of a light process; it says why on its line (or the line above) after a
`# lazy:` marker, so a convenience import does not slip in unexplained.
"""

from __future__ import annotations

import ast
import re
from dataclasses import dataclass
from pathlib import Path

SRC = Path(__file__).resolve().parents[2] / "src"
ARCHITECTURE = SRC.parent / "docs" / "architecture.md"
ROOT = SRC / "axon"

# Top to bottom. A module may import from its own floor or any floor below; within a floor the
# cycle checks keep packages from importing each other both ways. "axon" is the package's own
# __init__ (every import runs it); its lazy exports are resolved to the modules they name.
FLOORS: list[tuple[str, ...]] = [
    ("__main__", "cli", "prewarm", "bench"),
    ("server",),
    ("engine",),
    ("runner", "structured"),
    ("models", "tokenizer"),
    ("loader",),
    ("layers", "sampling", "cache", "multimodal"),
    ("kernels", "distributed"),
    (
        "axon",
        "config",
        "settings",
        "setting",
        "sequence",
        "batch",
        "sampling_params",
        "speculative_config",
        "outputs",
        "cache_dir",
        "demo",
    ),
]
FLOOR = {part: len(FLOORS) - index for index, parts in enumerate(FLOORS) for part in parts}

LAZY_MARK = "# lazy:"


@dataclass(frozen=True)
class Edge:
    source: str  # the importing module, dotted
    target: str  # the imported module, dotted (a submodule where `from package import` names one)
    line: int
    in_function: bool
    type_checking: bool


def module_name(path: Path) -> str:
    parts = list(path.relative_to(SRC).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules() -> dict[str, Path]:
    return {module_name(path): path for path in sorted(ROOT.rglob("*.py"))}


MODULES = modules()


def part_of(module: str) -> str:
    """The table's name for a module: its first name below `axon`, or "axon" for the root."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "axon"


def root_exports() -> dict[str, str]:
    """axon/__init__.py's `_EXPORTS` (name -> module), which `from axon import NAME` loads."""
    tree = ast.parse((ROOT / "__init__.py").read_text())
    for node in tree.body:
        if isinstance(node, ast.Assign) and getattr(node.targets[0], "id", None) == "_EXPORTS":
            return ast.literal_eval(node.value)
    return {}


EXPORTS = root_exports()


def _is_type_checking(node: ast.If) -> bool:
    return "TYPE_CHECKING" in ast.unparse(node.test)


def _from_targets(module: str, is_package: bool, node: ast.ImportFrom) -> list[str]:
    if node.level:
        base = module.split(".") if is_package else module.split(".")[:-1]
        base = base[: len(base) - (node.level - 1)]
        package = ".".join(base + ([node.module] if node.module else []))
    else:
        package = node.module or ""
    if package != "axon" and not package.startswith("axon."):
        return []
    targets = []
    for alias in node.names:
        submodule = f"{package}.{alias.name}"
        if submodule in MODULES:
            targets.append(submodule)
        elif package == "axon" and alias.name in EXPORTS:
            targets.append(EXPORTS[alias.name])
        else:
            targets.append(package)
    return targets


def edges_of(module: str, path: Path) -> list[Edge]:
    is_package = path.name == "__init__.py"
    found: list[Edge] = []

    def visit(node: ast.AST, in_function: bool, type_checking: bool) -> None:
        for child in ast.iter_child_nodes(node):
            function = in_function or isinstance(
                child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)
            )
            checking = type_checking or (isinstance(child, ast.If) and _is_type_checking(child))
            if isinstance(child, ast.Import):
                targets = [a.name for a in child.names if a.name.split(".")[0] == "axon"]
            elif isinstance(child, ast.ImportFrom):
                targets = _from_targets(module, is_package, child)
            else:
                targets = []
            for target in targets:
                found.append(Edge(module, target, child.lineno, in_function, type_checking))
            visit(child, function, checking)

    visit(ast.parse(path.read_text()), False, False)
    return found


EDGES = [edge for module, path in MODULES.items() for edge in edges_of(module, path)]


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of `graph` as a closed path of nodes, or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def walk(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for successor in sorted(graph.get(node, ())):
            if state.get(successor) == 1:
                return path[path.index(successor) :] + [successor]
            if successor not in state and (cycle := walk(successor)):
                return cycle
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (cycle := walk(node)):
            return cycle
    return None


def test_every_module_has_a_floor():
    unplaced = sorted({part_of(module) for module in MODULES} - set(FLOOR))
    assert not unplaced, f"place these in FLOORS (and docs/architecture.md): {unplaced}"


def test_the_table_names_only_what_exists():
    assert set(FLOOR) <= {part_of(module) for module in MODULES}


def test_the_architecture_page_draws_the_same_floors():
    section = ARCHITECTURE.read_text().split("## Layers", 1)[1].split("\n## ", 1)[0]
    rows = [line.split("|") for line in section.splitlines() if re.match(r"\| \d+ \|", line)]
    drawn = [tuple(re.findall(r"`(\w+)`", row[2])) for row in rows]
    assert drawn == FLOORS, "docs/architecture.md's table differs from FLOORS"


def test_imports_only_reach_down():
    upward = [
        f"{edge.source}:{edge.line} imports {edge.target}"
        for edge in EDGES
        if FLOOR[part_of(edge.target)] > FLOOR[part_of(edge.source)]
    ]
    assert not upward, "imports from a higher floor:\n" + "\n".join(upward)


def test_imports_name_existing_modules():
    missing = [f"{e.source}:{e.line} imports {e.target}" for e in EDGES if e.target not in MODULES]
    assert not missing, "\n".join(missing)


def test_no_cycle_among_packages():
    graph: dict[str, set[str]] = {}
    for edge in EDGES:
        source, target = part_of(edge.source), part_of(edge.target)
        if source != target and not edge.type_checking:
            graph.setdefault(source, set()).add(target)
    cycle = find_cycle(graph)
    assert cycle is None, "packages import each other: " + " -> ".join(cycle)


def test_no_cycle_among_modules_at_import_time():
    graph: dict[str, set[str]] = {}
    for edge in EDGES:
        if not edge.in_function and not edge.type_checking and edge.source != edge.target:
            graph.setdefault(edge.source, set()).add(edge.target)
    cycle = find_cycle(graph)
    assert cycle is None, "modules import each other: " + " -> ".join(cycle)


def test_imports_inside_functions_say_why():
    unexplained = []
    for edge in EDGES:
        if not edge.in_function or edge.type_checking:
            continue
        lines = MODULES[edge.source].read_text().splitlines()
        statement = _statement_lines(lines, edge.line)
        if not any(LAZY_MARK in line for line in statement):
            unexplained.append(f"{edge.source}:{edge.line} imports {edge.target}")
    assert not unexplained, (
        f"imports inside functions need a `{LAZY_MARK} why` comment (or belong at the top):\n"
        + "\n".join(unexplained)
    )


def _statement_lines(lines: list[str], line: int) -> list[str]:
    """The import's own lines (to its closing parenthesis) and a comment line just above it."""
    first = line - 1
    last = first
    if "(" in lines[first]:
        while ")" not in lines[last]:
            last += 1
    above = [lines[first - 1]] if first and lines[first - 1].strip().startswith("#") else []
    return above + lines[first : last + 1]


def test_the_checks_see_function_level_and_relative_imports(tmp_path):
    # A self-check of the walker: a relative import inside a function resolves to its module.
    package = tmp_path / "axon" / "engine"
    package.mkdir(parents=True)
    path = package / "probe.py"
    path.write_text("def f():\n    from ..runner import model_runner  # lazy: probe\n")
    tree = ast.parse(path.read_text())
    node = tree.body[0].body[0]
    assert _from_targets("axon.engine.probe", False, node) == ["axon.runner.model_runner"]
