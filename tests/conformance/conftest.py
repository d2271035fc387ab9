"""The conformance suite validates against OpenAI's OpenAPI file (../shared/reference/openapi/openapi.yaml
beside the checkout, or ``UPSHIFT_OPENAPI``) and the ``openai`` SDK's pydantic models. A clone without
the file runs the SDK layer alone: nothing is skipped, and the run's header says which layers ran."""

from __future__ import annotations

import pytest

from .schema import HAVE_OPENAPI, LAYERS, OPENAPI_PATH


def pytest_report_header(config: pytest.Config) -> str:
    if HAVE_OPENAPI:
        return f"conformance: OpenAPI ({OPENAPI_PATH}) and SDK models"
    return f"conformance: SDK models only (no OpenAPI file at {OPENAPI_PATH}; set UPSHIFT_OPENAPI to add it)"


@pytest.fixture
def layers() -> frozenset[str]:
    """The finding sources that run in this process."""
    return LAYERS


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    if any("conformance" in report.nodeid for report in terminalreporter.stats.get("passed", [])):
        terminalreporter.write_line(pytest_report_header(terminalreporter.config))
