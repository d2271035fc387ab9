"""Security (docs/reliability.md §4): identities never share sockets, heads or anchors; no secret
or message content in logs or metrics; loopback by default; an admin listener without request
data; memory bounded under a flood of conversations and identities."""

from __future__ import annotations

import asyncio
import io
import ipaddress
import logging
import os
import re
import signal
import subprocess
import sys
from collections.abc import Callable, Iterator
from typing import Any

import aiohttp
import orjson
import psutil
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from proxy.config import LoggingSettings, Settings
from proxy.config_load import load_settings
from proxy.core.budget import Kind
from proxy.core.channel import HoldPath
from proxy.ingress.handoff import HandoffOutcome
from proxy.observe.log import setup_logging
from proxy.observe.metrics import LABEL_VALUES
from proxy.reasons import (
    ErrorCode,
    ForwardOutcome,
    MissReason,
    Mode,
    PassthroughReason,
    ReplayCause,
    RequestOutcome,
    Route,
)
from proxy.server import Server, split_hostport
from tests.conftest import SidecarFactory
from tests.reliability.helpers import (
    MODEL,
    ROOT,
    Conversation,
    assert_openai_error,
    assert_pool_quiet,
    auth,
    head_response_ids,
    post,
    user,
    wait_for,
)
from tests.sidecar import Sidecar, SidecarProcess
from upshift_emulator import Emulator
from upshift_emulator.state import identity_of

pytestmark = pytest.mark.timeout(90)

ALICE, BOB = "sk-alice-0123456789abcdef", "sk-bob-fedcba9876543210"


# -- identities never share sockets, heads or anchors ------------------------------------------


async def twin_conversations(http: aiohttp.ClientSession, sc: Sidecar, emu: Emulator, turns: int) -> dict[str, list]:
    """Alice and Bob run byte-identical conversations at the same time; returns oracle records."""
    convs = {key: Conversation(http, sc.base_url, emu, key=key, name="twin") for key in (ALICE, BOB)}
    records: dict[str, list[dict[str, Any]]] = {ALICE: [], BOB: []}
    for turn in range(turns):
        done = await asyncio.gather(*(conv.turn(f"same words {turn}") for conv in convs.values()))
        for key, record in zip(convs, done, strict=True):
            records[key].append(record)
    return records


async def test_identical_histories_of_two_keys_never_share_sockets_or_heads(
    http: aiohttp.ClientSession, emulator: Emulator, sidecar: Sidecar
) -> None:
    records = await twin_conversations(http, sidecar, emulator, 4)
    ids = {key: {r["id"] for r in recs} for key, recs in records.items()}
    for key, recs in records.items():
        assert [r["continuation"] for r in recs] == [False, True, True, True]
        for record in recs:
            # The socket the create arrived on was opened with this key's credentials ...
            assert emulator.stats.connections[record["connection_id"]].identity == identity_of(f"Bearer {key}")
            # ... and a continuation chains only on this key's own responses.
            if record["previous_response_id"] is not None:
                assert record["previous_response_id"] in ids[key]
    # The head table keeps one head per identity, each pointing at that identity's response.
    heads = sidecar.heads._heads.values()
    assert len({h.identity for h in heads}) == 2
    for head in heads:
        owner = ALICE if head.response_id in ids[ALICE] else BOB
        assert head.response_id in ids[owner]
        assert all(h.identity == head.identity for h in heads if h.response_id in ids[owner])


async def test_tenants_behind_one_injected_key_never_share_sockets(
    http: aiohttp.ClientSession, emulator: Emulator, make_sidecar: SidecarFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    # With a configured key every upstream socket carries the same Authorization: only the
    # sidecar's own partitioning by the app's header keeps the tenants apart.
    monkeypatch.setenv("RELIABILITY_INJECTED_KEY", "sk-injected-0123456789abcdef")
    sc = await make_sidecar(api_key={"source": "env", "env": "RELIABILITY_INJECTED_KEY"})
    records = await twin_conversations(http, sc, emulator, 4)
    connections = {key: {r["connection_id"] for r in recs} for key, recs in records.items()}
    assert not connections[ALICE] & connections[BOB], connections
    alice_ids = {r["id"] for r in records[ALICE]}
    assert not any(r["previous_response_id"] in alice_ids for r in records[BOB])
    injected = identity_of("Bearer sk-injected-0123456789abcdef")
    assert all(c.identity == injected for c in emulator.stats.connections.values())


@pytest.mark.parametrize("store", [False, True])
async def test_app_previous_response_id_only_goes_on_its_own_identitys_socket(
    http: aiohttp.ClientSession, emulator: Emulator, sidecar: Sidecar, store: bool
) -> None:
    alice = Conversation(http, sidecar.base_url, emulator, key=ALICE, store=store)
    await alice.turn("alice's secret plan")
    alice_response = head_response_ids(sidecar)[0]
    alice_connection = emulator.record(alice_response)["connection_id"]  # type: ignore[index]
    before = emulator.stats.connections[alice_connection].requests
    # Bob (another key) chains on Alice's response id himself.
    body = {"model": MODEL, "store": store, "previous_response_id": alice_response, "input": [user("go on")]}
    reply = await post(http, sidecar.base_url, body, key=BOB)
    assert_openai_error(reply, 400, "previous_response_not_found")
    assert emulator.stats.connections[alice_connection].requests == before, "sent on Alice's socket"
    bob = [c for c in emulator.stats.connections.values() if c.identity == identity_of(f"Bearer {BOB}")]
    assert sum(c.requests for c in bob) == 0, "the sidecar knows the id is Alice's: nothing is forwarded"
    # Alice's own chain is intact.
    record = await alice.turn()
    assert record["continuation"] is True


async def test_injected_key_tenant_cannot_chain_on_another_tenants_response(
    http: aiohttp.ClientSession, emulator: Emulator, make_sidecar: SidecarFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("RELIABILITY_INJECTED_KEY", "sk-injected-0123456789abcdef")
    sc = await make_sidecar(api_key={"source": "env", "env": "RELIABILITY_INJECTED_KEY"})
    alice = Conversation(http, sc.base_url, emulator, key=ALICE, store=True)
    await alice.turn("alice's secret plan")
    body = {"model": MODEL, "store": True, "previous_response_id": head_response_ids(sc)[0], "input": [user("go")]}
    frames_before = emulator.stats.snapshot()["ws_frames_received"]
    reply = await post(http, sc.base_url, body, key=BOB)
    assert reply.status == 400, "Bob continued Alice's conversation"
    assert reply.json["error"]["code"] == "previous_response_not_found"
    assert emulator.stats.snapshot()["ws_frames_received"] == frames_before, "the foreign id was forwarded"
    # Alice herself may still chain on it.
    own = await post(http, sc.base_url, dict(body, input=[user("go on")]), key=ALICE)
    assert own.status == 200


# -- no secrets or content in logs --------------------------------------------------------------

LOG_KEY = "canary-key-7f3a9c1e5b"
CONTENT = "CANARY-CONTENT-4d2e"


@pytest.fixture
def log_buffer() -> Iterator[io.StringIO]:
    """The sidecar's JSON log (proxy.observe.log.setup_logging at debug level) into a buffer."""
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    buf = io.StringIO()
    setup_logging(LoggingSettings(level="debug"), stream=buf)
    yield buf
    for handler in list(root.handlers):
        if handler not in handlers:
            root.removeHandler(handler)
    root.setLevel(level)


async def noisy_traffic(http: aiohttp.ClientSession, base_url: str, emu: Emulator, port: int) -> None:
    """Traffic through every path that logs: continuations, replays, errors, passthrough, relay,
    bad requests, a malformed HTTP request, a bad key."""
    conv = Conversation(http, base_url, emu, key=LOG_KEY)
    await conv.turn(f"{CONTENT} first")
    emu.faults.arm("miss", match={"previous_response_id_present": True})
    await conv.turn(f"{CONTENT} second")
    emu.faults.arm("drop", after_events=0)
    await conv.turn(f"{CONTENT} third", stream=True)
    emu.faults.arm("close", after_events=5, close_code=1011)
    await conv.send(f"{CONTENT} fourth", stream=True)
    emu.faults.arm("error", status=429, transport="ws", message=f"{CONTENT} limit", headers={"retry-after": "1"})
    await post(http, base_url, {"model": MODEL, "input": f"{CONTENT} rl", "store": False}, key=LOG_KEY)
    await post(http, base_url, {"model": MODEL, "input": f"{CONTENT} bg", "background": True}, key=LOG_KEY)
    await post(http, base_url, b'{"model": "gpt-6.1-sol", "input": "' + CONTENT.encode() + b'", ', key=LOG_KEY)
    await post(http, base_url, {"model": MODEL, "input": f"{CONTENT} bad key"}, key="sk-bad-" + LOG_KEY)
    async with http.get(base_url + "/models", headers=auth(LOG_KEY)) as resp:
        assert resp.status == 200
    url = base_url.replace("http://", "ws://") + "/responses"
    async with http.ws_connect(url, headers=auth(LOG_KEY)) as ws:
        await ws.send_str(orjson.dumps({"type": "response.create", "model": MODEL, "input": CONTENT}).decode())
        while orjson.loads((await ws.receive(timeout=10)).data)["type"] != "response.completed":
            pass
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(f"POST /v1/responses HTTP/1.1\r\nAuthorization: Bearer {LOG_KEY}\rX: 1\r\n\r\n".encode())
    await writer.drain()
    await reader.read(1000)
    writer.close()


def assert_clean(text: str) -> None:
    assert text.strip(), "nothing was logged"
    for secret in (LOG_KEY, CONTENT, "CANARY", "canary-key"):
        assert secret not in text, f"{secret!r} in the logs: ...{text[max(text.find(secret) - 300, 0) :][:600]}"
    assert not re.search(r"(?i)bearer\s+(?!\[redacted\])", text), "a bearer credential in the logs"


async def test_no_secret_or_content_in_logs_in_process(
    http: aiohttp.ClientSession, emulator: Emulator, sidecar: Sidecar, log_buffer: io.StringIO
) -> None:
    await noisy_traffic(http, sidecar.base_url, emulator, sidecar.port)
    await asyncio.sleep(0.1)
    text = log_buffer.getvalue()
    assert_clean(text)
    lines = [orjson.loads(line) for line in text.splitlines() if line.strip()]
    assert any(line.get("logger") == "upshift.access" for line in lines)


async def test_no_secret_or_content_in_logs_subprocess(
    http: aiohttp.ClientSession, emulator: Emulator, spawn: Callable[..., SidecarProcess]
) -> None:
    sc = spawn(emulator.base_url, "--log-level", "debug")
    await sc.wait_ready(http)
    await noisy_traffic(http, sc.base_url, emulator, int(sc.api.rsplit(":", 1)[1]))
    async with http.get(sc.admin + "/metrics") as resp:
        metrics = await resp.text()
    sc.proc.send_signal(signal.SIGTERM)
    assert sc.proc.wait(15) == 0
    assert_clean(sc.logs())
    assert_metrics_clean(metrics)


async def test_malformed_request_bytes_are_not_logged(
    emulator: Emulator, sidecar: Sidecar, log_buffer: io.StringIO
) -> None:
    reader, writer = await asyncio.open_connection("127.0.0.1", sidecar.port)
    writer.write(f"POST /v1/responses HTTP/1.1\r\nHost: x\r\nx-api-key: {LOG_KEY}\rX: 1\r\n\r\n".encode())
    await writer.drain()
    assert (await reader.read(1000)).startswith(b"HTTP/1.")
    writer.close()
    await asyncio.sleep(0.1)
    assert LOG_KEY not in log_buffer.getvalue()


# -- no secrets or request data in metrics -------------------------------------------------------

_LABEL_VALUES: dict[str, set[str]] = {name: set(values) for name, values in LABEL_VALUES.items()}
_LABEL_VALUES["outcome"] |= set(HandoffOutcome)  # upshift_handoffs_total (proxy/ingress/handoff.py)
_VERSION_LABELS = frozenset({"version", "python"})


def test_label_sets_are_built_from_the_enums() -> None:
    """The documented sets hold every member of the enums that name the labels."""
    assert _LABEL_VALUES["route"] == set(Route) and _LABEL_VALUES["mode"] == set(Mode) >= {"forwarded"}
    assert set(RequestOutcome) | set(ForwardOutcome) <= _LABEL_VALUES["outcome"]
    assert set(MissReason) | set(PassthroughReason) | set(ReplayCause) <= _LABEL_VALUES["reason"]
    assert _LABEL_VALUES["cause"] == set(ReplayCause) and _LABEL_VALUES["code"] == set(ErrorCode)
    assert _LABEL_VALUES["kind"] == {k.value for k in Kind} and _LABEL_VALUES["path"] == set(HoldPath)


def label_values(text: str) -> dict[str, set[str]]:
    """Every label value of the sidecar's own metrics, by label name (``le`` excluded)."""
    found: dict[str, set[str]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name.startswith("upshift_"):
                for name, value in sample.labels.items():
                    if name != "le":
                        found.setdefault(name, set()).add(value)
    return found


def assert_metrics_clean(text: str) -> None:
    """No credential, id or content; every label value a short identifier from a small set."""
    for secret in (LOG_KEY, CONTENT, "CANARY", "canary", "resp_", "req_", "msg_", "conn_", "Bearer", "sk-"):
        assert secret not in text, secret
    for name, values in label_values(text).items():
        assert name in _LABEL_VALUES, name
        assert len(values) <= 32, (name, values)
        if name in _VERSION_LABELS:
            assert len(values) == 1 and all(re.fullmatch(r"[0-9a-z.+]{1,40}", v) for v in values), (name, values)
        else:
            assert all(re.fullmatch(r"[a-z0-9_]{1,40}", v) for v in values), (name, values)


async def test_no_secret_or_request_data_in_metrics(
    http: aiohttp.ClientSession, emulator: Emulator, sidecar: Sidecar
) -> None:
    await noisy_traffic(http, sidecar.base_url, emulator, sidecar.port)
    async with http.get(sidecar.admin_url + "/metrics") as resp:
        assert resp.status == 200
        text = await resp.text()
    assert "upshift_requests_total" in text and "upshift_replays_total" in text
    assert_metrics_clean(text)


async def test_metric_label_values_are_the_documented_ones(
    http: aiohttp.ClientSession, emulator: Emulator, sidecar: Sidecar
) -> None:
    conv = Conversation(http, sidecar.base_url, emulator)
    await conv.turn()
    emulator.faults.arm("drop", after_events=0)
    await conv.turn()  # a continuation, replayed in full on a new socket
    async with http.get(sidecar.admin_url + "/metrics") as resp:
        found = label_values(await resp.text())
    for name, values in found.items():
        assert values <= _LABEL_VALUES[name], (name, values - _LABEL_VALUES[name])


# -- listeners -----------------------------------------------------------------------------------


def test_api_listener_defaults_to_loopback() -> None:
    for settings in (Settings(), load_settings({}, {}, None)):
        host, _ = split_hostport(settings.listen)
        assert ipaddress.ip_address(host).is_loopback, settings.listen
    shipped = yaml.safe_load((ROOT / "config.yaml").read_text())
    assert ipaddress.ip_address(split_hostport(shipped["listen"])[0]).is_loopback
    env = {k: v for k, v in os.environ.items() if not k.startswith("UPSHIFT_")}
    command = [sys.executable, "-m", "proxy", "--print-config"]
    out = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, timeout=30, check=True)
    printed = yaml.safe_load(out.stdout)
    assert ipaddress.ip_address(split_hostport(printed["listen"])[0]).is_loopback, printed["listen"]


async def test_default_api_host_is_unreachable_from_other_interfaces(emulator: Emulator) -> None:
    host, _ = split_hostport(Settings().listen)
    server = Server(Settings(listen=f"{host}:0", admin_listen="127.0.0.1:0", upstream=emulator.base_url))
    await server.start()
    try:
        bound, port = server.api_address
        assert ipaddress.ip_address(bound).is_loopback
        others = [
            a.address
            for addrs in psutil.net_if_addrs().values()
            for a in addrs
            if a.family.name == "AF_INET" and not ipaddress.ip_address(a.address).is_loopback
        ]
        for address in others:
            with pytest.raises(OSError):
                _, writer = await asyncio.wait_for(asyncio.open_connection(address, port), 2)
                writer.close()
    finally:
        await server.stop()


async def test_admin_listener_exposes_no_request_data(
    http: aiohttp.ClientSession, emulator: Emulator, sidecar: Sidecar
) -> None:
    await Conversation(http, sidecar.base_url, emulator).turn(f"{CONTENT} admin")
    admin = sidecar.admin_url
    async with http.get(admin + "/healthz") as resp:
        assert (resp.status, await resp.json()) == (200, {"status": "ok"})
    async with http.get(admin + "/readyz") as resp:
        assert (resp.status, await resp.json()) == (200, {"status": "ready"})
    requests_before = dict(emulator.stats.requests)
    for method, path in [
        ("GET", "/"), ("GET", "/v1/responses"), ("POST", "/v1/responses"), ("GET", "/v1/models"),
        ("GET", "/debug"), ("GET", "/debug/pprof"), ("GET", "/config"), ("GET", "/heads"), ("GET", "/pool"),
        ("GET", "/_emulator/stats"), ("GET", "/metrics/../v1/models"), ("GET", "/healthz?verbose=1"),
        ("GET", "/status"), ("GET", "/misses"), ("POST", "/status"),
    ]:  # fmt: skip
        async with http.request(method, admin + path, headers=auth(), data=b"{}") as resp:
            body = await resp.text()
            assert CONTENT not in body and "resp_" not in body and "sk-" not in body, (path, body[:200])
            # The status page (/, /status) and /misses are read-only views without content.
            if not (
                path.startswith(("/healthz", "/metrics")) or (method == "GET" and path in ("/", "/status", "/misses"))
            ):
                assert resp.status in (404, 405), (method, path, resp.status)
    assert emulator.stats.requests == requests_before, "the admin listener forwarded a request"


# -- memory bounded under a flood --------------------------------------------------------------


@pytest.mark.parametrize(
    "keys",
    [2, 300],
    ids=["500-conversations-2-keys", "500-conversations-300-keys"],
)
async def test_flood_of_conversations_stays_within_limits(
    http: aiohttp.ClientSession, emulator: Emulator, make_sidecar: SidecarFactory, keys: int
) -> None:
    # 2 keys: the per-identity socket limit binds; 300 keys: the total limit does. The head LRU
    # (smaller than either) binds in both.
    limits = {"max_heads": 4, "per_identity": 3, "total": 10}
    sc = await make_sidecar(
        matching={"max_heads": limits["max_heads"]},
        pool={"max_sockets_per_identity": limits["per_identity"], "max_sockets_total": limits["total"]},
    )
    peaks = {"heads": 0, "sockets": 0, "per_identity": 0}

    def sample() -> None:
        peaks["heads"] = max(peaks["heads"], len(sc.heads))
        peaks["sockets"] = max(peaks["sockets"], sc.pool.count())
        peaks["per_identity"] = max([peaks["per_identity"], *sc.pool.sockets_per_identity().values()])

    async def sampler() -> None:
        while True:
            sample()
            await asyncio.sleep(0.001)

    gate = asyncio.Semaphore(25)
    names = [f"sk-flood-{i:03d}-0123456789" for i in range(keys)]

    async def one(i: int) -> None:
        async with gate:
            conv = Conversation(http, sc.base_url, emulator, key=names[i % keys], name=f"flood{i}")
            await conv.turn()
            sample()
            await conv.turn()
            sample()

    task = asyncio.create_task(sampler())
    try:
        await asyncio.gather(*(one(i) for i in range(500)))  # 500 conversations, 1,000 checked turns
    finally:
        task.cancel()
    assert peaks["heads"] <= limits["max_heads"], peaks
    assert peaks["sockets"] <= limits["total"], peaks
    assert peaks["per_identity"] <= limits["per_identity"], peaks
    assert peaks["heads"] == limits["max_heads"], peaks  # each limit was reached, and held
    if keys == 2:
        assert peaks["per_identity"] == limits["per_identity"], peaks
    else:
        assert peaks["sockets"] == limits["total"], peaks
    assert_pool_quiet(sc)
    assert await wait_for(lambda: emulator.stats.ws_connections["open"] <= limits["total"], 5)
    assert len(sc.heads._by_response) <= limits["max_heads"]


async def test_heads_and_sockets_expire_by_ttl_and_idle_time(
    http: aiohttp.ClientSession, emulator: Emulator, make_sidecar: SidecarFactory
) -> None:
    # The margins are wide on purpose: 40 concurrent turns took longer than a 0.4 s TTL on a busy
    # 2-core CI runner, so heads of the first turns were gone before the last turn ended. Heads
    # go about 2-3 s after the turns (TTL + one 1 s housekeeping pass); sockets 5-6 s after.
    sc = await make_sidecar(matching={"head_ttl_seconds": 2.0}, pool={"idle_close_seconds": 5.0})
    await asyncio.gather(*(Conversation(http, sc.base_url, emulator, name=f"t{i}").turn() for i in range(40)))
    assert len(sc.heads) == 40
    sockets = sc.pool.count()
    # Heads go by their TTL (housekeeping) while their sockets are still open ...
    assert await wait_for(lambda: len(sc.heads) == 0, timeout=4), repr(sc.heads)
    assert sc.pool.count() == sockets, repr(sc.pool)
    # ... and idle sockets close after idle_close_seconds.
    assert await wait_for(lambda: sc.pool.count() == 0, timeout=5), repr(sc.pool)
    assert await wait_for(lambda: emulator.stats.ws_connections["open"] == 0, timeout=3)
    assert 1 <= sockets <= 40  # conversations share sockets through lanes
    await Conversation(http, sc.base_url, emulator, name="later").turn()
