"""Small statistics helpers (no numpy needed)."""

from __future__ import annotations

import math
from collections.abc import Sequence

__all__ = ["percentile", "summary"]


def percentile(values: Sequence[float], q: float) -> float:
    """Linear-interpolated percentile ``q`` (0–100) of ``values``; NaN when empty."""
    if not values:
        return math.nan
    data = sorted(values)
    if len(data) == 1:
        return float(data[0])
    pos = (len(data) - 1) * q / 100.0
    low = math.floor(pos)
    high = min(low + 1, len(data) - 1)
    return float(data[low] + (data[high] - data[low]) * (pos - low))


def summary(values: Sequence[float], digits: int = 3) -> dict[str, float]:
    """Count, mean, p50, p90, p99, max (empty dict when there are no values)."""
    if not values:
        return {}
    return {
        "n": len(values),
        "mean": round(sum(values) / len(values), digits),
        "p50": round(percentile(values, 50), digits),
        "p90": round(percentile(values, 90), digits),
        "p99": round(percentile(values, 99), digits),
        "max": round(max(values), digits),
    }
