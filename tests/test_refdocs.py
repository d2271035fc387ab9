"""The generated reference pages of docs/reference/ equal what the code renders now."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from proxy.config_load import env_name, setting_keys
from proxy.ingress.handoff import HandoffOutcome
from proxy.observe import metrics
from proxy.ops import refdocs
from proxy.reasons import ErrorCode
from tests.sidecar import ROOT


@pytest.mark.parametrize("page", sorted(refdocs.PAGES))
def test_page_is_current(page: str) -> None:
    text = (ROOT / page).read_text(encoding="utf-8")
    assert text == refdocs.PAGES[page](), f"{page} is stale: run python -m proxy.ops.refdocs --write"


def test_the_check_names_a_stale_page(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert refdocs.main(["--write", "--root", str(tmp_path)]) == 0
    assert refdocs.main(["--root", str(tmp_path)]) == 0
    metrics = tmp_path / "docs" / "reference" / "metrics.md"
    metrics.write_text(metrics.read_text().replace("upshift_requests_total", "upshift_requests"))
    assert refdocs.main(["--root", str(tmp_path)]) == 1
    assert "docs/reference/metrics.md is stale" in capsys.readouterr().err


def test_every_key_has_its_default_and_meaning() -> None:
    page = refdocs.configuration()
    for key in setting_keys():
        row = next(line for line in page.splitlines() if line.startswith(f"| `{key}` |"))
        cells = [cell.strip() for cell in row.split(" | ")]
        assert cells[2].startswith(f"`{env_name(key)}`"), row
        assert len(cells[3]) > 10, f"{key} has no docstring in proxy/config.py"


def test_every_error_code_says_when() -> None:
    page = refdocs.errors_page()
    for code in ErrorCode:
        row = next(line for line in page.splitlines() if line.startswith(f"| `{code}` |"))
        assert len(row.split(" | ")[4].strip(" |")) > 10, f"{code} has no meaning"


def test_documented_label_values_are_values_the_label_takes() -> None:
    """A label's values read from a metric's docstring are ones the sidecar may emit."""
    rows = [line for line in refdocs.metrics_page().splitlines() if line.startswith("| `upshift_")]
    assert len(rows) == len(metrics.__all__) - 2  # every metric but REGISTRY and LABEL_VALUES
    seen = 0
    for row in rows:
        for label, values in re.findall(r"`([a-z_]+)` \(([^)]*)\)", row.split(" | ")[2]):
            documented = set(re.findall(r"`([a-z_0-9]+)`", values))
            allowed = metrics.LABEL_VALUES[label] | HANDOFF_OUTCOMES
            assert documented <= allowed, (row.split(" | ")[0], label, documented - allowed)
            seen += 1
    assert seen > 30


HANDOFF_OUTCOMES = frozenset(str(outcome) for outcome in HandoffOutcome)
"""``upshift_handoffs_total{outcome}``, which the ingress layer adds to the label's values."""
