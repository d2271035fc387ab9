"""The doctor's verdicts: each check's status, what it saw and what to do, as lines or JSON."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

__all__ = ["Check", "Result", "Status", "render", "to_json"]


class Status(enum.StrEnum):
    """The outcome of one check."""

    PASS = "pass"
    WARN = "warn"
    """It works, not as well as it could: the line says what to change."""
    FAIL = "fail"
    """It does not work here."""
    SKIP = "skip"
    """Not tried: what it needs failed, or ``--max-requests`` was spent."""


class Check(enum.StrEnum):
    """The checks, in the order they print."""

    HTTP = "http"
    WEBSOCKET = "websocket"
    CONTINUATION = "continuation"
    LANES = "lanes"
    STORE_FALSE = "store_false"
    HYDRATION = "hydration"
    COMPACT = "compact"
    SERVICE_TIER = "service_tier"
    VIA = "via"


@dataclass(slots=True)
class Result:
    """One check's line: its status, what it saw, what to do, and its own fields."""

    status: Status
    detail: str
    hint: str = ""
    fields: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"status": str(self.status), "detail": self.detail}
        if self.hint:
            out["hint"] = self.hint
        out.update(self.fields)
        return out


def render(results: dict[Check, Result], requests_sent: int, limit: int, head: str) -> str:
    """The lines for people: ``head``, one line per check, then the requests spent."""
    lines = [head]
    for check, result in results.items():
        line = f"{result.status.upper():<5} {check:<13} {result.detail}"
        if result.hint:
            line += f" -> {result.hint}"
        lines.append(line)
    failed = sum(r.status is Status.FAIL for r in results.values())
    lines.append(f"{requests_sent} of {limit} requests sent; {failed} check(s) failed")
    return "\n".join(lines) + "\n"


def to_json(results: dict[Check, Result], requests_sent: int) -> dict[str, Any]:
    """One object: a key per check, plus ``requests_sent``."""
    doc: dict[str, Any] = {str(check): result.to_json() for check, result in results.items()}
    doc["requests_sent"] = requests_sent
    return doc
