"""Which build runs: the pure one (the default and the reference) or the compiled one (mypyc).

CI runs the whole suite twice: pure, then with ``python -m proxy.build`` and
``UPSHIFT_EXPECT_BUILD=compiled``, where these tests prove the compiled modules are what ran.
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.machinery
import inspect
import os
import subprocess
import sys
from collections import Counter
from pathlib import Path
from types import FrameType, ModuleType

import aiohttp
import orjson

from proxy.build import COMPILED, build_kind, native_inits
from proxy.loop import loop_name
from proxy.reasons import Build
from tests.sidecar import Sidecar
from upshift_emulator import Emulator

ROOT = Path(__file__).resolve().parent.parent


def _is_extension(name: str) -> bool:
    path = getattr(importlib.import_module(name), "__file__", None) or ""
    return path.endswith(tuple(importlib.machinery.EXTENSION_SUFFIXES))


def test_the_build_is_the_one_expected() -> None:
    want = Build(os.environ.get("UPSHIFT_EXPECT_BUILD", "pure"))
    hint = "python -m proxy.build --clean, or set UPSHIFT_EXPECT_BUILD=compiled"
    assert build_kind() is want, f"the {build_kind()} build ran ({hint})"
    compiled = {name: _is_extension(name) for name in COMPILED}
    assert all(compiled.values()) if want is Build.COMPILED else not any(compiled.values()), compiled


def test_an_in_place_build_is_not_stale() -> None:
    # An extension beside its source shadows every later edit of it until `python -m proxy.build`.
    for name in COMPILED:
        # Not from __file__: mypyc sets that of a module its library loads as a dependency wrongly
        # (proxy/proxy/core/...) when the library sits inside the package; the suffix is right.
        source = ROOT / (name.replace(".", "/") + ".py")
        built = source.with_suffix(importlib.machinery.EXTENSION_SUFFIXES[0])
        if _is_extension(name) and built.exists():  # in place in this checkout
            assert source.stat().st_mtime <= built.stat().st_mtime, f"{source} changed after it was compiled"


def test_the_compiled_modules_need_nothing_at_run_time() -> None:
    # The wheel's only extra files are the extensions: mypy, mypyc and librt stay build-time tools.
    tools = ("mypy", "mypyc", "librt", "mypy_extensions")
    code = f"import sys, {', '.join(COMPILED)}; print(sorted(m for m in sys.modules if m.split('.')[0] in {tools}))"
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    assert out.returncode == 0 and out.stdout.strip() == "[]", out.stderr


def test_version_names_the_build() -> None:
    out = subprocess.run([sys.executable, "-m", "proxy", "--version"], cwd=ROOT, capture_output=True, text=True)
    assert out.returncode == 0 and f"({loop_name()} event loop, {build_kind()} build)" in out.stdout


def _module_of(name: str, source: str) -> ModuleType:
    """``source`` run as a fresh module beside the real one (interpreted in either build)."""
    module = ModuleType(f"{name}__as_run_here")
    sys.modules[module.__name__] = module  # dataclasses reads the module of a class
    try:
        exec(compile(source, f"<{module.__name__}>", "exec"), module.__dict__)
    finally:
        del sys.modules[module.__name__]
    return module


def _dataclasses_of(module: ModuleType) -> dict[str, type]:
    found = {}
    for value in vars(module).values():
        if isinstance(value, type) and dataclasses.is_dataclass(value) and value.__module__ == module.__name__:
            found[value.__qualname__] = value
    return found


def test_the_generated_inits_are_the_ones_dataclasses_writes() -> None:
    # The compiled build compiles each dataclass with the __init__ native_inits writes into a copy
    # of the source: run both sources, and every class must take the same parameters with the
    # same defaults and build the same instance (a default_factory's field: an equal fresh value).
    checked = 0
    for name in COMPILED:
        source = (ROOT / (name.replace(".", "/") + ".py")).read_text()
        skipped: list[str] = []
        generated = native_inits(source, skipped)
        assert not skipped, f"{name}: dataclasses left to an interpreted __init__: {skipped}"
        tail = source.splitlines()[-1:] == generated.splitlines()[-2:-1]  # a class ending the file
        assert len(generated.splitlines()) == len(source.splitlines()) + tail, "the lines kept their numbers"
        plain, native = _dataclasses_of(_module_of(name, source)), _dataclasses_of(_module_of(name, generated))
        assert plain.keys() == native.keys()
        for qualname, cls in plain.items():
            made = native[qualname]
            assert "__init__" in vars(made) and made.__dataclass_params__.init is False, qualname  # type: ignore[attr-defined]
            want, got = inspect.signature(cls.__init__), inspect.signature(made.__init__)
            assert list(want.parameters) == list(got.parameters), qualname
            fields = {f.name: f for f in dataclasses.fields(cls)}
            required = {}
            for param in want.parameters.values():
                if param.name == "self":
                    continue
                factory = fields[param.name].default_factory is not dataclasses.MISSING
                assert got.parameters[param.name].default == (None if factory else param.default), (qualname, param)
                if param.default is inspect.Parameter.empty:
                    required[param.name] = object()
            if "__post_init__" in vars(cls):
                continue  # it reads its arguments (checked by the suite, which builds it)
            a, b = cls(**required), made(**required)
            for field in fields:
                if hasattr(a, field) or hasattr(b, field):
                    mine, theirs = getattr(a, field), getattr(b, field)  # repr: a value without __eq__
                    assert mine == theirs or repr(mine) == repr(theirs), (qualname, field)
                    assert type(getattr(a, field)).__qualname__ == type(getattr(b, field)).__qualname__, (
                        qualname,
                        field,
                    )
            checked += 1
    assert checked >= 30, checked


def test_native_inits_writes_what_dataclasses_would() -> None:
    source = (
        "from dataclasses import dataclass, field\n"
        "from typing import ClassVar\n\n\n"
        "@dataclass(frozen=True)\n"
        "class A:\n"
        "    x: int\n"
        "    n: ClassVar[int] = 3\n"
        "    y: list[int] = field(default_factory=list, repr=False)\n"
        "    z: str = field(init=False, default='z')\n\n\n"
        "@dataclass\n"
        "class B(A):\n"
        "    w: int = 0\n"
    )
    skipped: list[str] = []
    out = native_inits(source, skipped)
    assert "@dataclass(init=False, frozen=True)" in out and "@dataclass\nclass B(A)" in out
    assert (
        "    def __init__(self, x: int, y: list[int] | None = None) -> None: "
        'object.__setattr__(self, "x", x); object.__setattr__(self, "y", list() if y is None else y); '
        "object.__setattr__(self, \"z\", 'z')\n\n@dataclass" in out
    )
    assert skipped == ["B: a base class"]


async def test_no_interpreted_dataclass_init_runs_on_a_turn(stack: tuple[Emulator, Sidecar]) -> None:
    # mypyc compiles a dataclass's methods as the dataclasses module writes them: Python code
    # built with exec (https://github.com/mypyc/mypyc/issues/671), so each instance of a
    # compiled module's dataclass would run an interpreted __init__ (0.2-0.6 us each, ~5 % of a
    # 1 KB turn's CPU). The compiled build compiles the __init__ native_inits writes instead;
    # such an __init__ is Python code from "<string>". The pure build runs the dataclasses
    # module's own: the probe must see those.
    _, sidecar = stack
    ran: Counter[str] = Counter()

    def profile(frame: FrameType, event: str, arg: object) -> None:
        code = frame.f_code
        if event == "call" and code.co_name == "__init__" and code.co_filename == "<string>":
            cls = type(frame.f_locals.get("self"))
            if cls.__module__ in COMPILED:
                ran[f"{cls.__module__}.{cls.__qualname__}"] += 1

    first = {"model": "gpt-6.1-sol", "input": [{"role": "user", "content": "hi"}], "stream": True}
    async with aiohttp.ClientSession(headers={"Authorization": "Bearer sk-test"}) as http:
        modes = []
        for turn in range(3):
            sys.setprofile(profile if turn else None)  # continuations: a first turn opens sockets
            try:
                async with http.post(sidecar.base_url + "/responses", json=first) as resp:
                    data = await resp.read()
            finally:
                sys.setprofile(None)
            assert resp.status == 200, data
            modes.append(resp.headers["x-upshift-mode"])
            completed = orjson.loads(data.rsplit(b"data: ", 1)[1])["response"]
            first["input"] += [*completed["output"], {"role": "user", "content": f"and {turn}?"}]
    assert modes == ["full", "continuation", "continuation"]  # the path measured is a turn's
    if build_kind() is Build.PURE:
        assert {"proxy.serve.record.Record", "proxy.core.plans.Continue"} <= ran.keys(), dict(ran)
    else:
        assert not ran, f"dataclasses built on a turn with the interpreted __init__: {dict(ran)}"
