"""Write the results: ``bench/results/<date>.json``, a markdown section, and the per-turn plot."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

__all__ = ["markdown", "plot_turns", "update_docs", "write_json"]

JSON = Any
BEGIN, END = "<!-- bench:results:begin -->", "<!-- bench:results:end -->"


def write_json(report: JSON, path: Path) -> None:
    """Pretty JSON (NaN becomes null)."""
    path.parent.mkdir(parents=True, exist_ok=True)

    def clean(value: JSON) -> JSON:
        if isinstance(value, float) and math.isnan(value):
            return None
        if isinstance(value, dict):
            return {k: clean(v) for k, v in value.items()}
        if isinstance(value, list):
            return [clean(v) for v in value]
        return value

    path.write_text(json.dumps(clean(report), indent=1) + "\n", encoding="utf-8")


def _f(value: JSON, digits: int = 2, unit: str = "") -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "–"
    if isinstance(value, float):
        return f"{value:,.{digits}f}{unit}"
    if isinstance(value, int):
        return f"{value:,}{unit}"
    return f"{value}{unit}"


def _kb(n: JSON) -> str:
    return "–" if not n else f"{n / 1000:,.1f} KB"


def _floor_table(report: JSON) -> list[str]:
    """The sidecar beside the floor relays (bench.floor) of the same run, plain and (``--tls``)
    with the emulator behind TLS: CPU per turn and added p50, and their ratios."""
    runs = [(kind, report.get(key) or []) for kind, key in (("plain", "overhead"), ("TLS", "overhead_tls"))]
    if not any(o.get("floor") or o.get("floor_aiohttp") for _, found in runs for o in found):
        return []
    lines = [
        "",
        "Sidecar beside the floor relays of the same run (bench.floor: bare asyncio, and aiohttp serving the app "
        "side), each speaking to the upstream as the sidecar does:",
        "",
        "| Upstream | History | Sidecar CPU ms/turn | Bare floor CPU | aiohttp floor CPU | Sidecar / aiohttp floor "
        "| Sidecar / bare floor | Added p50 sidecar / aiohttp floor ms |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for kind, found in runs:
        for o in found:
            bare, web = o.get("floor") or {}, o.get("floor_aiohttp") or {}
            lines.append(
                f"| {kind} | {o['label']} | {_f(o['sidecar_cpu_ms_per_request'], 3)} | "
                f"{_f(bare.get('cpu_ms_per_request'), 3)} | {_f(web.get('cpu_ms_per_request'), 3)} | "
                f"{_f(web.get('cpu_ratio_sidecar_over_floor'))} | {_f(bare.get('cpu_ratio_sidecar_over_floor'))} | "
                f"{_f(o['added_ms'].get('p50'))} / {_f((web.get('added_ms') or {}).get('p50'))} |"
            )
    return lines


def markdown(report: JSON) -> str:
    """The measured figures as markdown tables."""
    meta = report["meta"]
    lines = [
        f"Run of {meta['date']} (`{meta['command']}`), {meta['cpus']} CPUs ({meta['cpu_model']}), Python "
        f"{meta['python']} ({meta.get('build', 'pure')} build), commit `{meta['commit']}`. "
        f"Latency model: `{meta['latency']}`. Workload: "
        f"{meta['workload']}. Raw JSON: `{meta['json']}`.",
        "",
        "### Targets",
        "",
        "| Target | Measured | Met |",
        "|---|---|---|",
    ]
    for t in report.get("targets", []):
        met = {True: "met", False: "**not met**", None: "not measured"}[t["met"]]
        lines.append(f"| {t['target']} | {_f(t['measured'], 3)} | {met} |")
    load = report.get("load") or {}
    if load:
        parts = [f"{k} {v['machine_busy_pct']} % busy ({v.get('foreign_pct')} % not ours, steal "
                 f"{v.get('steal_pct')} %, loadavg {v.get('loadavg')})" for k, v in load.items()
                 if v.get("machine_busy_pct") is not None]  # fmt: skip
        lines += ["", "Machine CPU during each phase (mean, both cores): " + "; ".join(parts) + "."]
    lines += ["", "### Rollouts: A (HTTP, full history) vs B (through upshift) vs C (native WebSocket mode)", ""]
    lines += [
        "| Conv. | Client | Turns | A rollout s | B rollout s | C rollout s | B/A | B/C | Gain capture "
        "| Upstream A/B |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for c in report.get("comparisons", []):
        rs = c.get("rollout_s", {})
        lines.append(
            f"| {c['concurrency']} | {c['client']} | {c.get('turns', '–')} | {_f(rs.get('A'))} | {_f(rs.get('B'))} | "
            f"{_f(rs.get('C'))} | {_f(c.get('B_over_A'), 3)} | {_f(c.get('B_over_C'), 3)} | "
            f"{_f(c.get('gain_capture'), 3)} | {_f(c.get('upstream_bytes_A_over_B'), 1, '×')} |"
        )
    lines += ["", "What B adds per turn over C (paired by conversation and turn, ms), and what the sidecar spends:", ""]
    lines += [
        "| Conv. | Client | All turns p50 / p99 | First turn p50 / p99 | Continuations p50 / p99 | TTFB p50 | "
        "`x-upshift-overhead-ms` p50 / p99 | Sidecar CPU ms/turn | B turns/s | Continuation ratio | "
        "Machine busy during B (not ours) |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for c in report.get("comparisons", []):
        b = c.get("B", {})
        al, fi, co = (
            c.get("added_vs_C_ms", {}),
            c.get("added_first_turn_vs_C_ms", {}),
            c.get("added_continuations_vs_C_ms", {}),
        )
        hd = b.get("overhead_header_ms", {})
        lines.append(
            f"| {c['concurrency']} | {c['client']} | {_f(al.get('p50'))} / {_f(al.get('p99'))} | "
            f"{_f(fi.get('p50'))} / {_f(fi.get('p99'))} | {_f(co.get('p50'))} / {_f(co.get('p99'))} | "
            f"{_f(c.get('added_ttfb_vs_C_ms', {}).get('p50'))} | {_f(hd.get('p50'))} / {_f(hd.get('p99'))} | "
            f"{_f(b.get('sidecar_cpu_ms_per_turn'))} | {_f(b.get('throughput_turns_per_s'), 1)} | "
            f"{_f(b.get('continuation_ratio'), 3)} | {_f((b.get('cpu') or {}).get('machine_busy_pct'), 0, ' %')} "
            f"({_f((b.get('cpu') or {}).get('foreign_pct'), 0, ' %')}) |"
        )
    lines += ["", "Upstream bytes (what the emulator received), per setup:", ""]
    lines += ["| Conv. | Client | A total | B total | C total | A per turn | B per turn | C per turn |",
              "|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for c in report.get("comparisons", []):
        a, b, cc = c.get("A", {}), c.get("B", {}), c.get("C", {})
        lines.append(
            f"| {c['concurrency']} | {c['client']} | {_kb(a.get('upstream_bytes_total'))} | "
            f"{_kb(b.get('upstream_bytes_total'))} | {_kb(cc.get('upstream_bytes_total'))} | "
            f"{_kb(a.get('upstream_bytes_per_turn'))} | {_kb(b.get('upstream_bytes_per_turn'))} | "
            f"{_kb(cc.get('upstream_bytes_per_turn'))} |"
        )
    lines += ["", "### Proxy-added latency by history size (reasoning-agent stream, zero-latency emulator, "
              "continuation turns)", ""]  # fmt: skip
    lines += [
        "| History | Body (median) | Turns | Events/turn | Added vs native WS p50 / p99 ms | TTFB added p50 / p99 ms "
        "| First token added p50 ms | vs same body direct HTTP p50 / p99 ms | `x-upshift-overhead-ms` p50 / p99 | "
        "Sidecar CPU ms/turn | Emulator CPU ms per native turn | CPU ratio | First turn (full) added p50 ms |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for o in report.get("overhead", []):
        a, t, h, hd = o["added_ms"], o["added_ttfb_ms"], o["vs_direct_http_ms"], o["header_overhead_ms"]
        lines.append(
            f"| {o['label']} | {_kb(o['body_bytes'].get('p50'))} | {o['turns']} | "
            f"{_f((o.get('events_per_turn') or {}).get('p50'), 0)} | {_f(a.get('p50'))} / {_f(a.get('p99'))} | "
            f"{_f(t.get('p50'))} / {_f(t.get('p99'))} | {_f((o.get('added_first_output_ms') or {}).get('p50'))} | "
            f"{_f(h.get('p50'))} / {_f(h.get('p99'))} | "
            f"{_f(hd.get('p50'))} / {_f(hd.get('p99'))} | {_f(o['sidecar_cpu_ms_per_request'], 3)} | "
            f"{_f(o.get('emulator_cpu_ms_per_ws_turn'), 3)} | {_f(o.get('cpu_ratio_sidecar_over_emulator_ws'))} | "
            f"{_f(o['first_turn_added_ms'].get('p50'))} |"
        )
    lines += _floor_table(report)
    slopes = report.get("overhead_slopes") or {}
    if slopes:
        parts = [f"{name.replace('_', ' ')}: {v['at_zero']:g} + {v['per_mb']:g} per MB" for name, v in slopes.items()]
        lines += ["", "Per-MB slope (least squares over the sizes): " + "; ".join(parts) + "."]
    cap = report.get("capacity")
    if cap:
        lines += ["", f"### Capacity (sidecar pinned to one core: {cap.get('pinned')})", ""]
        lines += ["| 1 KB saturation: clients | Turns/s | Sidecar CPU % of its core | Turns per sidecar CPU-second | "
                  "Sidecar CPU ms/turn | Errors | aiohttp floor: turns per CPU-second (CPU ms/turn) | "
                  "Sidecar ÷ floor |", "|---|---|---|---|---|---|---|---|"]  # fmt: skip
        for r in cap.get("saturation", []):
            floor = r.get("floor_aiohttp") or {}
            beside = f"{_f(floor['turns_per_cpu_s'], 0)} ({_f(floor['cpu_ms_per_turn'], 3)})" if floor else "–"
            lines.append(
                f"| {r['concurrency']} | {_f(r['turns_per_s'], 0)} | {_f(r['sidecar_cpu_pct_of_one_core'], 0)} | "
                f"{_f(r['turns_per_sidecar_cpu_s'], 0)} | {_f(r['sidecar_cpu_ms_per_turn'], 3)} | {r['errors']} | "
                f"{beside} | {_f(r.get('capacity_ratio_sidecar_over_floor'), 2)} |"
            )
        lines += ["", "| Conversations (twins) | Added p50 / p99 ms | "
                  "Sidecar's own time per continuation p50 / p99 ms | First event added p50 / p99 ms | "
                  "Sidecar first event / first token / total p50 ms | Native first event / first token / total p50 ms "
                  "| Turns/s | Sidecar CPU % (ms per paced turn) | Errors |",
                  "|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
        for r in cap.get("many", []):
            a, fe, sd, nt = r["added_ms"], r["added_first_event_ms"], r["sidecar"], r["native"]
            own = r.get("sidecar_own_added_ms", {})
            lines.append(
                f"| {r['conversations']} ({r['twins']}) | {_f(a.get('p50'))} / {_f(a.get('p99'))} | "
                f"{_f(own.get('p50'))} / {_f(own.get('p99'))} | {_f(fe.get('p50'))} / {_f(fe.get('p99'))} | "
                f"{_f(sd['first_event_ms'].get('p50'), 1)} / {_f(sd['first_output_ms'].get('p50'), 1)} / "
                f"{_f(sd['total_ms'].get('p50'), 1)} | {_f(nt['first_event_ms'].get('p50'), 1)} / "
                f"{_f(nt['first_output_ms'].get('p50'), 1)} / {_f(nt['total_ms'].get('p50'), 1)} | "
                f"{_f(r['sidecar_turns_per_s'], 0)} | {_f(r['sidecar_cpu_pct_of_one_core'], 0)} "
                f"({_f(r.get('sidecar_cpu_ms_per_turn'), 2)}) | {r['errors']} |"
            )
    net = report.get("network")
    if net and "note" not in net:
        lines += ["", f"### Network distance ({net['rtt_ms']:g} ms RTT, {net['connect_ms']:g} ms connection setup, "
                  f"median of {net['conversations']} new conversations)", ""]  # fmt: skip
        med = net["median_per_turn_ms"]
        lines += ["| Turn | Through upshift ms | Direct HTTP (kept alive) ms |", "|---|---|---|"]
        for i, (u, d) in enumerate(zip(med["upshift"], med["direct"], strict=False)):
            lines.append(f"| {i + 1}{' (new conversation)' if i == 0 else ''} | {_f(u, 1)} | {_f(d, 1)} |")
    elif net:
        lines += ["", f"Network phase: {net['note']}."]
    mem = report.get("memory")
    if mem:
        lines += ["", "### Memory per idle conversation", ""]
        lines += [
            "| Conversations | RSS per conversation (with its socket) | Bare websockets socket | "
            "Residual per head in process | Bare HeadTable per head (traced) | Upstream sockets per conversation |",
            "|---|---|---|---|---|---|",
        ]
        lines.append(
            f"| {mem['conversations']:,} | {_f(mem['rss_bytes_per_conversation'])} B | "
            f"{_f(mem['socket_bytes_bare'])} B | "
            f"{_f(mem['head_bytes_in_process'])} B | {_f(mem['head_only_bytes_structural'])} B "
            f"({_f(mem['head_only_bytes_traced'])} B) | {_f(mem['sockets_per_conversation'])} |"
        )
    stall = report.get("stall")
    if stall:
        lines += ["", f"### Event-loop stall ({stall['streams']} streams through the sidecar + {stall['streams']} "
                  f"direct, one {stall['big_bytes'] / 1e6:g} MB request; nominal interval "
                  f"{stall['nominal_interval_ms']} ms; medians of {stall.get('repeats', 1)} rounds)", ""]  # fmt: skip
        lines += ["| Round | Large request ms (mode) | Sidecar loop stall ms (worst round) | "
                  "Max gap, sidecar streams ms | Max gap, direct streams ms | Stream stall (gap − interval) ms | "
                  "Excess over direct ms |", "|---|---|---|---|---|---|---|"]  # fmt: skip
        for name, r in stall["rounds"].items():
            big = f"{_f(r['big_request_ms'])} ({r['big_request_mode']})" if r["big_request_ms"] else "–"
            lines.append(
                f"| {name} | {big} | {_f(r['loop_stall_ms'])} ({_f(r.get('loop_stall_max_ms'))}) | "
                f"{_f(r['max_gap_sidecar_ms'])} | {_f(r['max_gap_direct_ms'])} | "
                f"{_f(r['stall_sidecar_ms'])} | {_f(r['stall_excess_over_direct_ms'])} |"
            )
    prof = report.get("profile")
    if prof and prof.get("self"):
        what = f"py-spy, {prof['samples']} samples" if "samples" in prof else f"pyinstrument, {prof['seconds']} s"
        lines += ["", f"### Sidecar hot path ({what} during continuation turns)", ""]
        lines += ["| Function (self time) | Share |", "|---|---|"]
        lines += [f"| `{row['frame']}` | {row['share'] * 100:.1f} % |" for row in prof["self"][:12]]
    return "\n".join(lines) + "\n"


def update_docs(doc: Path, section: str) -> None:
    """Replace the text between the result markers of ``doc`` (appended if the markers are missing)."""
    text = doc.read_text(encoding="utf-8") if doc.exists() else "# Benchmarks\n"
    block = f"{BEGIN}\n{section}{END}"
    if BEGIN in text and END in text:
        head, rest = text.split(BEGIN, 1)
        text = head + block + rest.split(END, 1)[1]
    else:
        text = text.rstrip() + "\n\n## Results\n\n" + block + "\n"
    doc.write_text(text, encoding="utf-8")


def plot_turns(report: JSON, path: Path) -> bool:
    """Time per turn against turn index for A, B, C (one panel per client at the lowest concurrency)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    panels = [c for c in report.get("comparisons", []) if c["concurrency"] == min(
        (x["concurrency"] for x in report.get("comparisons", [])), default=1)]  # fmt: skip
    if not panels:
        return False
    fig, axes = plt.subplots(1, len(panels), figsize=(6.5 * len(panels), 4.2), squeeze=False)
    styles = {"A": ("A: app → emulator, HTTP full history", "tab:red"),
              "B": ("B: app → upshift → WebSocket", "tab:blue"),
              "C": ("C: native WebSocket mode", "tab:green")}  # fmt: skip
    for ax, comp in zip(axes[0], panels, strict=True):
        for setup, (label, color) in styles.items():
            series = (comp.get(setup) or {}).get("per_turn_ms")
            if series:
                ax.plot(range(1, len(series) + 1), [v / 1000 for v in series], label=label, color=color, lw=1.6)
        ax.set_title(f"{comp['concurrency']} conversation(s), {comp['client']} client")
        ax.set_xlabel("turn (model response) index")
        ax.set_ylabel("time per turn, s")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(f"Time per turn ({report['meta']['latency']})", fontsize=9)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True
