"""Docs that are generated from code stay current."""

from __future__ import annotations

from proxy.core.lanes import state_diagram
from tests.sidecar import ROOT


def test_architecture_shows_the_current_state_machines() -> None:
    doc = (ROOT / "docs" / "architecture.md").read_text()
    start = doc.index("<!-- state-diagram -->\n") + len("<!-- state-diagram -->\n")
    end = doc.index("\n<!-- /state-diagram -->")
    assert doc[start:end] == state_diagram(), "regenerate the diagram from proxy.core.lanes.state_diagram()"
