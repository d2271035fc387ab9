"""The settings loader: the YAML file, the ``UPSHIFT_*`` environment and the flags, merged.

Precedence: CLI flags > env (``UPSHIFT_*``) > YAML file > defaults (:func:`load_settings`). The
loader is generic over the tree of :mod:`proxy.config`: a key is the dotted path of a leaf field
(``pool.max_sockets_per_identity``), its env var is ``UPSHIFT_`` plus the path upper-cased with
dots replaced by underscores (``UPSHIFT_POOL_MAX_SOCKETS_PER_IDENTITY``), and its value is parsed
by the field's type hint (:func:`proxy.config_check.coerce`). An unknown key or variable is an
error that names the closest spelling. Also the way back: :func:`settings_to_dict` for
``--print-config``.
"""

from __future__ import annotations

import dataclasses
import os
import re
from collections.abc import Mapping
from typing import Any, get_type_hints

import yaml

from proxy.config import Settings
from proxy.config_check import Leaf, check_settings, coerce, suggest
from proxy.errors import ConfigError
from proxy.redact import redact_url, redact_urls

__all__ = [
    "ADMIN_LISTEN_IN_KUBERNETES",
    "BUILD_ENV",
    "CONFIG_ENV",
    "ENV_PREFIX",
    "env_name",
    "load_settings",
    "setting_keys",
    "settings_to_dict",
]

ENV_PREFIX = "UPSHIFT_"
"""Prefix of every environment variable the loader reads."""
CONFIG_ENV = "UPSHIFT_CONFIG"
"""Environment variable naming the YAML file (``--config`` wins over it)."""
BUILD_ENV = frozenset({"UPSHIFT_COMPILE", "UPSHIFT_EXPECT_BUILD"})
"""Read by the build (``hatch_build.py``) and its tests (``tests/test_build.py``), not by the
sidecar: set in a shell that then runs it, they are no typo."""

# Kubernetes injects ``<SERVICE>_SERVICE_HOST``, ``<SERVICE>_PORT_8080_TCP`` ... for every
# Service in the namespace (enableServiceLinks); a Service called "upshift..." must not make
# the strict env check crash every sidecar in that namespace.
_SERVICE_LINK = re.compile(r"^UPSHIFT_\w*?(?:SERVICE_HOST|SERVICE_PORT(?:_\w+)?|PORT_\d+_(?:TCP|UDP|SCTP)\w*)$")
_SERVICE_LINK_PORT = re.compile(r"^(?:tcp|udp|sctp)://")
"""``<SERVICE>_PORT`` is matched by its value, so ``UPSHIFT_LISTEN_PORT=8080`` is still an error."""


def _collect_leaves(cls: type[Any], prefix: str = "") -> dict[str, Leaf]:
    leaves: dict[str, Leaf] = {}
    hints = get_type_hints(cls)
    for f in dataclasses.fields(cls):
        hint = hints[f.name]
        if isinstance(hint, type) and dataclasses.is_dataclass(hint):
            leaves.update(_collect_leaves(hint, f"{prefix}{f.name}."))
        else:
            leaves[prefix + f.name] = Leaf(prefix + f.name, hint)
    return leaves


def env_name(key: str) -> str:
    """The environment variable for a dotted key.

    Args:
        key: A dotted setting path such as ``pool.max_sockets_per_identity``.

    Returns:
        ``UPSHIFT_`` + the path upper-cased, dots as underscores
        (``UPSHIFT_POOL_MAX_SOCKETS_PER_IDENTITY``).
    """
    return ENV_PREFIX + key.replace(".", "_").upper()


_LEAVES = _collect_leaves(Settings)
_SECTIONS = frozenset(key.rpartition(".")[0] for key in _LEAVES if "." in key)
_BY_ENV = {env_name(key): leaf for key, leaf in _LEAVES.items()}
# Underscores join both section and key names, so two paths could map to one variable; fail
# at import rather than silently shadowing one setting with another.
if len(_BY_ENV) != len(_LEAVES) or CONFIG_ENV in _BY_ENV:
    raise RuntimeError("two settings map to the same UPSHIFT_* variable")


def setting_keys() -> tuple[str, ...]:
    """Every dotted setting key, in declaration order (``listen``, ..., ``shutdown.grace_seconds``)."""
    return tuple(_LEAVES)


def _value(leaf: Leaf, raw: object, *, text: bool, where: str) -> object:
    try:
        return coerce(leaf, raw, text=text)
    except ValueError as exc:
        raise ConfigError(f"{where}: {exc}", param=leaf.key) from None


def _from_file(path: str) -> dict[str, object]:
    try:
        with open(path, encoding="utf-8") as fh:
            data = yaml.safe_load(fh)
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read config file: {exc.strerror or exc}") from None
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path}: invalid YAML: {exc}") from None
    if data is None:  # an empty or all-comments file
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a mapping at the top level, got {type(data).__name__}")
    out: dict[str, object] = {}
    _flatten(data, "", path, out)
    return out


def _flatten(data: dict[Any, Any], prefix: str, path: str, out: dict[str, object]) -> None:
    for name, raw in data.items():
        key = f"{prefix}{name}"
        if key in _SECTIONS:
            if raw is None:  # "pool:" with every key commented out
                continue
            if not isinstance(raw, dict):
                raise ConfigError(f"{path}: key '{key}' must be a mapping", param=key)
            _flatten(raw, key + ".", path, out)
        elif key in _LEAVES:
            out[key] = _value(_LEAVES[key], raw, text=False, where=f"{path}: key '{key}'")
        else:
            hint = suggest(key, [*_LEAVES, *_SECTIONS])
            raise ConfigError(f"{path}: unknown key '{key}'{hint}", param=key)


def _is_service_link(name: str, value: str) -> bool:
    if _SERVICE_LINK.match(name):
        return True
    return name.endswith("_PORT") and bool(_SERVICE_LINK_PORT.match(value))


def _from_env(env: Mapping[str, str]) -> dict[str, object]:
    out: dict[str, object] = {}
    for name, raw in env.items():
        if not name.startswith(ENV_PREFIX) or name == CONFIG_ENV or name in BUILD_ENV or _is_service_link(name, raw):
            continue
        leaf = _BY_ENV.get(name)
        if leaf is None:
            hint = suggest(name, [*_BY_ENV, CONFIG_ENV])
            raise ConfigError(f"environment: unknown variable {name}{hint}", param=name)
        out[leaf.key] = _value(leaf, raw, text=True, where=f"environment: {name} ({leaf.key})")
    return out


def _from_flags(values: Mapping[str, object]) -> dict[str, object]:
    out: dict[str, object] = {}
    for key, raw in values.items():
        if raw is None:  # argparse default: flag not given
            continue
        leaf = _LEAVES.get(key)
        if leaf is None:
            raise ConfigError(f"command line: unknown setting '{key}'{suggest(key, list(_LEAVES))}")
        out[key] = _value(leaf, raw, text=True, where=f"command line: {key}")
    return out


def _build(cls: type[Any], values: Mapping[str, object], prefix: str = "") -> Any:
    hints = get_type_hints(cls)
    kwargs: dict[str, object] = {}
    for f in dataclasses.fields(cls):
        key = prefix + f.name
        if dataclasses.is_dataclass(hints[f.name]):
            kwargs[f.name] = _build(hints[f.name], values, key + ".")
        elif key in values:
            kwargs[f.name] = values[key]
    return cls(**kwargs)


ADMIN_LISTEN_IN_KUBERNETES = "0.0.0.0:9090"
"""``admin_listen`` when no flag, variable or file sets it and ``KUBERNETES_SERVICE_HOST`` is set
(every container of a Pod has it): the kubelet's probes and Prometheus reach the pod IP. Outside
Kubernetes the default stays loopback, so a laptop's LAN never sees the status page."""


def load_settings(
    argv_values: Mapping[str, object] | None,
    env: Mapping[str, str],
    config_path: str | None,
) -> Settings:
    """Build the effective settings: flags > env > YAML file > defaults.

    Args:
        argv_values: Flag values by dotted key (``"listen"``, ``"logging.level"``); ``None``
            values mean "not given". Strings are parsed like env values.
        env: The environment (``os.environ``). Every ``UPSHIFT_*`` variable must map to a key,
            except ``UPSHIFT_CONFIG`` and Kubernetes service-link variables.
        config_path: YAML file to read; when ``None``, ``env["UPSHIFT_CONFIG"]`` if set, else
            no file.

    Returns:
        The validated, frozen settings.

    Raises:
        ConfigError: Unknown key or variable, mistyped or out-of-range value, unreadable file.
            The message names the source and the key.
    """
    path = config_path if config_path is not None else env.get(CONFIG_ENV) or None
    values: dict[str, object] = {}
    if path is not None:
        values.update(_from_file(os.path.expanduser(path)))
    values.update(_from_env(env))
    values.update(_from_flags(argv_values or {}))
    if "admin_listen" not in values and env.get("KUBERNETES_SERVICE_HOST"):
        values["admin_listen"] = ADMIN_LISTEN_IN_KUBERNETES
    settings: Settings = _build(Settings, values)
    check_settings(settings)
    return settings


def settings_to_dict(settings: Settings) -> dict[str, Any]:
    """The settings as nested plain dicts in declaration order (the shape of ``config.yaml``).

    No setting holds a secret today (the key itself is only ever read from a file or env var,
    never stored here); a field named like one is still left out, so adding one later cannot
    leak it through ``--print-config``.
    """
    return _to_dict(settings)


_SECRET_NAME = re.compile(r"(^|_)(secret|password|token)$")


def _to_dict(obj: Any) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        if dataclasses.is_dataclass(value):
            out[f.name] = _to_dict(value)
        elif not _SECRET_NAME.search(f.name):
            if isinstance(value, tuple):
                value = list(value)
            elif isinstance(value, str) and "://" in value:
                # a URL's credentials (userinfo, key= in its query) never reach --print-config
                value = redact_urls(redact_url(value))
            out[f.name] = value
    return out
