"""No secret from a proxy or upstream URL in any answer, log line or printed config.

Canary passwords and query keys go into ``egress.proxy`` and ``upstream``; every answer the
apps get (POST over the pool and over HTTP, another ``/v1`` route, the id routes, the WebSocket
relay), everything the process logs and ``--print-config`` are searched for them. A proxy URL
websockets would refuse (a path: its ``InvalidProxy`` text is the whole URL) is refused at
startup, its password not shown. The controls: the same sidecar without the bad URL serves.
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable

import aiohttp
import orjson
import pytest

from tests.ingress.support import free_ports
from tests.reliability.helpers import MODEL, user
from tests.security.support import ALICE, start_process
from tests.sidecar import ROOT, SidecarProcess
from upshift_emulator import Emulator

pytestmark = pytest.mark.timeout(120)

PROXY_PW, UP_PW, UP_KEY = "CANARY-PROXY-PW-5e1f", "CANARY-UPSTREAM-PW-9a2b", "CANARY-QUERY-KEY-3c4d"
CANARIES = (PROXY_PW, UP_PW, UP_KEY)


def clean(text: str | bytes, where: str) -> None:
    data = text.decode(errors="replace") if isinstance(text, bytes) else text
    for canary in CANARIES:
        assert canary not in data, f"{canary} in {where}: {data[:500]}"


async def every_answer(http: aiohttp.ClientSession, api: str) -> list[tuple[int, bytes]]:
    """What apps get on every route, each as (status, body)."""
    headers = {"Authorization": f"Bearer {ALICE}", "Content-Type": "application/json"}
    body = orjson.dumps({"model": MODEL, "input": [user("hi")]})
    answers = []
    for method, path, data in [
        ("POST", "/v1/responses", body),
        ("POST", "/v1/responses", orjson.dumps({"model": MODEL, "input": [user("hi")], "background": True})),
        ("POST", "/v1/responses", orjson.dumps({"model": MODEL, "input": [user("hi")], "stream": True})),
        ("GET", "/v1/models", None),
        ("GET", "/v1/responses/resp_x", None),
    ]:
        async with http.request(method, api + path, headers=headers, data=data) as resp:
            answers.append((resp.status, await resp.read()))
    try:
        async with http.ws_connect(api.replace("http://", "ws://") + "/v1/responses", headers=headers) as ws:
            await ws.send_str(orjson.dumps({"type": "response.create", "model": MODEL, "input": "hi"}).decode())
            msg = await ws.receive(timeout=15)
            answers.append((101, str(msg.data).encode() + str(msg.extra).encode()))
    except aiohttp.WSServerHandshakeError as exc:
        answers.append((exc.status, str(exc).encode()))
    return answers


async def test_a_proxy_password_never_reaches_an_app_or_a_log_line(
    emulator: Emulator, spawn: Callable[..., SidecarProcess]
) -> None:
    # A proxy that refuses connections (port 9 on loopback: nothing listens), with a password.
    (closed,) = free_ports(1)
    env = {"UPSHIFT_EGRESS_PROXY": f"http://user:{PROXY_PW}@127.0.0.1:{closed}", "UPSHIFT_LOGGING_LEVEL": "debug"}
    proc = await start_process(spawn, emulator.base_url, env=env)
    async with aiohttp.ClientSession() as http:
        answers = await every_answer(http, proc.api)
    assert any(status in (426, 502) for status, _ in answers), answers  # the proxy was used, and failed
    for status, data in answers:
        clean(data, f"an answer ({status})")
    assert await proc.terminate() == 0
    clean(proc.logs(), "the logs")


async def test_upstream_url_credentials_never_reach_an_app_or_a_log_line(
    spawn: Callable[..., SidecarProcess],
) -> None:
    (closed,) = free_ports(1)
    upstream = f"http://user:{UP_PW}@127.0.0.1:{closed}/v1?api-key={UP_KEY}"
    proc = await start_process(spawn, upstream, env={"UPSHIFT_LOGGING_LEVEL": "debug"})
    async with aiohttp.ClientSession() as http:
        answers = await every_answer(http, proc.api)
    assert all(status >= 400 for status, _ in answers if status != 101), answers  # nothing listens there
    for status, data in answers:
        clean(data, f"an answer ({status})")
    assert await proc.terminate() == 0
    clean(proc.logs(), "the logs")


def test_print_config_shows_no_url_secret() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "proxy", "--print-config",
         "--upstream", f"https://user:{UP_PW}@gw.example/v1?api-key={UP_KEY}"],
        cwd=ROOT, capture_output=True, text=True, timeout=30, check=True,
        env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT),
             "UPSHIFT_EGRESS_PROXY": f"http://user:{PROXY_PW}@proxy.example:3128"},
    )  # fmt: skip
    clean(out.stdout + out.stderr, "--print-config")
    assert "upstream: https://user:***@gw.example/v1?api-key=***" in out.stdout
    assert "proxy: http://user:***@proxy.example:3128" in out.stdout


async def test_a_proxy_url_websockets_would_refuse_is_refused_at_startup_without_its_password(
    emulator: Emulator, spawn: Callable[..., SidecarProcess]
) -> None:
    proc = spawn(emulator.base_url, env={"UPSHIFT_EGRESS_PROXY": f"http://user:{PROXY_PW}@127.0.0.1:9/proxy"})
    assert await proc.wait() == 1
    assert "path is meaningless" in proc.logs() and "egress.proxy" in proc.logs()
    clean(proc.logs(), "the startup error")
    # The control: without the path it starts.
    ok = await start_process(
        spawn, emulator.base_url, env={"UPSHIFT_EGRESS_PROXY": f"http://user:{PROXY_PW}@127.0.0.1:9"}
    )
    assert ok.proc.poll() is None


def test_every_error_answer_and_log_line_loses_a_urls_credentials() -> None:
    # The nets under the tests above: an exception text quoting a URL (websockets' InvalidProxy,
    # aiohttp's InvalidURL) becomes an error body or a log line without its credentials.
    from proxy.errors import UpstreamUnavailable
    from proxy.observe.log import redact

    text = f"http://user:{PROXY_PW}@127.0.0.1:9/proxy isn't a valid proxy; see https://gw/v1?key={UP_KEY}&x=1"
    body = orjson.dumps(UpstreamUnavailable(f"The egress proxy failed: {text}").body()).decode()
    clean(body, "an error body")
    assert "http://user:***@127.0.0.1:9/proxy" in body and "key=***&x=***" in body  # every query value but api-version
    clean(str(redact({"msg": text, "exc": [text]})), "a log line")
