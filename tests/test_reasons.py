"""The reason tables of docs/operations.md and the label lists of docs/reference/metrics.md equal the
enums, exactly (no regex over code)."""

from __future__ import annotations

import re

from proxy.core.channel import HoldPath
from proxy.reasons import (
    ErrorCode,
    ForwardOutcome,
    MemoryRefusal,
    MissReason,
    Mode,
    PassthroughReason,
    ReplayCause,
    RequestOutcome,
    Route,
)
from tests.sidecar import ROOT

OPERATIONS = (ROOT / "docs" / "operations.md").read_text()
METRICS = (ROOT / "docs" / "reference" / "metrics.md").read_text()


def _table_after(heading: str) -> set[str]:
    """The first-column values of the Markdown table that follows ``heading``."""
    at = OPERATIONS.index(heading)
    rows: list[str] = []
    for line in OPERATIONS[at:].splitlines()[1:]:
        if line.startswith("|"):
            rows.append(line)
        elif rows:
            break
    return {m.group(1) for row in rows[2:] if (m := re.match(r"\| `([a-z_]+)` \|", row))}


def _label_list(metric: str, label: str) -> set[str]:
    row = next(line for line in METRICS.splitlines() if line.startswith(f"| `{metric}` |"))
    found = re.search(rf"`{label}` \(([^)]*)\)", row)
    assert found is not None, row
    return set(re.findall(r"`([a-z_]+)`", found.group(1)))


def test_miss_reasons_table() -> None:
    assert _table_after("Full-history sends over WebSocket") == set(MissReason)


def test_passthrough_reasons_table() -> None:
    assert _table_after("Plain HTTP passthrough") == set(PassthroughReason)


def test_replay_causes_listed() -> None:
    assert _label_list("upshift_replays_total", "cause") == set(ReplayCause)


def test_error_codes_listed() -> None:
    assert _label_list("upshift_errors_total", "code") == set(ErrorCode)


def test_every_error_class_code_is_an_error_code() -> None:
    import proxy.errors as errors

    codes = {
        cls.code
        for cls in vars(errors).values()
        if isinstance(cls, type) and issubclass(cls, errors.ProxyError) and cls is not errors.ConfigError
    }
    assert codes <= set(ErrorCode)


def test_request_labels_listed() -> None:
    assert _label_list("upshift_requests_total", "route") == set(Route)
    assert _label_list("upshift_requests_total", "mode") == set(Mode)
    assert _label_list("upshift_requests_total", "outcome") == set(RequestOutcome)


def test_forward_and_hold_labels_listed() -> None:
    assert _label_list("upshift_forwards_total", "outcome") == set(ForwardOutcome)
    assert _label_list("upshift_held_lifecycle_total", "path") == set(HoldPath)


def test_memory_refusals_listed() -> None:
    assert _label_list("upshift_memory_refusals_total", "reason") == set(MemoryRefusal)
