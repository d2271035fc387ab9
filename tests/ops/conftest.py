"""Fixtures of tests/ops: the access log of in-process sidecars, captured as JSON lines."""

from __future__ import annotations

import io
import logging
from collections.abc import Callable, Iterator
from typing import Any

import orjson
import pytest

from proxy.observe.log import ACCESS_LOGGER, JsonFormatter
from proxy.observe.misses import RECENT

AccessLines = Callable[[], list[dict[str, Any]]]


@pytest.fixture
def access_log() -> Iterator[tuple[AccessLines, io.StringIO]]:
    """The access lines written while the test runs (the real JSON formatter), and the raw text."""
    buffer = io.StringIO()
    handler = logging.StreamHandler(buffer)
    handler.setFormatter(JsonFormatter())
    logger = logging.getLogger(ACCESS_LOGGER)
    level = logger.level
    logger.setLevel(logging.INFO)
    logger.addHandler(handler)
    RECENT.clear()

    def lines() -> list[dict[str, Any]]:
        return [orjson.loads(line) for line in buffer.getvalue().splitlines() if line.strip()]

    try:
        yield lines, buffer
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
