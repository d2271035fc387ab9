"""Which build runs: the pure one (the default and the reference) or the compiled one (mypyc).

CI runs the whole suite twice: pure, then with ``python -m proxy.build`` and
``UPSHIFT_EXPECT_BUILD=compiled``, where these tests prove the compiled modules are what ran.
"""

from __future__ import annotations

import importlib
import importlib.machinery
import os
import subprocess
import sys
from collections import Counter
from pathlib import Path
from types import FrameType

import aiohttp
import orjson

from proxy.build import COMPILED, build_kind
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


async def test_no_interpreted_dataclass_init_runs_on_a_turn(stack: tuple[Emulator, Sidecar]) -> None:
    # mypyc compiles a dataclass's methods as the dataclasses module writes them: Python code
    # built with exec (mypyc issue 671), so each instance of a compiled module's dataclass ran an
    # interpreted __init__ (0.2-0.6 us each, ~5 % of a 1 KB turn's CPU). Those made on a
    # continuation's path write their own __init__ (dataclass(init=False)); this catches one that
    # does not, in either build: such an __init__ is Python code from "<string>".
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
    assert not ran, f"dataclasses built on a turn with the interpreted __init__: {dict(ran)}"
