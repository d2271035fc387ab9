"""A clone without OpenAI's OpenAPI file (a user's checkout has no ../shared) still runs the
conformance suite: the SDK layer validates, nothing is skipped, and the run says which layer ran."""

from __future__ import annotations

import os
import subprocess
import sys

from tests.sidecar import ROOT


def test_without_the_openapi_file_the_sdk_layer_runs_and_nothing_skips() -> None:
    env = {**os.environ, "UPSHIFT_OPENAPI": str(ROOT / "no-such-openapi.yaml")}
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/conformance/test_negative.py"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    out = result.stdout + result.stderr
    assert result.returncode == 0, out
    assert "conformance: SDK models only" in out
    assert "skipped" not in out and " passed" in out
