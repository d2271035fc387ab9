"""Command line: ``upshift [flags]`` runs the sidecar; ``upshift demo ...`` runs the demo;
``upshift explain PREVIOUS RESPONSE NEXT`` explains whether a saved request would continue;
``upshift doctor`` checks the upstream and a running sidecar with the sidecar's configuration.

Flags override env vars (``UPSHIFT_*``), which override the YAML file, which overrides the
defaults (see :func:`proxy.config_load.load_settings`). Exit codes: 0 ok, 1 configuration error,
2 usage error (argparse), 130 interrupted; otherwise whatever the server returns.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import os
import sys
from importlib.metadata import PackageNotFoundError, version

import yaml

from proxy.build import build_kind
from proxy.config_load import CONFIG_ENV, load_settings, settings_to_dict
from proxy.errors import ConfigError
from proxy.intake.keys import KeySource
from proxy.loop import loop_name
from proxy.observe.log import setup_logging
from proxy.upstream.egress import egress_for

__all__ = ["main"]

log = logging.getLogger("upshift")

# Flag destination -> dotted setting key. Flags hold None unless given, so only flags the
# user typed override env and file.
_FLAG_KEYS = {
    "listen": "listen",
    "admin_listen": "admin_listen",
    "upstream": "upstream",
    "mode": "mode",
    "log_level": "logging.level",
    "api_key_file": "api_key.file",
    "workers": "workers",
}


def _version() -> str:
    try:
        return version("upshift")
    except PackageNotFoundError:  # running from a source tree that was never installed
        return "0+unknown"


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="upshift",
        description="Sidecar relaying full-history Responses API calls as WebSocket continuations.",
        epilog="Every setting is also a config-file key and an UPSHIFT_<SECTION>_<KEY> env var; "
        "precedence: flags > env > file > defaults. 'upshift demo --help' runs the demo; "
        "'upshift explain --help' explains a miss; "
        "'upshift doctor --help' checks the upstream before you deploy.",
    )
    p.add_argument("--listen", metavar="HOST:PORT", help="API listener (default 127.0.0.1:8080)")
    p.add_argument(
        "--admin-listen",
        metavar="HOST:PORT",
        help="admin listener (default 127.0.0.1:9090, in Kubernetes 0.0.0.0:9090)",
    )
    p.add_argument("--upstream", metavar="URL", help="upstream base URL (default https://api.openai.com/v1)")
    p.add_argument("--config", metavar="PATH", help=f"YAML config file (env {CONFIG_ENV})")
    p.add_argument("--mode", metavar="{websocket,http}", help="'http' turns WebSocket use off")
    p.add_argument("--log-level", metavar="{debug,info,warning,error}", help="log level")
    p.add_argument(
        "--api-key-file",
        metavar="PATH",
        help="inject the key in this file upstream (implies api_key.source=file)",
    )
    p.add_argument("--workers", metavar="N", help="worker processes on the API address (default 1)")
    p.add_argument(
        "--print-config",
        action="store_true",
        help="print the effective settings as YAML and exit",
    )
    p.add_argument(
        "--version",
        action="version",
        version=f"upshift {_version()} ({loop_name()} event loop, {build_kind()} build)",
    )
    return p


def main(argv: list[str] | None = None) -> None:
    """Parse flags, load settings, and run the sidecar (or the demo). Never returns.

    Args:
        argv: Arguments without the program name; ``sys.argv[1:]`` when ``None``.
    """
    args_list = sys.argv[1:] if argv is None else argv
    if args_list[:1] == ["explain"]:
        # Offline: says whether a saved request would continue the previous one (no server).
        explain = importlib.import_module("proxy.ops.explain_cmd")
        sys.exit(explain.main(args_list[1:]))
    if args_list[:1] == ["doctor"]:
        # Checks the upstream (and a running sidecar) with the sidecar's configuration.
        doctor = importlib.import_module("proxy.ops.doctor")
        sys.exit(doctor.main(args_list[1:]))
    if args_list[:1] == ["demo"]:
        # Imported lazily: the demo pulls in client libraries the sidecar itself never needs.
        demo = importlib.import_module("proxy.ops.demo")
        sys.exit(demo.main(args_list[1:]))

    args = _parser().parse_args(args_list)
    flags: dict[str, object] = {key: getattr(args, dest) for dest, key in _FLAG_KEYS.items()}
    if args.api_key_file is not None:
        flags["api_key.source"] = "file"
    try:
        settings = load_settings(flags, os.environ, args.config)
        if args.print_config:
            sys.stdout.write(yaml.safe_dump(settings_to_dict(settings), sort_keys=False))
            sys.exit(0)
        setup_logging(settings.logging)
        KeySource(settings.api_key)  # fail fast on a missing key file, before binding anything
        egress_for(settings)  # and on a proxy URL websockets would refuse
        log.info(
            "upshift %s starting (%s event loop, %s build)",
            _version(),
            loop_name(),
            build_kind(),
            extra={
                "listen": settings.listen,
                "admin_listen": settings.admin_listen,
                "mode": settings.mode,
                "loop": loop_name(),
                "build": build_kind(),
            },
        )
        # Imported lazily so that config errors (and tests of the loader) need no server. With
        # workers above 1 this process is their supervisor (it runs no server of its own).
        if settings.workers > 1:
            workers = importlib.import_module("proxy.supervisor")
            sys.exit(workers.supervise(settings))
        server = importlib.import_module("proxy.server")
        sys.exit(server.run(settings))
    except ConfigError as exc:
        print(f"upshift: configuration error: {exc}", file=sys.stderr)
        sys.exit(1)
    except KeyboardInterrupt:
        sys.exit(130)
