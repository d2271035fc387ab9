"""Docs and comments say what the product does and why, not when or in which step it was built.

Every text a newcomer reads (the package, the emulator, the benchmarks' code, the tests, the docs,
the README, ``config.yaml``, the deployment files and CI scripts) is searched for what reads as a
changelog: issue numbers, "used to", "before the fix", "as reproduced before", "this round".
``bench/results/`` is exempt: it is the history, kept as data.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCANNED = ("proxy", "upshift_emulator", "bench", "tests", "docs", "deploy", ".ci")
TOP_FILES = ("README.md", "config.yaml", "pyproject.toml")
SUFFIXES = {".py", ".md", ".yaml", ".yml", ".toml", ".sh", ".txt", ""}
EXEMPT = (ROOT / "bench" / "results", Path(__file__).resolve())

HISTORY = re.compile(
    "|".join(
        (
            r"\bissues? ?#?\d+\b",  # "issue 21", "issues 9, 23", "issue #4" (a URL's /issues/N is fine)
            r"\(#\d+\)",
            r"(?<!\bis )(?<!\bare )(?<!\bbe )(?<!\bwas )(?<!\bwere )(?<!\bbeen )\bused to\b",
            r"\bbefore the fix\b",
            r"\bas reproduced before\b",
            r"\bthis round\b",
        )
    ),
    re.IGNORECASE,
)
"""What reads as history: each alternative is a phrase that only a changelog needs."""


def _texts() -> list[Path]:
    found = [ROOT / name for name in TOP_FILES]
    for top in SCANNED:
        for path in sorted((ROOT / top).rglob("*")):
            if not path.is_file() or path.suffix not in SUFFIXES or "__pycache__" in path.parts:
                continue
            if any(path == exempt or exempt in path.parents for exempt in EXEMPT):
                continue
            found.append(path)
    return found


def history_in(text: str) -> list[tuple[int, str]]:
    """The lines of ``text`` that read as history: (line number, the phrase)."""
    return [
        (number, match.group()) for number, line in enumerate(text.splitlines(), 1) for match in HISTORY.finditer(line)
    ]


@pytest.mark.parametrize(
    ("line", "flagged"),
    [
        ("# issue 21: the queue used to be strict FIFO", True),
        ('"""Issue 22, tenant walls: ...', True),
        ("lanes at scale (issues 9, 23).", True),
        ("a gateway (#17) refuses it", True),
        ("it used to turn named lanes off", True),
        ("| Attack (as reproduced before the fix) | Now | Test |", True),
        ("missed by a hair twice this round", True),
        ("her third session is refused", False),
        ("the key is used to sign every forward", False),
        ("see https://github.com/mypyc/mypyc/issues/671", False),
        ("a lone surrogate is refused (400)", False),
    ],
)
def test_the_check_flags_history_and_only_history(line: str, flagged: bool) -> None:
    assert bool(history_in(line)) is flagged


def test_docs_and_comments_carry_no_history() -> None:
    texts = _texts()
    assert len(texts) > 300, f"only {len(texts)} files found: the scan is looking in the wrong place"
    found = [
        f"{path.relative_to(ROOT)}:{number}: {phrase!r}"
        for path in texts
        for number, phrase in history_in(path.read_text(encoding="utf-8", errors="replace"))
    ]
    assert not found, "say what and why, not when or in which step:\n" + "\n".join(found)
