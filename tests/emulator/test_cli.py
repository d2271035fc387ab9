"""The command line: flags, config file, and a real ``python -m upshift_emulator`` process."""

from __future__ import annotations

import asyncio
import ssl
import sys
from pathlib import Path

import aiohttp
import pytest

from bench.ports import free_port
from upshift_emulator import REALISTIC_LATENCY, load_config_file
from upshift_emulator.__main__ import build_parser, config_from_args, parse_listen, tls_context

pytestmark = pytest.mark.timeout(30)


def test_parse_listen() -> None:
    assert parse_listen("127.0.0.1:9100") == ("127.0.0.1", 9100)
    assert parse_listen("[::1]:80") == ("::1", 80)
    assert parse_listen(":81") == ("127.0.0.1", 81)


def test_flags_override_file(tmp_path: Path) -> None:
    path = tmp_path / "emu.yaml"
    path.write_text("latency:\n  preset: realistic\n  ttft_ms: 10\nws_max_age_s: 5\nreply_bytes: 300\n")
    config = load_config_file(path)
    assert config.latency.ttft_ms == 10 and config.latency.tokens_per_second == REALISTIC_LATENCY.tokens_per_second
    args = build_parser().parse_args(
        ["--config", str(path), "--ws-max-age", "1", "--require-key", "sk-a", "--ws-no-compress"]
    )
    merged = config_from_args(args)
    assert merged.ws_max_age_s == 1 and merged.reply_bytes == 300 and merged.latency.ttft_ms == 10
    assert merged.require_keys == ("sk-a",) and merged.ws_compress is False
    (tmp_path / "bad.yaml").write_text("nope: 1\n")
    with pytest.raises(ValueError):
        load_config_file(tmp_path / "bad.yaml")


def test_help_documents_defaults(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--help"])
    out = capsys.readouterr().out
    assert "3600" in out and "65" in out and "1000" in out and "127.0.0.1:9100" in out


async def test_module_runs(tmp_path: Path) -> None:
    port = free_port()
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "upshift_emulator", "--listen", f"127.0.0.1:{port}", "--ws-max-age", "60",
        stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.DEVNULL,
    )  # fmt: skip
    try:
        async with aiohttp.ClientSession() as session:
            for _ in range(100):
                try:
                    async with session.get(f"http://127.0.0.1:{port}/_emulator/config") as resp:
                        config = await resp.json()
                        break
                except aiohttp.ClientConnectionError:
                    await asyncio.sleep(0.05)
            else:
                pytest.fail("emulator did not start")
        assert config["ws_max_age_s"] == 60
    finally:
        proc.terminate()
        assert await asyncio.wait_for(proc.wait(), 10) == 0


async def test_module_serves_tls_with_cert_and_key(tmp_path: Path) -> None:
    trustme = pytest.importorskip("trustme", reason="trustme is in the test extra: pip install -e '.[test]'")
    ca = trustme.CA()
    cert = ca.issue_cert("127.0.0.1")
    chain, key = tmp_path / "server.pem", tmp_path / "server.key"
    chain.write_bytes(b"".join(blob.bytes() for blob in cert.cert_chain_pems))
    cert.private_key_pem.write_to_path(str(key))
    port = free_port()
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "upshift_emulator", "--listen", f"127.0.0.1:{port}",
        "--tls-cert", str(chain), "--tls-key", str(key),
        stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.DEVNULL,
    )  # fmt: skip
    context = ssl.create_default_context()
    ca.configure_trust(context)
    try:
        async with aiohttp.ClientSession() as session:
            for _ in range(100):
                try:
                    async with session.get(f"https://127.0.0.1:{port}/_emulator/health", ssl=context) as resp:
                        assert resp.status == 200
                        break
                except aiohttp.ClientConnectionError:
                    await asyncio.sleep(0.05)
            else:
                pytest.fail("emulator did not start")
            with pytest.raises(aiohttp.ClientConnectorCertificateError):  # not a CA of this machine's
                await session.get(f"https://127.0.0.1:{port}/_emulator/health")
    finally:
        proc.terminate()
        assert await asyncio.wait_for(proc.wait(), 10) == 0


def test_tls_needs_both_cert_and_key() -> None:
    assert tls_context(None, None) is None
    with pytest.raises(ValueError, match="go together"):
        tls_context("server.pem", None)
