"""The package's structure: no import circles, and every module imports only from floors below its own
(or from its own package), in the order docs/development.md's layout section gives. Imports are read from the
source (top-level and inside functions alike), so a lazy import cannot hide a circle."""
from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "megasparse"

# Lowest first. A module may import from a lower floor, or from its own package.
FLOORS = [
    ["megasparse.errors", "megasparse.faults", "megasparse.model.presets",
     "megasparse.progress", "megasparse.versions"],
    ["megasparse.config"],
    ["megasparse.parallel"],
    ["megasparse.optim", "megasparse.data"],
    ["megasparse.sparse", "megasparse.lowrank"],
    ["megasparse.hybrid"],
    ["megasparse.model"],
    ["megasparse.checkpoint"],
    ["megasparse.train"],
    ["megasparse.convert", "megasparse.launch", "megasparse.plot", "megasparse.plan"],
    ["megasparse.study"],
    ["megasparse.cli"],
    ["megasparse.__main__"],
]


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(path): path for path in sorted(PACKAGE.rglob("*.py"))}


def imports(name: str) -> set[str]:
    """The megasparse modules ``name`` imports (a package's ``__init__`` stands for the package)."""
    found = set()
    for node in ast.walk(ast.parse(MODULES[name].read_text())):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found |= {f"{node.module}.{alias.name}" if f"{node.module}.{alias.name}" in MODULES else node.module
                      for alias in node.names}
    return {target for target in found if target in MODULES and target != "megasparse" and target != name}


GRAPH = {name: imports(name) for name in MODULES if name != "megasparse"}  # (the version string only)


def floor(name: str) -> tuple[int, str]:
    """The floor of ``name`` and the prefix that placed it there (the longest that matches)."""
    matches = [(len(prefix), index, prefix) for index, prefixes in enumerate(FLOORS) for prefix in prefixes
               if name == prefix or name.startswith(prefix + ".")]
    assert matches, f"{name} is on no floor: add it to FLOORS (and to the layout in docs/development.md)"
    _, index, prefix = max(matches)
    return index, prefix


def test_no_import_circles():
    circles, seen, path = [], set(), []

    def visit(name: str) -> None:
        if name in path:
            circles.append(path[path.index(name):] + [name])
            return
        if name in seen:
            return
        seen.add(name)
        path.append(name)
        for target in sorted(GRAPH[name]):
            visit(target)
        path.pop()

    for name in sorted(GRAPH):
        visit(name)
    assert not circles, "import circles: " + "; ".join(" -> ".join(circle) for circle in circles)


def test_imports_go_down_the_floors():
    upward = []
    for name, targets in GRAPH.items():
        level, place = floor(name)
        for target in targets:
            target_level, target_place = floor(target)
            if target_level > level or (target_level == level and target_place != place):
                upward.append(f"{name} (floor {level}) imports {target} (floor {target_level})")
    assert not upward, "\n".join(sorted(upward))


def test_the_layout_names_every_module():
    """docs/development.md's layout names every module, each under its own folder."""
    page = (PACKAGE.parent / "docs" / "development.md").read_text()
    block = page.split("## Layout", 1)[1].split("```", 2)[1]
    entries: dict[str, str] = {}  # a folder's entry (or "" for the package's own modules) -> its text
    for line in block.splitlines():
        if line.startswith("  ") and not line.startswith("   "):
            name = line.split()[0]
            folder = name if name.endswith("/") else ""
            entries[folder] = entries.get(folder, "") + line
        elif line.startswith("   ") and entries:
            entries[folder] += line
    for path in sorted(PACKAGE.rglob("*.py")):
        relative = path.relative_to(PACKAGE)
        if path.name == "__init__.py":
            continue
        folder = f"{relative.parent}/" if relative.parent.parts else ""
        assert path.name in entries.get(folder, ""), f"{relative} is not in docs/development.md's layout"
