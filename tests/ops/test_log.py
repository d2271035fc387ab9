"""JSON log lines and the redaction safety net."""

from __future__ import annotations

import asyncio
import io
import logging
import re
from collections.abc import Iterator
from typing import Any

import orjson
import pytest

from proxy.config import LoggingSettings
from proxy.observe.log import ACCESS_LOGGER, FLUSH_DELAY, REDACTED, BatchedHandler, access_log, redact, setup_logging

BEARER = "Bearer abc.DEF-123_xyz"
SK_KEY = "sk-proj-AbCdEf0123456789_-xyz"
TS = re.compile(r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z$")


@pytest.fixture
def stream() -> Iterator[io.StringIO]:
    """setup_logging() into a buffer; the root logger and switches restored afterwards."""
    root = logging.getLogger()
    saved = list(root.handlers), root.level
    levels = {name: logging.getLogger(name).level for name in ("websockets", "aiohttp.access")}
    buffer = io.StringIO()
    setup_logging(LoggingSettings(level="debug"), stream=buffer)
    yield buffer
    setup_logging(LoggingSettings())  # re-enable access_log for other tests
    root.handlers[:] = saved[0]
    root.setLevel(saved[1])
    for name, level in levels.items():
        logging.getLogger(name).setLevel(level)


def _lines(buffer: io.StringIO) -> list[dict[str, Any]]:
    text = buffer.getvalue()
    assert text.endswith("\n")
    return [orjson.loads(line) for line in text.splitlines()]


def test_one_json_object_per_record(stream: io.StringIO) -> None:
    log = logging.getLogger("upshift.test")
    log.info("hello %s", "world", extra={"request_id": "req_1", "status": 200})
    log.warning("second\nline")
    first, second = _lines(stream)
    assert TS.match(first["ts"]), first["ts"]
    assert first == {
        "ts": first["ts"],
        "level": "info",
        "logger": "upshift.test",
        "msg": "hello world",
        "request_id": "req_1",
        "status": 200,
    }
    assert (second["level"], second["msg"]) == ("warning", "second\nline")


def test_exception_and_odd_values(stream: io.StringIO) -> None:
    try:
        raise ValueError("boom")
    except ValueError:
        logging.getLogger("upshift.test").exception("failed", extra={"obj": object()})
    (line,) = _lines(stream)
    assert "ValueError: boom" in line["exc"]
    assert line["obj"].startswith("<object object")


def test_level_filters(stream: io.StringIO) -> None:
    setup_logging(LoggingSettings(level="warning"), stream=stream)
    logging.getLogger("upshift.test").info("hidden")
    logging.getLogger("upshift.test").error("shown")
    assert [line["msg"] for line in _lines(stream)] == ["shown"]


def test_redacts_secrets_in_msg_and_fields(stream: io.StringIO) -> None:
    log = logging.getLogger("upshift.test")
    log.info(
        "upstream said %s with key %s",
        BEARER,
        SK_KEY,
        extra={
            "detail": f"header Authorization: {BEARER}",
            "nested": {"list": [SK_KEY, 1], "ok": "fine"},
            "headers": {"Authorization": BEARER, "OpenAI-Api-Key": SK_KEY, "x-request-id": "r1"},
            "Authorization": BEARER,
            "api_key": SK_KEY,
        },
    )
    raw = stream.getvalue()
    assert "abc.DEF-123_xyz" not in raw
    assert "AbCdEf0123456789" not in raw
    (line,) = _lines(stream)
    assert line["msg"] == f"upstream said {REDACTED} with key {REDACTED}"
    assert line["detail"] == f"header {REDACTED}"
    assert line["nested"] == {"list": [REDACTED, 1], "ok": "fine"}
    assert line["headers"] == {"x-request-id": "r1"}
    assert "Authorization" not in line and "api_key" not in line


@pytest.mark.parametrize(
    ("text", "want"),
    [
        ("authorization=Bearer tok123", REDACTED),
        ('{"authorization": "Basic dXNlcjpwYXNz"}', '{"' + REDACTED + '"}'),
        ("bearer tok123 rest", f"{REDACTED} rest"),
        ("key sk-abcdefgh12 end", f"key {REDACTED} end"),
        ("sk-short", "sk-short"),  # too short to be a key; task-like ids stay readable
        ("no secrets here", "no secrets here"),
    ],
)
def test_redact_strings(text: str, want: str) -> None:
    assert redact(text) == want


def test_access_log_line(stream: io.StringIO) -> None:
    access_log({"request_id": "req_9", "mode": "continuation", "items_sent": 2, "status": 200, "msg": "x"})
    (line,) = _lines(stream)
    assert line["logger"] == ACCESS_LOGGER
    assert (line["request_id"], line["mode"], line["items_sent"], line["status"]) == (
        "req_9",
        "continuation",
        2,
        200,
    )
    assert line["f_msg"] == "x"  # a field named like a LogRecord attribute is kept, renamed


def test_access_log_switch(stream: io.StringIO) -> None:
    setup_logging(LoggingSettings(access_log=False), stream=stream)
    access_log({"request_id": "req_9"})
    assert stream.getvalue() == ""


def test_noisy_loggers_are_quiet(stream: io.StringIO) -> None:
    logging.getLogger("websockets.client").debug("> GET /v1/responses HTTP/1.1 authorization: Bearer x")
    logging.getLogger("aiohttp.access").info('127.0.0.1 "POST /v1/responses" 200')
    logging.getLogger("websockets.client").warning("kept")
    assert [line["msg"] for line in _lines(stream)] == ["kept"]


def test_setup_is_idempotent(stream: io.StringIO) -> None:
    setup_logging(LoggingSettings(level="debug"), stream=stream)
    logging.getLogger("upshift.test").info("once")
    assert len(_lines(stream)) == 1


def test_access_line_redacts_only_what_could_hold_a_secret(stream: io.StringIO) -> None:
    access_log(
        {
            "request_id": "req_1",
            "mode": "full",
            "items_in": 3,
            "added_ms": 0.5,
            "note": f"got {BEARER}",
            "authorization": BEARER,
            "nested": {"api_key": SK_KEY, "ok": 1},
        }  # fmt: skip
    )
    raw = stream.getvalue()
    assert "abc.DEF-123_xyz" not in raw and "AbCdEf0123456789" not in raw
    (line,) = _lines(stream)
    assert (line["request_id"], line["mode"], line["items_in"], line["added_ms"]) == ("req_1", "full", 3, 0.5)
    assert line["note"] == f"got {REDACTED}" and "authorization" not in line and line["nested"] == {"ok": 1}
    assert TS.match(line["ts"]) and line["msg"] == "access" and line["level"] == "info"


FIELDS = {"request_id": "req_7", "mode": "full", "items_in": 3, "note": f"got {BEARER}", "msg": "x"}


def test_access_fast_path_writes_the_same_line_as_the_logging_path(stream: io.StringIO) -> None:
    root = logging.getLogger()
    ours = [h for h in root.handlers if isinstance(h, BatchedHandler)]
    assert len(ours) == 1
    access_log(FIELDS)  # pytest's own handlers are on the root logger: the logging path
    others = [h for h in root.handlers if h not in ours]
    root.handlers[:] = ours  # as in the sidecar: only setup_logging's handler, the fast path
    try:
        access_log(FIELDS)
    finally:
        root.handlers[:] = ours + others
    logged, fast = _lines(stream)
    assert {k: v for k, v in fast.items() if k != "ts"} == {k: v for k, v in logged.items() if k != "ts"}
    assert fast["note"] == f"got {REDACTED}" and fast["f_msg"] == "x" and TS.match(fast["ts"])


async def test_lines_of_a_burst_are_written_together_and_a_warning_at_once() -> None:
    class Counting(io.StringIO):
        writes = 0

        def write(self, text: str) -> int:
            self.writes += 1
            return super().write(text)

    buffer = Counting()
    handler = BatchedHandler(buffer)
    handler.setFormatter(logging.Formatter("%(message)s"))
    log = logging.getLogger("upshift.test.batched")
    log.addHandler(handler)
    log.propagate = False
    log.setLevel(logging.INFO)
    try:
        log.info("one")
        log.info("two")
        assert buffer.getvalue() == ""  # waiting for the rest of the burst
        await asyncio.sleep(FLUSH_DELAY * 3)
        assert (buffer.getvalue(), buffer.writes) == ("one\ntwo\n", 1)
        log.info("three")
        log.warning("four")  # at once, after what waited: the order of lines never changes
        assert (buffer.getvalue(), buffer.writes) == ("one\ntwo\nthree\nfour\n", 2)
        log.info("five")
        handler.flush()  # as logging.shutdown() at exit
        assert buffer.getvalue().endswith("four\nfive\n")
    finally:
        log.removeHandler(handler)
        log.propagate = True


def test_without_an_event_loop_a_line_is_written_at_once() -> None:
    buffer = io.StringIO()
    handler = BatchedHandler(buffer)
    handler.setFormatter(logging.Formatter("%(message)s"))
    handler.handle(logging.LogRecord("x", logging.INFO, "", 0, "now", None, None))
    assert buffer.getvalue() == "now\n"


def test_a_line_never_waits_behind_the_timer_of_a_loop_that_is_gone() -> None:
    buffer = io.StringIO()
    handler = BatchedHandler(buffer)
    handler.setFormatter(logging.Formatter("%(message)s"))

    async def log(message: str) -> None:
        handler.handle(logging.LogRecord("x", logging.INFO, "", 0, message, None, None))

    asyncio.run(log("first"))  # its loop ends before the flush timer fires
    assert buffer.getvalue() == ""
    asyncio.run(log("second"))  # a new loop: what waited goes out now, not never
    assert buffer.getvalue() == "first\nsecond\n"
