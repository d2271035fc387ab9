"""The handler path stays short: ``POST /v1/responses`` from entry to answer.

Measured statically: from :func:`proxy.ingress.front.post_responses` and the handler the reception
hands the request to (:func:`proxy.serve.handlers.serve`), every call (and property
read) that resolves to a function or method defined in the handler path proper
(``proxy/ingress/front.py``, ``proxy/serve/handlers.py``) is followed; the code lines of every
function reached are added up (docstrings, comments and blank lines left out). What those
functions call elsewhere (the reception, the planner, the pump, the passthrough, the record) are
pieces with a job of their own, each tested where it lives.
"""

from __future__ import annotations

import ast
import io
import tokenize
from dataclasses import dataclass

from tests.sidecar import ROOT

PATH_FILES = (ROOT / "proxy" / "ingress" / "front.py", ROOT / "proxy" / "serve" / "handlers.py")
ENTRIES = (("front.py", "post_responses"), ("handlers.py", "serve"))
"""Where the path starts: the front, and the local handler the reception hands an arrival to
(the reception, between them, is a piece with a job of its own)."""
MAX_LINES = 120
MAX_PARAMS = 5

_Def = ast.FunctionDef | ast.AsyncFunctionDef


@dataclass(frozen=True, slots=True)
class _Function:
    name: str
    """``function``, or ``Class.method``."""
    file: str
    node: _Def
    code_lines: int
    params: int


def _code_lines(source: str) -> set[int]:
    """Line numbers holding a token other than a comment or a line break."""
    lines: set[int] = set()
    skip = {tokenize.COMMENT, tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT, tokenize.ENDMARKER}
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type not in skip:
            lines.update(range(tok.start[0], tok.end[0] + 1))
    return lines


def _docstring_lines(node: ast.AST) -> set[int]:
    """The lines of every string statement inside ``node``: its docstring, nested functions'
    and classes' docstrings, attribute docstrings."""
    lines: set[int] = set()
    for inner in ast.walk(node):
        if isinstance(inner, ast.Expr) and isinstance(inner.value, ast.Constant) and isinstance(inner.value.value, str):
            lines.update(range(inner.lineno, (inner.end_lineno or inner.lineno) + 1))
    return lines


def _params(node: _Def) -> int:
    """Positional and keyword-only parameters (and ``*args``/``**kwargs``), ``self``/``cls`` aside."""
    a = node.args
    names = [p.arg for p in (*a.posonlyargs, *a.args, *a.kwonlyargs)]
    names += [p.arg for p in (a.vararg, a.kwarg) if p is not None]
    return len([n for n in names if n not in ("self", "cls")])


@dataclass(slots=True)
class _Index:
    """The functions of the path's files, by how a call reaches them."""

    by_name: dict[str, list[_Function]]
    """Module-level functions, and classes' constructors (``__init__``, ``__post_init__``)."""
    methods: dict[str, list[_Function]]
    """Methods, by bare name (``x.name(...)``)."""
    properties: dict[str, list[_Function]]
    """Properties, by bare name (``x.name``)."""


def _function(node: _Def, owner: str, file: str, code: set[int]) -> _Function:
    start = min([node.lineno, *(d.lineno for d in node.decorator_list)])
    span = set(range(start, (node.end_lineno or node.lineno) + 1))
    lines = len((span & code) - _docstring_lines(node))
    return _Function(f"{owner}.{node.name}" if owner else node.name, file, node, lines, _params(node))


def _index() -> _Index:
    index = _Index({}, {}, {})
    for path in PATH_FILES:
        source = path.read_text()
        tree = ast.parse(source, str(path))
        code = _code_lines(source)
        for top in tree.body:
            if isinstance(top, ast.FunctionDef | ast.AsyncFunctionDef):
                index.by_name.setdefault(top.name, []).append(_function(top, "", path.name, code))
            if not isinstance(top, ast.ClassDef):
                continue
            for node in top.body:
                if not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                    continue
                fn = _function(node, top.name, path.name, code)
                decorators = {d.id for d in node.decorator_list if isinstance(d, ast.Name)}
                if node.name in ("__init__", "__post_init__"):
                    index.by_name.setdefault(top.name, []).append(fn)  # reached by constructing the class
                elif "property" in decorators:
                    index.properties.setdefault(node.name, []).append(fn)
                else:
                    index.methods.setdefault(node.name, []).append(fn)
    return index


def _annotations(node: _Def) -> list[ast.expr]:
    found: list[ast.expr] = []
    for inner in ast.walk(node):
        if isinstance(inner, ast.arg | ast.AnnAssign) and inner.annotation is not None:
            found.append(inner.annotation)
        elif isinstance(inner, ast.FunctionDef | ast.AsyncFunctionDef) and inner.returns is not None:
            found.append(inner.returns)
    return found


def _reached(node: _Def, index: _Index) -> list[_Function]:
    """What ``node`` reaches in the path's files: functions called or passed along by name
    (``partial(_serve, ...)``), methods called, properties read."""
    found: list[_Function] = []
    hints = {id(n) for hint in _annotations(node) for n in ast.walk(hint)}
    for inner in ast.walk(node):
        if id(inner) in hints:
            continue  # a type named in an annotation is not a call
        if isinstance(inner, ast.Name) and isinstance(inner.ctx, ast.Load):
            found += index.by_name.get(inner.id, [])
        elif isinstance(inner, ast.Call) and isinstance(inner.func, ast.Attribute):
            found += index.methods.get(inner.func.attr, [])
        elif isinstance(inner, ast.Attribute):
            found += index.properties.get(inner.attr, [])
    return found


def handler_path() -> list[_Function]:
    """The functions reached from :data:`ENTRIES`, in the order they are first reached."""
    index = _index()
    todo = [f for file, name in ENTRIES for f in index.by_name[name] if f.file == file]
    reached: dict[str, _Function] = {}
    while todo:
        fn = todo.pop(0)
        key = f"{fn.file}:{fn.name}"
        if key not in reached:
            reached[key] = fn
            todo += _reached(fn.node, index)
    return list(reached.values())


def _table(path: list[_Function]) -> str:
    rows = [f"  {f.file + ':' + f.name:<40} {f.code_lines:>4} lines {f.params:>2} params" for f in path]
    total = sum(f.code_lines for f in path)
    return "\n".join([*rows, f"  {'total':<40} {total:>4} lines"])


def test_the_handler_path_is_short() -> None:
    path = handler_path()
    total = sum(f.code_lines for f in path)
    assert total <= MAX_LINES, f"the handler path is {total} code lines (at most {MAX_LINES}):\n{_table(path)}"


def test_no_function_on_the_handler_path_takes_more_than_five_parameters() -> None:
    path = handler_path()
    wide = [f for f in path if f.params > MAX_PARAMS]
    assert not wide, f"over {MAX_PARAMS} parameters: {[f.name for f in wide]}\n{_table(path)}"


def test_the_measure_follows_calls_and_counts_code_only() -> None:
    """The walk reaches the local handler and its stages; a docstring or comment is not a line."""
    path = {f.name for f in handler_path()}
    assert {"post_responses", "serve", "refuse"} <= path, path
    sample = "def f(a, b, *, c):\n    '''Doc.\n\n    More.'''\n    # a comment\n\n    return a  # trailing\n"
    tree = ast.parse(sample)
    node = tree.body[0]
    assert isinstance(node, ast.FunctionDef)
    assert len(set(range(1, 8)) & _code_lines(sample) - _docstring_lines(node)) == 2
    assert _params(node) == 3
