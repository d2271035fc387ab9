"""Build hook: ``UPSHIFT_COMPILE=1 pip install .`` ships the hot path compiled (mypyc).

Without the variable it does nothing and the wheel is pure Python (the default: no compiler
needed). With it, :func:`proxy.build.compile_modules` compiles the modules of
``proxy.build.COMPILED``: into the wheel beside their sources (a platform wheel), or, for an
editable install, in place in this checkout (rebuild with ``python -m proxy.build`` after edits).
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

from hatchling.builders.hooks.plugin.interface import BuildHookInterface

SWITCH = "UPSHIFT_COMPILE"
TYPED = ("aiohttp", "orjson", "websockets")
"""The project's dependencies that the compiled modules import."""


def _wanted() -> bool:
    return os.environ.get(SWITCH, "") not in ("", "0")


class CompileHook(BuildHookInterface):  # type: ignore[misc]
    """Compiles with mypyc when ``UPSHIFT_COMPILE=1``."""

    PLUGIN_NAME = "custom"

    def dependencies(self) -> list[str]:
        # Only a compiled build needs the compiler: the pure one builds with hatchling alone. mypyc
        # type-checks what it compiles, so the libraries those modules import come too.
        if not _wanted():
            return []
        from packaging.requirements import Requirement

        typed = [dep for dep in self.metadata.core.dependencies if Requirement(dep).name in TYPED]
        return ["mypy>=1.10", "setuptools>=70", *typed]

    def initialize(self, version: str, build_data: dict[str, Any]) -> None:
        if not _wanted():
            return
        sys.path.insert(0, self.root)
        from proxy.build import compile_modules

        root = Path(self.root)
        self._work = Path(tempfile.mkdtemp(prefix="upshift-mypyc-"))
        if version == "editable":
            compile_modules(root, self._work, in_place=True)
        else:
            lib = self._work / "lib"
            for path in compile_modules(root, self._work, in_place=False):
                build_data["force_include"][str(path)] = path.relative_to(lib).as_posix()
        build_data["pure_python"] = False
        build_data["infer_tag"] = True

    def finalize(self, version: str, build_data: dict[str, Any], artifact_path: str) -> None:
        work = getattr(self, "_work", None)
        if work is not None:
            shutil.rmtree(work, ignore_errors=True)
