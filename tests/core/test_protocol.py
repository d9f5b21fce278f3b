"""The store protocol tells the truth: every member of a store that moepage's code outside ``moepage/backends`` uses is
declared in ``PagedExpertStore`` or in one of the capability protocols beside it (``backends.protocol``), and no code
there asks a store for its class (a capability is asked for by its protocol)."""

from __future__ import annotations

import ast
from pathlib import Path

import moepage
from moepage.backends.protocol import CAPABILITIES, PagedExpertStore

ROOT = Path(moepage.__file__).parent
STORES = {"store", "staging"}  # how the code names a store: ``store.x``, ``staging.x``, ``self.store.x``, ...


def declared() -> set[str]:
    """Every member the protocol and the capabilities declare: their methods and their attributes."""
    out: set[str] = set()
    for proto in (PagedExpertStore, *CAPABILITIES):
        out |= {n for n in vars(proto) if not n.startswith("_")} | set(vars(proto).get("__annotations__", {}))
    return out


def store_classes() -> set[str]:
    """The classes ``moepage/backends`` defines that are not protocols (the stores and their parts)."""
    out = set()
    for path in (ROOT / "backends").glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef) and not any(getattr(b, "id", None) == "Protocol" for b in node.bases):
                out.add(node.name)
    return out


def _named(node: ast.expr) -> str | None:
    return node.id if isinstance(node, ast.Name) else node.attr if isinstance(node, ast.Attribute) else None


def problems(source: str, where: str, members: set[str], classes: set[str]) -> list[str]:
    """What ``source`` uses of a store that is not declared, and every ``isinstance`` naming a store class, in line
    order."""
    out = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Attribute) and _named(node.value) in STORES and node.attr not in members:
            out.append(f"{where}:{node.lineno}: {_named(node.value)}.{node.attr} is declared by no store protocol")
        if isinstance(node, ast.Call) and _named(node.func) == "isinstance" and len(node.args) == 2:
            kinds = node.args[1].elts if isinstance(node.args[1], ast.Tuple) else [node.args[1]]
            out += [f"{where}:{node.lineno}: isinstance on the store class {_named(k)}" for k in kinds
                    if _named(k) in classes]
    return sorted(out, key=lambda line: int(line.split(":")[1]))


def test_every_store_member_used_outside_the_backends_is_declared_by_a_protocol():
    members, classes = declared(), store_classes()
    found = []
    for path in sorted(ROOT.rglob("*.py")):
        if (ROOT / "backends") not in path.parents:
            found += problems(path.read_text(), str(path.relative_to(ROOT)), members, classes)
    assert found == []


def test_the_check_finds_an_undeclared_member_and_an_isinstance_on_a_store_class():
    members, classes = declared(), store_classes()
    assert {"TieredStore", "Store", "TorchStore"} <= classes and "PagedExpertStore" not in classes
    assert {"page_in", "compresses", "spill_dir", "reuse", "warm", "held_rows"} <= members
    source = ("def f(store, layer, lifetime):\n"
              "    store.some_undeclared_thing()\n"
              "    lifetime.store.disk.missing(layer, 'w')\n"
              "    self.staging.page_in(layer, [])\n"
              "    return isinstance(store, (int, TieredStore))\n")
    assert problems(source, "x.py", members, classes) == [
        "x.py:2: store.some_undeclared_thing is declared by no store protocol",
        "x.py:3: store.disk is declared by no store protocol",
        "x.py:5: isinstance on the store class TieredStore",
    ]


def test_a_disk_tier_has_every_capability_and_a_plain_store_none(tmp_path):
    from moepage.backends.tiered import TieredStore
    from moepage.backends.torch import TorchStore

    tiered, plain = TieredStore(tmp_path, lambda *_: 1), TorchStore(pin_memory=False)
    try:
        assert all(isinstance(tiered, c) for c in (PagedExpertStore, *CAPABILITIES))
        assert isinstance(plain, PagedExpertStore) and not any(isinstance(plain, c) for c in CAPABILITIES)
    finally:
        tiered.close()
        plain.close()
