"""Turn raw rollout results into report figures: per-setup summaries, A/B/C comparisons, targets."""

from __future__ import annotations

import math
import statistics
from typing import Any

from .rollout import SetupResult
from .stats import summary

__all__ = ["compare", "summarize_setup", "targets"]

JSON = Any


def _median(values: list[float]) -> float:
    return statistics.median(values) if values else math.nan


def summarize_setup(res: SetupResult, upstream: JSON, sidecar_cpu_s: float | None) -> dict[str, JSON]:
    """One setup at one concurrency: rollout times, per-turn medians, bytes, sidecar figures."""
    convs = [c for c in res.conversations if c.error is None and c.turns]
    errors = [c.error for c in res.conversations if c.error is not None]
    turns = [t for c in convs for t in c.turns]
    n_turns = max((len(c.turns) for c in convs), default=0)
    per_turn = [_median([c.turns[k].total * 1000 for c in convs if len(c.turns) > k]) for k in range(n_turns)]
    per_turn_ttfb = [_median([c.turns[k].ttfb * 1000 for c in convs if len(c.turns) > k]) for k in range(n_turns)]
    up_bytes = int(upstream.get("bytes", 0))
    out: dict[str, JSON] = {
        "setup": res.setup,
        "concurrency": res.concurrency,
        "client": res.client,
        "conversations_ok": len(convs),
        "errors": errors[:5],
        "error_count": len(errors),
        "turns_per_rollout": n_turns,
        "rollout_s": summary([c.wall for c in convs]),
        "client_s_per_rollout": summary([sum(t.client_s for t in c.turns) for c in convs]),
        "wall_s": round(res.wall, 3),
        "turn_ms": summary([t.total * 1000 for t in turns]),
        "ttfb_ms": summary([t.ttfb * 1000 for t in turns]),
        "per_turn_ms": [round(v, 2) for v in per_turn],
        "per_turn_ttfb_ms": [round(v, 2) for v in per_turn_ttfb],
        "client_bytes_total": sum(t.request_bytes for t in turns),
        "upstream_bytes_total": up_bytes,
        "upstream_bytes_per_turn": round(up_bytes / len(turns)) if turns else 0,
        "upstream_per_turn_index": upstream.get("per_turn"),
        "emulator": {k: upstream.get(k) for k in ("cache_hits", "continuations", "requests", "misses")},
        "throughput_turns_per_s": round(len(turns) / res.wall, 2) if res.wall else 0.0,
    }
    if res.setup == "B":
        modes: dict[str, int] = {}
        for t in turns:
            modes[t.mode or "?"] = modes.get(t.mode or "?", 0) + 1
        out["modes"] = modes
        out["continuation_ratio"] = round(modes.get("continuation", 0) / len(turns), 4) if turns else 0.0
        out["overhead_header_ms"] = summary([t.overhead_ms for t in turns if t.overhead_ms is not None])
        if sidecar_cpu_s is not None and turns:
            out["sidecar_cpu_ms_per_turn"] = round(sidecar_cpu_s * 1000 / len(turns), 3)
            out["sidecar_cpu_s"] = round(sidecar_cpu_s, 3)
    return out


def _paired(b: SetupResult, c: SetupResult, attr: str, turns: slice = slice(None)) -> list[float]:
    """Per (conversation, turn) differences B − C in ms, for turns both setups completed."""
    by_index = {conv.index: conv for conv in c.conversations if conv.error is None}
    out = []
    for conv in b.conversations:
        other = by_index.get(conv.index)
        if conv.error is not None or other is None:
            continue
        for tb, tc in list(zip(conv.turns, other.turns, strict=False))[turns]:
            out.append((getattr(tb, attr) - getattr(tc, attr)) * 1000)
    return out


def compare(results: dict[str, SetupResult], sums: dict[str, dict[str, JSON]]) -> dict[str, JSON]:
    """Ratios B/A and B/C, gain capture, upstream bytes A vs B, and B's added latency vs C."""
    out: dict[str, JSON] = {}
    med = {s: sums[s]["rollout_s"].get("p50", math.nan) for s in sums}
    a, b, c = med.get("A", math.nan), med.get("B", math.nan), med.get("C", math.nan)
    out["rollout_s"] = {s: med[s] for s in med}
    if not math.isnan(a) and not math.isnan(b):
        out["B_over_A"] = round(b / a, 4)
    if not math.isnan(b) and not math.isnan(c):
        out["B_over_C"] = round(b / c, 4)
    if not any(math.isnan(x) for x in (a, b, c)) and a != c:
        out["gain_capture"] = round((a - b) / (a - c), 4)
        out["ideal_gain"] = round((a - c) / a, 4)
        # The client's own time (the SDK serialising the full history every turn in B; a native
        # client serialises only new items): no sidecar can remove it. What is left of B − C
        # is the sidecar's share of the gain not delivered.
        cb = sums.get("B", {}).get("client_s_per_rollout", {}).get("p50")
        cc = sums.get("C", {}).get("client_s_per_rollout", {}).get("p50")
        if cb is not None and cc is not None:
            out["client_extra_s_per_rollout"] = round(cb - cc, 4)
            out["gain_lost_to_client"] = round((cb - cc) / (a - c), 4)
            out["gain_lost_to_rest"] = round((b - c - (cb - cc)) / (a - c), 4)
    if "A" in sums and "B" in sums and sums["B"]["upstream_bytes_total"]:
        out["upstream_bytes_A_over_B"] = round(sums["A"]["upstream_bytes_total"] / sums["B"]["upstream_bytes_total"], 2)
    if "B" in results and "C" in results:
        total, ttfb = _paired(results["B"], results["C"], "total"), _paired(results["B"], results["C"], "ttfb")
        out["added_vs_C_ms"] = summary(total)
        out["added_ttfb_vs_C_ms"] = summary(ttfb)
        out["added_first_turn_vs_C_ms"] = summary(_paired(results["B"], results["C"], "total", slice(0, 1)))
        out["added_continuations_vs_C_ms"] = summary(_paired(results["B"], results["C"], "total", slice(1, None)))
    return out


def _target(name: str, measured: float | None, limit: float, higher_is_better: bool = False, unit: str = "") -> JSON:
    ok = None
    if measured is not None and not math.isnan(measured):
        ok = measured >= limit if higher_is_better else measured <= limit
    sign = "≥" if higher_is_better else "≤"
    return {"target": f"{name} {sign} {limit:g}{unit}", "measured": measured, "met": ok}


def targets(report: JSON) -> list[JSON]:
    """Each target of the issue with the value measured in this run."""
    out = []
    by_label = {o["label"]: o for o in report.get("overhead", [])}
    for label, limit in (("1k", 0.7), ("200k", 1.0), ("1m", 2.0)):
        o = by_label.get(label)
        p50 = o["added_ms"].get("p50") if o else None
        out.append(_target(f"added latency p50 at {label}", p50, limit, unit=" ms"))
        if o and p50:
            out.append(_target(f"added latency p99 − 2·p50 at {label}", round(o["added_ms"]["p99"] - 2 * p50, 3), 0.5,
                               unit=" ms"))  # fmt: skip
    # Ratios to the aiohttp floor relay measured in the same run, interleaved with it.
    for label, limit in (("1k", 1.4), ("200k", 1.15), ("1m", 1.0)):
        floor = (by_label.get(label) or {}).get("floor_aiohttp") or {}
        if floor:
            out.append(_target(f"sidecar CPU / aiohttp floor CPU per turn at {label}",
                               floor.get("cpu_ratio_sidecar_over_floor"), limit))  # fmt: skip
            mine, theirs = by_label[label]["added_ms"].get("p50"), floor["added_ms"].get("p50")
            over = round(mine - theirs, 3) if mine is not None and theirs is not None else None
            out.append(_target(f"added latency p50 at {label}: sidecar − aiohttp floor", over, 0.2, unit=" ms"))
    one_k = by_label.get("1k") or {}
    cpu = one_k.get("sidecar_cpu_ms_per_request")
    out.append(_target("sidecar CPU per turn at 1k", cpu, 0.5, unit=" ms"))
    ratio = one_k.get("cpu_ratio_sidecar_over_emulator_ws")
    out.append(_target("sidecar CPU / emulator CPU per native turn at 1k", ratio, 0.6))
    for name, what in (("floor", "bare relay"), ("floor_aiohttp", "bare relay on aiohttp")):
        floor = one_k.get(name) or {}
        if floor:
            # What the two CPU targets above ask, put to a bare relay (bench.floor) in the same run.
            out.append(_target(f"{what} (bench.floor) CPU per turn at 1k", floor.get("cpu_ms_per_request"), 0.5,
                               unit=" ms"))  # fmt: skip
            out.append(_target(f"{what} CPU / emulator CPU per native turn at 1k",
                               floor.get("cpu_ratio_floor_over_emulator_ws"), 0.6))  # fmt: skip
    cap = report.get("capacity") or {}
    best = max((r.get("turns_per_sidecar_cpu_s") or 0 for r in cap.get("saturation", [])), default=None)
    out.append(_target("turns per second on one core at 1k (per sidecar CPU-second)", best, 1500, True))
    floors = [r["floor_aiohttp"]["turns_per_cpu_s"] for r in cap.get("saturation", []) if r.get("floor_aiohttp")]
    if floors:
        # The same target put to the aiohttp floor relay on the same core in the same run.
        out.append(_target("aiohttp floor relay's turns per CPU-second at 1k (same clients, same core)",
                           max(floors), 1500, True))  # fmt: skip
    for r in cap.get("many", []):
        out.append(_target(f"p99 added latency, {r['conversations']} conversations (fast, tool time)",
                           r["added_ms"].get("p99"), 20.0, unit=" ms"))  # fmt: skip
        own = r.get("sidecar_own_added_ms", {}).get("p99")
        if own is not None:
            out.append(_target(f"p99 of the sidecar's own time per continuation, {r['conversations']} conversations",
                               own, 20.0, unit=" ms"))  # fmt: skip
    net = report.get("network") or {}
    if "median_per_turn_ms" in net:
        med = net["median_per_turn_ms"]
        out.append(_target(f"first turn at {net['rtt_ms']:g} ms RTT: upshift − direct HTTP (median)",
                           round(med["upshift"][0] - med["direct"][0], 2), 0.0, unit=" ms"))  # fmt: skip
    comps = report.get("comparisons", [])
    first = [c for c in comps if c["concurrency"] == min((x["concurrency"] for x in comps), default=0)]
    for comp in first:
        if comp["client"] == "sdk":
            name = (f"app on the openai SDK (gain capture {comp.get('gain_capture')}, of which the SDK's own "
                    f"serialising of the full history takes {comp.get('gain_lost_to_client')}): gain not delivered "
                    "beyond that")  # fmt: skip
            out.append(_target(name, comp.get("gain_lost_to_rest"), 0.01))
        else:
            out.append(_target("gain capture (A−B)/(A−C), lean client: the sidecar alone",
                               comp.get("gain_capture"), 0.99, True))  # fmt: skip
    if first:
        bytes_ratio = first[0].get("upstream_bytes_A_over_B")
        out.append(_target(f"upstream bytes A/B over a {first[0]['turns']}-call rollout", bytes_ratio, 20.0, True, "×"))
    big = max(comps, key=lambda c: c["concurrency"], default=None)
    if big is not None:
        out.append(_target(f"p99 added latency at {big['concurrency']} conversations",
                           big.get("added_vs_C_ms", {}).get("p99"), 20.0, unit=" ms"))  # fmt: skip
    mem = report.get("memory") or {}
    out.append(
        _target("bytes per idle head (sockets aside: bare HeadTable)", mem.get("head_only_bytes_structural"), 4096)
    )
    stall = (report.get("stall") or {}).get("rounds", {})
    worst = max((r["loop_stall_ms"] for k, r in stall.items() if not k.startswith("control")), default=None)
    size = (report.get("stall") or {}).get("big_bytes", 3e6) / 1e6
    out.append(_target(f"sidecar event-loop stall from one {size:g} MB request", worst, 5.0, unit=" ms"))
    return out
