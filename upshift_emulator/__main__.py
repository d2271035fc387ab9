"""``python -m upshift_emulator --listen 127.0.0.1:9100``: run the emulated upstream.

Precedence: flag > ``--config`` file > default. Latency defaults to zero; ``--latency-preset
realistic`` (GPT-5-class) or ``fast`` (fast coding model) gives the documented figures.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import logging
import signal
import ssl
import sys
from collections.abc import Sequence
from typing import Any

from .config import FAST_LATENCY, LATENCY_PRESETS, REALISTIC_LATENCY, EmulatorConfig, load_config_file
from .server import Emulator

__all__ = ["build_parser", "config_from_args", "main", "parse_listen", "tls_context"]

_LATENCY_HELP = f"""latency model (all 0 by default; see docs/emulator.md for sources):
  realistic preset (GPT-5-class): {dataclasses.asdict(REALISTIC_LATENCY)}
  fast preset (fast coding model): {dataclasses.asdict(FAST_LATENCY)}
  ~65 tokens/s is typical of GPT-5-class models, >1,000 tokens/s of the fast coding model;
  per-turn overhead is dominated by re-processing history, hence rebuild-ms-per-kb."""


def parse_listen(value: str) -> tuple[str, int]:
    """``HOST:PORT``, ``[V6]:PORT`` or ``:PORT`` (host 127.0.0.1)."""
    host, sep, port = value.rpartition(":")
    if not sep or not port.isdigit():
        raise argparse.ArgumentTypeError(f"expected HOST:PORT, got {value!r}")
    host = host.strip("[]") or "127.0.0.1"
    return host, int(port)


def build_parser() -> argparse.ArgumentParser:
    """Every flag, with its default in the help text."""
    p = argparse.ArgumentParser(
        prog="python -m upshift_emulator",
        description="Emulated OpenAI Responses API (HTTP + WebSocket mode) for tests, benchmarks and demos.",
        epilog=_LATENCY_HELP,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    d = EmulatorConfig()
    p.add_argument("--listen", type=parse_listen, default=("127.0.0.1", 9100), help="HOST:PORT (127.0.0.1:9100)")
    p.add_argument("--config", help="YAML/JSON file: EmulatorConfig keys plus a 'latency' section")
    lat = p.add_argument_group("latency")
    lat.add_argument("--latency-preset", choices=sorted(LATENCY_PRESETS), help="start from a preset (zero)")
    lat.add_argument("--overhead-ms", type=float, help="fixed per-request cost before response.created (0)")
    lat.add_argument("--rebuild-ms-per-kb", type=float, help="per KiB of context not in the connection cache (0)")
    lat.add_argument("--ttft-ms", type=float, help="time to first token after the rebuild (0)")
    lat.add_argument("--tokens-per-second", type=float, help="output speed, 0 = instant (0)")
    lat.add_argument("--rtt-ms", type=float, help="network round trip: RTT/2 on every message each way (0)")
    lat.add_argument("--connect-ms", type=float, help="TCP+TLS setup of each new connection (0)")
    ws = p.add_argument_group("websocket mode")
    ws.add_argument("--ws-max-age", type=float, help=f"connection age limit in seconds ({d.ws_max_age_s:g})")
    ws.add_argument("--ws-keep-open-on-age-limit", action="store_true", help="do not close after the age error")
    ws.add_argument(
        "--ws-age-limit-close-code", type=int, help=f"close code after the age error ({d.ws_age_limit_close_code})"
    )
    ws.add_argument("--ws-idle-timeout", type=float, help="close idle sockets after N seconds, 0 = never (0)")
    ws.add_argument(
        "--ws-max-message-bytes", type=int, help=f"largest client frame, else close 1009 ({d.ws_max_message_bytes})"
    )
    ws.add_argument("--ws-max-in-flight", type=int, help=f"responses running per connection ({d.ws_max_in_flight})")
    ws.add_argument(
        "--ws-max-named-streams", type=int, help=f"distinct stream_ids per connection ({d.ws_max_named_streams})"
    )
    ws.add_argument("--ws-no-compress", action="store_true", help="refuse permessage-deflate")
    ws.add_argument(
        "--ws-max-connections-per-key", type=int, help="open sockets per key, then upgrades get 429; 0 = no cap (0)"
    )
    ws.add_argument(
        "--ws-connection-retry-after",
        type=float,
        help=f"retry-after seconds on a capped upgrade ({d.ws_connection_retry_after_s:g})",
    )
    ws.add_argument(
        "--ws-stream-ids",
        choices=("lanes", "reject", "close"),
        help="stream_id lanes, or a lane-less upstream: unknown_parameter error / close (lanes)",
    )
    ws.add_argument(
        "--ws-reject-close-code", type=int, help=f"close code of --ws-stream-ids close ({d.ws_reject_close_code})"
    )
    ws.add_argument("--steer-models", help="comma-separated models that support response.steer ('*' = all; none)")
    api = p.add_argument_group("api behaviour")
    api.add_argument(
        "--require-key",
        action="append",
        help="accept only these keys (repeatable; default: any key not starting with sk-bad)",
    )
    api.add_argument("--no-isolate-keys", action="store_true", help="let any key read any stored response")
    api.add_argument("--allow-unknown-params", action="store_true", help="do not 400 on unknown body fields")
    api.add_argument("--no-validate-tool-pairs", action="store_true", help="do not 400 on unpaired tool calls/outputs")
    api.add_argument("--no-obfuscation", action="store_true", help="never add 'obfuscation' to SSE deltas")
    api.add_argument("--reply-bytes", type=int, help=f"plain reply size ({d.reply_bytes})")
    api.add_argument("--delta-chars", type=int, help=f"characters per delta event ({d.delta_chars})")
    api.add_argument("--models", help="comma-separated ids for GET /v1/models")
    api.add_argument(
        "--background-delay", type=float, help=f"seconds a background response stays queued ({d.background_delay_s:g})"
    )
    today = p.add_argument_group("today's protocol (protocol.md §7)")
    today.add_argument("--no-ws-obfuscation", action="store_true", help="never add 'obfuscation' to WebSocket deltas")
    today.add_argument(
        "--safeguard-pause", type=float, help=f"seconds a 'safeguard' answer pauses ({d.safeguard_pause_s:g})"
    )
    today.add_argument("--ultrafast-models", help="comma-separated models served on service_tier ultrafast")
    today.add_argument("--ultrafast-fallback-every", type=int, help="every Nth ultrafast request served on default (0)")
    today.add_argument("--ultrafast-rate-limit", type=int, help="ultrafast requests a minute per key (0: none)")
    today.add_argument("--encrypted-reasoning-models", help="models with encrypted reasoning by default")
    tls = p.add_argument_group("tls")
    tls.add_argument("--tls-cert", help="PEM certificate chain: serve HTTPS and wss:// (with --tls-key)")
    tls.add_argument("--tls-key", help="PEM private key of --tls-cert")
    p.add_argument("--log-level", default="INFO", help="logging level (INFO)")
    return p  # fmt: skip


def _names(value: str | None) -> tuple[str, ...] | None:
    return tuple(m.strip() for m in value.split(",") if m.strip()) if value else None


def config_from_args(args: argparse.Namespace) -> EmulatorConfig:
    """File (if any) then flags."""
    config = load_config_file(args.config) if args.config else EmulatorConfig()
    latency = LATENCY_PRESETS[args.latency_preset] if args.latency_preset else config.latency
    overrides = {
        name: getattr(args, name)
        for name in ("overhead_ms", "rebuild_ms_per_kb", "ttft_ms", "tokens_per_second", "rtt_ms", "connect_ms")
        if getattr(args, name) is not None
    }
    changes: dict[str, Any] = {"latency": dataclasses.replace(latency, **overrides)}
    flags = {
        "ws_max_age_s": args.ws_max_age,
        "ws_age_limit_close_code": args.ws_age_limit_close_code,
        "ws_idle_timeout_s": args.ws_idle_timeout,
        "ws_max_message_bytes": args.ws_max_message_bytes,
        "ws_max_in_flight": args.ws_max_in_flight,
        "ws_max_named_streams": args.ws_max_named_streams,
        "ws_max_connections_per_key": args.ws_max_connections_per_key,
        "ws_connection_retry_after_s": args.ws_connection_retry_after,
        "ws_stream_ids": args.ws_stream_ids,
        "ws_reject_close_code": args.ws_reject_close_code,
        "steer_models": tuple(m.strip() for m in args.steer_models.split(",") if m.strip())
        if args.steer_models
        else None,
        "reply_bytes": args.reply_bytes,
        "delta_chars": args.delta_chars,
        "background_delay_s": args.background_delay,
        "require_keys": tuple(args.require_key) if args.require_key else None,
        "models": tuple(m.strip() for m in args.models.split(",") if m.strip()) if args.models else None,
        "safeguard_pause_s": args.safeguard_pause,
        "ultrafast_models": _names(args.ultrafast_models),
        "ultrafast_fallback_every": args.ultrafast_fallback_every,
        "ultrafast_rate_limit": args.ultrafast_rate_limit,
        "encrypted_reasoning_models": _names(args.encrypted_reasoning_models),
    }
    changes.update({k: v for k, v in flags.items() if v is not None})
    for flag, field, value in (
        (args.ws_keep_open_on_age_limit, "ws_close_on_age_limit", False),
        (args.ws_no_compress, "ws_compress", False),
        (args.no_isolate_keys, "isolate_keys", False),
        (args.allow_unknown_params, "reject_unknown_params", False),
        (args.no_validate_tool_pairs, "validate_tool_pairs", False),
        (args.no_obfuscation, "http_obfuscation", False),
        (args.no_ws_obfuscation, "ws_obfuscation", False),
    ):
        if flag:
            changes[field] = value
    return config.replace(**changes)


def tls_context(cert: str | None, key: str | None) -> ssl.SSLContext | None:
    """The server context of ``--tls-cert`` / ``--tls-key`` (None: plain HTTP)."""
    if not cert and not key:
        return None
    if not cert or not key:
        raise ValueError("--tls-cert and --tls-key go together")
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.load_cert_chain(cert, key)
    return context


async def _serve(config: EmulatorConfig, host: str, port: int, context: ssl.SSLContext | None = None) -> None:
    emulator = Emulator(config)
    await emulator.start(host, port, ssl_context=context)
    logging.getLogger("upshift_emulator").info(
        "emulator listening on %s (WebSocket %s)", emulator.base_url, emulator.ws_url
    )
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        with contextlib.suppress(NotImplementedError):
            loop.add_signal_handler(sig, stop.set)
    try:
        await stop.wait()
    finally:
        await emulator.stop()


def main(argv: Sequence[str] | None = None) -> int:
    """CLI entry point; returns the exit code."""
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s %(message)s")
    try:
        config = config_from_args(args)
        context = tls_context(args.tls_cert, args.tls_key)
    except (OSError, ValueError, KeyError, ssl.SSLError) as exc:
        print(f"emulator: {exc}", file=sys.stderr)
        return 1
    host, port = args.listen
    asyncio.run(_serve(config, host, port, context))
    return 0


if __name__ == "__main__":
    sys.exit(main())
