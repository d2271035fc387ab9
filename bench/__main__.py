"""``python -m bench``: A (HTTP, full history) vs B (through upshift) vs C (native WebSocket mode).

Runs the emulator and the sidecar as separate processes on 127.0.0.1, then the phases
(``--phases``): ``overhead`` (added latency and CPU per turn by history size on a reasoning agent's
event stream, zero-latency emulator, plus a profile of the sidecar), ``capacity`` (one pinned core:
1 KB saturation, then 500 and 1,000 conversations), ``network`` (a remote API's RTT: first turn
through upshift vs kept-alive direct HTTP), ``rollouts`` (A, B, C coding-agent rollouts at each
concurrency, one latency model for all), ``memory`` (RSS per idle conversation head) and ``stall``
(event-loop stall from one large request). Writes ``<out>/<date>.json``, the results section of
``docs/benchmarks.md`` and ``docs/benchmarks-turns.png``. ``--quick`` is a < 60 s smoke run that writes only the JSON.
See docs/benchmarks.md for the method.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import importlib.util
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import psutil

from . import report as rpt
from .capacity import run_capacity
from .floor import FloorProc
from .memory import WORKLOADS, run_budget, run_memory
from .network import DEFAULT_FLAGS, run_network
from .overhead import SizeResult, parse_size, run_overhead, slopes
from .phases import LoadMonitor, meta, profile_pass, pyinstrument_pass, quiet_stderr, rollouts_phase, wait_quiet
from .procs import EmulatorProc, Managed, SidecarProc, arm_watchdog, install_signal_handlers, stop_all
from .stall import run_stall
from .summary import targets
from .tls import LoopbackCA
from .workload import RolloutSpec

JSON = Any
ROOT = Path(__file__).resolve().parent.parent
LATENCY: dict[str, dict[str, float]] = {
    # GPT-5-class: 50 ms request overhead, 450 ms to first token, 65 tokens/s; 2.8 ms per KiB of
    # history re-processed (1 MB ≈ 2.8 s), calibrated so that C beats A by ~40 % on the default
    # 30-call workload (OpenAI's figure). See docs/benchmarks.md, "Latency model".
    "realistic": {"overhead_ms": 50.0, "rebuild_ms_per_kb": 2.8, "ttft_ms": 450.0, "tokens_per_second": 65.0},
    # Fast coding model (>1,000 tokens/s): the same history cost weighs even more.
    "fast": {"overhead_ms": 50.0, "rebuild_ms_per_kb": 2.8, "ttft_ms": 150.0, "tokens_per_second": 1000.0},
    "zero": {"overhead_ms": 0.0, "rebuild_ms_per_kb": 0.0, "ttft_ms": 0.0, "tokens_per_second": 0.0},
    # --quick: small but non-zero, so pacing code paths run.
    "quick": {"overhead_ms": 5.0, "rebuild_ms_per_kb": 0.1, "ttft_ms": 10.0, "tokens_per_second": 4000.0},
}
PHASES = ("overhead", "capacity", "network", "rollouts", "memory", "stall")


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def _range(text: str) -> tuple[float, float]:
    lo, _, hi = text.partition("-")
    return float(lo), float(hi or lo)


def parser() -> argparse.ArgumentParser:
    """Every option."""
    p = argparse.ArgumentParser(prog="python -m bench", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)  # fmt: skip
    p.add_argument("--turns", type=int, default=30, help="tool calls per rollout (T)")
    p.add_argument("--turns-large", type=int, default=10, help="tool calls per rollout above 100 conversations")
    p.add_argument("--conversations", default="1,10,100,500", help="concurrency levels")
    p.add_argument("--sizes", default="1k,200k,1m,3m", help="history sizes for the added-latency phase")
    p.add_argument("--reps", type=int, default=200, help="continuation turns per history size")
    p.add_argument("--light-settings", action="store_true",
                   help="added-latency phase: one tool, a one-line instruction (as before 2026-12-01)")  # fmt: skip
    p.add_argument("--latency", choices=[*LATENCY, "custom"], default="realistic",
                   help="emulator latency model for the rollouts (custom: zero + the flags below)")  # fmt: skip
    for name in LATENCY["zero"]:
        p.add_argument(f"--{name.replace('_', '-')}", type=float, help=f"override latency {name}")
    p.add_argument("--tool-kb", type=_range, default=(1.0, 20.0), help="tool output size range, KB")
    p.add_argument("--context-kb", type=float, default=40.0, help="initial repository context, KB")
    p.add_argument("--tool-ms", type=float, default=0.0, help="client-side tool execution time per call")
    p.add_argument(
        "--clients-at-first",
        default="sdk,raw",
        help="clients at the lowest concurrency (sdk = openai SDK, raw = aiohttp/websockets); raw above",
    )
    p.add_argument("--phases", default=",".join(PHASES), help="phases to run")
    p.add_argument("--capacity-saturation", default="32,128", help="concurrency levels of the 1 KB saturation run")
    p.add_argument("--capacity-seconds", type=float, default=10.0, help="length of each saturation run")
    p.add_argument("--capacity-conversations", default="500,1000", help="conversations of the under-load runs")
    p.add_argument("--capacity-turns", type=int, default=8, help="agent turns per conversation under load")
    p.add_argument("--capacity-tool-ms", type=_range, default=(200.0, 2000.0), help="tool time per call, ms")
    p.add_argument("--capacity-twin-every", type=int, default=4, help="one native twin per this many conversations")
    p.add_argument("--capacity-latency", choices=[k for k in LATENCY if k != "zero"], default="fast",
                   help="latency model of the under-load runs")  # fmt: skip
    p.add_argument("--network-rtt-ms", type=float, default=30.0, help="round-trip time of the network phase")
    p.add_argument("--network-connect-ms", type=float, default=60.0,
                   help="connection setup (TCP + TLS; the upgrade pays its RTT) of the network phase")  # fmt: skip
    p.add_argument("--network-flags", default=DEFAULT_FLAGS,
                   help="emulator flags for the network model ({rtt} and {connect} are filled in)")  # fmt: skip
    p.add_argument("--network-latency", choices=list(LATENCY), default="fast",
                   help="model latency of the network phase's emulator (besides the network)")  # fmt: skip
    p.add_argument("--network-conversations", type=int, default=50, help="new conversations (median of these)")
    p.add_argument("--network-later-turns", type=int, default=5, help="turns after the first one, per conversation")
    p.add_argument("--network-first-kb", type=float, default=10.0, help="history of a first turn, KB")
    p.add_argument("--memory-conversations", type=int, default=2000)
    p.add_argument("--memory-budget-mb", type=float, default=256.0,
                   help="limits.memory_bytes for the memory phase's load workloads")  # fmt: skip
    p.add_argument("--stall-streams", type=int, default=8)
    p.add_argument("--stall-size", default="3m")
    p.add_argument("--stall-repeats", type=int, default=3, help="rounds of each stall scenario (medians reported)")
    p.add_argument("--no-sidecar", action="store_true", help="setups A and C only")
    p.add_argument("--no-profile", action="store_true", help="skip the profile of the sidecar")
    p.add_argument("--tls", action="store_true",
                   help="added-latency phase: also run it with the emulator behind TLS on loopback (private CA, "
                        "trustme), sidecar and floors alike; both are reported")  # fmt: skip
    p.add_argument("--no-floor", action="store_true",
                   help="added-latency and capacity phases: skip the floor relays (bench.floor)")  # fmt: skip
    p.add_argument("--profiler", choices=["pyinstrument", "py-spy"], default="pyinstrument",
                   help="pyinstrument: a second sidecar run under it; py-spy: samples the timed one")  # fmt: skip
    p.add_argument("--profile-native", action="store_true",
                   help="with --profiler py-spy: C frames too (the compiled build), at the run's sizes")  # fmt: skip
    p.add_argument("--pin", action="store_true", help="pin the sidecar to CPU 0, emulator and bench to CPU 1")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument(
        "--wait-quiet",
        type=float,
        default=0.0,
        metavar="SECONDS",
        help="before each phase and concurrency level, wait up to this long for other work on the machine to calm down",
    )
    p.add_argument("--quick", action="store_true", help="short smoke run (< 60 s), JSON only")
    p.add_argument(
        "--deadline",
        type=float,
        default=0.0,
        metavar="SECONDS",
        help="abort (exit code 3, children killed) if the run takes longer; 0 = none (--quick: 150)",
    )
    p.add_argument("--out", default=str(ROOT / "bench" / "results"), help="directory for <date>.json")
    p.add_argument(
        "--docs",
        default=None,
        help="markdown file to update (default: docs/benchmarks.md after a full run; none with --quick, "
        "--phases or --out)",
    )
    p.add_argument("--no-plot", action="store_true")
    return p


def _apply_quick(args: argparse.Namespace) -> None:
    args.turns, args.conversations, args.sizes, args.reps = 3, "1,4", "1k,200k", 12
    args.memory_conversations, args.stall_streams, args.stall_size, args.stall_repeats = 100, 2, "500k", 1
    args.capacity_saturation, args.capacity_seconds, args.capacity_conversations = "4", 2.0, "8"
    args.capacity_turns, args.capacity_tool_ms, args.capacity_latency = 2, (20.0, 50.0), "quick"
    args.network_conversations, args.network_later_turns, args.network_latency = 3, 1, "quick"
    args.clients_at_first, args.no_profile = "sdk", True
    args.deadline = args.deadline or 150.0
    if args.latency == "realistic":
        args.latency = "quick"
    args.no_plot = True


def _latency(args: argparse.Namespace) -> dict[str, float]:
    base = dict(LATENCY["zero" if args.latency == "custom" else args.latency])
    for name in base:
        value = getattr(args, name)
        if value is not None:
            base[name] = float(value)
    return base


def log(message: str) -> None:
    """Progress line on stderr."""
    print(f"[bench {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


async def _start_sidecar(logs: Path, emu: EmulatorProc, pin: bool) -> SidecarProc:
    side = SidecarProc(logs, emu.base_url)
    side.start([0] if pin else None)
    await side.ready()
    return side


async def _capacity(
    args: argparse.Namespace, logs: Path, emu: EmulatorProc, side: SidecarProc, roles: dict[str, Managed]
) -> JSON:
    """The capacity phase; its saturation part beside the aiohttp floor relay (unless ``--no-floor``)."""
    floor = None if args.no_floor else FloorProc(logs, emu.base_url, with_aiohttp=True)
    try:
        if floor is not None:
            floor.start()
            await floor.ready()
            roles["floor_aiohttp"] = floor
        return await run_capacity(
            emu, side, latency=LATENCY[args.capacity_latency], saturation=_ints(args.capacity_saturation),
            seconds=args.capacity_seconds, conversations=_ints(args.capacity_conversations),
            turns=args.capacity_turns, tool_ms=args.capacity_tool_ms, twin_every=args.capacity_twin_every,
            seed=args.seed, log=log, floor=floor,
        )  # fmt: skip
    finally:
        if floor is not None:
            floor.stop()
            roles.pop("floor_aiohttp", None)


async def _overhead(
    args: argparse.Namespace,
    logs: Path,
    emu: EmulatorProc,
    side: SidecarProc,
    sizes: list[str],
    roles: dict[str, Managed],
    tls: LoopbackCA | None = None,
) -> list[SizeResult]:
    """The added-latency phase against ``emu``, with the floor relays (unless ``--no-floor``)."""
    floors: dict[str, FloorProc] = {}
    try:
        if not args.no_floor:
            for name, with_aiohttp in (("floor", False), ("floor_aiohttp", True)):
                floor = floors[name] = FloorProc(logs, emu.base_url, with_aiohttp=with_aiohttp, tls=tls)
                floor.start([0] if args.pin else None)
                await floor.ready()
                roles[name] = floor
        return await run_overhead(emu, side, sizes, reps=args.reps, seed=args.seed, log=log,
                                  light=args.light_settings, floors=floors)  # fmt: skip
    finally:
        for name, floor in floors.items():
            floor.stop()
            roles.pop(name, None)


async def _overhead_tls(
    args: argparse.Namespace, logs: Path, sizes: list[str], roles: dict[str, Managed]
) -> list[SizeResult]:
    """``--tls``: the added-latency phase with its own emulator behind TLS (a private CA on
    loopback, :mod:`bench.tls`), a sidecar that trusts it by ``egress.ca_file``, and floors that
    speak TLS to it as well, so that each ratio compares like with like."""
    tls = LoopbackCA.create(logs / "tls")
    emu = EmulatorProc(logs, {}, tls=tls)
    side = SidecarProc(logs / "tls", emu.base_url, tls=tls)
    try:
        emu.start([1] if args.pin else None)
        await emu.ready()
        roles["emulator_tls"] = emu
        side.start([0] if args.pin else None)
        await side.ready()
        roles["sidecar_tls"] = side
        return await _overhead(args, logs / "tls", emu, side, sizes, roles, tls)
    finally:
        for name, proc in (("sidecar_tls", side), ("emulator_tls", emu)):
            proc.stop()
            roles.pop(name, None)


async def run(args: argparse.Namespace, argv: list[str]) -> JSON:
    """All requested phases; returns the report."""
    phases = [p for p in args.phases.split(",") if p]
    latency = _latency(args)
    spec = RolloutSpec(args.turns, args.tool_kb, args.context_kb, args.seed)
    stamp = dt.datetime.now().strftime("%Y-%m-%d") + ("-quick" if args.quick else "")
    json_path = Path(args.out) / f"{stamp}.json"
    report: JSON = {"meta": meta(argv, latency, spec, os.path.relpath(json_path, ROOT))}
    logs = Path(tempfile.mkdtemp(prefix="upshift-bench-"))
    log(f"logs in {logs}; latency {report['meta']['latency']}")
    have_sidecar = not args.no_sidecar and importlib.util.find_spec("proxy.server") is not None
    if args.pin and (os.cpu_count() or 1) >= 2:
        psutil.Process().cpu_affinity([1])
    emu = EmulatorProc(logs, {})
    side: SidecarProc | None = None
    extra_roles: dict[str, Managed] = {}

    def roles() -> dict[str, int]:
        found = {"bench": os.getpid(), "emulator": emu.pid if emu.alive() else 0}
        if side is not None and side.alive():
            found["sidecar"] = side.pid
        for name, proc in extra_roles.items():
            if proc.alive():
                found[name] = proc.pid
        return {k: v for k, v in found.items() if v}

    monitor = LoadMonitor(roles)
    load = report["load"] = {}
    try:
        monitor.start()
        emu.start([1] if args.pin else None)
        await emu.ready()
        if have_sidecar:
            side = await _start_sidecar(logs, emu, args.pin)
        if "overhead" in phases and side is not None:
            await wait_quiet(args.wait_quiet, log)
            monitor.phase()
            log("phase overhead: added latency per history size (zero latency)")
            sizes = [s for s in args.sizes.split(",") if s]
            found = await _overhead(args, logs, emu, side, sizes, extra_roles)
            report["overhead"] = [r.report() for r in found]
            report["overhead_slopes"] = slopes(found)
            load["overhead"] = monitor.phase()
            if args.tls:
                await wait_quiet(args.wait_quiet, log)
                monitor.phase()
                log("phase overhead, TLS: the same, the emulator behind TLS on loopback (private CA)")
                report["overhead_tls"] = [r.report() for r in await _overhead_tls(args, logs, sizes, extra_roles)]
                load["overhead_tls"] = monitor.phase()
            if not args.no_profile and args.profiler == "pyinstrument":
                log("profile: a sidecar under pyinstrument during continuation turns")
                report["profile"] = await pyinstrument_pass(
                    emu, logs, reps=max(40, args.reps // 2), seed=args.seed, log=log,
                    sizes=[x for x in sizes if parse_size(x) <= 1_000_000][:3] or None, light=args.light_settings,
                )  # fmt: skip
                monitor.phase()
            elif not args.no_profile:
                log("profile: py-spy on the sidecar during continuation turns")
                raw = logs / "sidecar.pyspy.txt"
                reps = max(20, args.reps)
                report["profile"] = await profile_pass(
                    emu, side, raw, reps=reps, seed=args.seed, log=log, native=args.profile_native,
                    sizes=sizes if args.profile_native else None,
                )  # fmt: skip
                monitor.phase()
        if "capacity" in phases and side is not None:
            await wait_quiet(args.wait_quiet, log)
            monitor.phase()
            log("phase capacity: one core of sidecar (pinned), 1 KB saturation, then many conversations")
            report["capacity"] = await _capacity(args, logs, emu, side, extra_roles)
            load["capacity"] = monitor.phase()
        if "network" in phases and have_sidecar:
            await wait_quiet(args.wait_quiet, log)
            monitor.phase()
            log(f"phase network: {args.network_rtt_ms:g} ms RTT, first turn vs kept-alive direct HTTP")
            report["network"] = await run_network(
                logs, rtt_ms=args.network_rtt_ms, connect_ms=args.network_connect_ms, template=args.network_flags,
                conversations=args.network_conversations, later_turns=args.network_later_turns,
                first_bytes=int(args.network_first_kb * 1000), seed=args.seed, log=log,
                latency=LATENCY[args.network_latency],
            )  # fmt: skip
            load["network"] = monitor.phase()
        if "rollouts" in phases:
            log(f"phase rollouts: A/B/C at {args.conversations} conversations")
            report["comparisons"] = await rollouts_phase(
                emu, side, spec, _ints(args.conversations), latency=latency,
                clients_at_first=[c for c in args.clients_at_first.split(",") if c],
                turns_large=args.turns_large, tool_seconds=args.tool_ms / 1000.0, log=log, monitor=monitor,
                quiet_s=args.wait_quiet,
            )  # fmt: skip
            load["rollouts"] = monitor.phase()
        if side is not None and ("memory" in phases or "stall" in phases):
            if "memory" in phases:
                side.stop()
                side = await _start_sidecar(logs, emu, args.pin)
                await wait_quiet(args.wait_quiet, log)
                monitor.phase()
                log(f"phase memory: {args.memory_conversations} idle conversations")
                report["memory"] = await run_memory(emu, side, args.memory_conversations)
                # The memory budget under the load (its own sidecar per workload).
                loads = [(6, 4.0, 2)] if args.quick else WORKLOADS
                log(f"phase memory: budget {args.memory_budget_mb:g} MiB under {loads}")
                budget = int(args.memory_budget_mb * 2**20)
                report["memory"]["budget"] = await run_budget(emu, logs, loads, budget_bytes=budget, log=log)
                load["memory"] = monitor.phase()
            if "stall" in phases:
                side.stop()
                side = await _start_sidecar(logs, emu, args.pin)
                await wait_quiet(args.wait_quiet, log)
                monitor.phase()
                log("phase stall: one large request while others stream")
                report["stall"] = await run_stall(emu, side, streams=args.stall_streams,
                                                  big_bytes=parse_size(args.stall_size), seed=args.seed,
                                                  repeats=args.stall_repeats)  # fmt: skip
                load["stall"] = monitor.phase()
        if side is None and not args.no_sidecar:
            report["missing"] = "sidecar not runnable: setup B, overhead, memory and stall were skipped"
    finally:
        await monitor.stop()
        if side is not None:
            side.stop()
        emu.stop()
    report["targets"] = targets(report)
    rpt.write_json(report, json_path)
    log(f"wrote {json_path}")
    # Only a full run rewrites the results section (a run of some phases, or one written
    # elsewhere with --out, leaves the figures of the last full run alone unless --docs names a file).
    default_out = Path(args.out).resolve() == (ROOT / "bench" / "results").resolve()
    full = not args.quick and set(args.phases.split(",")) >= set(PHASES) and default_out
    docs = args.docs if args.docs is not None else (str(ROOT / "docs" / "benchmarks.md") if full else None)
    if docs:
        rpt.update_docs(Path(docs), rpt.markdown(report))
        log(f"updated {docs}")
    if not args.no_plot:
        png = ROOT / "docs" / "benchmarks-turns.png"
        if rpt.plot_turns(report, png):
            log(f"plotted {png}")
    return report


def main(argv: list[str] | None = None) -> int:
    """Entry point; always stops the child processes."""
    argv = sys.argv[1:] if argv is None else argv
    args = parser().parse_args(argv)
    if args.quick:
        _apply_quick(args)
    quiet_stderr()
    install_signal_handlers()
    if args.deadline > 0:
        arm_watchdog(args.deadline)
    started = time.perf_counter()
    try:
        report = asyncio.run(run(args, argv))
    except KeyboardInterrupt:
        log("interrupted")
        return 130
    finally:
        stop_all()
    for t in report.get("targets", []):
        state = {True: "met", False: "NOT MET", None: "n/a"}[t["met"]]
        log(f"  {t['target']}: {t['measured']} ({state})")
    log(f"done in {time.perf_counter() - started:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
