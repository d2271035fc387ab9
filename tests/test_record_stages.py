"""The access record (:class:`proxy.serve.record.Record`) is written only through its stage methods.

Each stage of a request says what happened in one call (``received``, ``parsed``, ``planned``,
``responded``, ...), and only ``proxy/serve/record.py`` assigns a field. This reads every module of
``proxy/`` (its syntax tree: nothing runs) for an assignment to a field of a name that holds a
record: a parameter or variable annotated ``Record``, one assigned ``Record(...)``, or an
attribute declared or assigned so (``self.rec``, ``arrival.rec``).
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "proxy"
RECORD = PACKAGE / "serve" / "record.py"


def _fields() -> set[str]:
    tree = ast.parse(RECORD.read_text())
    (cls,) = (node for node in tree.body if isinstance(node, ast.ClassDef) and node.name == "Record")
    return {s.target.id for s in cls.body if isinstance(s, ast.AnnAssign) and isinstance(s.target, ast.Name)}


def _is_record(node: ast.expr | None) -> bool:
    """An annotation ``Record`` (or ``Record | None``), or a call ``Record(...)``."""
    if node is None:
        return False
    if isinstance(node, ast.Call):
        node = node.func
    text = ast.unparse(node).replace(" ", "")
    return any(part.rsplit(".", 1)[-1] == "Record" for part in text.strip("'\"").split("|"))


def _holders(trees: list[ast.Module]) -> set[str]:
    """Names that hold a record somewhere in ``trees``: parameters, variables and attributes."""
    names: set[str] = set()
    for tree in trees:
        for node in ast.walk(tree):
            if isinstance(node, ast.arg) and _is_record(node.annotation):
                names.add(node.arg)
            elif isinstance(node, ast.AnnAssign) and _is_record(node.annotation):
                target = node.target
                names.add(target.id if isinstance(target, ast.Name) else ast.unparse(target).rsplit(".", 1)[-1])
            elif isinstance(node, ast.Assign) and _is_record(node.value) and isinstance(node.value, ast.Call):
                for target in node.targets:
                    if isinstance(target, ast.Name):
                        names.add(target.id)
                    elif isinstance(target, ast.Attribute):
                        names.add(target.attr)
    return names


def _writes(tree: ast.Module, holders: set[str], fields: set[str]) -> list[str]:
    """Every assignment in ``tree`` to ``<holder>.<field>`` (plain, augmented, in a tuple)."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign):
            targets = node.targets
        elif isinstance(node, ast.AugAssign | ast.AnnAssign):
            targets = [node.target]
        else:
            continue
        for target in targets:
            for part in ast.walk(target):
                if not (isinstance(part, ast.Attribute) and part.attr in fields):
                    continue
                holder = part.value
                name = holder.id if isinstance(holder, ast.Name) else getattr(holder, "attr", None)
                if name in holders:
                    found.append(f"{node.lineno}: {ast.unparse(node)}")
    return found


def test_only_the_record_writes_its_fields() -> None:
    modules = {path: ast.parse(path.read_text()) for path in sorted(PACKAGE.rglob("*.py"))}
    holders, fields = _holders(list(modules.values())), _fields()
    assert {"rec"} <= holders and {"status", "outcome", "bytes_in", "added_s", "upstream_s"} <= fields
    writes = {
        str(path.relative_to(ROOT)): found
        for path, tree in modules.items()
        if path != RECORD and (found := _writes(tree, holders, fields))
    }
    assert not writes, f"a Record field written outside proxy/serve/record.py (add a stage method): {writes}"


def test_the_check_finds_a_write() -> None:
    # The forms the request path used before the stage methods: each one is found.
    source = """
def refuse(record: Record, started: float) -> None:
    record.status = 400

class Reception:
    def __init__(self) -> None:
        self.rec = Record("id")

    def answered(self, arrival) -> None:
        self.rec.outcome, self.rec.status = "cancelled", 499
        arrival.rec.items_in = 3
        self.rec.upstream_s += 0.5
        self.rec.planned(1, 2, 3, 4)  # a stage method: not a write
        self.other.status = 200  # not a record
"""
    tree = ast.parse(source)
    found = _writes(tree, _holders([tree]), _fields())
    assert [line.split(":")[0] for line in found] == ["3", "10", "10", "11", "12"], found
