"""Benchmark phases that combine the building blocks: rollouts (A/B/C per concurrency), profiling, run metadata."""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import importlib.metadata
import os
import platform
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from proxy.build import build_kind

from . import hotspots
from .overhead import run_overhead
from .procs import EmulatorProc, SidecarProc
from .rollout import SETUPS, Urls, run_setup
from .summary import compare, summarize_setup
from .workload import RolloutSpec

__all__ = ["LoadMonitor", "meta", "profile_pass", "pyinstrument_pass", "quiet_stderr", "rollouts_phase", "wait_quiet"]

JSON = Any
Log = Callable[[str], None]


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def _commit() -> str:
    root = Path(__file__).resolve().parent.parent
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True, text=True,
                              timeout=10).stdout.strip()  # fmt: skip
        dirty = subprocess.run(["git", "status", "--porcelain", "--", "proxy"], cwd=root, capture_output=True,
                               text=True, timeout=10).stdout.strip()  # fmt: skip
        return f"{head}{'+dirty' if dirty else ''}" or "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def meta(argv: list[str], latency: dict[str, float], spec: RolloutSpec, json_path: str) -> JSON:
    """Run metadata: when, where, what."""
    versions: dict[str, str | None] = {}
    for name in ("openai", "aiohttp", "websockets", "orjson"):
        try:
            versions[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            versions[name] = None
    lat = ", ".join(f"{k}={v:g}" for k, v in latency.items())
    return {
        "date": dt.datetime.now().strftime("%Y-%m-%d %H:%M"),
        "command": "python -m bench " + " ".join(argv),
        "cpus": os.cpu_count(),
        "cpu_model": _cpu_model(),
        "python": platform.python_version(),
        "build": str(build_kind()),
        "commit": _commit(),
        "versions": versions,
        "latency": lat,
        "latency_model": latency,
        "workload": f"{spec.turns} tool calls, tool outputs {spec.tool_kb[0]:g}–{spec.tool_kb[1]:g} KB, "
        f"initial context {spec.context_kb:g} KB, seed {spec.seed}",
        "json": json_path,
    }


async def _upstream(emu: EmulatorProc, per_turn_ids: list[str] | None) -> JSON:
    stats = await emu.stats()
    out: JSON = {
        "bytes": sum(stats["bytes_received"].values()),
        "cache_hits": stats["cache_hits"],
        "continuations": sum(stats["continuations"].values()),
        "requests": sum(stats["requests"].values()),
        "misses": sum(stats["misses"].values()),
    }
    if per_turn_ids:
        out["per_turn"] = [(await emu.record(rid)).get("input_bytes") for rid in per_turn_ids if rid]
    return out


async def rollouts_phase(
    emu: EmulatorProc,
    side: SidecarProc | None,
    base_spec: RolloutSpec,
    levels: list[int],
    *,
    latency: dict[str, float],
    clients_at_first: list[str],
    turns_large: int,
    tool_seconds: float,
    log: Log,
    monitor: LoadMonitor | None = None,
    quiet_s: float = 0.0,
) -> list[JSON]:
    """A, B, C at each concurrency (order rotated per level); one comparison per (level, client)."""
    urls = Urls(emu.base_url, side.base_url if side else None)
    setups = [s for s in SETUPS if s != "B" or side is not None]
    comparisons = []
    first_index = 10**6
    warm = RolloutSpec(2, base_spec.tool_kb, base_spec.context_kb, base_spec.seed)
    await emu.set_latency({})
    for client in dict.fromkeys([*clients_at_first, "raw"]):  # warm-up: imports, pools, first connections
        for setup in setups:
            await run_setup(setup, urls, warm, 1, client=client, first_index=first_index)
            first_index += 1
    await emu.set_latency(latency)
    first_index = 0
    for level_no, conc in enumerate(levels):
        turns = base_spec.turns if conc <= 100 else min(base_spec.turns, turns_large)
        spec = RolloutSpec(turns, base_spec.tool_kb, base_spec.context_kb, base_spec.seed)
        for client in clients_at_first if level_no == 0 else ["raw"]:
            order = setups[level_no % len(setups) :] + setups[: level_no % len(setups)]
            results, sums = {}, {}
            await wait_quiet(quiet_s, log)
            for setup in order:
                await emu.reset()
                if monitor is not None:
                    monitor.phase()
                cpu0 = side.cpu_seconds() if side is not None else 0.0
                res = await run_setup(setup, urls, spec, conc, client=client, tool_seconds=tool_seconds,
                                      first_index=first_index, start_spread=max(1.0, conc / 100))  # fmt: skip
                cpu = side.cpu_seconds() - cpu0 if side is not None and setup == "B" else None
                ids = [t.response_id for t in res.conversations[0].turns] if conc == levels[0] else None
                sums[setup] = summarize_setup(res, await _upstream(emu, ids), cpu)
                if monitor is not None:
                    sums[setup]["cpu"] = monitor.phase()
                results[setup] = res
                p50 = sums[setup]["rollout_s"].get("p50", float("nan"))
                log(
                    f"  {setup} x{conc} {client}: rollout p50 {p50:.2f} s, wall {res.wall:.1f} s, "
                    f"errors {sums[setup]['error_count']}"
                )
            comp = {"concurrency": conc, "client": client, "turns": turns, **compare(results, sums), **sums}
            comparisons.append(comp)
            nan = float("nan")
            log(
                f"  x{conc} {client}: B/A {comp.get('B_over_A', nan):.3f} capture {comp.get('gain_capture', nan):.3f} "
                f"bytes A/B {comp.get('upstream_bytes_A_over_B', 0):.1f}"
            )
            first_index += conc  # fresh conversations for every run: the sidecar never sees one twice
    return comparisons


async def profile_pass(
    emu: EmulatorProc,
    side: SidecarProc,
    out: Path,
    *,
    reps: int,
    seed: int,
    log: Log,
    native: bool = False,
    sizes: list[str] | None = None,
) -> JSON:
    """Re-run continuation turns (200 KB and 1 MB unless ``sizes``) under py-spy (kept apart from
    the timed runs); ``native``: with C frames (:func:`bench.hotspots.start`).

    Conversations of 31 turns, so the first (full) turn of each weighs 1/31 of the samples.
    """
    if not hotspots.available():
        log("  py-spy not installed: no profile (pip install py-spy)")
        return {"samples": 0, "self": [], "inclusive_proxy": [], "note": "py-spy not installed"}
    proc = hotspots.start(side.pid, out, native=native)
    await asyncio.sleep(1.0)
    try:
        await run_overhead(
            emu, side, sizes or ["200k", "1m"], reps=reps, seed=seed + 7, warmup=2, log=lambda _: None, per_chain=30
        )
    finally:
        err = hotspots.stop(proc)
    ranked = hotspots.rank(out)
    if not ranked["samples"]:
        ranked["note"] = f"py-spy recorded nothing: {err.strip()[-300:]}"
    ranked["raw_file"] = str(out)
    return ranked


async def pyinstrument_pass(
    emu: EmulatorProc,
    logs: Path,
    *,
    reps: int,
    seed: int,
    log: Log,
    sizes: list[str] | None = None,
    light: bool = False,
) -> JSON:
    """A second sidecar under pyinstrument (``bench`` extra), driven by continuation turns of the
    reasoning-agent workload at ``sizes`` (1 KB and 200 KB); returns the top self-time frames.

    Kept apart from the timed runs (the profiler slows the sidecar several times over).
    """
    import importlib.util
    import json

    if importlib.util.find_spec("pyinstrument") is None:
        return {"note": "pyinstrument not installed (pip install -e '.[bench]')"}
    out = logs / "sidecar.pyinstrument.json"
    wrap = ["-m", "pyinstrument", "-i", "0.0002", "-r", "json", "-p", "show_all", "-p",
            "processor_options.filter_threshold=0", "-o", str(out)]  # fmt: skip
    side = SidecarProc(logs, emu.base_url, wrap=wrap)
    side.start()
    await side.ready()
    try:
        await run_overhead(emu, side, sizes or ["1k", "200k"], reps=reps, seed=seed + 11, warmup=2,
                           log=lambda _: None, light=light)  # fmt: skip
    finally:
        side.stop(grace=30.0)
    if not out.exists():
        return {"note": f"pyinstrument wrote nothing; see {side.log_path}"}
    return _rank_pyinstrument(json.loads(out.read_text()), out, log)


def _rank_pyinstrument(data: JSON, out: Path, log: Log) -> JSON:
    """Self time per frame and inclusive time per ``proxy/`` function, without the idle loop and
    start-up (the event loop's own ``[self]`` time is mostly its wait for I/O)."""
    own: dict[str, float] = {}
    inclusive: dict[str, float] = {}

    def name(node: JSON) -> str:
        path = str(node.get("file_path_short") or node.get("file_path") or "")
        return f"{node.get('function')} ({path}:{node.get('line_no')})"

    def walk(node: JSON, stack: frozenset[str], startup: bool, parent: str = "") -> None:
        function = str(node.get("function"))
        startup = startup or function in ("_find_and_load", "import_module")  # imports at start-up
        children = node.get("children", [])
        where = f"{parent} [self]" if function.startswith("[self]") and parent else name(node)
        spent = float(node.get("time", 0.0))
        if not startup and "proxy/" in where and where not in stack:
            inclusive[where] = inclusive.get(where, 0.0) + spent
        self_time = spent - sum(float(c.get("time", 0.0)) for c in children)
        idle = "runners.py" in where and "[self]" in where or function in ("select", "poll")
        if not startup and not idle and self_time > 0:
            own[where] = own.get(where, 0.0) + self_time
        for child in children:
            walk(child, stack | {where}, startup, where)

    walk(data.get("root_frame") or {}, frozenset(), False)
    busy = sum(own.values())
    log(f"  pyinstrument: {busy:.2f} s busy (idle loop and start-up excluded)")
    return {
        "seconds": round(busy, 3),
        "self": [{"frame": f, "share": round(t / busy, 4)} for f, t in sorted(own.items(), key=lambda kv: -kv[1])[:25]]
        if busy
        else [],
        "inclusive_proxy": [
            {"frame": f, "share": round(t / busy, 4)} for f, t in sorted(inclusive.items(), key=lambda kv: -kv[1])[:25]
        ]
        if busy
        else [],
        "raw_file": str(out),
    }


def _mean(values: list[float]) -> float | None:
    return round(sum(values) / len(values), 1) if values else None


class LoadMonitor:
    """Samples machine-wide CPU use and each of our processes' share once a second.

    Other work on the machine skews latency figures; the report keeps, per phase (or per setup
    run), the mean machine CPU busy % (of all cores), each role's share (bench client, emulator,
    sidecar; % of all cores) and the rest ("foreign").
    """

    def __init__(self, roles: Callable[[], dict[str, int]]) -> None:
        self.roles = roles
        self.samples: list[tuple[float, dict[str, float]]] = []
        self._task: asyncio.Task[None] | None = None
        self._procs: dict[int, Any] = {}
        self.steal: list[float] = []

    async def _run(self) -> None:
        import psutil

        psutil.cpu_percent(None)
        psutil.cpu_times_percent(None)
        ncpu = psutil.cpu_count() or 1
        while True:
            await asyncio.sleep(1.0)
            self.steal.append(float(getattr(psutil.cpu_times_percent(None), "steal", 0.0)))
            shares: dict[str, float] = {}
            for role, pid in self.roles().items():
                proc = self._procs.get(pid)
                try:
                    if proc is None:
                        proc = self._procs[pid] = psutil.Process(pid)
                        proc.cpu_percent(None)
                        continue
                    shares[role] = proc.cpu_percent(None) / ncpu
                except psutil.Error:
                    self._procs.pop(pid, None)
            self.samples.append((psutil.cpu_percent(None), shares))

    def start(self) -> None:
        """Begin sampling."""
        self._task = asyncio.get_running_loop().create_task(self._run())

    def phase(self) -> JSON:
        """Mean figures since the last call (then reset), with the load averages."""
        samples, self.samples = self.samples, []
        steal, self.steal = self.steal, []
        busy = [b for b, _ in samples]
        roles = sorted({r for _, shares in samples for r in shares})
        out: JSON = {"machine_busy_pct": _mean(busy)}
        for role in roles:
            out[f"{role}_pct"] = _mean([shares.get(role, 0.0) for _, shares in samples])
        out["foreign_pct"] = _mean([b - sum(shares.values()) for b, shares in samples])
        out["steal_pct"] = _mean(steal)
        out["loadavg"] = [round(x, 2) for x in os.getloadavg()]
        return out

    async def stop(self) -> None:
        """Stop sampling."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task


async def wait_quiet(limit_s: float, log: Log, threshold: float = 20.0) -> float:
    """Wait (at most ``limit_s``) until the machine is under ``threshold`` % busy for 2 s in a row.

    Called between phases and setup runs, when the bench's own processes are idle: whatever
    keeps the machine busy then is someone else's work, which would skew the next measurement.
    Returns the last busy figure.
    """
    import psutil

    if limit_s <= 0:
        return float("nan")
    deadline = asyncio.get_running_loop().time() + limit_s
    psutil.cpu_percent(None)
    calm, busy = 0, 100.0
    while asyncio.get_running_loop().time() < deadline:
        await asyncio.sleep(1.0)
        busy = float(psutil.cpu_percent(None))
        calm = calm + 1 if busy < threshold else 0
        if calm >= 2:
            return busy
    if calm == 0:
        log(f"  machine still {busy:.0f} % busy after waiting {limit_s:.0f} s; measuring anyway")
    return busy


def quiet_stderr() -> None:
    """Line-buffer stderr so progress shows up in order."""
    if hasattr(sys.stderr, "reconfigure"):
        sys.stderr.reconfigure(line_buffering=True)
