"""A URL's secrets never reach a text, whatever characters they hold: a password with a quote,
a space, a ``/``, ``#`` or ``@`` is hidden as a plain one is (the redaction parses the URL up to
its last ``@`` and masks the configured URLs' secrets wherever they appear, never stopping at a
character a password may contain)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from proxy.redact import redact_urls
from tests.sidecar import ROOT

pytestmark = pytest.mark.timeout(90)

CANARY = "CANARY7c1e"
PASSWORDS = [f"p'{CANARY}", f'p"{CANARY}', f"p {CANARY}", f"p/{CANARY}#x", f"p@{CANARY}", f"p<{CANARY}>"]


def _start(proxy: str) -> str:
    """What ``python -m proxy`` prints when started with ``proxy`` as its egress proxy."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("UPSHIFT_", "OPENAI_"))}
    env["UPSHIFT_EGRESS_PROXY"] = proxy
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "proxy",
            "--upstream",
            "https://r.example/v1",
            "--listen",
            "127.0.0.1:0",
            "--admin-listen",
            "127.0.0.1:0",
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        timeout=30,
    )
    assert out.returncode == 1, out
    return out.stdout.decode() + out.stderr.decode()


@pytest.mark.parametrize("password", PASSWORDS, ids=["quote", "dquote", "space", "slash-hash", "at", "angle"])
def test_a_proxy_password_with_any_character_is_never_printed(password: str) -> None:
    # The attack: a password holding a quote ended the URL's redaction at the quote, and the
    # start-up error (a proxy URL with a path) printed the rest of it.
    printed = _start(f"http://user:{password}@127.0.0.1:9/x")
    assert CANARY not in printed, printed
    # The control: the error still says what is wrong and which proxy it is.
    assert "egress.proxy" in printed and "user:***@127.0.0.1:9" in printed, printed


def test_urls_in_any_text_are_redacted_through_quotes() -> None:
    texts = [
        f"\"http://user:p'{CANARY}@h.example:3128/x\" isn't a valid proxy",
        f"InvalidURL('http://u:p\"{CANARY}@h.example')",
        f"wss://h.example/v1/responses?api-key={CANARY}' refused",
        f"https://{CANARY}@h.example/v1,http://h.example/",
    ]
    for text in texts:
        assert CANARY not in redact_urls(text), text
    # The control: what is not a secret is shown as it is.
    kept = "upstream https://api.openai.com/v1?api-version=2025-01-01 answered 'ok' (200)"
    assert redact_urls(kept) == kept
