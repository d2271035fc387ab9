"""``upshift doctor``: check an upstream (and a running sidecar) with the user's key and network.

With the configuration the sidecar reads (upstream URL, key source, identity headers, egress
proxy and CA; in passthrough mode the key comes from ``OPENAI_API_KEY``, as the SDKs read it),
a short scripted conversation with small responses answers what a deployment needs to know:
does ``POST /v1/responses`` answer, does the WebSocket upgrade pass this network, are
continuations answered on the socket and what they save here, does the upstream take
``stream_id`` lanes, is a ``store: false`` response continued on its socket, is a stored one
continued from a new socket, is ``/v1/responses/compact`` served, which service tier is served.
With ``--via`` the same conversation goes through a running sidecar, as an app's would.

Never a hammer: at most ``--max-requests`` requests (every HTTP request and every
``response.create``), at most two sockets, one at a time, and a refused upgrade is tried again
once at most (only after a 429's ``retry-after``).

Exit codes: 0 no check failed, 1 a check failed, 2 unusable arguments or configuration.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys

import orjson

from proxy.config import Settings
from proxy.config_load import load_settings
from proxy.errors import ConfigError
from proxy.intake.keys import KeySource
from proxy.ops.doctor_checks import Checks, Options
from proxy.ops.doctor_report import Check, Result, Status, render, to_json
from proxy.redact import redact_url
from proxy.upstream.egress import egress_for

__all__ = ["Check", "Result", "Status", "main"]

DEFAULT_MODEL = "gpt-6.1-terra"
"""A current, cheap model id (``--model`` chooses another)."""


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="upshift doctor",
        description="Check the upstream (and a running sidecar) with the sidecar's configuration: HTTP, the "
        "WebSocket upgrade, continuations, lanes, store:false, hydration, compaction and the service tier.",
        epilog="The upstream, key source, identity headers, egress proxy and CA come from the sidecar's own "
        "configuration (--config, UPSHIFT_* env vars); in passthrough mode the key is OPENAI_API_KEY. "
        "Exit status 1 when a check fails.",
    )
    p.add_argument("--config", metavar="PATH", help="the sidecar's YAML config file (env UPSHIFT_CONFIG)")
    p.add_argument("--upstream", metavar="URL", help="upstream base URL (default: the configuration's)")
    p.add_argument("--api-key-file", metavar="PATH", help="use the key in this file (as api_key.source=file)")
    p.add_argument("--model", default=DEFAULT_MODEL, help=f"model of the test responses ({DEFAULT_MODEL})")
    p.add_argument("--max-requests", type=int, default=12, metavar="N", help="requests to spend at most (12)")
    p.add_argument("--max-output-tokens", type=int, default=64, metavar="N", help="per response (64)")
    p.add_argument("--service-tier", metavar="TIER", help="ask for this tier (default, flex, priority, ...)")
    p.add_argument("--api-version", metavar="V", help="add ?api-version=V as an Azure app does")
    p.add_argument(
        "--key-header",
        metavar="NAME",
        help="passthrough mode: the header the app sends its key in (api-key for an Azure app; default api_key.header)",
    )
    p.add_argument("--via", metavar="URL", help="also run the conversation through this sidecar (its /v1 URL)")
    p.add_argument("--via-admin", metavar="URL", help="the sidecar's admin URL (default: --via's host, admin port)")
    p.add_argument("--timeout", type=float, default=30.0, metavar="S", help="seconds per request (30)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of lines")
    return p


def _key_setup(args: argparse.Namespace, settings: Settings) -> tuple[KeySource, dict[str, str], list[str]]:
    """The key source, the headers an app would send, and the secrets never to print.

    Raises:
        ConfigError: no usable key.
    """
    keys = KeySource(settings.api_key)
    if keys.injects:
        injected = (keys.authorization(None) or "").removeprefix("Bearer ").strip()
        return keys, {}, [injected]
    key = os.environ.get("OPENAI_API_KEY", "").strip()
    if not key:
        raise ConfigError("OPENAI_API_KEY is not set: in passthrough mode the key comes from it, as the SDKs read it")
    header = args.key_header or settings.api_key.header
    value = f"Bearer {key}" if header.lower() == "authorization" else key
    return keys, {header: value}, [key]


def _scrub(text: str, secrets: list[str]) -> str:
    for secret in secrets:
        if secret:
            text = text.replace(secret, "***")
    return text


def main(argv: list[str]) -> int:
    """``upshift doctor [flags]``; returns the exit code."""
    args = _parser().parse_args(argv)
    if args.max_requests < 1 or args.max_output_tokens < 16 or args.timeout <= 0:
        print("upshift doctor: --max-requests >= 1, --max-output-tokens >= 16, --timeout > 0", file=sys.stderr)
        return 2
    flags: dict[str, object] = {"upstream": args.upstream, "api_key.file": args.api_key_file}
    if args.api_key_file is not None:
        flags["api_key.source"] = "file"
    try:
        settings = load_settings(flags, os.environ, args.config)
        egress_for(settings)  # a proxy URL or CA file the sidecar would refuse
        keys, app_headers, secrets = _key_setup(args, settings)
    except ConfigError as exc:
        print(f"upshift doctor: configuration error: {exc}", file=sys.stderr)
        return 2
    options = Options(
        model=args.model,
        max_requests=args.max_requests,
        max_output_tokens=args.max_output_tokens,
        service_tier=args.service_tier,
        query=f"api-version={args.api_version}" if args.api_version else "",
        via=args.via,
        via_admin=args.via_admin,
        timeout=args.timeout,
    )
    checks = Checks(settings, keys, app_headers, options)
    try:
        results = asyncio.run(checks.run())
    except KeyboardInterrupt:
        return 130
    if args.json:
        out = orjson.dumps(to_json(results, checks.requests_sent), option=orjson.OPT_INDENT_2).decode() + "\n"
    else:
        head = f"upshift doctor: {redact_url(settings.upstream)} ({checks.path}), model {args.model}"
        out = render(results, checks.requests_sent, args.max_requests, head)
    sys.stdout.write(_scrub(out, secrets))
    return 1 if any(r.status is Status.FAIL for r in results.values()) else 0
