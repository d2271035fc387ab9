"""An injected key behind a listener other apps' machines reach needs the Host names it answers
to: with ``api_key.source`` ``file`` or ``env``, a non-loopback ``listen`` and no
``listener.allowed_hosts``, every ``Host`` would be answered with the key (a DNS-rebound page
in a browser on a laptop running the sidecar in a container on ``0.0.0.0``), so the sidecar
refuses to start and says what to set."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tests.sidecar import ROOT

pytestmark = pytest.mark.timeout(90)


def _load(*args: str, **env: str) -> subprocess.CompletedProcess[str]:
    """``python -m proxy --print-config`` (the loader every start runs) with ``env``."""
    child = {k: v for k, v in os.environ.items() if not k.startswith(("UPSHIFT_", "OPENAI_", "KUBERNETES_"))}
    child.update(UPSHIFT_API_KEY_SOURCE="env", UPSHIFT_API_KEY_ENV="HOSTS_TEST_KEY", HOSTS_TEST_KEY="sk-injected-0123")
    child.update(env)
    return subprocess.run(
        [sys.executable, "-m", "proxy", *args, "--print-config"],
        cwd=ROOT,
        env=child,
        capture_output=True,
        text=True,
        timeout=30,
    )


@pytest.mark.parametrize("listen", ["0.0.0.0:8080", "[::]:8080", "10.0.0.5:8080", "upshift.internal:8080"])
def test_an_injected_key_on_an_open_listener_without_allowed_hosts_does_not_start(listen: str) -> None:
    out = _load("--listen", listen)
    assert out.returncode == 1, out.stdout
    assert "listener.allowed_hosts" in out.stderr and "UPSHIFT_LISTENER_ALLOWED_HOSTS" in out.stderr, out.stderr
    assert "sk-injected" not in out.stdout + out.stderr
    file = _load("--listen", listen, UPSHIFT_API_KEY_SOURCE="file", UPSHIFT_API_KEY_FILE="/nonexistent/key")
    assert file.returncode == 1 and "listener.allowed_hosts" in file.stderr, file.stderr


def test_the_legitimate_setups_still_start() -> None:
    # An injected key on loopback (the laptop), with the Host names given (a gateway), and an
    # open listener passing each app's own key through (the gateway default) all load.
    for args, env in [
        (("--listen", "127.0.0.1:8080"), {}),
        (("--listen", "[::1]:8080"), {}),
        (("--listen", "localhost:8080"), {}),
        (("--listen", "0.0.0.0:8080"), {"UPSHIFT_LISTENER_ALLOWED_HOSTS": "upshift-gateway,upshift-gateway:8080"}),
        (("--listen", "0.0.0.0:8080"), {"UPSHIFT_API_KEY_SOURCE": "passthrough"}),
    ]:
        out = _load(*args, **env)
        assert out.returncode == 0, (args, env, out.stderr)
