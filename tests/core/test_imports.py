"""moepage's modules import one another without a circle: module-level imports and those under ``TYPE_CHECKING`` alike
(an import inside a function is a deliberate late one and is not counted)."""

from __future__ import annotations

import ast
from pathlib import Path

import moepage

ROOT = Path(moepage.__file__).parent


def _module(path: Path) -> str:
    parts = ("moepage", *path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _top_level(body: list[ast.stmt]):
    for node in body:
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
        elif isinstance(node, (ast.If, ast.Try)):  # ``if TYPE_CHECKING:``, ``try: import ...``
            yield from _top_level(node.body + node.orelse + [s for h in getattr(node, "handlers", []) for s in h.body])


def imports() -> dict[str, set[str]]:
    """Each module -> the moepage modules it imports at its top level."""
    paths = {_module(p): p for p in ROOT.rglob("*.py")}
    out = {}
    for name, path in paths.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        found = set()
        for node in _top_level(ast.parse(path.read_text()).body):
            if isinstance(node, ast.Import):
                found |= {a.name for a in node.names if a.name in paths}
                continue
            base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1]) if node.level else ""
            base = ".".join(x for x in (base, node.module) if x)
            found |= {f"{base}.{a.name}" if f"{base}.{a.name}" in paths else base for a in node.names} & set(paths)
        out[name] = found - {name}
    return out


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One circle through each module that is on one (depth-first search)."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []
    found = []

    def visit(node: str) -> None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                found.append(path[path.index(nxt):] + [nxt])
            elif nxt not in state:
                visit(nxt)
        path.pop()
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node)
    return found


def test_no_module_imports_itself_through_others():
    graph = imports()
    assert {"moepage.pager", "moepage.split", "moepage.step"} <= set(graph)
    assert "moepage.pager" in graph["moepage.step"]  # the graph sees what it should
    assert circles(graph) == []


def test_the_search_finds_a_circle():
    assert circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c", "a"]]
