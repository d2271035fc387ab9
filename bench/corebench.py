"""The core's own share of a turn, without I/O: parse (the prefix cache's fast parse) + plan + finish.

    python -m bench.corebench                    # whichever build is imported (pure by default)
    python -m proxy.build && python -m bench.corebench && python -m proxy.build --clean

A conversation of tool calls grows by one call and its output per turn, starting from a history
of each size; every turn is parsed by :meth:`HeadTable.parse`, planned by :meth:`Planner.plan`
(a continuation on the lane that holds its head) and finished (its response becomes the head), as
:mod:`proxy.serve.handlers` does. Prints µs per turn (median of ``--rounds`` rounds), naming the
build (:func:`proxy.build.build_kind`): compare the builds by running it on each.
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import orjson

from proxy.build import build_kind
from proxy.core.conversation import HeadTable
from proxy.core.demux import LaneSupport
from proxy.core.planner import LaneLimits, PlanKind, Planner

SIZES = {"1k": 1_000, "200k": 200_000, "1m": 1_000_000}


def _call(n: int) -> dict[str, Any]:
    return {"type": "function_call", "id": f"fc_{n}", "call_id": f"call_{n}", "name": "f", "arguments": "{}"}


def _output(n: int) -> dict[str, Any]:
    return {"type": "function_call_output", "call_id": f"call_{n}", "output": "ok " * 20}


def run(size: int, turns: int) -> float:
    """Median µs per continuation turn of one conversation starting at ``size`` bytes of history."""
    heads = HeadTable(max_heads=1000, ttl_seconds=3600)
    planner = Planner(LaneLimits(), heads)
    items: list[dict[str, Any]] = [{"role": "user", "content": "x" * size}]
    times: list[float] = []
    for n in range(turns + 1):
        body = orjson.dumps({"model": "m", "stream": True, "input": items})
        began = time.perf_counter()
        req = heads.parse("id", body)
        plan = planner.plan("id", req, float(n))
        assert plan.lane is not None
        if plan.open_socket:
            planner.opened(plan.lane[0], float(n))
            sock = planner.socket(plan.lane[0])
            assert sock is not None
            sock.demux.support = LaneSupport.PROVEN
        response = {"id": f"resp_{n}", "output": [_call(n)]}
        planner.finished(plan.lane, float(n), req=req, response=response)
        elapsed = time.perf_counter() - began
        if n:  # the first turn is a full send: not what a conversation spends its turns on
            assert plan.kind is PlanKind.CONTINUE, plan
            times.append(elapsed)
        items = [*items, _call(n), _output(n)]
    return statistics.median(times) * 1e6


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m bench.corebench", description=__doc__.splitlines()[0])
    p.add_argument("--sizes", default="1k,200k", help=f"history sizes of {', '.join(SIZES)} (default: 1k,200k)")
    p.add_argument("--turns", type=int, default=40, help="continuation turns per round (default: 40)")
    p.add_argument("--rounds", type=int, default=15, help="rounds; the median is reported (default: 15)")
    args = p.parse_args(argv)
    for name in args.sizes.split(","):
        per_round = [run(SIZES[name], args.turns) for _ in range(args.rounds)]
        print(f"{build_kind()} build, {name} history: parse + plan + finish {statistics.median(per_round):.1f} µs/turn")


if __name__ == "__main__":
    main()
