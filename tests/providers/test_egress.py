"""The network path of a real company: a mandatory forward proxy (tinyproxy on loopback) and
TLS to the upstream with a private CA (the emulator served over TLS with a trustme CA).

Continuations work through the proxy (both the WebSocket upgrade and the HTTP relay tunnel
through ``CONNECT``); a proxy that refuses the ``CONNECT`` gives the app a clear 502; the CA
comes from ``egress.ca_file`` or ``SSL_CERT_FILE``, and without it TLS fails cleanly.
"""

from __future__ import annotations

from pathlib import Path

import openai
import pytest
from openai import AsyncOpenAI
from websockets.exceptions import InvalidStatus

from proxy.config import EgressSettings, Settings
from proxy.errors import ConfigError
from proxy.intake.keys import KeySource
from proxy.upstream.egress import egress_for
from proxy.upstream.passthrough import Passthrough
from tests.clients.support import Capture, assert_continuations, assert_fidelity, run_loop_async, task_text
from tests.sidecar import Sidecar

from .support import Tinyproxy, TlsEmulator

STEPS = 3

# -- choosing the path (no network) -----------------------------------------------------------------

PROXY = "http://proxy.corp.example:3128"


def _egress(upstream: str, env: dict[str, str], proxy: str = "env") -> str | None:
    return egress_for(Settings(upstream=upstream, egress=EgressSettings(proxy=proxy)), env).proxy


@pytest.mark.parametrize(
    ("upstream", "env", "want"),
    [
        ("https://api.openai.com/v1", {"HTTPS_PROXY": PROXY}, PROXY),
        ("https://api.openai.com/v1", {"https_proxy": PROXY, "HTTPS_PROXY": "http://other:1"}, PROXY),
        ("https://api.openai.com/v1", {"HTTP_PROXY": PROXY}, None),
        ("http://gateway.internal/v1", {"HTTP_PROXY": PROXY, "HTTPS_PROXY": "http://other:1"}, PROXY),
        ("https://api.openai.com/v1", {"ALL_PROXY": PROXY}, PROXY),
        ("https://api.openai.com/v1", {"HTTPS_PROXY": "proxy.corp.example:3128"}, PROXY),
        ("https://api.openai.com/v1", {"HTTPS_PROXY": PROXY, "NO_PROXY": "openai.com"}, None),
        ("https://api.openai.com/v1", {"HTTPS_PROXY": PROXY, "no_proxy": ".openai.com,x"}, None),
        ("https://api.openai.com/v1", {"HTTPS_PROXY": PROXY, "NO_PROXY": "*"}, None),
        ("https://api.openai.com/v1", {"HTTPS_PROXY": PROXY, "NO_PROXY": "notopenai.com"}, PROXY),
        ("https://api.openai.com/v1", {"HTTPS_PROXY": PROXY, "NO_PROXY": "api.openai.com:80"}, PROXY),
        ("https://10.1.2.3/v1", {"HTTPS_PROXY": PROXY, "NO_PROXY": "10.0.0.0/8"}, None),
        ("https://127.0.0.1:8443/v1", {"HTTPS_PROXY": PROXY}, None),
        ("http://localhost:8080/v1", {"HTTP_PROXY": PROXY}, None),
        ("https://[::1]:8443/v1", {"HTTPS_PROXY": PROXY}, None),
    ],
)
def test_env_proxy_choice(upstream: str, env: dict[str, str], want: str | None) -> None:
    assert _egress(upstream, env) == want


def test_off_and_explicit_proxy() -> None:
    env = {"HTTPS_PROXY": PROXY}
    assert _egress("https://api.openai.com/v1", env, proxy="off") is None
    assert _egress("https://api.openai.com/v1", {}, proxy="http://127.0.0.1:3128") == "http://127.0.0.1:3128"
    # an explicit proxy is used for a loopback upstream too
    assert _egress("http://127.0.0.1:1/v1", {}, proxy="http://127.0.0.1:3128") == "http://127.0.0.1:3128"


@pytest.mark.parametrize(
    ("proxy", "bare", "auth", "for_ws"),
    [
        ("http://p:3128", "http://p:3128", None, "http://p:3128"),
        ("http://u:s%33cret@p:3128", "http://p:3128", "dTpzM2NyZXQ=", "http://u:s3cret@p:3128"),
        ("http://u:a%40b%3Ac@p:3128", "http://p:3128", "dTphQGI6Yw==", "http://u:a@b:c@p:3128"),
        ("http://u:a%2Fb@p:3128", "http://p:3128", "dTphL2I=", "http://u:a%2Fb@p:3128"),
    ],
)
def test_proxy_credentials(proxy: str, bare: str, auth: str | None, for_ws: str) -> None:
    egress = egress_for(Settings(upstream="https://api.openai.com/v1", egress=EgressSettings(proxy=proxy)))
    url, headers = egress.without_credentials()
    assert url == bare
    assert headers == ({"Proxy-Authorization": f"Basic {auth}"} if auth else {})
    assert egress.for_websockets() == for_ws
    assert "s3cret" not in egress.describe() and "a%40b" not in egress.describe()


def test_one_tls_context_for_both_clients(tmp_path: Path) -> None:
    settings = Settings(upstream="https://api.openai.com/v1")
    egress = egress_for(settings)
    assert egress.ssl is not None and egress_for(settings).ssl is egress.ssl
    assert Passthrough(settings, KeySource(settings.api_key)).egress.ssl is egress.ssl
    assert egress_for(Settings(upstream="http://127.0.0.1:1/v1")).ssl is None


def test_unreadable_ca_file_is_a_config_error(tmp_path: Path) -> None:
    bad = tmp_path / "ca.pem"
    bad.write_text("not a certificate")
    for path in (str(bad), str(tmp_path / "missing.pem")):
        settings = Settings(upstream="https://api.openai.com/v1", egress=EgressSettings(ca_file=path))
        with pytest.raises(ConfigError) as info:
            egress_for(settings)
        assert info.value.param == "egress.ca_file"


def test_env_proxy_of_unsupported_scheme_is_a_config_error() -> None:
    with pytest.raises(ConfigError):
        _egress("https://api.openai.com/v1", {"HTTPS_PROXY": "socks5://127.0.0.1:1080"})


# -- through a real proxy to a TLS upstream ---------------------------------------------------------


def _settings(upstream: str, proxy: str, ca_file: str = "") -> Settings:
    return Settings(upstream=upstream, egress=EgressSettings(proxy=proxy, ca_file=ca_file))


async def test_continuations_through_a_forward_proxy_to_a_tls_upstream(tmp_path: Path) -> None:
    async with TlsEmulator(tmp_path) as tls, Tinyproxy(tmp_path) as proxy:
        emulator = tls.emulator
        settings = _settings(tls.base_url, proxy.url, str(tls.ca_file))
        async with Sidecar(tls.base_url, settings=settings) as sidecar:
            capture = Capture()
            client = capture.async_client(sidecar.base_url)
            run = await run_loop_async(client, task_text(STEPS, "proxy"))
            models = await client.models.list()  # the HTTP relay takes the same path
            await client.close()
        assert "gpt-6.1-sol" in [m.id for m in models.data]
        assert run.tool_calls == STEPS
        assert_continuations(emulator, capture.bodies, run.response_ids, run.output_counts, capture.modes)
        assert_fidelity(emulator, capture.bodies, run.response_ids)
        # Every upstream connection went through the proxy: at least one socket, one HTTP request.
        assert proxy.connects(tls.port) >= 2, proxy.log.read_text()
        assert emulator.stats.other_requests.get("models") == 1


async def test_an_authenticating_proxy(tmp_path: Path) -> None:
    """Credentials in the proxy URL reach the proxy on both transports; without them the
    proxy's 407 gives the app a clear 502."""
    async with TlsEmulator(tmp_path) as tls, Tinyproxy(tmp_path, basic_auth=("upshift", "s3cret")) as proxy:
        authed = proxy.url.replace("http://", "http://upshift:s%33cret@")
        settings = _settings(tls.base_url, authed, str(tls.ca_file))
        async with Sidecar(tls.base_url, settings=settings) as sidecar:
            capture = Capture()
            client = capture.async_client(sidecar.base_url)
            run = await run_loop_async(client, task_text(1, "proxy-auth"))
            models = await client.models.list()
            await client.close()
        assert capture.modes == ["full", "continuation"] and models.data
        assert_fidelity(tls.emulator, capture.bodies, run.response_ids)
        async with Sidecar(tls.base_url, settings=_settings(tls.base_url, proxy.url, str(tls.ca_file))) as sidecar:
            client = AsyncOpenAI(base_url=sidecar.base_url, api_key="sk-test", max_retries=0)
            with pytest.raises(openai.APIStatusError) as info:
                await client.responses.create(model="gpt-6.1-sol", input="hi")
            await client.close()
        assert info.value.status_code == 502
        body = info.value.body
        assert isinstance(body, dict) and "(HTTP 407 to CONNECT)" in body["message"]


async def test_ssl_cert_file_is_honoured(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    async with TlsEmulator(tmp_path) as tls:
        monkeypatch.setenv("SSL_CERT_FILE", str(tls.ca_file))
        async with Sidecar(tls.base_url, settings=_settings(tls.base_url, "off")) as sidecar:
            capture = Capture()
            client = capture.async_client(sidecar.base_url)
            run = await run_loop_async(client, task_text(1, "ssl-cert-file"))
            await client.close()
        assert capture.modes == ["full", "continuation"]
        assert_fidelity(tls.emulator, capture.bodies, run.response_ids)


async def test_without_the_ca_the_app_gets_a_clean_502(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("SSL_CERT_FILE", raising=False)
    monkeypatch.delenv("SSL_CERT_DIR", raising=False)
    async with TlsEmulator(tmp_path) as tls, Sidecar(tls.base_url, settings=_settings(tls.base_url, "off")) as sc:
        client = AsyncOpenAI(base_url=sc.base_url, api_key="sk-test", max_retries=0)
        with pytest.raises(openai.APIStatusError) as info:
            await client.responses.create(model="gpt-6.1-sol", input="hi")
        await client.close()
    assert info.value.status_code == 502
    assert info.value.response.headers["x-upshift-mode"] == "passthrough"
    error = info.value.body
    assert isinstance(error, dict) and error["code"] == "upstream_unavailable"
    assert "certificate" in error["message"].lower(), error
    assert tls.emulator.stats.requests["ws"] == 0 and tls.emulator.stats.requests["http"] == 0


async def test_a_refused_connect_gives_a_clear_502(tmp_path: Path) -> None:
    async with TlsEmulator(tmp_path) as tls, Tinyproxy(tmp_path, connect_ports=(443,)) as proxy:
        settings = _settings(tls.base_url, proxy.url, str(tls.ca_file))
        async with Sidecar(tls.base_url, settings=settings) as sidecar:
            client = AsyncOpenAI(base_url=sidecar.base_url, api_key="sk-test", max_retries=0)
            with pytest.raises(openai.APIStatusError) as info:
                await client.responses.create(model="gpt-6.1-sol", input="hi")
            with pytest.raises(openai.APIStatusError) as streamed:
                await client.responses.create(model="gpt-6.1-sol", input="hi", stream=True)
            with pytest.raises(openai.APIStatusError) as other:
                await client.models.list()
            await client.close()
        for exc in (info.value, streamed.value, other.value):
            assert exc.status_code == 502
            body = exc.body
            assert isinstance(body, dict), body
            assert body["type"] == "server_error" and body["code"] == "upstream_unavailable"
            assert body["message"].startswith("The egress proxy refused the connection to the upstream (HTTP 403")
            assert proxy.url not in body["message"]
        # the WebSocket attempt was refused first, then the HTTP fallback, by the same proxy
        assert proxy.refused() >= 4
        assert tls.emulator.stats.requests["ws"] == 0 and tls.emulator.stats.requests["http"] == 0


async def test_a_refused_connect_on_the_websocket_relay_is_426(tmp_path: Path) -> None:
    """A WebSocket app (``client.responses.connect()``) gets 426, the "use HTTP" signal."""
    async with TlsEmulator(tmp_path) as tls, Tinyproxy(tmp_path, connect_ports=(443,)) as proxy:
        settings = _settings(tls.base_url, proxy.url, str(tls.ca_file))
        async with Sidecar(tls.base_url, settings=settings) as sidecar:
            client = AsyncOpenAI(base_url=sidecar.base_url, api_key="sk-test", max_retries=0)
            with pytest.raises(InvalidStatus) as info:
                async with client.responses.connect() as conn:
                    await conn.response.create(model="gpt-6.1-sol", input="hi")
            await client.close()
        assert info.value.response.status_code == 426
        assert b"egress proxy refused" in (info.value.response.body or b"")
        assert proxy.refused() >= 1
