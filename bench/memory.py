"""Memory: RSS per idle conversation head, and the memory budget under load.

**Under load** (:func:`run_budget`, phase ``memory``): N conversations with histories of S MB
made of 64 KB tool outputs, T turns each, ``stream: false``, all at once, against a sidecar
with ``limits.memory_bytes`` set (default 256 MiB). The client behaves like an SDK: a 429 or
503 is retried up to twice after its ``retry-after``. The sidecar's RSS is sampled every 50 ms
with psutil; reported: idle, peak and after-load RSS next to the budget, the turns answered,
waits and refusals for memory, and whether the emulator's oracle saw exactly each app's
history. ``python -m bench.memory load N SIZE_MB TURNS [BUDGET_MB]`` runs one workload alone.

**Idle heads** (:func:`run_memory`), two views:

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
import random
import subprocess
import sys
import tempfile
import time
import tracemalloc
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import orjson
import psutil

from .clients import echo_items, post_sse, sdk_headers
from .procs import EmulatorProc, SidecarProc
from .workload import body_fields, corpus

__all__ = ["WORKLOADS", "LoadResult", "RssSampler", "conversation_load", "heads_only", "run_budget", "run_memory"]

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
    """Record ``n`` heads in a bare HeadTable (with what the server attaches to it: the miss
    explainer, and the owner registry the planner notes each head's id in); bytes per head,
    two ways.

    ``structural``: requests and responses built beforehand, so only what the table keeps shows.
    ``interleaved``: built as traffic arrives, so allocator fragmentation from the freed
    request bodies between retained heads shows too. ``traced``: tracemalloc's count of Python
    allocations (tracemalloc's own traces inflate RSS, hence a separate run).
    """
    from proxy.core.conversation import HeadTable
    from proxy.core.creators import OwnerRegistry
    from proxy.core.explainer import MissExplainer

    proc = psutil.Process()
    identity = "0" * 16
    out: dict[str, float] = {"heads": float(n)}
    table = HeadTable(max_heads=n + 400, ttl_seconds=3600.0)
    MissExplainer(table)  # listens to the table: per-setting digests of each recorded head's settings
    owners = OwnerRegistry.for_heads(table.max_heads)

    def record(anchor: tuple[str, int], body: bytes, response: dict[str, Any]) -> None:
        head = table.record(identity, anchor, table.parse(identity, body), response, 0.0)
        if head is not None:  # as the planner does
            owners.note(head.identity, head.response_id)

    for i in range(200):  # warm-up: allocator pools, caches
        record(("warm", i), _body(-i - 1), _fake_response(10**9 + i))
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
        record(("sock", i), body, response)
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


# -- the memory budget under load ----------------------------------------------------------------

WORKLOADS: list[tuple[int, float, int]] = [(60, 4.0, 3), (10, 16.0, 3), (200, 1.0, 3)]
"""(conversations, history MB, turns) of the issue's "done when"."""
TOOL_OUTPUT = 64 * 1024
"""Characters per tool output in the histories."""
MIB = 1024 * 1024


def big_history(target: int, tag: str, steps: int, seed: int = 1) -> list[JSON]:
    """About ``target`` bytes of input: function calls with 64 KB outputs, then a user message
    asking the emulator's scripted model for ``steps`` more calls."""
    rng = random.Random(f"{seed}:{tag}")
    text = corpus(seed, 1 << 21)
    items: list[JSON] = [{"role": "user", "content": f"[{tag}] Resume the session."}]
    size, pair = 0, 0
    while size < target - TOOL_OUTPUT:
        start = rng.randrange(0, len(text) - TOOL_OUTPUT)
        call_id = f"call_{tag}_{pair}"
        items.append({"type": "function_call", "call_id": call_id, "name": "shell",
                      "arguments": f'{{"command":["cat","src/{pair}.py"]}}'})  # fmt: skip
        items.append({"type": "function_call_output", "call_id": call_id, "output": text[start : start + TOOL_OUTPUT]})
        size += TOOL_OUTPUT + 200
        pair += 1
    items.append({"role": "user", "content": f"[{tag}] Continue. (benchmark: steps={steps})"})
    return items


class RssSampler:
    """RSS of one process every ``interval`` seconds (psutil), in a task of this loop."""

    def __init__(self, pid: int, interval: float = 0.05) -> None:
        self.proc = psutil.Process(pid)
        self.interval = interval
        self.peak = 0
        self.samples = 0
        self._task: asyncio.Task[None] | None = None

    def now(self) -> int:
        return int(self.proc.memory_info().rss)

    def high_water(self) -> int:
        """The kernel's exact peak RSS of the process (``VmHWM``), 0 if unknown."""
        try:
            with open(f"/proc/{self.proc.pid}/status") as fh:
                for line in fh:
                    if line.startswith("VmHWM:"):
                        return int(line.split()[1]) * 1024
        except OSError:
            pass
        return 0

    async def _run(self) -> None:
        while True:
            try:
                self.peak = max(self.peak, self.now())
            except psutil.Error:
                return
            self.samples += 1
            await asyncio.sleep(self.interval)

    def start(self) -> None:
        self.peak = self.now()
        self._task = asyncio.ensure_future(self._run())

    async def stop(self) -> int:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        return self.peak


@dataclass(slots=True)
class LoadResult:
    """What the SDK-style clients saw."""

    turns: int = 0
    answered: int = 0
    failures: list[str] = field(default_factory=list)
    retries: int = 0
    connection_retries: int = 0
    """Requests sent again after a connection error (as the openai SDK does)."""
    statuses: dict[str, int] = field(default_factory=dict)
    modes: dict[str, int] = field(default_factory=dict)
    sent: list[tuple[str, str, int]] = field(default_factory=list)
    """(response id, context digest of the app's input, item count) per answered turn."""


async def _post_retrying(
    session: aiohttp.ClientSession, url: str, body: bytes, result: LoadResult, retries: int = 2
) -> tuple[int, dict[str, str], bytes]:
    """``POST`` like an OpenAI SDK: a 429/503 is retried up to ``retries`` times after its
    ``retry-after``."""
    headers = sdk_headers()
    for attempt in range(retries + 1):
        try:
            res = await session.post(url, data=body, headers=headers)
        except (aiohttp.ClientOSError, aiohttp.ServerDisconnectedError):
            # The openai SDK retries a connection error too (APIConnectionError); counted apart.
            result.connection_retries += 1
            if attempt == retries:
                raise
            await asyncio.sleep(0.5)
            continue
        async with res:
            raw = await res.read()
            head = {k.lower(): v for k, v in res.headers.items()}
            key = str(res.status)
            result.statuses[key] = result.statuses.get(key, 0) + 1
            if res.status in (429, 503) and attempt < retries:
                result.retries += 1
                await asyncio.sleep(float(head.get("retry-after", "1")))
                continue
            return res.status, head, raw
    raise AssertionError("unreachable")


async def conversation_load(
    base_url: str, conversations: int, size_bytes: int, turns: int, *, digest: bool = True
) -> LoadResult:
    """``conversations`` agent loops at once, each ``turns`` turns of ``stream: false`` over a
    history of ``size_bytes``; each app echoes the output and adds a 64 KB tool output."""
    from upshift_emulator import context_digest

    result = LoadResult()
    url = base_url + "/responses"
    fields = body_fields(stream=False, light=True)
    connector = aiohttp.TCPConnector(limit=0)
    timeout = aiohttp.ClientTimeout(total=None, sock_read=600)
    text = corpus(7, 1 << 21)

    async def loop(index: int, session: aiohttp.ClientSession) -> None:
        history = big_history(size_bytes, f"c{index}", turns)
        for turn in range(turns):
            result.turns += 1
            body = orjson.dumps({**fields, "input": history})
            status, head, raw = await _post_retrying(session, url, body, result)
            del body
            if status != 200:
                result.failures.append(f"conversation {index} turn {turn}: {status} {raw[:200]!r}")
                return
            response = orjson.loads(raw)
            result.answered += 1
            mode = head.get("x-upshift-mode", "?")
            result.modes[mode] = result.modes.get(mode, 0) + 1
            if digest:
                result.sent.append((response["id"], await asyncio.to_thread(context_digest, history), len(history)))
            history = history + echo_items(response["output"])
            calls = [i for i in response["output"] if i.get("type") == "function_call"]
            for call in calls:
                start = (index * 7919 + turn * 104729) % (len(text) - TOOL_OUTPUT)
                output = text[start : start + TOOL_OUTPUT]
                history.append({"type": "function_call_output", "call_id": call["call_id"], "output": output})
            if not calls:
                history.append({"role": "user", "content": f"[c{index}] One more thing, please."})

    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        await asyncio.gather(*(loop(i, session) for i in range(conversations)))
    return result


async def check_oracle(result: LoadResult, record: Callable[[str], Awaitable[JSON]]) -> list[str]:
    """Turns whose response the model did not see with exactly the app's input."""
    wrong = []
    for response_id, digest, count in result.sent:
        rec = await record(response_id)
        if rec.get("context_digest") != digest or rec.get("context_items") != count:
            wrong.append(response_id)
    return wrong


def _metric(text: str, name: str, **labels: str) -> float:
    want = name + ("{" + ",".join(f'{k}="{v}"' for k, v in labels.items()) + "}" if labels else "")
    total = 0.0
    for line in text.splitlines():
        if line.startswith(want + " "):
            total += float(line.split()[-1])
    return total


async def run_budget(
    emu: EmulatorProc,
    logs: Path,
    workloads: list[tuple[int, float, int]] | None = None,
    *,
    budget_bytes: int = 256 * MIB,
    log: Callable[[str], None] = print,
) -> list[JSON]:
    """Each workload against a fresh sidecar with ``limits.memory_bytes = budget_bytes``."""
    out = []
    for conversations, size_mb, turns in workloads or WORKLOADS:
        # budget_bytes 0: the sidecar's own default (a sidecar from before the budget, too).
        env = {"UPSHIFT_LIMITS_MEMORY_BYTES": str(budget_bytes)} if budget_bytes else {}
        side = SidecarProc(logs, emu.base_url, env)
        side.start()
        try:
            await side.ready()
            await emu.set_latency({})
            await asyncio.sleep(0.5)
            sampler = RssSampler(side.pid)
            idle = sampler.now()
            sampler.start()
            started = time.perf_counter()
            result = await conversation_load(side.base_url, conversations, int(size_mb * MIB), turns)
            elapsed = time.perf_counter() - started
            peak = await sampler.stop()
            peak = max(peak, sampler.high_water())
            await asyncio.sleep(2.0)
            after = sampler.now()
            metrics = await side.metrics()
            wrong = await check_oracle(result, emu.record)
            kept = _metric(metrics, "upshift_memory_bytes", kind="kept_bodies")
            heads = _metric(metrics, "upshift_memory_bytes", kind="heads")
            bound = 1.2 * idle + kept + heads
            row = {
                "conversations": conversations,
                "history_mb": size_mb,
                "turns": turns,
                "budget_mib": round(budget_bytes / MIB, 1),
                "idle_rss_mib": round(idle / MIB, 1),
                "peak_rss_mib": round(peak / MIB, 1),
                "after_rss_mib": round(after / MIB, 1),
                "kept_bodies_mib": round(kept / MIB, 1),
                "heads_mib": round(heads / MIB, 1),
                "after_bound_mib": round(bound / MIB, 1),
                "peak_within_budget": peak <= (budget_bytes or 256 * MIB),
                "after_within_bound": after <= bound,
                "turns_answered": f"{result.answered}/{result.turns}",
                "failures": result.failures[:5],
                "oracle_mismatches": len(wrong),
                "client_retries": result.retries,
                "connection_retries": result.connection_retries,
                "statuses": result.statuses,
                "modes": result.modes,
                "memory_waits": _metric(metrics, "upshift_memory_waits_total"),
                "memory_refusals": {
                    r: _metric(metrics, "upshift_memory_refusals_total", reason=r)
                    for r in ("too_large", "wait_timeout")
                },
                "history_bytes_in_flight_mib": round(conversations * size_mb, 1),
                "peak_rss_per_in_flight_byte": round((peak - idle) / (conversations * size_mb * MIB), 3),
                "seconds": round(elapsed, 1),
                "rss_samples": sampler.samples,
            }
            log(json.dumps(row))
            out.append(row)
        finally:
            side.stop()
    return out


async def _load_main(conversations: int, size_mb: float, turns: int, budget_mb: float) -> list[JSON]:
    logs = Path(tempfile.mkdtemp(prefix="upshift-memory-"))
    emu = EmulatorProc(logs, {})
    emu.start()
    try:
        await emu.ready()
        return await run_budget(emu, logs, [(conversations, size_mb, turns)], budget_bytes=int(budget_mb * MIB))
    finally:
        emu.stop()


if __name__ == "__main__":
    if len(sys.argv) == 4 and sys.argv[1] == "heads":
        print(json.dumps(heads_only(int(sys.argv[2]), sys.argv[3])))
    elif len(sys.argv) in (5, 6) and sys.argv[1] == "load":
        budget_mb = float(sys.argv[5]) if len(sys.argv) == 6 else 256.0
        asyncio.run(_load_main(int(sys.argv[2]), float(sys.argv[3]), int(sys.argv[4]), budget_mb))
    elif len(sys.argv) == 4 and sys.argv[1] == "sockets":
        print(json.dumps(asyncio.run(_sockets(int(sys.argv[2]), sys.argv[3]))))
    else:
        print("usage: python -m bench.memory heads N structural|interleaved|traced | sockets N WS_URL", file=sys.stderr)
        sys.exit(2)
