"""A third-party upstream nobody here wrote: ``@copilotkit/aimock`` (npm), a fixture-driven
server that speaks the Responses API over HTTP and over WebSocket mode.

It differs from our emulator where real third parties differ: its WebSocket events carry no
``sequence_number``, its error frames carry no ``status``, an "interrupted" fixture destroys the
TCP connection mid-response (no close frame), and it is **stateless**: it ignores
``previous_response_id`` and answers from the items of the frame alone. Each case must end
right for the app (the real openai SDK): the answer, or a clean error.

The package is installed from the npm registry on first use into ``.cache/aimock-<version>/``
(git-ignored); the test skips, saying why, where node >= 20.15 or npm is missing.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest
from openai import AsyncOpenAI

from tests.sidecar import ROOT, Sidecar

from .support import free_port

VERSION = "1.43.0"
"""Pinned aimock version (``npm view @copilotkit/aimock version``)."""
PREFIX = ROOT / ".cache" / f"aimock-{VERSION}"

WEATHER = [
    {
        "type": "function",
        "name": "get_weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    }
]
LONG = "This answer is long enough for aimock to cut it into several chunks of twenty characters."

FIXTURES: dict[str, Any] = {
    "fixtures": [
        {"match": {"userMessage": "say hello"}, "response": {"content": "Hello from aimock!"}},
        {
            "match": {"userMessage": "weather please"},
            "response": {"toolCalls": [{"name": "get_weather", "arguments": {"city": "Paris"}, "id": "call_aimock_1"}]},
        },
        {"match": {"toolCallId": "call_aimock_1"}, "response": {"content": "It is sunny in Paris."}},
        # Needs the history: with AIMOCK_STRICT_TURN_INDEX=1 it matches only a request whose
        # messages hold exactly one assistant message (the first answer) before "and again".
        {"match": {"userMessage": "and again", "turnIndex": 1}, "response": {"content": "Hello again!"}},
        {
            "match": {"userMessage": "trigger error"},
            "response": {
                "error": {"message": "Rate limited by the fixture", "type": "rate_limit_error", "code": "rate_limit"},
                "status": 429,
            },
        },
        {"match": {"userMessage": "cut me off"}, "response": {"content": LONG}, "truncateAfterChunks": 4},
    ]
}


def _node_ok() -> str | None:
    """Why aimock cannot run here, or ``None``."""
    node, npm = shutil.which("node"), shutil.which("npm")
    if node is None or npm is None:
        return "node and npm are needed for the aimock test (node >= 20.15; https://nodejs.org)"
    out = subprocess.run([node, "--version"], capture_output=True, text=True, check=True).stdout.strip()
    major, minor = (int(part) for part in out.lstrip("v").split(".")[:2])
    if (major, minor) < (20, 15):
        return f"aimock {VERSION} needs node >= 20.15, this machine has {out}"
    return None


def _install() -> Path:
    cli = PREFIX / "node_modules" / "@copilotkit" / "aimock" / "dist" / "cli.js"
    if not cli.exists():
        PREFIX.mkdir(parents=True, exist_ok=True)
        npm = shutil.which("npm")
        assert npm is not None
        result = subprocess.run(
            [npm, "install", "--prefix", str(PREFIX), "--no-audit", "--no-fund", f"@copilotkit/aimock@{VERSION}"],
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert result.returncode == 0, f"npm install @copilotkit/aimock@{VERSION} failed:\n{result.stderr}"
    return cli


def _get(url: str) -> Any:
    with urllib.request.urlopen(url, timeout=5) as response:  # 127.0.0.1 only
        return json.loads(response.read())


@pytest.fixture(scope="module")
def aimock(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A running aimock on 127.0.0.1; yields its base URL (``http://127.0.0.1:PORT``)."""
    reason = _node_ok()
    if reason is not None:
        pytest.skip(reason)
    cli = _install()
    tmp = tmp_path_factory.mktemp("aimock")
    fixtures = tmp / "fixtures.json"
    fixtures.write_text(json.dumps(FIXTURES))
    port = free_port()
    log = tmp / "aimock.log"
    env = {**os.environ, "AIMOCK_STRICT_TURN_INDEX": "1"}
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            ["node", str(cli), "-p", str(port), "-h", "127.0.0.1", "-f", str(fixtures), "--log-level", "warn"],
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            env=env,
        )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 30
        while True:
            assert proc.poll() is None, f"aimock exited:\n{log.read_text()}"
            try:
                _get(url + "/__aimock/journal")
                break
            except OSError:
                assert time.monotonic() < deadline, f"aimock did not start:\n{log.read_text()}"
                time.sleep(0.05)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)


def journal(aimock: str) -> list[dict[str, Any]]:
    """aimock's request journal: method (``WS`` or ``POST``), the messages it matched on, status."""
    entries: list[dict[str, Any]] = _get(aimock + "/__aimock/journal")
    return entries


def client(sidecar: Sidecar) -> AsyncOpenAI:
    return AsyncOpenAI(base_url=sidecar.base_url, api_key="sk-aimock", max_retries=0)


def messages(entry: dict[str, Any]) -> list[tuple[str, str | None]]:
    return [(m["role"], m.get("content")) for m in entry["body"]["messages"]]


async def test_first_turn_over_websocket_to_json_and_sse(aimock: str) -> None:
    async with Sidecar(aimock + "/v1") as sidecar:
        app = client(sidecar)
        raw = await app.responses.with_raw_response.create(model="gpt-6.1-sol", input="say hello")
        response = raw.parse()
        stream = await app.responses.create(model="gpt-6.1-sol", input="say hello", stream=True)
        events = [event async for event in stream]
        async with app.responses.stream(model="gpt-6.1-sol", input="say hello") as helper:
            final = await helper.get_final_response()
        await app.close()
    assert raw.headers["x-upshift-mode"] == "full"
    assert response.status == "completed" and response.output_text == "Hello from aimock!"
    types = [e.type for e in events]
    assert types[0] == "response.created" and types[-1] == "response.completed"
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == "Hello from aimock!"
    assert final.output_text == "Hello from aimock!"
    # aimock's own events carry no sequence_number; the sidecar relays them as they are
    assert all(getattr(e, "sequence_number", None) is None for e in events)
    assert [e["method"] for e in journal(aimock)[-3:]] == ["WS", "WS", "WS"]


async def test_tool_call_continuation_carries_only_the_new_items(aimock: str) -> None:
    """A stateless upstream answers from the frame alone. Here that is enough: aimock keys the
    second turn on the tool call's id, which the continuation's new items carry."""
    async with Sidecar(aimock + "/v1") as sidecar:
        app = client(sidecar)
        history: list[Any] = [{"role": "user", "content": "weather please"}]
        first = await app.responses.with_raw_response.create(model="gpt-6.1-sol", input=history, tools=WEATHER)
        output = first.parse().output
        call = output[0]
        assert call.type == "function_call" and call.call_id == "call_aimock_1"
        history += [*output, {"type": "function_call_output", "call_id": call.call_id, "output": "sunny"}]
        second = await app.responses.with_raw_response.create(model="gpt-6.1-sol", input=history, tools=WEATHER)
        await app.close()
    assert (first.headers["x-upshift-mode"], second.headers["x-upshift-mode"]) == ("full", "continuation")
    assert second.parse().output_text == "It is sunny in Paris."
    seen = journal(aimock)[-1]
    assert seen["method"] == "WS"
    assert [role for role, _ in messages(seen)] == ["assistant", "tool"], "only the new item went upstream"


async def test_a_continuation_that_needs_the_history_fails_cleanly(aimock: str) -> None:
    """aimock ignores ``previous_response_id``: the continuation's frame holds one user message,
    so the fixture that needs the first answer does not match, and the app gets aimock's error
    (not a wrong answer). Over ``mode: http`` the full history goes upstream and it matches."""
    history: list[Any] = [{"role": "user", "content": "say hello"}]
    async with Sidecar(aimock + "/v1") as sidecar:
        app = client(sidecar)
        first = await app.responses.create(model="gpt-6.1-sol", input=history)
        history += [*first.output, {"role": "user", "content": "and again"}]
        with pytest.raises(openai.APIStatusError) as info:
            await app.responses.create(model="gpt-6.1-sol", input=history)
        await app.close()
    assert info.value.response.headers["x-upshift-mode"] == "continuation"
    body = info.value.body
    assert isinstance(body, dict) and body["code"] == "no_fixture_match" and body["type"] == "invalid_request_error"
    # no status in aimock's error frame: the sidecar's default for that is 500
    assert info.value.status_code == 500
    assert messages(journal(aimock)[-1]) == [("user", "and again")]
    # The recipe for a stateless upstream: mode: http (the app's full history every turn).
    async with Sidecar(aimock + "/v1", mode="http") as sidecar:
        app = client(sidecar)
        raw = await app.responses.with_raw_response.create(model="gpt-6.1-sol", input=history)
        await app.close()
    assert raw.headers["x-upshift-mode"] == "passthrough"
    assert raw.parse().output_text == "Hello again!"


async def test_an_error_frame_without_status(aimock: str) -> None:
    """``{"type":"error","error":{...}}`` with no ``status``: the app gets an HTTP error with
    aimock's type, code and message, streamed or not (nothing was written before it)."""
    async with Sidecar(aimock + "/v1") as sidecar:
        app = client(sidecar)
        with pytest.raises(openai.APIStatusError) as plain:
            await app.responses.create(model="gpt-6.1-sol", input="trigger error")
        with pytest.raises(openai.APIStatusError) as streamed:
            await app.responses.create(model="gpt-6.1-sol", input="trigger error", stream=True)
        await app.close()
    for exc in (plain.value, streamed.value):
        assert exc.status_code == 500
        assert exc.body == {
            "type": "rate_limit_error",
            "code": "rate_limit",
            "message": "Rate limited by the fixture",
            "param": None,
        }
    assert [e["method"] for e in journal(aimock)[-2:]] == ["WS", "WS"]


async def test_an_abrupt_close_mid_response(aimock: str) -> None:
    """aimock destroys the TCP connection after four events: a JSON app gets a 502, a
    streaming app the events so far and then an error it can act on; the next request works."""
    async with Sidecar(aimock + "/v1") as sidecar:
        app = client(sidecar)
        with pytest.raises(openai.APIStatusError) as plain:
            await app.responses.create(model="gpt-6.1-sol", input="cut me off")
        events: list[Any] = []
        with pytest.raises(openai.APIError) as streamed:
            async for event in await app.responses.create(model="gpt-6.1-sol", input="cut me off", stream=True):
                events.append(event)
        after = await app.responses.create(model="gpt-6.1-sol", input="say hello")
        await app.close()
    assert plain.value.status_code == 502
    assert isinstance(plain.value.body, dict) and plain.value.body["code"] == "upstream_closed"
    assert [e.type for e in events][:2] == ["response.created", "response.in_progress"]
    assert "response.completed" not in [e.type for e in events]
    assert "upstream closed" in streamed.value.message
    assert after.output_text == "Hello from aimock!"
