"""KeySource: passthrough, env, and a key file re-read on Kubernetes-style rotation."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

from proxy.config import ApiKeySettings
from proxy.errors import ConfigError
from proxy.intake.keys import KeySource


class Clock:
    """A monotonic clock the test moves by hand."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _secret_dir(root: Path, key: str, version: int) -> None:
    """Lay out (or rotate) a directory as the kubelet does for a mounted Secret:
    api-key -> ..data/api-key, ..data -> ..<version>, swapped atomically with rename()."""
    target = root / f"..v{version}"
    target.mkdir()
    (target / "api-key").write_text(key)
    tmp = root / "..data_tmp"
    tmp.symlink_to(target.name)
    os.replace(tmp, root / "..data")
    if not (root / "api-key").is_symlink():
        (root / "api-key").symlink_to("..data/api-key")


@pytest.fixture
def clock() -> Clock:
    return Clock()


def _file_source(path: Path, clock: Clock) -> KeySource:
    return KeySource(ApiKeySettings(source="file", file=str(path)), clock=clock)


def test_passthrough_returns_the_apps_header() -> None:
    source = KeySource(ApiKeySettings())
    assert not source.injects
    assert source.authorization("Bearer app-key") == "Bearer app-key"
    assert source.authorization(None) is None


def test_env_source() -> None:
    settings = ApiKeySettings(source="env", env="MY_KEY")
    source = KeySource(settings, environ={"MY_KEY": "  k-123\n"})
    assert source.injects
    assert source.authorization("Bearer placeholder") == "Bearer k-123"
    assert source.authorization(None) == "Bearer k-123"


@pytest.mark.parametrize("environ", [{}, {"MY_KEY": ""}, {"MY_KEY": "two words"}])
def test_env_source_missing_key_is_a_config_error(environ: dict[str, str]) -> None:
    with pytest.raises(ConfigError, match="MY_KEY"):
        KeySource(ApiKeySettings(source="env", env="MY_KEY"), environ=environ)


def test_file_source_strips_and_replaces_app_header(tmp_path: Path, clock: Clock) -> None:
    path = tmp_path / "api-key"
    path.write_text("  key-one \n")
    source = _file_source(path, clock)
    assert source.authorization("Bearer sk-placeholder") == "Bearer key-one"
    path.write_text("Bearer key-two\n")  # a file holding the header value works too
    clock.now += 1
    assert source.authorization(None) == "Bearer key-two"


@pytest.mark.parametrize("content", [None, "", " \n", "a b"])
def test_file_source_unusable_at_startup(tmp_path: Path, clock: Clock, content: str | None) -> None:
    path = tmp_path / "api-key"
    if content is not None:
        path.write_text(content)
    with pytest.raises(ConfigError, match="api_key.file"):
        _file_source(path, clock)


def test_secret_rotation_by_symlink_swap(tmp_path: Path, clock: Clock) -> None:
    _secret_dir(tmp_path, "key-one\n", 1)
    source = _file_source(tmp_path / "api-key", clock)
    assert source.authorization(None) == "Bearer key-one"

    _secret_dir(tmp_path, "key-two\n", 2)  # same size, new inode
    clock.now += 0.5
    assert source.authorization(None) == "Bearer key-one", "checked at most once per second"
    clock.now += 0.5
    assert source.authorization(None) == "Bearer key-two"


def test_same_size_rewrite_in_place_is_noticed(tmp_path: Path, clock: Clock) -> None:
    path = tmp_path / "api-key"
    path.write_text("key-one")
    source = _file_source(path, clock)
    path.write_text("key-two")
    st = path.stat()
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))
    clock.now += 1
    assert source.authorization(None) == "Bearer key-two"


def test_unchanged_file_is_not_reread(tmp_path: Path, clock: Clock, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "api-key"
    path.write_text("key-one")
    source = _file_source(path, clock)
    opened: list[object] = []
    real_open = open

    def spy_open(*args: Any, **kwargs: Any) -> Any:
        opened.append(args)
        return real_open(*args, **kwargs)

    monkeypatch.setattr("builtins.open", spy_open)
    clock.now += 5
    assert source.authorization(None) == "Bearer key-one"
    assert opened == []


def test_missing_or_empty_file_keeps_last_good_key(
    tmp_path: Path, clock: Clock, caplog: pytest.LogCaptureFixture
) -> None:
    path = tmp_path / "api-key"
    path.write_text("key-one")
    source = _file_source(path, clock)

    path.unlink()
    clock.now += 1
    assert source.authorization(None) == "Bearer key-one"
    clock.now += 1
    assert source.authorization(None) == "Bearer key-one"
    assert len([r for r in caplog.records if "last good key" in r.getMessage()]) == 1, "warn once"

    path.write_text("")
    clock.now += 1
    assert source.authorization(None) == "Bearer key-one"

    path.write_text("key-three")
    clock.now += 1
    assert source.authorization(None) == "Bearer key-three"
    assert "key-three" not in caplog.text and "key-one" not in caplog.text, "keys are never logged"
