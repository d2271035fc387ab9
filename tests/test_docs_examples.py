"""Every documented example loads: configuration snippets and command lines of README.md,
config.yaml, deploy/README.md and docs/*.md, through the real loader and the real CLI.

* A YAML code block whose top-level keys are upshift settings is loaded by
  :func:`proxy.config_load.load_settings` from a file, as ``--config`` reads it; one whose keys are
  the emulator's (``latency``, ...) by the emulator's loader. A block meant to be refused is
  preceded by ``<!-- refused -->`` in the doc, and the test checks that the loader refuses it.
* A command line (in a code block or an inline code span, also in config.yaml's comments) that
  starts ``python -m proxy`` or ``upshift`` (the same program) runs through the CLI: a command
  that would start the sidecar runs with ``--print-config`` added (its settings load, nothing
  listens), ``--help``/``--version``/``--print-config`` as written, a subcommand (``demo``, ``doctor``,
  ``explain``) with ``--help``. The CLI runs with the user's defaults: no ``UPSHIFT_*`` variable.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml

from proxy.config_load import load_settings
from proxy.errors import ConfigError
from tests.sidecar import ROOT
from upshift_emulator.config import load_config_file

DOCS = [ROOT / "README.md", ROOT / "deploy" / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
REFUSED = "<!-- refused -->"
_BLOCK = re.compile(r"^( *)```(\w*)[^\n]*\n(.*?)^\1```", re.M | re.S)
_INLINE = re.compile(r"`((?:python -m proxy|upshift)(?:\s[^`]*)?)`")
_COMMAND = re.compile(r"(?:^|&& |; )((?:python -m proxy|upshift)(?=\s|$)[^#\n]*)")
_SUBCOMMANDS = ("demo", "explain", "doctor")


@dataclass(frozen=True)
class Example:
    where: str
    text: str
    refused: bool = False

    def __str__(self) -> str:
        return self.where


def _line(text: str, offset: int) -> int:
    return text.count("\n", 0, offset) + 1


def _rel(path: Path) -> str:
    return str(path.relative_to(ROOT))


def yaml_blocks() -> list[Example]:
    out = []
    for path in DOCS:
        text = path.read_text(encoding="utf-8")
        for m in _BLOCK.finditer(text):
            if m.group(2) not in ("yaml", "yml"):
                continue
            before = text[: m.start()].rstrip().splitlines()[-1:] or [""]
            where = f"{_rel(path)}:{_line(text, m.start())}"
            out.append(Example(where, m.group(3), refused=before[0].strip() == REFUSED))
    return out


def command_lines() -> list[Example]:
    out: list[Example] = []
    seen: set[str] = set()
    for path in [*DOCS, ROOT / "config.yaml"]:
        text = path.read_text(encoding="utf-8")
        spans: list[tuple[int, str]] = []
        if path.suffix == ".md":
            for m in _BLOCK.finditer(text):
                for i, line in enumerate(m.group(3).splitlines()):
                    spans.append((_line(text, m.start(3)) + i, line))
            prose = _BLOCK.sub(lambda m: "\n" * m.group(0).count("\n"), text)
            for m in _INLINE.finditer(prose):
                spans.append((_line(prose, m.start()), m.group(1)))
        else:
            for i, line in enumerate(text.splitlines()):
                if line.lstrip().startswith("#"):
                    spans.append((i + 1, line.split(":", 1)[-1] if ": python" in line else line.lstrip("# ")))
        for lineno, span in spans:
            for m in _COMMAND.finditer(" ".join(span.split())):
                command = m.group(1).strip()
                words = command.split()
                if "..." in command:
                    continue  # an elided example
                if (
                    words[0] == "upshift"
                    and len(words) > 1
                    and not (words[1].startswith("-") or words[1] in _SUBCOMMANDS)
                ):
                    continue  # prose or program output ("upshift configuration.", "upshift demo: ...")
                if command not in seen:
                    seen.add(command)
                    out.append(Example(f"{_rel(path)}:{lineno}: {command}", command))
    return out


def _is_upshift_config(data: object) -> bool:
    from proxy.config_load import setting_keys

    tops = {key.split(".", 1)[0] for key in setting_keys()}
    return isinstance(data, dict) and bool(data) and all(str(k) in tops for k in data)


@pytest.mark.parametrize("example", yaml_blocks(), ids=str)
def test_configuration_snippet_loads(example: Example, tmp_path: Path) -> None:
    data = yaml.safe_load(example.text)
    path = tmp_path / "snippet.yaml"
    path.write_text(example.text, encoding="utf-8")
    if not _is_upshift_config(data):
        # Not the sidecar's settings: the emulator's (docs/emulator.md), loaded by its loader.
        assert isinstance(data, dict), f"{example}: neither upshift nor emulator configuration"
        load_config_file(path)
        return
    if example.refused:
        with pytest.raises(ConfigError):
            load_settings({}, {}, str(path))
    else:
        load_settings({}, {}, str(path))


def test_shipped_config_yaml_loads() -> None:
    load_settings({}, {}, str(ROOT / "config.yaml"))


def test_the_docs_have_examples() -> None:
    """The extraction finds what the docs hold (a broken pattern would make every test vacuous)."""
    assert len(yaml_blocks()) >= 4
    commands = {e.text for e in command_lines()}
    assert {"python -m proxy", "python -m proxy --print-config", "python -m proxy demo"} <= commands
    assert any(c.startswith("python -m proxy --config config.yaml") for c in commands)
    assert any(c.startswith("upshift explain") for c in commands)


def _cli_argv(command: str) -> list[str]:
    words = shlex.split(command)
    args = words[3:] if words[:3] == ["python", "-m", "proxy"] else words[1:]
    if args[:1] and args[0] in _SUBCOMMANDS:
        return [args[0], "--help"]
    if {"--help", "-h", "--version", "--print-config"} & set(args):
        return args
    return [*args, "--print-config"]


@pytest.mark.parametrize("example", command_lines(), ids=str)
def test_command_line_loads(example: Example) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("UPSHIFT_")}
    argv = _cli_argv(example.text)
    proc = subprocess.run(
        [sys.executable, "-m", "proxy", *argv], cwd=ROOT, env=env, capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 0, f"{example}: exit {proc.returncode}\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}"
    if "--print-config" in argv:
        assert isinstance(yaml.safe_load(proc.stdout), dict)
