"""Before/after on a machine whose speed drifts: two sidecars, two commits, interleaved turn sets.

    python -m bench.ab --base fc58807                 # base commit vs this working tree
    python -m bench.ab --base main~3 --sizes 1k,200k,1m --rounds 8 --reps 150 --json out.json
    python -m bench.ab --base fc58807 --tls           # the emulator behind TLS (wss://), both sides
    python -m bench.ab --base fc58807 --emulator-args "--delta-chars 2"   # many small deltas per turn
    python -m bench.ab --base fc58807 --no-stream     # stream: false turns (JSON answers)
    python -m proxy.build && python -m bench.ab --base fc58807 --compiled-base   # both compiled
    python -m bench.ab --base fc58807 --saturate 32 --seconds 8   # the capacity phase's load instead

One emulator (zero latency) serves two sidecar processes: **A** runs the code of ``--base``
(a detached ``git worktree`` in a temporary directory, removed afterwards), **B** this checkout's
working tree. Each round runs the added-latency phase (:func:`bench.overhead.run_overhead`:
the reasoning agent's event stream, continuation turns) against A and against B, in alternating
order, so both see the same machine within seconds of each other. Reported per history size:
the median over rounds of each side's CPU per turn and added p50, B/A of those medians, and the
median of each round's own CPU B/A (A and B of a size run back to back, seconds apart). A
single run of ``python -m bench`` cannot tell a 10 % change from the machine's own drift (it
moved by a quarter between runs of one afternoon); this can.

``--saturate N`` compares what the capacity phase measures instead: per round, N lean clients
hammer A and then B (or B then A) with 1 KB continuation turns for ``--seconds`` each, the
sidecar pinned to one core (:func:`bench.capacity.saturate`); reported are the turns per
sidecar CPU-second. A lever that costs per request in flight (the collector walking the
requests' young objects) shows there and not in the added-latency phase's one turn at a time.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import shlex
import statistics
import subprocess
import sys
import tempfile
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from .capacity import pinned, saturate
from .overhead import run_overhead
from .procs import EmulatorProc, SidecarProc, install_signal_handlers, stop_all
from .stats import percentile
from .tls import LoopbackCA

JSON = Any
ROOT = Path(__file__).resolve().parent.parent
ZERO = {"overhead_ms": 0.0, "rebuild_ms_per_kb": 0.0, "ttft_ms": 0.0, "tokens_per_second": 0.0}


def _args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.ab", description=__doc__.split("\n\n")[0])
    p.add_argument("--base", required=True, help="the commit to compare against (A)")
    p.add_argument("--sizes", default="1k,200k", help="history sizes (default: 1k,200k)")
    p.add_argument("--rounds", type=int, default=8, help="rounds; each runs A and B once (default: 8)")
    p.add_argument("--reps", type=int, default=150, help="continuation turns per size per run (default: 150)")
    p.add_argument("--tls", action="store_true", help="the emulator behind TLS on loopback (a private CA)")
    p.add_argument("--emulator-args", default="",
                   help="more emulator flags, e.g. '--delta-chars 2' (more, smaller events per read)")  # fmt: skip
    p.add_argument("--compiled-base", action="store_true",
                   help="compile A's worktree (python -m proxy.build --root): compiled against compiled, "
                        "when this tree is compiled in place too")  # fmt: skip
    p.add_argument("--no-stream", action="store_true", help="stream: false turns (JSON answers) instead of SSE")
    p.add_argument("--saturate", type=int, default=0, metavar="N",
                   help="compare turns per sidecar CPU-second under N concurrent clients (the capacity "
                        "phase's load, 1 KB turns) instead of the added-latency phase")  # fmt: skip
    p.add_argument("--seconds", type=float, default=8.0, help="with --saturate: seconds per side per round")
    p.add_argument("--json", type=Path, help="also write the figures here")
    return p.parse_args(argv)


@contextlib.asynccontextmanager
async def _started(
    base_dir: Path, tls: bool = False, emulator_args: str = ""
) -> AsyncIterator[tuple[Path, EmulatorProc, dict[str, SidecarProc]]]:
    """A zero-latency emulator and two sidecars on it, ready: A from ``base_dir``, B from this
    checkout; their logs under a new temporary directory. All three are stopped on the way out,
    also when a round fails."""
    logs = Path(tempfile.mkdtemp(prefix="upshift-ab-"))
    ca = LoopbackCA.create(logs / "tls") if tls else None
    emu = EmulatorProc(logs, ZERO, shlex.split(emulator_args), tls=ca)
    sides: dict[str, SidecarProc] = {}
    try:
        emu.start()
        await emu.ready()
        sides.update(A=SidecarProc(logs / "a", emu.base_url, tls=ca), B=SidecarProc(logs / "b", emu.base_url, tls=ca))
        sides["A"].cwd = base_dir
        for side in sides.values():
            side.start()
            await side.ready()
        yield logs, emu, sides
    finally:
        for proc in (*sides.values(), emu):
            proc.stop()


async def _compare(
    base_dir: Path,
    sizes: list[str],
    rounds: int,
    reps: int,
    tls: bool = False,
    emulator_args: str = "",
    stream: bool = True,
) -> JSON:
    async with _started(base_dir, tls, emulator_args) as (logs, emu, sides):
        samples: dict[str, dict[str, list[tuple[float, float]]]] = {n: {z: [] for z in sizes} for n in sides}
        for r in range(rounds):
            for size in sizes:  # A and B back to back per size: seconds apart, not a whole round
                for name in ("A", "B") if r % 2 == 0 else ("B", "A"):
                    (res,) = await run_overhead(
                        emu, sides[name], [size], reps=reps, seed=100 + r, warmup=2, log=_quiet, stream=stream
                    )
                    samples[name][size].append((res.cpu_ms_per_request, percentile(res.added_total, 50)))
            print(f"[ab] round {r + 1}/{rounds} done", flush=True)
    return _summary(samples, sizes, logs)


def _summary(samples: dict[str, dict[str, list[tuple[float, float]]]], sizes: list[str], logs: Path) -> JSON:
    out: JSON = {"sizes": {}, "logs": str(logs)}
    for size in sizes:
        row: JSON = {}
        for name in samples:
            cpu = [c for c, _ in samples[name][size]]
            added = [a for _, a in samples[name][size]]
            row[name] = {
                "cpu_ms_per_turn": round(statistics.median(cpu), 3),
                "added_p50_ms": round(statistics.median(added), 3),
                "cpu_rounds": [round(c, 3) for c in cpu],
                "added_rounds": [round(a, 3) for a in added],
            }
        row["B_over_A_cpu"] = round(row["B"]["cpu_ms_per_turn"] / row["A"]["cpu_ms_per_turn"], 3)
        row["B_over_A_added"] = round(row["B"]["added_p50_ms"] / row["A"]["added_p50_ms"], 3)
        # The median of each round's own B/A: A and B ran seconds apart, so the machine's drift
        # over the run cancels out of each ratio.
        pairs = zip(samples["B"][size], samples["A"][size], strict=True)
        row["B_over_A_cpu_paired"] = round(statistics.median(b[0] / a[0] for b, a in pairs), 3)
        out["sizes"][size] = row
    return out


async def _compare_saturated(base_dir: Path, clients: int, seconds: float, rounds: int) -> JSON:
    """Each round: ``clients`` lean clients against A and against B in turn (the order
    alternating), each sidecar pinned to the same core while it is measured."""
    rates: dict[str, list[float]] = {"A": [], "B": []}
    async with _started(base_dir) as (logs, emu, sides):
        for r in range(rounds):
            for name in ("A", "B") if r % 2 == 0 else ("B", "A"):
                with pinned(emu, sides[name]):
                    res = await saturate(sides[name], clients, seconds, 100 + r)
                if res["errors"]:
                    raise RuntimeError(f"{name}: {res['errors']} turns failed under load")
                rates[name].append(float(res["turns_per_sidecar_cpu_s"]))
            print(f"[ab] round {r + 1}/{rounds} done", flush=True)
    a, b = statistics.median(rates["A"]), statistics.median(rates["B"])
    row: JSON = {
        "A": {"turns_per_cpu_s": round(a, 1), "rounds": [round(x, 1) for x in rates["A"]]},
        "B": {"turns_per_cpu_s": round(b, 1), "rounds": [round(x, 1) for x in rates["B"]]},
        "B_over_A": round(b / a, 3),
        "B_over_A_paired": round(statistics.median(y / x for x, y in zip(rates["A"], rates["B"], strict=True)), 3),
    }
    return {"saturated": row, "clients": clients, "seconds": seconds, "logs": str(logs)}


def _quiet(_: str) -> None:
    pass


def main(argv: list[str] | None = None) -> int:
    """Run the comparison and print one line per size."""
    args = _args(argv)
    install_signal_handlers()
    sizes = [s.strip() for s in args.sizes.split(",") if s.strip()]
    with tempfile.TemporaryDirectory(prefix="upshift-ab-base-") as tmp:
        base_dir = Path(tmp) / "base"
        subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", str(base_dir), args.base],
                       check=True, capture_output=True)  # fmt: skip
        try:
            if args.compiled_base:
                subprocess.run([sys.executable, "-m", "proxy.build", "--root", str(base_dir)], cwd=base_dir, check=True)
            if args.saturate:
                out = asyncio.run(_compare_saturated(base_dir, args.saturate, args.seconds, args.rounds))
            else:
                out = asyncio.run(
                    _compare(base_dir, sizes, args.rounds, args.reps, args.tls, args.emulator_args, not args.no_stream)
                )
        finally:
            stop_all()
            subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(base_dir)], check=False)
    out["base"], out["tls"], out["emulator_args"] = args.base, args.tls, args.emulator_args
    out["stream"] = not args.no_stream
    out["compiled_base"] = args.compiled_base
    if args.saturate:
        row = out["saturated"]
        print(
            f"saturated ({args.saturate} clients, 1 KB turns): turns per sidecar CPU-second A "
            f"{row['A']['turns_per_cpu_s']:.0f}, B {row['B']['turns_per_cpu_s']:.0f} (B/A {row['B_over_A']:.3f}); "
            f"medians of {args.rounds} rounds; B/A per round, median {row['B_over_A_paired']:.3f}"
        )
    for size, row in out.get("sizes", {}).items():
        print(
            f"{size}: CPU/turn A {row['A']['cpu_ms_per_turn']:.2f} ms, B {row['B']['cpu_ms_per_turn']:.2f} ms "
            f"(B/A {row['B_over_A_cpu']:.3f}); added p50 A {row['A']['added_p50_ms']:.2f} ms, "
            f"B {row['B']['added_p50_ms']:.2f} ms (B/A {row['B_over_A_added']:.3f}); medians of {args.rounds} rounds; "
            f"CPU B/A per round, median {row['B_over_A_cpu_paired']:.3f}"
        )
    if args.json is not None:
        args.json.write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
