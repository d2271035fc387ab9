"""``python -m bench.walk``: the path of one continuation through the sidecar, counted.

Starts the emulator (its own thread) and the real server (:class:`proxy.server.Server`, both
listeners on 127.0.0.1, port 0) in this process on asyncio's loop, sends a conversation's first
turn, then sends its second turn (turn 1's input, its output and one new user message: a fast-parse
continuation) with a :func:`sys.setprofile` hook installed for that request only. Nothing is
installed in the sidecar: the hook lives here, around one request.

What is counted, from the first call of ``post_responses`` to the call that writes the access
line (``proxy.observe.log.access_log``):

- A *call* is a function of ``proxy/`` entered anew (a coroutine resuming is not a call). Its
  caller is the nearest ``proxy/`` frame on the stack (a comprehension counts as its function).
  Loops count once: a function already called by the same caller invocation is dropped with
  everything it calls; a function entered from the event loop (no ``proxy/`` caller) is kept the
  first time only.
- A *stop* is a run of consecutive calls within one file; *files* are the distinct files.
- An *upward call* goes from a lower layer to a higher one (docs/architecture.md: the composition
  root > ops > ingress > serve > upstream > intake > observe > core > wire > the base),
  or into a module that imports the caller's module (directly or not): a callback or a hook.
- The *main line* leaves out properties, ``__init__``/``__new__``/``__post_init__``/``__len__``/
  ``__repr__``, lambdas and helpers of at most two statements (the statements of the body, a
  docstring aside); a call they make is attributed to their nearest counted caller.

The compiled build (``python -m proxy.build``) runs its modules as C: the profiler does not see
them, so the walk needs the pure build (it refuses to run on the compiled one).
"""

from __future__ import annotations

import argparse
import ast
import asyncio
import dis
import json
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from types import CodeType, FrameType
from typing import Any

import aiohttp
import orjson

__all__ = ["Call", "Figures", "Walk", "figures", "import_graph", "main", "measure", "read", "upward"]

PACKAGE = Path(__file__).resolve().parent.parent / "proxy"
"""The sidecar's package: only its frames are counted."""

START = ("ingress/front.py", "post_responses")
END = ("observe/log.py", "access_log")

LAYERS: tuple[tuple[str, ...], ...] = (
    (
        "proxy.errors",
        "proxy.reasons",
        "proxy.config",
        "proxy.contracts",
        "proxy.loop",
        "proxy.redact",
        "proxy.kernel",
        "proxy",
    ),
    ("proxy.wire",),
    ("proxy.core",),
    ("proxy.observe",),
    ("proxy.intake",),
    ("proxy.upstream",),
    ("proxy.serve",),
    ("proxy.ingress",),
    ("proxy.ops",),
    ("proxy.server", "proxy.cli", "proxy.supervisor", "proxy.__main__", "proxy.build"),
)
"""The layers, lowest first (docs/architecture.md's allowed imports)."""

HIDDEN_NAMES = frozenset({"__init__", "__new__", "__post_init__", "__len__", "__repr__", "<lambda>"})
COMPREHENSIONS = frozenset({"<listcomp>", "<setcomp>", "<dictcomp>", "<genexpr>"})


@dataclass
class Call:
    """One counted call."""

    file: str
    """Relative to ``proxy/``."""
    name: str
    """The function's qualified name."""
    line: int
    """The function's first line."""
    parent: int | None
    """Index of the calling call (None: entered from the loop or by a frame older than the walk)."""
    caller_file: str | None
    """The calling frame's file (also for a caller older than the walk)."""


@dataclass
class Figures:
    """Stops, files and upward calls of one selection of the walk."""

    stops: list[tuple[str, list[str]]]
    files: int
    upward: list[tuple[str, str]]
    """(caller file, callee file:function) of each upward call."""

    def line(self) -> str:
        return f"{len(self.stops)} stops over {self.files} files, {len(self.upward)} upward calls"


@dataclass
class Walk:
    """The traced calls of one continuation and their two readings."""

    calls: list[Call]
    main_line: Figures
    all_functions: Figures
    mode: str
    """The ``x-upshift-mode`` the continuation was answered with."""
    distinct: int
    """Distinct functions reached."""


class _Tracer:
    """The :func:`sys.setprofile` hook: records new calls of ``proxy/`` functions."""

    def __init__(self) -> None:
        self.calls: list[Call] = []
        self.done = False
        self._keys: dict[FrameType, int] = {}
        """A counted frame's call index; -1 for a dropped one; -2 - n for a frame older than the
        walk (its own invocation key)."""
        self._seen: set[tuple[int | None, tuple[str, int]]] = set()
        self._resume: dict[CodeType, int] = {}
        self._files: dict[str, str | None] = {}

    def _file(self, code: CodeType) -> str | None:
        name = code.co_filename
        if name not in self._files:
            path = Path(name)
            self._files[name] = path.relative_to(PACKAGE).as_posix() if path.is_relative_to(PACKAGE) else None
        return self._files[name]

    def _fresh(self, frame: FrameType) -> bool:
        code = frame.f_code
        first = self._resume.get(code)
        if first is None:
            first = next((i.offset for i in dis.get_instructions(code) if i.opname == "RESUME"), 0)
            self._resume[code] = first
        return frame.f_lasti <= first

    def _caller(self, frame: FrameType) -> FrameType | None:
        back = frame.f_back
        while back is not None and (self._file(back.f_code) is None or back.f_code.co_name in COMPREHENSIONS):
            back = back.f_back
        return back

    def __call__(self, frame: FrameType, event: str, arg: Any) -> None:
        if event != "call" or self.done:
            return
        code = frame.f_code
        file = self._file(code)
        if file is None or code.co_name in COMPREHENSIONS or not self._fresh(frame):
            return
        caller = self._caller(frame)
        key: int | None = None
        if caller is not None:
            key = self._keys.get(caller)
            if key is None:
                key = self._keys[caller] = -2 - len(self._keys)
            if key == -1:
                self._keys[frame] = -1
                return
        seen = (key, (file, code.co_firstlineno))
        if seen in self._seen:
            self._keys[frame] = -1
            return
        self._seen.add(seen)
        self._keys[frame] = len(self.calls)
        parent = key if key is not None and key >= 0 else None
        caller_file = self._file(caller.f_code) if caller is not None else None
        self.calls.append(Call(file, code.co_qualname, code.co_firstlineno, parent, caller_file))
        if (file, code.co_name) == END:
            self.done = True


# -- reading the walk ----------------------------------------------------------------------------


def _module(file: str) -> str:
    parts = ["proxy", *Path(file).with_suffix("").parts]
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _rank(module: str) -> int:
    for rank, names in enumerate(LAYERS):
        if any(module == n or module.startswith(n + ".") for n in names if n != "proxy") or module in names:
            return rank
    return 0


def import_graph() -> dict[str, set[str]]:
    """Which ``proxy`` modules each one imports, at the top or inside a function."""
    modules = {_module(p.relative_to(PACKAGE).as_posix()): p for p in PACKAGE.rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        found: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                found |= {alias.name for alias in node.names}
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                for alias in node.names:
                    full = f"{node.module}.{alias.name}"
                    found.add(full if full in modules else node.module)
        graph[name] = {m for m in found if m in modules and m != name}
    return graph


def _reach(graph: dict[str, set[str]], start: str) -> set[str]:
    seen: set[str] = set()
    todo = [start]
    while todo:
        for nxt in graph.get(todo.pop(), ()):
            if nxt not in seen:
                seen.add(nxt)
                todo.append(nxt)
    return seen


def upward(caller: str, callee: str, graph: dict[str, set[str]]) -> bool:
    """Whether a call from file ``caller`` into file ``callee`` goes up: into a higher layer, or
    into a module that imports the caller's (directly or not)."""
    a, b = _module(caller), _module(callee)
    if a == b:
        return False
    return _rank(b) > _rank(a) or a in _reach(graph, b)


def _statements(node: ast.AST) -> int:
    body = list(getattr(node, "body", []))
    if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
        body = body[1:]  # the docstring
    return len(body)


def _hidden_functions() -> set[tuple[str, int]]:
    """(file, first line) of every function the main line leaves out."""
    hidden: set[tuple[str, int]] = set()
    for path in PACKAGE.rglob("*.py"):
        file = path.relative_to(PACKAGE).as_posix()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                continue
            decorators = [ast.unparse(d) for d in node.decorator_list]
            prop = any(d in ("property", "cached_property", "functools.cached_property") for d in decorators)
            prop = prop or any(d.endswith((".setter", ".getter", ".deleter")) for d in decorators)
            if prop or node.name in HIDDEN_NAMES or _statements(node) <= 2:
                lines = {node.lineno, *(d.lineno for d in node.decorator_list)}
                hidden |= {(file, line) for line in lines}
    return hidden


def figures(calls: list[Call], keep: list[bool], graph: dict[str, set[str]]) -> Figures:
    """Stops, files and upward calls of the calls where ``keep`` holds."""
    stops: list[tuple[str, list[str]]] = []
    ups: list[tuple[str, str]] = []
    for index, call in enumerate(calls):
        if not keep[index]:
            continue
        if stops and stops[-1][0] == call.file:
            stops[-1][1].append(call.name)
        else:
            stops.append((call.file, [call.name]))
        parent, caller_file = call.parent, call.caller_file
        while parent is not None and not keep[parent]:
            above = calls[parent]
            parent, caller_file = above.parent, above.caller_file
        source = caller_file if parent is None else calls[parent].file
        if source is not None and upward(source, call.file, graph):
            ups.append((source, f"{call.file}:{call.name}"))
    return Figures(stops, len({file for file, _ in stops}), ups)


def read(calls: list[Call]) -> tuple[Figures, Figures]:
    """The main line's figures and every function's."""
    graph = import_graph()
    hidden = _hidden_functions()
    main = [(c.file, c.line) not in hidden for c in calls]
    return figures(calls, main, graph), figures(calls, [True] * len(calls), graph)


# -- running one continuation --------------------------------------------------------------------


async def _turn(session: aiohttp.ClientSession, url: str, body: dict[str, Any]) -> tuple[str, list[Any]]:
    async with session.post(url, data=orjson.dumps(body), headers={"content-type": "application/json"}) as resp:
        text = await resp.text()
        if resp.status != 200:
            raise RuntimeError(f"{url}: {resp.status} {text[:300]}")
        mode = resp.headers.get("x-upshift-mode", "")
    output: list[Any] = []
    for line in text.splitlines():
        if line.startswith("data: ") and '"response.completed"' in line:
            output = json.loads(line[6:])["response"]["output"]
    return mode, output


def _cut(calls: list[Call]) -> list[Call]:
    """The calls from the first ``post_responses`` on, parents renumbered."""
    begin = next(i for i, c in enumerate(calls) if (c.file, c.name) == START)
    kept = calls[begin:]
    return [
        Call(c.file, c.name, c.line, c.parent - begin if c.parent is not None and c.parent >= begin else None,
             c.caller_file)
        for c in kept
    ]  # fmt: skip


async def trace() -> tuple[list[Call], str]:
    """Run both turns; the traced calls of the second and its ``x-upshift-mode``."""
    from proxy.config import Settings
    from proxy.server import Server
    from upshift_emulator import ThreadedEmulator

    with ThreadedEmulator() as emulator:
        settings = Settings(upstream=emulator.base_url, listen="127.0.0.1:0", admin_listen="127.0.0.1:0")
        server = Server(settings)
        await server.start()
        try:
            url = f"http://127.0.0.1:{server.api_address[1]}/v1/responses"
            headers = {"authorization": "Bearer sk-walk"}
            first = [{"role": "user", "content": "What is the capital of France?"}]
            async with aiohttp.ClientSession(headers=headers) as session:
                _, output = await _turn(session, url, {"model": "gpt-4.1", "input": first, "stream": True})
                second = [*first, *output, {"role": "user", "content": "And of Italy?"}]
                tracer = _Tracer()
                sys.setprofile(tracer)
                try:
                    mode, _ = await _turn(session, url, {"model": "gpt-4.1", "input": second, "stream": True})
                    for _ in range(200):
                        if tracer.done:
                            break
                        await asyncio.sleep(0.01)
                finally:
                    sys.setprofile(None)
            if not tracer.done:
                raise RuntimeError("the access line was never written")
            return _cut(tracer.calls), mode
        finally:
            await server.stop()


def measure() -> Walk:
    """Trace one continuation on asyncio's loop and read it."""
    from proxy.build import build_kind
    from proxy.reasons import Build

    if build_kind() is Build.COMPILED:
        raise RuntimeError("the compiled build hides its frames from the profiler: python -m proxy.build --clean")
    calls, mode = asyncio.run(trace())
    main_line, every = read(calls)
    distinct = len({(c.file, c.line) for c in calls})
    return Walk(calls, main_line, every, mode, distinct)


def _report(walk: Walk, detail: bool) -> Iterator[str]:
    yield f"one continuation (x-upshift-mode: {walk.mode}), post_responses -> access line, pure build, asyncio"
    yield f"main line:     {walk.main_line.line()}"
    yield f"all functions: {walk.all_functions.line()} ({walk.distinct} distinct functions)"
    if not detail:
        return
    for title, figs in (("main line", walk.main_line), ("all functions", walk.all_functions)):
        yield f"\n{title}: stops"
        for n, (file, names) in enumerate(figs.stops, 1):
            yield f"{n:4}. {file}: {', '.join(names)}"
        yield f"{title}: upward calls"
        for source, target in figs.upward:
            yield f"      {source} -> {target}"


def main(argv: list[str] | None = None) -> int:
    """``python -m bench.walk [--stops] [--json]``."""
    parser = argparse.ArgumentParser(prog="python -m bench.walk", description=__doc__.splitlines()[0])
    parser.add_argument("--stops", action="store_true", help="list every stop and upward call")
    parser.add_argument("--json", action="store_true", help="the figures as one JSON object")
    args = parser.parse_args(argv)
    try:
        walk = measure()
    except RuntimeError as exc:
        print(f"bench.walk: {exc}", file=sys.stderr)
        return 2
    if args.json:
        doc = {
            name: {"stops": len(f.stops), "files": f.files, "upward": len(f.upward)}
            for name, f in (("main_line", walk.main_line), ("all_functions", walk.all_functions))
        }
        print(json.dumps({"mode": walk.mode, **doc}))
    else:
        print("\n".join(_report(walk, args.stops)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
