"""Request bodies with a ``Content-Encoding``: gzip and deflate bodies are decoded as they are
read, within the body limit (a zip bomb gets 413 at the limit, never the whole
bomb in memory), and any other ``Content-Encoding`` gets 415, unread. The model sees exactly
the decoded history."""

from __future__ import annotations

import gzip
import zlib

import aiohttp
import orjson
import pytest

from tests.exposition import metric
from tests.security.ingress import ALICE, Spawn, metrics, openai_error, started
from upshift_emulator import Emulator, context_digest

pytestmark = pytest.mark.timeout(90)

MIB = 1024 * 1024


def _history(tag: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": f"{tag} " + "compressible words " * 5000}]


async def _post(side_url: str, data: bytes, encoding: str) -> tuple[int, bytes]:
    headers = {"Authorization": f"Bearer {ALICE}", "Content-Type": "application/json", "Content-Encoding": encoding}
    async with aiohttp.ClientSession() as http:
        async with http.post(side_url + "/responses", data=data, headers=headers) as resp:
            return resp.status, await resp.read()


@pytest.mark.parametrize(
    ("encoding", "encode"),
    [
        ("gzip", gzip.compress),
        ("deflate", zlib.compress),  # RFC 9110's deflate: the zlib format
        ("deflate", lambda b: zlib.compress(b)[2:-4]),  # raw deflate, as some clients send it
    ],
    ids=["gzip", "deflate", "raw-deflate"],
)
async def test_a_compressed_body_is_decoded_and_the_model_sees_exactly_it(
    emulator: Emulator, spawn: Spawn, encoding: str, encode: object
) -> None:
    side = await started(spawn, emulator.base_url)
    history = _history(encoding)
    plain = orjson.dumps({"model": "gpt-6.1-sol", "input": history, "store": False})
    packed = encode(plain)  # type: ignore[operator]
    assert len(packed) < len(plain) // 10
    status, data = await _post(side.base_url, packed, encoding)
    assert status == 200, data[:300]
    record = emulator.record(orjson.loads(data)["id"])
    assert record is not None and record["context_digest"] == context_digest(history)
    # Over plain HTTP too (the relayed request is sent decoded, without the encoding header).
    http_side = await started(spawn, emulator.base_url, UPSHIFT_MODE="http")
    status, data = await _post(http_side.base_url, packed, encoding)
    assert status == 200, data[:300]
    record = emulator.record(orjson.loads(data)["id"])
    assert record is not None and record["context_digest"] == context_digest(history)


async def test_a_zip_bomb_is_a_413_at_the_limit(emulator: Emulator, spawn: Spawn) -> None:
    side = await started(spawn, emulator.base_url, UPSHIFT_LIMITS_MEMORY_BYTES=str(256 * MIB))
    # 1 GiB of zeros in about 1 MB: far above the body limit (~40 MiB) once decoded.
    bomb = zlib.compressobj(9, zlib.DEFLATED, 31)
    chunk = bytes(MIB)
    packed = b"".join(bomb.compress(chunk) for _ in range(1024)) + bomb.flush()
    assert len(packed) < 2 * MIB
    status, data = await _post(side.base_url, packed, "gzip")
    assert status == 413, data[:300]
    openai_error(data, "request_too_large")
    assert sum(emulator.stats.requests.values()) == 0
    text = await metrics(side)
    rss = metric(text, "upshift_memory_rss_bytes")
    assert rss < 256 * MIB, rss / MIB  # never the decoded gigabyte
    # The control: the next request on the same sidecar is served.
    status, _ = await _post(side.base_url, gzip.compress(orjson.dumps({"model": "gpt-6.1-sol", "input": "hi"})), "gzip")
    assert status == 200


@pytest.mark.parametrize("encoding", ["br", "zstd", "compress", "x-custom", "gzip, gzip"])
async def test_an_unknown_encoding_is_a_415_unread(emulator: Emulator, spawn: Spawn, encoding: str) -> None:
    side = await started(spawn, emulator.base_url)
    status, data = await _post(side.base_url, b"\x00\x01 not json at all", encoding)
    assert status == 415, data[:300]
    openai_error(data, "unsupported_content_encoding")
    assert sum(emulator.stats.requests.values()) == 0
