"""Sample the sidecar with py-spy (an external sampler: the sidecar runs unmodified) and rank hotspots."""

from __future__ import annotations

import contextlib
import re
import shutil
import signal
import subprocess
from collections import Counter
from pathlib import Path
from typing import Any

from .procs import track

__all__ = ["available", "rank", "start", "stop"]

JSON = Any
_FRAME = re.compile(r"^(?P<func>.*?) \((?P<file>[^:()]*)(?::(?P<line>\d+))?\)$")


def available() -> bool:
    """Whether py-spy is installed."""
    return shutil.which("py-spy") is not None


def start(pid: int, out: Path, rate: int = 1000, *, native: bool = False) -> subprocess.Popen[bytes] | None:
    """Start recording ``pid`` in py-spy's raw (collapsed stacks) format; None without py-spy.

    ``native``: C frames too (the compiled build's functions, uvloop, orjson, libc), so the
    interpreted code that compiled code calls shows (a dataclass's generated ``__init__`` is
    ``__create_fn__`` from ``<string>``). py-spy stops the process for each such sample, so the
    rate is lower and the sidecar slower meanwhile: read shares, not times.
    """
    exe = shutil.which("py-spy")
    if exe is None:
        return None
    out.parent.mkdir(parents=True, exist_ok=True)
    argv = [exe, "record", "--pid", str(pid), "--rate", str(min(rate, 250) if native else rate), "--format", "raw",
            "--output", str(out), "--native" if native else "--nonblocking"]  # fmt: skip
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    track(proc)
    return proc


def stop(proc: subprocess.Popen[bytes] | None, timeout: float = 20.0) -> str:
    """Stop recording (SIGINT makes py-spy write its file); returns py-spy's stderr tail."""
    if proc is None:
        return ""
    with contextlib.suppress(ProcessLookupError):
        proc.send_signal(signal.SIGINT)
    try:
        _, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        _, err = proc.communicate()
    return (err or b"").decode(errors="replace")[-500:]


def _short(frame: str) -> str:
    match = _FRAME.match(frame.strip())
    if match is None:
        return frame.strip()
    path = match.group("file")
    for marker in ("site-packages/", "/work/main/", "lib/python3.11/"):
        if marker in path:
            path = path.split(marker, 1)[1]
            break
    return f"{match.group('func')} ({path})"


def rank(path: Path, top: int = 20) -> JSON:
    """Self and inclusive shares per function from a py-spy raw file."""
    self_count: Counter[str] = Counter()
    incl: Counter[str] = Counter()
    total = 0
    if not path.exists():
        return {"samples": 0, "self": [], "inclusive": []}
    for line in path.read_text(errors="replace").splitlines():
        stack, _, count_text = line.rpartition(" ")
        if not stack or not count_text.isdigit():
            continue
        count = int(count_text)
        frames = [_short(f) for f in stack.split(";") if f and not f.startswith("process ")]
        frames = [f for f in frames if not f.startswith("thread ")]
        if not frames:
            continue
        total += count
        self_count[frames[-1]] += count
        for name in set(frames):
            incl[name] += count
    proxy_incl = [(n, c) for n, c in incl.most_common() if "(proxy/" in n]

    def rows(items: list[tuple[str, int]]) -> list[JSON]:
        return [{"frame": n, "samples": c, "share": round(c / total, 4)} for n, c in items[:top]]

    return {"samples": total, "self": rows(self_count.most_common()), "inclusive_proxy": rows(proxy_incl)}
