"""The live status page of the admin listener (``GET /`` and ``GET /status``).

Everything on the page is read from :data:`proxy.observe.metrics.REGISTRY` (so the page and
``/metrics`` always agree) and from :data:`proxy.observe.misses.RECENT` (explained misses: indices,
types and field paths, never content). A :class:`Sampler` keeps a snapshot of the counters every
``interval`` seconds over the last ``window`` seconds for the chart. The HTML is rendered on the
server with inline CSS and SVG only: no external asset, no script, so it works air-gapped; a
``<meta http-equiv="refresh">`` reloads it. Read-only: no form, no action, no request content,
no keys, no ids (identities appear only as digest prefixes).
"""

from __future__ import annotations

import asyncio
import contextlib
import html
import math
import time
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from prometheus_client import CollectorRegistry

from proxy.observe.metrics import REGISTRY
from proxy.observe.misses import RECENT, Miss, MissRing

__all__ = ["Sampler", "Snapshot", "render_status", "snapshot"]

Labels = tuple[tuple[str, str], ...]


@dataclass(frozen=True, slots=True)
class Snapshot:
    """Every sample of a registry at one moment: ``(sample name, labels) -> value``."""

    at: float
    values: dict[tuple[str, Labels], float]

    def get(self, name: str, **labels: str) -> float:
        """Sum of the samples called ``name`` whose labels include ``labels``."""
        want = set(labels.items())
        return sum(v for (n, ls), v in self.values.items() if n == name and want <= set(ls))

    def by(self, name: str, label: str, **labels: str) -> dict[str, float]:
        """``name`` summed per value of ``label`` (only samples matching ``labels``)."""
        want = set(labels.items())
        out: dict[str, float] = {}
        for (n, ls), v in self.values.items():
            if n != name or not want <= set(ls):
                continue
            key = dict(ls).get(label)
            if key is not None:
                out[key] = out.get(key, 0.0) + v
        return out

    def has(self, name: str) -> bool:
        return any(n == name for n, _ in self.values)


def snapshot(registry: CollectorRegistry = REGISTRY) -> Snapshot:
    """Read every sample of ``registry`` now."""
    values: dict[tuple[str, Labels], float] = {}
    for family in registry.collect():
        for sample in family.samples:
            if sample.name.endswith("_created"):
                continue
            values[(sample.name, tuple(sorted(sample.labels.items())))] = float(sample.value)
    return Snapshot(time.time(), values)


class Sampler:
    """Snapshots of the registry every ``interval`` seconds over the last ``window`` seconds."""

    def __init__(self, interval: float = 5.0, window: float = 900.0, registry: CollectorRegistry = REGISTRY) -> None:
        self.interval = interval
        self.registry = registry
        self.samples: deque[Snapshot] = deque(maxlen=max(int(window / interval), 2) + 1)
        self._task: asyncio.Task[None] | None = None

    def sample(self) -> Snapshot:
        snap = snapshot(self.registry)
        self.samples.append(snap)
        return snap

    def start(self) -> None:
        if self._task is None:
            self.sample()
            self._task = asyncio.get_running_loop().create_task(self._run())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self.interval)
            self.sample()


# -- figures ------------------------------------------------------------------------------

_RESPONSES = {"route": "responses"}


def _quantile(snap: Snapshot, name: str, q: float) -> float | None:
    """``histogram_quantile`` over the cumulative buckets of ``name`` (linear within a bucket)."""
    buckets = sorted(
        ((float(dict(ls)["le"]), v) for (n, ls), v in snap.values.items() if n == f"{name}_bucket"),
        key=lambda b: b[0],
    )
    if not buckets or buckets[-1][1] <= 0:
        return None
    rank = q * buckets[-1][1]
    lower, below = 0.0, 0.0
    for upper, count in buckets:
        if count >= rank:
            if math.isinf(upper):
                return lower
            share = (rank - below) / (count - below) if count > below else 0.0
            return lower + (upper - lower) * share
        lower, below = upper, count
    return lower


def _num(value: float) -> str:
    if value >= 1e9:
        return f"{value / 1e9:.2f} G"
    if value >= 1e6:
        return f"{value / 1e6:.2f} M"
    if value >= 1e4:
        return f"{value / 1e3:.1f} k"
    return f"{value:.0f}"


def _ms(seconds: float | None) -> str:
    return "–" if seconds is None else f"{seconds * 1000:.2f} ms"


def _pct(part: float, whole: float) -> str:
    return "–" if whole <= 0 else f"{100 * part / whole:.1f} %"


_COLOURS = ["#2f7d32", "#c62828", "#ef6c00", "#6a1b9a", "#1565c0", "#00838f", "#8d6e63", "#ad1457", "#546e7a"]


def _series(samples: list[Snapshot]) -> dict[str, list[float]]:
    """Per interval: continuations and misses by reason (deltas of the counters)."""
    names: set[str] = set()
    for snap in samples:
        names.update(snap.by("upshift_continuation_misses_total", "reason"))
    series: dict[str, list[float]] = {"continuation": []}
    for name in sorted(names):
        series[name] = []
    for prev, cur in zip(samples, samples[1:], strict=False):
        delta = cur.get("upshift_requests_total", mode="continuation", **_RESPONSES)
        series["continuation"].append(
            max(delta - prev.get("upshift_requests_total", mode="continuation", **_RESPONSES), 0)
        )
        old, new = (
            prev.by("upshift_continuation_misses_total", "reason"),
            cur.by("upshift_continuation_misses_total", "reason"),
        )
        for name in names:
            series[name].append(max(new.get(name, 0.0) - old.get(name, 0.0), 0.0))
    return series


def _chart(samples: list[Snapshot], width: int = 900, height: int = 200) -> str:
    series = _series(samples)
    points = len(series["continuation"])
    if points < 1:
        return '<p class="muted">Collecting samples…</p>'
    top = max([1.0, *(v for values in series.values() for v in values)])
    pad_l, pad_b, pad_t = 40, 20, 10
    span_x = (width - pad_l - 10) / max(points - 1, 1)
    span_y = (height - pad_b - pad_t) / top
    parts = [
        f'<svg id="chart" role="img" aria-label="turns per interval" viewBox="0 0 {width} {height}" '
        f'style="width:100%;max-width:{width * 3 // 2}px;height:auto" xmlns="http://www.w3.org/2000/svg">',
        f'<line x1="{pad_l}" y1="{height - pad_b}" x2="{width - 10}" y2="{height - pad_b}" stroke="#999"/>',
        f'<line x1="{pad_l}" y1="{pad_t}" x2="{pad_l}" y2="{height - pad_b}" stroke="#999"/>',
        f'<text x="{pad_l - 4}" y="{pad_t + 8}" text-anchor="end" font-size="10">{_num(top)}</text>',
        f'<text x="{pad_l - 4}" y="{height - pad_b}" text-anchor="end" font-size="10">0</text>',
    ]
    parts.append(
        f'<text x="{pad_l}" y="{height - 4}" font-size="10">−{_span(samples[-1].at - samples[0].at)}</text>'
        f'<text x="{width - 10}" y="{height - 4}" text-anchor="end" font-size="10">now</text>'
    )
    legend = []
    for index, (name, values) in enumerate(series.items()):
        colour = _COLOURS[index % len(_COLOURS)]
        coords = " ".join(
            f"{pad_l + i * span_x:.1f},{height - pad_b - v * span_y:.1f}" for i, v in enumerate(values or [0.0])
        )
        if points == 1:
            y = height - pad_b - values[0] * span_y
            parts.append(f'<circle cx="{pad_l}" cy="{y:.1f}" r="3" fill="{colour}"/>')
        parts.append(f'<polyline fill="none" stroke="{colour}" stroke-width="2" points="{coords}"/>')
        legend.append(f'<span class="key" style="--c:{colour}">{html.escape(name)}</span>')
    parts.append("</svg>")
    return "".join(parts) + f'<div class="legend">{"".join(legend)}</div>'


def _table(rows: Iterable[tuple[str, str]], empty: str = "none") -> str:
    body = "".join(f"<tr><td>{html.escape(k)}</td><td class='n'>{html.escape(v)}</td></tr>" for k, v in rows)
    return f"<table>{body}</table>" if body else f'<p class="muted">{html.escape(empty)}</p>'


def _misses_table(misses: list[Miss]) -> str:
    if not misses:
        return '<p class="muted">No misses yet.</p>'
    head = "".join(
        f"<th>{h}</th>" for h in ("time (UTC)", "reason", "identity", "item", "type", "field", "detail", "candidate")
    )
    rows = []
    for miss in misses:
        d = miss.as_dict()
        when = datetime.fromtimestamp(miss.at, UTC).strftime("%H:%M:%S")
        cells = [when, d["reason"], d["identity"], d["miss_item"], d["miss_type"], d["miss_field"], d["miss_detail"]]
        cand = d["candidate_items"]
        cells.append(f"{cand} items" if cand is not None else None)
        rows.append("<tr>" + "".join(f"<td>{html.escape('–' if c is None else str(c))}</td>" for c in cells) + "</tr>")
    return f'<table id="misses"><tr>{head}</tr>{"".join(rows)}</table>'


_CSS = """
body{font:14px/1.4 system-ui,sans-serif;margin:0;background:#f6f7f9;color:#1d1f23}
header{background:#1d2b3a;color:#fff;padding:10px 20px;display:flex;justify-content:space-between}
header h1{font-size:18px;margin:0}main{padding:14px 20px}
.cards{display:grid;grid-template-columns:repeat(auto-fill,minmax(170px,1fr));gap:10px}
.card{background:#fff;border:1px solid #dde1e6;border-radius:6px;padding:10px}
.card .v{font-size:22px;font-weight:600}.card .l{color:#5b6470;font-size:12px}
section{background:#fff;border:1px solid #dde1e6;border-radius:6px;padding:10px;margin-top:12px}
section h2{font-size:15px;margin:0 0 8px}
.cols{display:grid;grid-template-columns:repeat(auto-fit,minmax(220px,1fr));gap:12px}
table{border-collapse:collapse;width:100%}td,th{padding:3px 6px;border-bottom:1px solid #eef0f3;text-align:left}
td.n{text-align:right;font-variant-numeric:tabular-nums}.muted{color:#7a828c}
.legend{margin-top:4px}.key{margin-right:12px;font-size:12px}
.key::before{content:"";display:inline-block;width:10px;height:10px;background:var(--c);margin-right:4px}
"""


def render_status(
    samples: list[Snapshot], now: Snapshot, misses: MissRing = RECENT, state: str = "", interval: float = 5.0
) -> str:
    """The status page for the counters ``now`` and the chart of ``samples`` (+ ``now``), taken
    every ``interval`` seconds."""
    turns = now.get("upshift_requests_total", **_RESPONSES)
    cont = now.get("upshift_requests_total", mode="continuation", **_RESPONSES)
    full = now.get("upshift_requests_total", mode="full", **_RESPONSES)
    http = now.get("upshift_requests_total", mode="passthrough", **_RESPONSES)
    received = now.get("upshift_request_bytes_total")
    sent = now.get("upshift_upstream_bytes_sent_total")
    saved = max(received - sent, 0.0)
    window = [*samples, now]
    recent = ""
    if len(window) >= 2:
        d_turns = turns - window[0].get("upshift_requests_total", **_RESPONSES)
        d_cont = cont - window[0].get("upshift_requests_total", mode="continuation", **_RESPONSES)
        recent = f"continuation rate {_pct(d_cont, d_turns)} over the last {_span(now.at - window[0].at)}"
    cards = [
        ("continuation-rate", _pct(cont, turns), "continuation rate (since start)"),
        ("continuations", _num(cont), "continuations"),
        ("full-sends", _num(full), "full-history sends"),
        ("passthrough", _num(http), "sent over plain HTTP"),
        ("items-avoided", _num(now.get("upshift_input_items_avoided_total")), "input items not re-sent"),
        ("bytes-avoided", _num(saved) + "B", f"upstream bytes saved ({_pct(saved, received)} of received)"),
        ("replays", _num(now.get("upshift_replays_total")), "replays"),
        ("errors", _num(now.get("upshift_errors_total")), "sidecar errors"),
        ("added-p50", _ms(_quantile(now, "upshift_added_latency_seconds", 0.5)), "added latency p50"),
        ("added-p99", _ms(_quantile(now, "upshift_added_latency_seconds", 0.99)), "added latency p99"),
        ("inflight", _num(now.get("upshift_inflight_requests")), "requests in flight"),
    ]
    card_html = "".join(
        f'<div class="card"><div class="v" id="{i}">{html.escape(v)}</div>'
        f'<div class="l">{html.escape(label)}</div></div>'
        for i, v, label in cards
    )
    sockets = _table(((k, _num(v)) for k, v in sorted(now.by("upshift_upstream_sockets", "state").items())))
    cap = now.get("upshift_upstream_socket_cap")
    if cap:  # what 429s on upgrades taught
        refused = now.get("upshift_upgrade_refusals_total", refusal="cap")
        sockets += "<h2>Learned socket cap</h2>" + _table(
            [("sockets per credential", _num(cap)), ("upgrades refused (cap)", _num(refused))]
        )
    lanes = ""
    if now.has("upshift_upstream_lanes"):
        rows = sorted(now.by("upshift_upstream_lanes", "state").items())
        lanes = "<h2>Upstream lanes</h2>" + _table((k, _num(v)) for k, v in rows)
    by_reason = now.by("upshift_continuation_misses_total", "reason")
    misses_rows = ((k, _num(v)) for k, v in sorted(by_reason.items(), key=lambda kv: -kv[1]) if v)
    replays = ((k, _num(v)) for k, v in sorted(now.by("upshift_replays_total", "cause").items()) if v)
    errors = ((k, _num(v)) for k, v in sorted(now.by("upshift_errors_total", "code").items()) if v)
    stamp = datetime.fromtimestamp(now.at, UTC).strftime("%Y-%m-%d %H:%M:%S UTC")
    state_html = f" · {html.escape(state)}" if state else ""
    return f"""<!doctype html>
<html lang="en"><head><meta charset="utf-8"><meta http-equiv="refresh" content="5">
<meta name="viewport" content="width=device-width, initial-scale=1">
<link rel="icon" href="data:,"><title>upshift status</title><style>{_CSS}</style></head>
<body><header><h1>upshift</h1><span>{stamp}{state_html}</span></header><main>
<div class="cards">{card_html}</div>
<section><h2>Turns per sample (every {interval:g} s): continuations and misses by reason</h2>
<p class="muted">{html.escape(recent)}</p>{_chart(window)}</section>
<div class="cols">
<section><h2>Misses by reason</h2>{_table(misses_rows, "no misses")}</section>
<section><h2>Upstream sockets</h2>{sockets}{lanes}</section>
<section><h2>Replays by cause</h2>{_table(replays, "no replays")}</section>
<section><h2>Errors by code</h2>{_table(errors, "no errors")}</section>
</div>
<section><h2>Last explained misses</h2>
<p class="muted">Where each full-history send departed from the best candidate head: item index, type and
field path, never content. Identities are digest prefixes.</p>{_misses_table(misses.latest(15))}</section>
</main></body></html>
"""


def _span(seconds: float) -> str:
    return f"{seconds:.0f} s" if seconds < 120 else f"{seconds / 60:.0f} min"


def misses_json(misses: MissRing = RECENT, limit: int | None = None) -> dict[str, Any]:
    """``GET /misses``: the last explained misses, newest first."""
    return {"size": misses.size, "misses": [m.as_dict() for m in misses.latest(limit)]}
