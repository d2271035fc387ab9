"""RSS per idle conversation head.

Two views:

* **process** (sockets included): N conversations of ~1 KB make one turn each through the
  sidecar process and stay idle; RSS delta / N from psutil. The sidecar keeps one upstream
  socket per conversation head, so this includes a socket (its Python objects and buffers;
  kernel socket memory is not in RSS). The emulator's open-connection count confirms it.
* **sockets aside**: a child process opens N bare ``websockets`` client connections (the sidecar's
  upstream library) to the emulator: RSS per socket, subtracted from the process figure. A
  second child records N heads in a bare :class:`proxy.core.conversation.HeadTable` and reports
  RSS delta / N (and tracemalloc's count, which misses OpenSSL's hash states).

``python -m bench.memory heads N structural|interleaved|traced`` and ``... sockets N WS_URL`` run
the children alone (JSON out).
"""

from __future__ import annotations

import asyncio
import gc
import json
import subprocess
import sys
import time
import tracemalloc
from typing import Any

import aiohttp
import orjson
import psutil

from .clients import post_sse, sdk_headers
from .procs import EmulatorProc, SidecarProc
from .workload import body_fields

__all__ = ["heads_only", "run_memory"]

JSON = Any


def _body(index: int) -> bytes:
    context = f"Conversation {index}: explain what module_{index}.py does. " + "x" * 800
    return orjson.dumps({"input": [{"role": "user", "content": context}], **body_fields(stream=True, light=True)})


def _fake_response(index: int) -> dict[str, JSON]:
    """An emulator-shaped response: a reasoning item and a message."""
    return {
        "id": f"resp_{index:048x}",
        "output": [
            {"id": f"rs_{index:048x}", "type": "reasoning", "encrypted_content": "gAAAAAB" + "Q" * 172,
             "summary": [{"type": "summary_text", "text": f"**Planning** context {index} has 1 item."}]},
            {"id": f"msg_{index:048x}", "type": "message", "status": "completed", "role": "assistant",
             "content": [{"type": "output_text", "annotations": [], "logprobs": [], "text": "Echo " * 24}]},
        ],
    }  # fmt: skip


def heads_only(n: int, variant: str) -> dict[str, float]:
    """Record ``n`` heads in a bare HeadTable; bytes per head, two ways.

    ``structural``: requests and responses built beforehand, so only what the table keeps shows.
    ``interleaved``: built as traffic arrives, so allocator fragmentation from the freed
    request bodies between retained heads shows too. ``traced``: tracemalloc's count of Python
    allocations (tracemalloc's own traces inflate RSS, hence a separate run).
    """
    from proxy.core.conversation import HeadTable

    proc = psutil.Process()
    identity = "0" * 16
    out: dict[str, float] = {"heads": float(n)}
    table = HeadTable(max_heads=n + 400, ttl_seconds=3600.0)
    for i in range(200):  # warm-up: allocator pools, caches
        table.record(identity, ("warm", i), table.parse(identity, _body(-i - 1)), _fake_response(10**9 + i), 0.0)
    prebuilt = variant != "interleaved"
    bodies = [_body(i) for i in range(n)] if prebuilt else []
    responses = [_fake_response(i) for i in range(n)] if prebuilt else []
    gc.collect()
    if variant == "traced":
        tracemalloc.start()
        snap0 = tracemalloc.take_snapshot()
    rss0 = proc.memory_info().rss
    for i in range(n):
        body = bodies[i] if prebuilt else _body(i)
        response = responses[i] if prebuilt else _fake_response(i)
        table.record(identity, ("sock", i), table.parse(identity, body), response, 0.0)
    gc.collect()
    if variant == "traced":
        snap1 = tracemalloc.take_snapshot()
        out["traced_bytes_per_head"] = sum(s.size_diff for s in snap1.compare_to(snap0, "filename")) / n
        tracemalloc.stop()
    else:
        out[f"{variant}_rss_bytes_per_head"] = (proc.memory_info().rss - rss0) / n
    return out


async def _sockets(n: int, url: str) -> dict[str, float]:
    """RSS per idle upstream socket: ``n`` websockets client connections, as the sidecar opens them."""
    import websockets

    proc = psutil.Process()
    headers = {"Authorization": "Bearer sk-bench-0000"}
    warm = [await websockets.connect(url, additional_headers=headers, compression=None) for _ in range(20)]
    gc.collect()
    rss0 = proc.memory_info().rss
    conns = []
    for _ in range(n):
        conns.append(await websockets.connect(url, additional_headers=headers, compression=None, max_size=2**26))
    await asyncio.sleep(0.5)
    gc.collect()
    per = (proc.memory_info().rss - rss0) / n
    for conn in conns + warm:
        await conn.close()
    return {"sockets": float(n), "rss_bytes_per_socket": per}


def _child(*args: str) -> dict[str, float]:
    out = subprocess.run(
        [sys.executable, "-m", "bench.memory", *args], capture_output=True, text=True, timeout=300, check=True
    )
    result: dict[str, float] = json.loads(out.stdout)
    return result


async def run_memory(emu: EmulatorProc, side: SidecarProc, n: int, *, warm: int = 100, parallel: int = 32) -> JSON:
    """Create ``warm`` then ``n`` idle conversations through the sidecar; RSS delta per conversation."""
    await emu.set_latency({})
    url = side.base_url + "/responses"
    headers = sdk_headers()
    connector = aiohttp.TCPConnector(limit=parallel)
    modes: dict[str, int] = {}
    timeout = aiohttp.ClientTimeout(total=None, sock_read=60)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:

        async def create(first: int, count: int) -> None:
            queue = iter(range(first, first + count))

            async def worker() -> None:
                for i in queue:
                    res = await post_sse(session, url, _body(i), headers)
                    mode = res.headers.get("x-upshift-mode", "?")
                    modes[mode] = modes.get(mode, 0) + 1

            await asyncio.gather(*(worker() for _ in range(parallel)))

        await create(10_000_000, warm)
        await asyncio.sleep(1.0)
        rss0, fds0 = side.rss(), side.ps.num_fds() if side.ps else 0
        open0 = (await emu.stats())["ws_connections"]["open"]
        started = time.perf_counter()
        await create(0, n)
        elapsed = time.perf_counter() - started
        await asyncio.sleep(2.0)
        rss1, fds1 = side.rss(), side.ps.num_fds() if side.ps else 0
        open1 = (await emu.stats())["ws_connections"]["open"]
    heads = await asyncio.to_thread(_child, "heads", str(min(n * 5, 20_000)), "structural")
    heads |= await asyncio.to_thread(_child, "heads", str(min(n * 5, 20_000)), "interleaved")
    heads |= await asyncio.to_thread(_child, "heads", str(min(n * 5, 20_000)), "traced")
    socks = await asyncio.to_thread(
        _child, "sockets", str(min(n, 1000)), emu.base_url.replace("http", "ws") + "/responses"
    )
    per_conv = (rss1 - rss0) / n
    return {
        "conversations": n,
        "create_seconds": round(elapsed, 2),
        "rss_before_mb": round(rss0 / 2**20, 1),
        "rss_after_mb": round(rss1 / 2**20, 1),
        "rss_bytes_per_conversation": round(per_conv),
        "upstream_sockets_added": open1 - open0,
        "sockets_per_conversation": round((open1 - open0) / n, 3),
        "fds_added": fds1 - fds0,
        "socket_bytes_bare": round(socks["rss_bytes_per_socket"]),
        "head_bytes_in_process": round(per_conv - socks["rss_bytes_per_socket"]),
        "head_only_bytes_structural": round(heads["structural_rss_bytes_per_head"]),
        "head_only_bytes_traced": round(heads["traced_bytes_per_head"]),
        "head_only_bytes_interleaved": round(heads["interleaved_rss_bytes_per_head"]),
        "modes": modes,
    }


if __name__ == "__main__":
    if len(sys.argv) == 4 and sys.argv[1] == "heads":
        print(json.dumps(heads_only(int(sys.argv[2]), sys.argv[3])))
    elif len(sys.argv) == 4 and sys.argv[1] == "sockets":
        print(json.dumps(asyncio.run(_sockets(int(sys.argv[2]), sys.argv[3]))))
    else:
        print("usage: python -m bench.memory heads N structural|interleaved|traced | sockets N WS_URL", file=sys.stderr)
        sys.exit(2)
