"""The compiled modules' share of a turn, without I/O: parse + plan + finish, and the events.

    python -m bench.corebench                    # whichever build is imported (pure by default)
    python -m proxy.build && python -m bench.corebench && python -m proxy.build --clean

A conversation of tool calls grows by one call and its output per turn, starting from a history
of each size; every turn is parsed by :meth:`HeadTable.parse`, planned by :meth:`Planner.plan`
(a continuation on the lane that holds its head) and finished (its response becomes the head), as
:mod:`proxy.serve.handlers` does. Prints µs per turn (median of ``--rounds`` rounds), naming the
build (:func:`proxy.build.build_kind`): compare the builds by running it on each. The events: a
reasoning agent's 19 events per turn as WebSocket frames, read (:class:`FrameReader`), parsed,
through the :class:`Channel` and SSE-encoded, as the pump does.
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import orjson

from proxy.build import build_kind
from proxy.core.channel import Channel
from proxy.core.conversation import HeadTable
from proxy.core.demux import LaneSupport
from proxy.core.lanes import LaneLimits
from proxy.core.planner import Planner
from proxy.core.plans import Continue, Full
from proxy.wire.sse import encode
from proxy.wire.wsframe import FrameReader

SIZES = {"1k": 1_000, "200k": 200_000, "1m": 1_000_000}


def _call(n: int) -> dict[str, Any]:
    return {"type": "function_call", "id": f"fc_{n}", "call_id": f"call_{n}", "name": "f", "arguments": "{}"}


def _output(n: int) -> dict[str, Any]:
    return {"type": "function_call_output", "call_id": f"call_{n}", "output": "ok " * 20}


def run(size: int, turns: int, conversations: int = 1) -> float:
    """Median µs per continuation turn of ``conversations`` conversations of one identity (one
    key), taking turns, each starting at ``size`` bytes of history (its own first message)."""
    heads = HeadTable(max_heads=10_000, ttl_seconds=3600)
    planner = Planner(LaneLimits(), heads)
    chats: list[list[dict[str, Any]]] = [
        [{"role": "user", "content": f"{c} " + "x" * size}] for c in range(conversations)
    ]
    times: list[float] = []
    for n in range(turns + 1):
        for c, items in enumerate(chats):
            body = orjson.dumps({"model": "m", "stream": True, "input": items})
            now = float(n * conversations + c)
            began = time.perf_counter()
            req = heads.parse("id", body)
            plan = planner.plan("id", req, now)
            assert isinstance(plan, (Continue, Full)), plan
            if plan.open_socket:
                planner.opened(plan.lane[0], now)
                sock = planner.socket(plan.lane[0])
                assert sock is not None
                sock.demux.support = LaneSupport.PROVEN
            response = {"id": f"resp_{c}_{n}", "output": [_call(n)]}
            planner.finished(plan.lane, now, req=req, response=response)
            elapsed = time.perf_counter() - began
            if n:  # the first turn is a full send: not what a conversation spends its turns on
                assert isinstance(plan, Continue), plan
                times.append(elapsed)
            chats[c] = [*items, _call(n), _output(n)]
    return statistics.median(times) * 1e6


def _frame(payload: bytes) -> bytes:
    size = len(payload)
    head = bytes([0x81, size]) if size < 126 else bytes([0x81, 126]) + size.to_bytes(2, "big")
    return head + payload


def _events() -> bytes:
    response = {"id": "resp_1", "object": "response", "status": "in_progress", "output": []}
    done = {**response, "status": "completed", "output": [_call(1)]}
    events: list[dict[str, Any]] = [
        {"type": "response.created", "response": response},
        {"type": "response.in_progress", "response": response},
        {"type": "response.output_item.added", "output_index": 0, "item": {"type": "reasoning", "id": "rs_1"}},
        *({"type": "response.reasoning_summary_text.delta", "item_id": "rs_1", "delta": "think "} for _ in range(6)),
        {"type": "response.output_item.done", "output_index": 0, "item": {"type": "reasoning", "id": "rs_1"}},
        {"type": "response.output_item.added", "output_index": 1, "item": _call(1)},
        *({"type": "response.function_call_arguments.delta", "item_id": "fc_1", "delta": "{}"} for _ in range(6)),
        {"type": "response.output_item.done", "output_index": 1, "item": _call(1)},
        {"type": "response.completed", "response": done},
    ]
    return b"".join(_frame(orjson.dumps({**e, "sequence_number": i})) for i, e in enumerate(events))


def run_events(turns: int) -> float:
    """Median µs per turn of reading, routing and encoding one turn's events."""
    wire = _events()
    times: list[float] = []
    for _ in range(turns):
        began = time.perf_counter()
        reader, channel = FrameReader(1 << 24), Channel(None, hold_back_s=0.0)
        out: list[bytes] = []
        for message in reader.feed(wire):
            raw = getattr(message, "data", message)
            assert isinstance(raw, bytes)
            for o in channel.feed(raw, orjson.loads(raw), 0.0):
                out.append(encode(o.type, o.raw if o.raw is not None else orjson.dumps(o.obj)))
        times.append(time.perf_counter() - began)
        assert channel.done and len(out) == 19, (channel.done, len(out))
    return statistics.median(times) * 1e6


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m bench.corebench", description=__doc__.splitlines()[0])
    p.add_argument("--sizes", default="1k,200k", help=f"history sizes of {', '.join(SIZES)} (default: 1k,200k)")
    p.add_argument("--turns", type=int, default=40, help="continuation turns per round (default: 40)")
    p.add_argument("--rounds", type=int, default=15, help="rounds; the median is reported (default: 15)")
    p.add_argument(
        "--conversations", default="1",
        help="conversations of one key taking turns, e.g. 1,100,1000 (default: 1; each count its own row)",
    )  # fmt: skip
    args = p.parse_args(argv)
    for name in args.sizes.split(","):
        for count in (int(c) for c in args.conversations.split(",")):
            per_round = [run(SIZES[name], args.turns, count) for _ in range(args.rounds)]
            of = f", {count} conversations of one key" if count > 1 else ""
            took = statistics.median(per_round)
            print(f"{build_kind()} build, {name} history{of}: parse + plan + finish {took:.1f} µs/turn")
    events = statistics.median(run_events(args.turns) for _ in range(args.rounds))
    print(f"{build_kind()} build, 19 events: frames + channel + SSE {events:.1f} µs/turn")


if __name__ == "__main__":
    main()
