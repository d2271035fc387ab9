"""Settings loader and CLI: precedence flag > env > file > default, validation, config.yaml."""

from __future__ import annotations

import dataclasses
import logging
import os
import subprocess
import sys
import types
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from proxy import cli
from proxy.config import Settings, parse_hostport
from proxy.config_load import env_name, load_settings, setting_keys, settings_to_dict
from proxy.errors import ConfigError

ROOT = Path(__file__).resolve().parents[1]
DATA = Path(__file__).resolve().parent / "data" / "config"
PRIORITY = str(DATA / "priority.yaml")


def _get(settings: Settings, key: str) -> Any:
    value: Any = settings
    for part in key.split("."):
        value = getattr(value, part)
    return value


# ----------------------------------------------------------------------------- precedence

FLAG = {"listen": "127.0.0.1:7003", "pool.max_sockets_per_identity": "9"}
ENV = {"UPSHIFT_LISTEN": "127.0.0.1:7002", "UPSHIFT_POOL_MAX_SOCKETS_PER_IDENTITY": "8"}


@pytest.mark.parametrize(
    ("flags", "env", "path", "want_listen", "want_sockets"),
    [
        pytest.param(None, {}, None, "127.0.0.1:8080", 32, id="defaults"),
        pytest.param(None, {}, PRIORITY, "127.0.0.1:7001", 7, id="file over default"),
        pytest.param(None, ENV, None, "127.0.0.1:7002", 8, id="env over default"),
        pytest.param(None, ENV, PRIORITY, "127.0.0.1:7002", 8, id="env over file"),
        pytest.param(FLAG, {}, PRIORITY, "127.0.0.1:7003", 9, id="flag over file"),
        pytest.param(FLAG, ENV, PRIORITY, "127.0.0.1:7003", 9, id="flag over env"),
        pytest.param({"listen": "127.0.0.1:7003"}, ENV, PRIORITY, "127.0.0.1:7003", 8, id="flag for one key only"),
        pytest.param({"listen": None}, {}, PRIORITY, "127.0.0.1:7001", 7, id="None flag means not given"),
        pytest.param(
            None, {"UPSHIFT_CONFIG": str(DATA / "other.yaml")}, None, "127.0.0.1:7101", 32, id="UPSHIFT_CONFIG"
        ),
        pytest.param(
            None,
            {"UPSHIFT_CONFIG": str(DATA / "other.yaml")},
            PRIORITY,
            "127.0.0.1:7001",
            7,
            id="--config over UPSHIFT_CONFIG",
        ),
    ],
)
def test_precedence(
    flags: dict[str, object] | None,
    env: dict[str, str],
    path: str | None,
    want_listen: str,
    want_sockets: int,
) -> None:
    settings = load_settings(flags, env, path)
    assert settings.listen == want_listen
    assert settings.pool.max_sockets_per_identity == want_sockets


def test_full_file_every_type() -> None:
    s = load_settings(None, {}, str(DATA / "full.yaml"))
    assert s.listen == "[::1]:8081"
    assert s.admin_listen == "127.0.0.1:0"
    assert s.ws_url == "ws://127.0.0.1:9999/v1/responses"
    assert s.mode == "http"
    assert (s.api_key.source, s.api_key.file, s.api_key.env) == ("file", "/tmp/key", "OPENAI_API_KEY")
    assert s.limits.ws_frame_budget_bytes == 0
    assert s.pool.idle_close_seconds == 60.0 and isinstance(s.pool.idle_close_seconds, float)
    assert s.pool.ping_timeout_seconds == 2.5
    assert s.pool.compression is True
    assert s.logging.level == "debug"
    assert s.pool.max_sockets_total == 256  # untouched keys keep their defaults


def test_empty_file_and_empty_section_give_defaults() -> None:
    assert load_settings(None, {}, str(DATA / "empty.yaml")) == Settings()


# ----------------------------------------------------------------------------- env parsing


@pytest.mark.parametrize(
    ("text", "want"),
    [("true", True), ("1", True), ("yes", True), ("YES", True), (" True ", True)]
    + [("false", False), ("0", False), ("no", False), ("No", False)],
)
def test_env_bool(text: str, want: bool) -> None:
    s = load_settings(None, {"UPSHIFT_POOL_COMPRESSION": text, "UPSHIFT_LOGGING_ACCESS_LOG": text}, None)
    assert s.pool.compression is want
    assert s.logging.access_log is want


@pytest.mark.parametrize(
    ("name", "text", "key", "want"),
    [
        ("UPSHIFT_MATCHING_MAX_HEADS", "123", "matching.max_heads", 123),
        ("UPSHIFT_LIMITS_MAX_BODY_BYTES", " 1024 ", "limits.max_body_bytes", 1024),
        ("UPSHIFT_POOL_PING_INTERVAL_SECONDS", "0.5", "pool.ping_interval_seconds", 0.5),
        ("UPSHIFT_SHUTDOWN_GRACE_SECONDS", "3", "shutdown.grace_seconds", 3.0),
        ("UPSHIFT_MODE", "http", "mode", "http"),
        ("UPSHIFT_LOGGING_LEVEL", "WARNING", "logging.level", "warning"),
        ("UPSHIFT_API_KEY_SOURCE", "env", "api_key.source", "env"),
        ("UPSHIFT_API_KEY_FILE", "/run/key", "api_key.file", "/run/key"),
        ("UPSHIFT_POOL_OPENAI_BETA", "responses_websockets=2026-02-06", "pool.openai_beta", None),
        ("UPSHIFT_ADMIN_LISTEN", "[::]:9191", "admin_listen", "[::]:9191"),
    ],
)
def test_env_values_parsed_by_type(name: str, text: str, key: str, want: object) -> None:
    value = _get(load_settings(None, {name: text}, None), key)
    assert value == (text if want is None else want)
    assert type(value) is type(_get(Settings(), key))


def test_every_key_has_an_env_var() -> None:
    for key in setting_keys():
        default = _get(Settings(), key)
        text = str(default).lower() if isinstance(default, bool) else str(default)
        if isinstance(default, tuple):  # a list: comma-separated
            text = ",".join(default)
        if key in ("listen", "admin_listen"):
            text = "127.0.0.1:1234" if key == "listen" else "0.0.0.0:1235"
        settings = load_settings(None, {env_name(key): text}, None)
        value = _get(settings, key)
        assert (",".join(value) if isinstance(value, tuple) else str(value)).lower() == text.lower(), key
    assert env_name("pool.max_sockets_per_identity") == "UPSHIFT_POOL_MAX_SOCKETS_PER_IDENTITY"
    assert env_name("api_key.file") == "UPSHIFT_API_KEY_FILE"


# ----------------------------------------------------------------------------- lists


@pytest.mark.parametrize(
    ("text", "want"),
    [
        ("Authorization, api-key", ("Authorization", "api-key")),
        ("api-key,authorization,x-litellm-api-key", ("api-key", "authorization", "x-litellm-api-key")),
        (" Authorization ,, api-key,OpenAI-Project ,", ("Authorization", "api-key", "OpenAI-Project")),
    ],
)
def test_list_from_env_is_comma_separated(text: str, want: tuple[str, ...]) -> None:
    assert load_settings(None, {"UPSHIFT_IDENTITY_HEADERS": text}, None).identity.headers == want


def test_list_from_yaml_and_flag(tmp_path: Path) -> None:
    path = tmp_path / "c.yaml"
    path.write_text("identity:\n  headers: [Authorization, api-key, x-portkey-api-key]\n")
    assert load_settings(None, {}, str(path)).identity.headers == ("Authorization", "api-key", "x-portkey-api-key")
    flags = {"identity.headers": "api-key,Authorization"}
    assert load_settings(flags, {}, str(path)).identity.headers == ("api-key", "Authorization")
    assert settings_to_dict(load_settings(None, {}, str(path)))["identity"]["headers"] == [
        "Authorization",
        "api-key",
        "x-portkey-api-key",
    ]


def test_matching_tolerate_and_its_deprecated_alias(tmp_path: Path) -> None:
    from proxy.reasons import Tolerance

    assert load_settings(None, {}, None).matching.tolerances() == frozenset()
    env = {"UPSHIFT_MATCHING_TOLERATE": "phase, reasoning"}
    assert load_settings(None, env, None).matching.tolerances() == {Tolerance.PHASE, Tolerance.REASONING}
    path = tmp_path / "c.yaml"
    path.write_text("matching:\n  allow_dropped_reasoning: true\n")  # an existing config still loads
    assert load_settings(None, {}, str(path)).matching.tolerances() == {Tolerance.REASONING}
    path.write_text("matching:\n  tolerate: [phase]\n  allow_dropped_reasoning: true\n")
    assert load_settings(None, {}, str(path)).matching.tolerances() == {Tolerance.PHASE, Tolerance.REASONING}
    path.write_text("matching:\n  tolerate: [phases]\n")
    with pytest.raises(ConfigError) as info:
        load_settings(None, {}, str(path))
    assert "expected a list of reasoning, phase; got 'phases'" in str(info.value)
    assert "did you mean 'phase'" in str(info.value) and info.value.param == "matching.tolerate"


@pytest.mark.parametrize(
    ("yaml_text", "needle"),
    [
        ("identity:\n  headers: Authorization\n", "expected a list of strings"),
        ("identity:\n  headers: [Authorization, 3]\n", "expected a list of strings"),
        ("identity:\n  headers: [Authorization, 'bad header']\n", "not an HTTP header name"),
        ("identity:\n  headers: [Authorization, authorization]\n", "listed twice"),
        ("identity:\n  headers: [Cookie]\n", "cannot be a credential header"),
        ("identity:\n  headers: []\n", "missing Authorization, api-key"),
        ("identity:\n  headers: [Authorization, OpenAI-Project]\n", "missing api-key"),
        ("api_key:\n  header: x-gw-key\n", "missing x-gw-key"),
        ("identity:\n  headers: [Sec-WebSocket-Key]\n", "cannot be a credential header"),
        ("api_key:\n  header: 'a b'\n", "not an HTTP header name"),
        ("egress:\n  proxy: socks5://127.0.0.1:1080\n", "expected env, off or an http(s):// proxy URL"),
        ("egress:\n  proxy: direct\n", "expected env, off or an http(s):// proxy URL"),
    ],
)
def test_list_and_header_errors_name_the_key(tmp_path: Path, yaml_text: str, needle: str) -> None:
    path = tmp_path / "c.yaml"
    path.write_text(yaml_text)
    with pytest.raises(ConfigError) as info:
        load_settings(None, {}, str(path))
    assert needle in str(info.value)
    assert info.value.param in ("identity.headers", "api_key.header", "egress.proxy")


def test_proxy_password_never_printed() -> None:
    settings = load_settings(None, {"UPSHIFT_EGRESS_PROXY": "http://user:s3cret@127.0.0.1:3128"}, None)
    assert settings.egress.proxy == "http://user:s3cret@127.0.0.1:3128"
    assert settings_to_dict(settings)["egress"]["proxy"] == "http://user:***@127.0.0.1:3128"
    with pytest.raises(ConfigError) as info:
        load_settings(None, {"UPSHIFT_EGRESS_PROXY": "ftp://user:s3cret@127.0.0.1:3128"}, None)
    assert "s3cret" not in str(info.value)


def test_unrelated_and_service_link_env_vars_are_ignored() -> None:
    env = {
        "HOME": "/root",
        "UPSHIFTX": "1",
        "UPSHIFT_GATEWAY_SERVICE_HOST": "10.0.0.1",
        "UPSHIFT_GATEWAY_SERVICE_PORT": "8080",
        "UPSHIFT_GATEWAY_SERVICE_PORT_HTTP": "8080",
        "UPSHIFT_GATEWAY_PORT": "tcp://10.0.0.1:8080",
        "UPSHIFT_GATEWAY_PORT_8080_TCP_ADDR": "10.0.0.1",
    }
    assert load_settings(None, env, None) == Settings()


# ----------------------------------------------------------------------------- errors


@pytest.mark.parametrize(
    ("fixture", "needles"),
    [
        ("unknown_key.yaml", ["unknown key 'pool.max_socket'", "did you mean", "pool.max_sockets_per_identity"]),
        ("unknown_top.yaml", ["unknown key 'listn'", "'listen'"]),
        ("mistyped_int.yaml", ["'pool.max_sockets_total'", "integer", "many"]),
        ("bool_as_int.yaml", ["'matching.max_heads'", "number"]),
        ("negative.yaml", ["'timeouts.connect_seconds'", "> 0"]),
        ("bad_literal.yaml", ["'mode'", "websocket, http", "grpc"]),
        ("bad_listen.yaml", ["'listen'", "[::1]:port"]),
        ("bad_section.yaml", ["'pool' must be a mapping"]),
        ("not_mapping.yaml", ["mapping at the top level"]),
        ("invalid_yaml.yaml", ["invalid YAML"]),
        ("string_as_bool.yaml", ["'pool.compression'", "boolean"]),
        ("missing.yaml", ["cannot read config file"]),
    ],
)
def test_file_errors_name_the_key(fixture: str, needles: list[str]) -> None:
    path = str(DATA / fixture)
    with pytest.raises(ConfigError) as info:
        load_settings(None, {}, path)
    message = str(info.value)
    assert message.startswith(path + ":")
    for needle in needles:
        assert needle in message


@pytest.mark.parametrize(
    ("env", "needles"),
    [
        ({"UPSHIFT_POOL_MAX_SOCKET": "3"}, ["UPSHIFT_POOL_MAX_SOCKET", "UPSHIFT_POOL_MAX_SOCKETS_PER_IDENTITY"]),
        ({"UPSHIFT_LOG_LEVEL": "debug"}, ["UPSHIFT_LOG_LEVEL", "UPSHIFT_LOGGING_LEVEL"]),
        ({"UPSHIFT_LISTEN_PORT": "8080"}, ["unknown variable UPSHIFT_LISTEN_PORT"]),
        ({"UPSHIFT_MATCHING_MAX_HEADS": "lots"}, ["UPSHIFT_MATCHING_MAX_HEADS", "matching.max_heads", "integer"]),
        ({"UPSHIFT_MATCHING_MAX_HEADS": "1.5"}, ["UPSHIFT_MATCHING_MAX_HEADS", "integer"]),
        ({"UPSHIFT_POOL_COMPRESSION": "maybe"}, ["UPSHIFT_POOL_COMPRESSION", "boolean"]),
        ({"UPSHIFT_POOL_IDLE_CLOSE_SECONDS": "-5"}, ["pool.idle_close_seconds", ">= 0"]),
        ({"UPSHIFT_POOL_IDLE_CLOSE_SECONDS": "nan"}, ["pool.idle_close_seconds", "finite"]),
        ({"UPSHIFT_POOL_MAX_SOCKETS_TOTAL": "0"}, ["pool.max_sockets_total", "> 0"]),
        ({"UPSHIFT_POOL_MAX_SOCKETS_TOTAL": "10"}, ["pool.max_sockets_per_identity", "pool.max_sockets_total"]),
        ({"UPSHIFT_MODE": "grpc"}, ["UPSHIFT_MODE", "websocket, http"]),
        ({"UPSHIFT_API_KEY_SOURCE": "vault"}, ["UPSHIFT_API_KEY_SOURCE", "passthrough, file, env"]),
        ({"UPSHIFT_LISTEN": "127.0.0.1"}, ["UPSHIFT_LISTEN", "host:port"]),
        ({"UPSHIFT_LISTEN": "127.0.0.1:99999"}, ["UPSHIFT_LISTEN", "0..65535"]),
        ({"UPSHIFT_ADMIN_LISTEN": "[::1:9090"}, ["UPSHIFT_ADMIN_LISTEN"]),
        ({"UPSHIFT_ADMIN_LISTEN": "0.0.0.0:8080"}, ["listen", "admin_listen", "share a port"]),
        ({"UPSHIFT_UPSTREAM": "api.openai.com"}, ["UPSHIFT_UPSTREAM", "URL"]),
        ({"UPSHIFT_CONFIG": str(DATA / "missing.yaml")}, ["missing.yaml", "cannot read"]),
    ],
)
def test_env_errors_name_the_variable(env: dict[str, str], needles: list[str]) -> None:
    with pytest.raises(ConfigError) as info:
        load_settings(None, env, None)
    for needle in needles:
        assert needle in str(info.value)


def test_the_build_variables_are_not_settings() -> None:
    # UPSHIFT_COMPILE=1 exported for `pip install .` (or the compiled test run's
    # UPSHIFT_EXPECT_BUILD) must not stop the sidecar started from the same shell.
    env = {"UPSHIFT_COMPILE": "1", "UPSHIFT_EXPECT_BUILD": "compiled"}
    assert load_settings(None, env, None) == load_settings(None, {}, None)
    with pytest.raises(ConfigError, match="unknown variable UPSHIFT_COMPILED"):
        load_settings(None, {"UPSHIFT_COMPILED": "1"}, None)


def test_flag_errors() -> None:
    with pytest.raises(ConfigError, match=r"command line: mode: .*grpc"):
        load_settings({"mode": "grpc"}, {}, None)
    with pytest.raises(ConfigError, match=r"unknown setting 'pool\.max_socket'"):
        load_settings({"pool.max_socket": 1}, {}, None)


def test_error_param_is_the_key() -> None:
    with pytest.raises(ConfigError) as info:
        load_settings(None, {"UPSHIFT_POOL_MAX_SOCKETS_TOTAL": "x"}, None)
    assert info.value.param == "pool.max_sockets_total"


@pytest.mark.parametrize(
    ("text", "want"),
    [
        ("127.0.0.1:8080", ("127.0.0.1", 8080)),
        ("0.0.0.0:0", ("0.0.0.0", 0)),
        ("localhost:65535", ("localhost", 65535)),
        ("[::1]:8080", ("::1", 8080)),
        ("[::]:9090", ("::", 9090)),
    ],
)
def test_parse_hostport(text: str, want: tuple[str, int]) -> None:
    assert parse_hostport(text) == want


@pytest.mark.parametrize(
    "text", ["8080", ":8080", "::1:8080", "[::1]8080", "[nope]:80", "host:http", "host:-1", "host:65536", ""]
)
def test_parse_hostport_rejects(text: str) -> None:
    with pytest.raises(ConfigError):
        parse_hostport(text)


# ----------------------------------------------------------------------------- config.yaml


def _flatten(data: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in data.items():
        if isinstance(value, dict):
            out.update(_flatten(value, f"{prefix}{key}."))
        else:
            out[prefix + key] = value
    return out


def test_config_yaml_equals_the_defaults_and_lists_every_key() -> None:
    path = ROOT / "config.yaml"
    assert load_settings(None, {}, str(path)) == Settings()
    listed = _flatten(yaml.safe_load(path.read_text()))
    assert list(listed) == list(setting_keys()), "config.yaml must list every key, in declaration order"
    assert listed == _flatten(settings_to_dict(Settings()))


def test_config_yaml_documents_every_key() -> None:
    lines = (ROOT / "config.yaml").read_text().splitlines()
    positions = {}
    for number, line in enumerate(lines):
        stripped = line.strip()
        if stripped and not stripped.startswith("#") and not stripped.endswith(":"):
            positions[stripped.split(":")[0]] = number
    for key in setting_keys():
        number = positions[key.rpartition(".")[2]]
        comment: list[str] = []
        while number > 0 and lines[number - 1].strip().startswith("#"):
            number -= 1
            comment.insert(0, lines[number])
        text = " ".join(comment)
        assert env_name(key) in text, f"comment above {key} must name {env_name(key)}"
        assert "Default" in text, f"comment above {key} must give its default"


# ----------------------------------------------------------------------------- CLI


def _clean_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("UPSHIFT_")}
    return {**env, **extra}


def _run(*args: str, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "proxy", *args],
        cwd=ROOT,
        env=_clean_env(**env),
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_print_config_subprocess() -> None:
    result = _run(
        "--config", PRIORITY, "--listen", "127.0.0.1:7003", "--print-config",
        UPSHIFT_POOL_COMPRESSION="yes",
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    printed = yaml.safe_load(result.stdout)
    want = dataclasses.replace(
        Settings(),
        listen="127.0.0.1:7003",
        pool=dataclasses.replace(Settings().pool, max_sockets_per_identity=7, compression=True),
    )
    assert printed == settings_to_dict(want)


def test_bad_config_exits_1_naming_the_key() -> None:
    result = _run("--config", str(DATA / "unknown_key.yaml"), "--print-config")
    assert result.returncode == 1
    assert "pool.max_socket" in result.stderr
    assert result.stdout == ""
    result = _run("--print-config", UPSHIFT_POOL_MAX_SOCKETS_TOTAL="-3")
    assert result.returncode == 1
    assert "UPSHIFT_POOL_MAX_SOCKETS_TOTAL" in result.stderr


def test_version_subprocess() -> None:
    result = _run("--version")
    assert result.returncode == 0
    assert result.stdout.startswith("upshift ")


@pytest.fixture
def clean_process(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """No UPSHIFT_* env, and the root logger restored after cli.main() configured it."""
    for name in [n for n in os.environ if n.startswith("UPSHIFT_")]:
        monkeypatch.delenv(name)
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    yield
    root.handlers[:] = handlers
    root.setLevel(level)


def test_main_runs_server_with_settings(clean_process: None, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    key = tmp_path / "api-key"
    key.write_text("sk-test-key\n")
    seen: list[Settings] = []

    def run(settings: Settings) -> int:
        seen.append(settings)
        return 3

    monkeypatch.setitem(sys.modules, "proxy.server", types.SimpleNamespace(run=run))
    monkeypatch.setenv("UPSHIFT_LISTEN", "127.0.0.1:7002")
    with pytest.raises(SystemExit) as info:
        cli.main(["--api-key-file", str(key), "--log-level", "warning", "--mode", "http"])
    assert info.value.code == 3
    (settings,) = seen
    assert settings.listen == "127.0.0.1:7002"
    assert (settings.api_key.source, settings.api_key.file) == ("file", str(key))
    assert (settings.logging.level, settings.mode) == ("warning", "http")
    assert logging.getLogger().level == logging.WARNING  # setup_logging ran


def test_main_missing_key_file_exits_1(
    clean_process: None, monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setitem(sys.modules, "proxy.server", types.SimpleNamespace(run=lambda s: 0))
    with pytest.raises(SystemExit) as info:
        cli.main(["--api-key-file", str(tmp_path / "absent")])
    assert info.value.code == 1
    assert "api_key.file" in capsys.readouterr().err


def test_demo_dispatch(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[list[str]] = []

    def demo_main(argv: list[str]) -> int:
        calls.append(argv)
        return 0

    monkeypatch.setitem(sys.modules, "proxy.ops.demo", types.SimpleNamespace(main=demo_main))
    with pytest.raises(SystemExit) as info:
        cli.main(["demo", "--turns", "3"])
    assert info.value.code == 0
    assert calls == [["--turns", "3"]]
