"""No example, doc, demo, benchmark or test uses a model id its provider has announced for retirement.

upshift never depends on a model id, but what it shows users must work for them: a retired id in
the docs is an example that fails, and client libraries warn on (and suites that treat warnings
as errors fail with) a deprecated one. The list of announcements is a real client's own:
pydantic-ai's model profiles carry the provider's deprecation notices (``profile["deprecation"]``),
which is what makes it warn.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

# OpenAI model ids as they appear in code and prose: gpt-*, o-series, codex-mini.
_ID = re.compile(
    r"(?<![\w./-])(gpt-\d[\w.]*(?:-[a-z0-9][\w.]*)*|o[1-9](?:-(?:mini|pro|deep-research))?|codex-mini-latest)(?![\w/-])"
)
_SCANNED = ("README.md", "config.yaml", "docs", "proxy", "tests", "bench", "deploy")


def _ids_in_repo() -> dict[str, list[str]]:
    files = subprocess.run(
        ["git", "ls-files", "--", *_SCANNED], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout.split()
    found: dict[str, list[str]] = {}
    for name in files:
        path = ROOT / name
        if (
            path.suffix not in {".py", ".md", ".yaml", ".yml", ".json", ".toml", ".txt"}
            or path == Path(__file__).resolve()
        ):
            continue
        for lineno, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
            if "family prefixes, not model ids" in line:
                continue  # a rule over model families (the emulator's defaults), named as such
            for match in _ID.finditer(line):
                found.setdefault(match.group(1), []).append(f"{name}:{lineno}")
    return found


def test_the_scan_finds_the_ids_the_examples_use() -> None:
    found = _ids_in_repo()
    # The client examples (docs/providers.md), the README's doctor example and the emulator's
    # default model list are found: the scan works.
    assert "gpt-6.1-sol" in found
    assert any(place.startswith("docs/providers.md:") for place in found["gpt-6.1-sol"])
    assert any(place.startswith("README.md:") for place in found["gpt-6.1-terra"])


def test_no_model_id_announced_for_retirement() -> None:
    pytest.importorskip("pydantic_ai", reason="pydantic-ai is in the test extra: pip install -e '.[test]'")
    from pydantic_ai.models.openai import OpenAIResponsesModel
    from pydantic_ai.providers.openai import OpenAIProvider

    provider = OpenAIProvider(api_key="sk-test-not-used", base_url="http://127.0.0.1:9/v1")
    retiring = {}
    for model_id, places in sorted(_ids_in_repo().items()):
        deprecation = OpenAIResponsesModel(model_id, provider=provider).profile.get("deprecation")
        if deprecation is not None:
            retiring[model_id] = (str(deprecation.retirement_date), deprecation.replacement, places[:3])
    assert not retiring, f"model ids announced for retirement (date, replacement, where): {retiring}"


def test_a_retired_id_is_recognised() -> None:
    """Control: the check does see an announcement (gpt-5 retires on 2026-12-11)."""
    pytest.importorskip("pydantic_ai", reason="pydantic-ai is in the test extra: pip install -e '.[test]'")
    from pydantic_ai.models.openai import OpenAIResponsesModel
    from pydantic_ai.providers.openai import OpenAIProvider

    provider = OpenAIProvider(api_key="sk-test-not-used", base_url="http://127.0.0.1:9/v1")
    retired = "gpt" + "-5"  # spelled apart so that the scan above does not count this file's control
    assert OpenAIResponsesModel(retired, provider=provider).profile.get("deprecation") is not None
