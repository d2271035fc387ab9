"""Bad input from the app (docs/reliability.md §2).

Every malformed request gets a clear OpenAI-style 4xx (or, for what only the upstream can judge,
a faithful passthrough), and nothing is forwarded that should not be: the emulator's counters and
the captured upstream frames prove what left the sidecar.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import aiohttp
import orjson
import pytest

from tests.conftest import SidecarFactory
from tests.reliability.conftest import EmulatorFactory, SidecarFor
from tests.reliability.helpers import (
    KEY,
    MODEL,
    Conversation,
    assert_openai_error,
    auth,
    check_answer,
    post,
    user,
)
from tests.sidecar import Sidecar
from upshift_emulator import Emulator
from upshift_emulator.oracle import context_digest

pytestmark = pytest.mark.timeout(60)


def nothing_forwarded(emu: Emulator, frames: list[bytes]) -> None:
    assert frames == [], frames[:1]
    assert emu.stats.requests == {"http": 0, "ws": 0}, emu.stats.requests
    assert emu.stats.ws_connections["opened"] == 0


async def still_serving(http: aiohttp.ClientSession, sc: Sidecar, emu: Emulator) -> None:
    await Conversation(http, sc.base_url, emu, name="after-bad-input").turn()


MALFORMED = {
    "truncated": b'{"model": "gpt-6.1-sol", "input": [',
    "trailing-garbage": b'{"model": "gpt-6.1-sol", "input": "hi"} x',
    "single-quotes": b"{'model': 'gpt-6.1-sol'}",
    "trailing-comma": b'{"model": "gpt-6.1-sol", "input": "hi",}',
    "empty": b"",
    "whitespace": b"   ",
    "unterminated-string": b'{"model": "gpt-6.1-sol", "input": "hi}',
}


@pytest.mark.parametrize("name", MALFORMED)
async def test_malformed_json_is_a_400(
    http: aiohttp.ClientSession, emulator: Emulator, sidecar: Sidecar, frames: list[bytes], name: str
) -> None:
    reply = await post(http, sidecar.base_url, MALFORMED[name])
    error = assert_openai_error(reply, 400)
    assert error["type"] == "invalid_request_error"
    nothing_forwarded(emulator, frames)
    await still_serving(http, sidecar, emulator)


@pytest.mark.parametrize("body", [b"[]", b'["model"]', b'"gpt-6.1-sol"', b"1", b"null", b"true"])
async def test_non_object_body_is_a_400(
    http: aiohttp.ClientSession, emulator: Emulator, sidecar: Sidecar, frames: list[bytes], body: bytes
) -> None:
    reply = await post(http, sidecar.base_url, body)
    assert assert_openai_error(reply, 400)["type"] == "invalid_request_error"
    nothing_forwarded(emulator, frames)


WRONG_TYPES: dict[str, tuple[dict[str, Any], str]] = {
    "input-number": ({"input": 5}, "input"),
    "input-object": ({"input": {"role": "user", "content": "hi"}}, "input"),
    "input-bool": ({"input": True}, "input"),
    "input-item-string": ({"input": ["hi"]}, "input[0]"),
    "input-item-null": ({"input": [user("hi"), None]}, "input[1]"),
    "input-item-list": ({"input": [[user("hi")]]}, "input[0]"),
    "tools-object": ({"input": "hi", "tools": {"type": "function", "name": "f"}}, "tools"),
    "tools-string": ({"input": "hi", "tools": "f"}, "tools"),
    "tools-item-string": ({"input": "hi", "tools": ["f"]}, "tools[0]"),
    "stream-string": ({"input": "hi", "stream": "yes"}, "stream"),
    "store-string": ({"input": "hi", "store": "false"}, "store"),
    "model-number": ({"input": "hi", "model": 5}, "model"),
    "previous-response-id-number": ({"input": "hi", "previous_response_id": 1}, "previous_response_id"),
}


@pytest.mark.parametrize("name", WRONG_TYPES)
async def test_wrong_types_are_a_400_naming_the_field(
    http: aiohttp.ClientSession, emulator: Emulator, sidecar: Sidecar, frames: list[bytes], name: str
) -> None:
    fields, param = WRONG_TYPES[name]
    reply = await post(http, sidecar.base_url, {"model": MODEL, **fields})
    error = assert_openai_error(reply, 400)
    assert error["param"] == param, error
    assert error["type"] == "invalid_request_error"
    nothing_forwarded(emulator, frames)


INVALID_UTF8 = {
    "bad-byte-in-string": b'{"model": "gpt-6.1-sol", "input": "caf\xe9"}',
    "bad-byte-in-key": b'{"model": "gpt-6.1-sol", "inp\xffut": "hi"}',
    "overlong-encoding": b'{"model": "gpt-6.1-sol", "input": "\xc0\xaf"}',
    "truncated-sequence": b'{"model": "gpt-6.1-sol", "input": "\xe2\x82"}',
    "encoded-surrogate": b'{"model": "gpt-6.1-sol", "input": "\xed\xa0\x80"}',
}


@pytest.mark.parametrize("name", INVALID_UTF8)
async def test_invalid_utf8_is_a_400(
    http: aiohttp.ClientSession, emulator: Emulator, sidecar: Sidecar, frames: list[bytes], name: str
) -> None:
    reply = await post(http, sidecar.base_url, INVALID_UTF8[name])
    assert_openai_error(reply, 400)
    nothing_forwarded(emulator, frames)


@pytest.mark.parametrize(
    "body",
    [
        b'{"model": "gpt-6.1-sol", "input": "\\ud800"}',
        b'{"model": "gpt-6.1-sol", "input": "hi", "metadata": {"k": "\\udfff"}}',
    ],
    ids=["in-string-input", "in-metadata"],
)
async def test_lone_surrogate_escape_is_a_400(
    http: aiohttp.ClientSession, emulator: Emulator, sidecar: Sidecar, frames: list[bytes], body: bytes
) -> None:
    reply = await post(http, sidecar.base_url, body)
    assert_openai_error(reply, 400)
    nothing_forwarded(emulator, frames)


@pytest.mark.parametrize("constant", [b"NaN", b"Infinity", b"-Infinity"])
async def test_non_json_constants_are_a_400(
    http: aiohttp.ClientSession, emulator: Emulator, sidecar: Sidecar, frames: list[bytes], constant: bytes
) -> None:
    body = b'{"model": "gpt-6.1-sol", "input": "hi", "temperature": ' + constant + b"}"
    reply = await post(http, sidecar.base_url, body)
    assert_openai_error(reply, 400)
    nothing_forwarded(emulator, frames)


async def test_big_integers_reach_the_upstream_unchanged(
    http: aiohttp.ClientSession, sidecar: Sidecar, frames: list[bytes]
) -> None:
    body = b'{"model": "gpt-6.1-sol", "input": "hi", "store": false, "metadata": {"n": 18446744073709551616}}'
    reply = await post(http, sidecar.base_url, body)
    assert reply.status == 200
    assert b"18446744073709551616" in frames[0], frames[0]


# -- huge and deep -----------------------------------------------------------------------------


async def test_ten_thousand_item_history(
    http: aiohttp.ClientSession, emulator: Emulator, sidecar: Sidecar, frames: list[bytes]
) -> None:
    conv = Conversation(http, sidecar.base_url, emulator)
    for i in range(5000):
        conv.items.append(user(f"question {i}"))
        conv.items.append({"role": "assistant", "content": f"answer {i}"})
    t0 = time.monotonic()
    first = await conv.turn("the 10,001st item")  # full send of 10,001 items
    assert first["context_items"] == 10_001 and first["continuation"] is False
    second = await conv.turn("and one more")  # a continuation: only the new item goes up
    elapsed = time.monotonic() - t0
    assert second["continuation"] is True and second["input_items"] == 1
    assert len(frames[-1]) < 2_000, "the continuation frame carried the history"
    assert second["context_digest"] == context_digest(conv.items[:-1])
    assert elapsed < 10, f"two turns of a 10k-item history took {elapsed:.1f} s"


async def test_deeply_nested_json_is_a_400_and_harmless(
    http: aiohttp.ClientSession, emulator: Emulator, sidecar: Sidecar, frames: list[bytes]
) -> None:
    depth = 100_000
    item = b'{"type": "message", "role": "user", "content": "hi", "x": ' + b"[" * depth + b"]" * depth + b"}"
    reply = await post(http, sidecar.base_url, b'{"model": "gpt-6.1-sol", "input": [' + item + b"]}")
    assert_openai_error(reply, 400)
    deep_object = b'{"a":' * depth + b"1" + b"}" * depth
    reply = await post(
        http, sidecar.base_url, b'{"model": "gpt-6.1-sol", "input": "hi", "metadata": ' + deep_object + b"}"
    )
    assert_openai_error(reply, 400)
    nothing_forwarded(emulator, frames)
    await still_serving(http, sidecar, emulator)


async def test_moderately_nested_unknown_field_is_forwarded_faithfully(
    http: aiohttp.ClientSession, emulator: Emulator, sidecar: Sidecar, frames: list[bytes]
) -> None:
    nested: Any = "leaf"
    for _ in range(200):
        nested = [nested]
    conv = Conversation(http, sidecar.base_url, emulator)
    conv.items.append({"type": "x_future_item", "payload": nested})
    await conv.turn()
    assert orjson.dumps({"type": "x_future_item", "payload": nested}) in frames[0]


# -- the body limit ------------------------------------------------------------------------------


@pytest.mark.parametrize("chunked", [False, True], ids=["content-length", "chunked"])
async def test_body_above_the_limit_is_a_413(
    http: aiohttp.ClientSession, emulator: Emulator, make_sidecar: SidecarFactory, frames: list[bytes], chunked: bool
) -> None:
    limit = 64 * 1024
    sc = await make_sidecar(limits={"max_body_bytes": limit})
    body = orjson.dumps({"model": MODEL, "input": "x" * (limit + 10)})

    async def chunks() -> Any:
        for i in range(0, len(body), 8192):
            yield body[i : i + 8192]
            await asyncio.sleep(0)

    data: Any = chunks() if chunked else body
    headers = {**auth(), "Content-Type": "application/json"}
    async with http.post(sc.base_url + "/responses", data=data, headers=headers) as resp:
        raw = await resp.read()
        assert ("Content-Length" in resp.request_info.headers) is not chunked
        from tests.reliability.helpers import Reply

        reply = Reply(resp.status, resp.headers, raw)
    assert_openai_error(reply, 413, "request_too_large")
    nothing_forwarded(emulator, frames)
    # Just under the limit is fine.
    conv = Conversation(http, sc.base_url, emulator)
    conv.items.append(user("y" * (limit - 200)))
    await conv.turn()


# -- unknown item types ----------------------------------------------------------------------------


async def test_unknown_item_types_pass_through_untouched(
    http: aiohttp.ClientSession, emulator: Emulator, sidecar: Sidecar, frames: list[bytes]
) -> None:
    future = {"type": "x_future_item", "id": "xf_1", "payload": {"n": [1, 2.5, -0.0, 1e-7], "s": "é🌧\u2028"}}
    raw_future = (
        b'{"type":"x_future_item","id":"xf_1","payload":{"s":"\\u00e9\xf0\x9f\x8c\xa7","n":[1,2.50,-0.0,1E-7]}}'  # noqa: E501
    )
    body = b'{"model":"gpt-6.1-sol","store":false,"input":[{"role":"user","content":"hi"},' + raw_future + b"]}"
    reply = await post(http, sidecar.base_url, body)
    assert reply.status == 200, reply.raw[:300]
    assert raw_future in frames[0], "a full send must splice the app's input bytes unchanged"
    items = orjson.loads(body)["input"]
    check_answer(emulator, reply.json, items)
    # A continuation that brings another unknown item: sent as parsed, values intact.
    items = items + reply.json["output"] + [dict(future, id="xf_2"), user("next")]
    reply = await post(http, sidecar.base_url, {"model": MODEL, "store": False, "input": items})
    record = check_answer(emulator, reply.json, items)
    assert record["continuation"] is True
    sent = orjson.loads(frames[-1])
    assert sent["input"] == [dict(future, id="xf_2"), user("next")]


# -- header injection ------------------------------------------------------------------------------


async def raw_request(port: int, data: bytes) -> bytes:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(data)
    await writer.drain()
    out = await asyncio.wait_for(reader.read(65536), 5)
    writer.close()
    return out


@pytest.mark.parametrize(
    "header",
    [
        b"X-Test: a\r\nAuthorization: Bearer sk-other\rInjected: 1",  # bare CR
        b"X-Test: a\n Injected: 1",  # obs-fold continuation line
        b"X-Test: a\x00Injected: 1",  # NUL
        b"X-Te st: a",  # space in a name
    ],
    ids=["bare-cr", "obs-fold", "nul", "space-in-name"],
)
async def test_header_injection_in_app_request_is_refused(
    http: aiohttp.ClientSession, emulator: Emulator, sidecar: Sidecar, frames: list[bytes], header: bytes
) -> None:
    body = b'{"model":"gpt-6.1-sol","input":"hi"}'
    request = (
        b"POST /v1/responses HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer " + KEY.encode() + b"\r\n"
        + header + b"\r\nContent-Type: application/json\r\nContent-Length: " + str(len(body)).encode()
        + b"\r\nConnection: close\r\n\r\n" + body
    )  # fmt: skip
    answer = await raw_request(sidecar.port, request)
    assert answer.startswith(b"HTTP/1.") and b" 400 " in answer.split(b"\r\n")[0], answer[:200]
    nothing_forwarded(emulator, frames)
    await still_serving(http, sidecar, emulator)


async def test_error_frame_headers_cannot_inject_response_headers(
    http: aiohttp.ClientSession, emulator: Emulator, sidecar: Sidecar
) -> None:
    emulator.faults.arm(
        "error",
        status=429,
        transport="ws",
        headers={
            "retry-after": "1\r\nSet-Cookie: session=stolen",
            "x-ratelimit-reset-requests": "2s\nX-Injected: 1",
            "x-ratelimit-remaining-requests": "0",
            "set-cookie": "session=stolen",
            "x-request-id": "req_forged",
            "content-type": "text/html",
            "location": "http://example.invalid/",
        },
    )
    reply = await post(http, sidecar.base_url, {"model": MODEL, "input": "hi", "store": False})
    assert_openai_error(reply, 429)
    headers = {k.lower(): v for k, v in reply.headers.items()}
    assert headers["x-ratelimit-remaining-requests"] == "0"  # a clean allowed header passes
    for name in ("set-cookie", "x-injected", "location", "retry-after", "x-ratelimit-reset-requests"):
        assert name not in headers, (name, headers)
    assert headers["x-request-id"] != "req_forged" and headers["content-type"].startswith("application/json")


async def test_app_headers_that_must_not_travel_are_dropped(
    http: aiohttp.ClientSession, make_emulator: EmulatorFactory, sidecar_for: SidecarFor
) -> None:
    seen: list[tuple[str, str, dict[str, str]]] = []
    emu = await make_emulator(seen=seen)
    sc = await sidecar_for(emu.base_url)
    hostile = {
        "Cookie": "session=app-cookie",
        "Proxy-Authorization": "Basic cHJveHk6c2VjcmV0",
        "Connection": "keep-alive, X-Hop-Secret",
        "X-Hop-Secret": "hop",
        "X-Forwarded-Host": "evil.invalid",
    }
    # WebSocket mode: the upgrade carries only identity headers.
    reply = await post(http, sc.base_url, {"model": MODEL, "input": "hi", "store": False}, headers=hostile)
    assert reply.status == 200
    # HTTP passthrough (background goes over HTTP): hop-by-hop and credentials of others dropped.
    reply = await post(http, sc.base_url, {"model": MODEL, "input": "hi", "background": True}, headers=hostile)
    assert reply.status == 200 and reply.mode == "passthrough"
    methods = {(method, path.split("?")[0]) for method, path, _ in seen}
    assert {("GET", "/v1/responses"), ("POST", "/v1/responses")} <= methods, methods
    for method, path, headers in seen:
        lowered = {k.lower(): v for k, v in headers.items()}
        assert lowered.get("authorization") == f"Bearer {KEY}", (method, path)
        for name in ("cookie", "proxy-authorization", "x-hop-secret"):
            assert name not in lowered, (method, path, name)
        if method == "GET":
            assert "x-forwarded-host" not in lowered  # the upgrade carries identity headers only
            assert lowered["host"] == f"127.0.0.1:{emu.port}"


@pytest.mark.parametrize("path", ["/v1/../admin", "/v1/%2e%2e/admin", "/v1/models/%2E%2E/%2e%2e/admin"])
async def test_dot_segments_never_leave_the_v1_prefix(
    http: aiohttp.ClientSession, make_emulator: EmulatorFactory, sidecar_for: SidecarFor, path: str
) -> None:
    seen: list[tuple[str, str, dict[str, str]]] = []
    emu = await make_emulator(seen=seen)
    sc = await sidecar_for(emu.base_url)
    request = f"GET {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer {KEY}\r\nConnection: close\r\n\r\n"
    answer = await raw_request(sc.port, request.encode())
    assert answer.startswith(b"HTTP/1.1 4"), answer[:100]
    forwarded = [p for _, p, _ in seen]
    assert not any(".." in p or "%2e" in p.lower() for p in forwarded), forwarded
