"""Where the upstream ``Authorization`` comes from: the app, a mounted Secret file, or env.

A Kubernetes Secret mounted as a directory is updated by an atomic symlink swap
(``..data -> ..2024_01_01_00_00_00.123``), so the key file's inode, size or mtime changes on
rotation. :class:`KeySource` notices that with one ``os.stat`` at most once per second and
re-reads the file; a missing or empty file at request time keeps the last good key (a rotation
in progress must not fail requests), but at startup it is a configuration error.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Mapping

from proxy.config import ApiKeySettings
from proxy.errors import ConfigError

__all__ = ["KeySource"]

log = logging.getLogger(__name__)

_STAT_INTERVAL = 1.0
"""Seconds between two ``os.stat`` checks of the key file."""

_Signature = tuple[int, int, int, int]
"""(st_dev, st_ino, st_size, st_mtime_ns): changes when the Secret is rotated."""


def _signature(st: os.stat_result) -> _Signature:
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)


def _clean(raw: str) -> str | None:
    """The bare key from file or env text, or ``None`` if it is unusable."""
    key = raw.strip()
    if key[:7].lower() == "bearer ":  # tolerate a file that holds the whole header value
        key = key[7:].strip()
    # A key with whitespace or control characters inside would corrupt the header (or inject
    # another one); treat it like a missing key.
    if not key or any(c.isspace() or not c.isprintable() for c in key):
        return None
    return key


class KeySource:
    """Produces the ``Authorization`` header value to send upstream.

    Args:
        settings: ``source`` (passthrough | file | env), ``file`` and ``env``.
        environ: Environment to read for ``source: env`` (default ``os.environ``).
        clock: Monotonic clock in seconds (tests pass a fake one).

    Raises:
        ConfigError: ``source`` is ``file`` and the file is missing, unreadable or empty, or
            ``source`` is ``env`` and the variable is unset or empty.
    """

    def __init__(
        self,
        settings: ApiKeySettings,
        *,
        environ: Mapping[str, str] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.source = settings.source
        """``passthrough``, ``file`` or ``env``."""
        self._path = settings.file
        self._clock = clock
        self._key: str | None = None
        self._signature: _Signature | None = None
        self._checked_at = 0.0
        self._warned = False  # one warning per bad spell, not one per second
        if self.source == "file":
            if not self._reload():
                raise ConfigError(
                    f"api_key.file: no usable key in {self._path!r} (missing, unreadable or empty)",
                    param="api_key.file",
                )
            self._checked_at = clock()
        elif self.source == "env":
            env = os.environ if environ is None else environ
            self._key = _clean(env.get(settings.env, ""))
            if self._key is None:
                raise ConfigError(
                    f"api_key.env: environment variable {settings.env} is unset or empty",
                    param="api_key.env",
                )

    @property
    def injects(self) -> bool:
        """Whether the sidecar replaces the app's ``Authorization`` with its own key."""
        return self.source != "passthrough"

    def authorization(self, app_authorization: str | None) -> str | None:
        """The ``Authorization`` value to use upstream for one request or (re)connect.

        Args:
            app_authorization: The app's own header value, if any.

        Returns:
            The app's value for ``passthrough`` (possibly ``None``); otherwise
            ``Bearer <key>`` with the current key.
        """
        if self.source == "passthrough":
            return app_authorization
        if self.source == "file":
            now = self._clock()
            if now - self._checked_at >= _STAT_INTERVAL:
                self._checked_at = now
                self._reload()
        return f"Bearer {self._key}"

    def _reload(self) -> bool:
        """Re-read the key file if its signature changed. Returns whether a key is held."""
        try:
            signature = _signature(os.stat(self._path))
            if signature == self._signature:
                return self._key is not None
            with open(self._path, encoding="utf-8") as fh:
                key = _clean(fh.read())
        except (OSError, UnicodeDecodeError) as exc:
            self._warn(f"api key file unreadable, keeping the last good key: {exc}")
            return self._key is not None
        if key is None:
            self._warn(f"api key file {self._path} is empty or invalid, keeping the last good key")
            # Signature not recorded: the next check retries (the writer may not be done).
            return self._key is not None
        self._warned = False
        if self._key is not None and key != self._key:
            log.info("api key file %s changed, using the new key", self._path)
        self._key = key
        self._signature = signature
        return True

    def _warn(self, message: str) -> None:
        if self._key is not None and not self._warned:
            self._warned = True
            log.warning(message)
