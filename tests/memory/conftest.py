"""Fixtures of the memory suite: the sidecar as a process (its RSS alone), optionally inside a
memory cgroup of its own, and the issue-12 workloads driven by bench/memory.py's SDK-style client."""

from __future__ import annotations

import os
import subprocess
import sys
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tests.sidecar import ROOT, SidecarProcess

MIB = 1024 * 1024


class Cgroup:
    """A child memory cgroup of this process's own (v1 or v2), removed at teardown."""

    def __init__(self, path: Path, version: int) -> None:
        self.path = path
        self.version = version

    def set_limit(self, limit: int) -> None:
        name = "memory.max" if self.version == 2 else "memory.limit_in_bytes"
        (self.path / name).write_text(str(limit))

    @property
    def procs(self) -> Path:
        return self.path / "cgroup.procs"

    def oom_kills(self) -> int:
        """OOM kills inside the cgroup so far."""
        name = "memory.events" if self.version == 2 else "memory.oom_control"
        for line in (self.path / name).read_text().splitlines():
            key, _, value = line.partition(" ")
            if key == "oom_kill":
                return int(value)
        return 0


def _own_memory_cgroup() -> tuple[Path, int] | None:
    try:
        lines = Path("/proc/self/cgroup").read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if "memory" in controllers.split(","):
            base = Path("/sys/fs/cgroup/memory")
            return base / path.lstrip("/"), 1
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if controllers == "" and Path("/sys/fs/cgroup/cgroup.controllers").exists():
            return Path("/sys/fs/cgroup") / path.lstrip("/"), 2
    return None


@pytest.fixture
def cgroup() -> Iterator[Cgroup]:
    """A fresh memory cgroup to run the sidecar in; skipped where cgroups are not writable."""
    found = _own_memory_cgroup()
    if found is None or not os.access(found[0], os.W_OK):
        pytest.skip("no writable memory cgroup here")
    parent, version = found
    path = parent / f"upshift-test-{uuid.uuid4().hex[:8]}"
    try:
        path.mkdir()
    except OSError as exc:
        pytest.skip(f"cannot create a memory cgroup: {exc}")
    group = Cgroup(path, version)
    try:
        yield group
    finally:
        for pid in group.procs.read_text().split():  # only our sidecars can be in there
            try:
                os.kill(int(pid), 9)
            except ProcessLookupError:
                pass
        for _ in range(100):
            try:
                path.rmdir()
                break
            except OSError:
                import time

                time.sleep(0.05)


class LimitedSidecar(SidecarProcess):
    """``python -m proxy`` started inside ``cgroup`` (it joins before exec, so everything it
    allocates is charged there and it reads its own limit at startup)."""

    def __init__(self, upstream: str, tmp: Path, cgroup: Cgroup | None, env: dict[str, str]) -> None:
        self.out_path, self.err_path = tmp / "sidecar.stdout", tmp / "sidecar.stderr"
        child_env = {k: v for k, v in os.environ.items() if not k.startswith(("UPSHIFT_", "OPENAI_"))}
        child_env.update({"PYTHONUNBUFFERED": "1", "UPSHIFT_LOGGING_ACCESS_LOG": "false", **env})
        procs = str(cgroup.procs) if cgroup is not None else None

        def join() -> None:
            if procs is not None:
                with open(procs, "w") as fh:
                    fh.write(str(os.getpid()))

        with open(self.out_path, "wb") as out, open(self.err_path, "wb") as err:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "proxy", "--listen", "127.0.0.1:0", "--admin-listen", "127.0.0.1:0",
                 "--upstream", upstream],
                cwd=ROOT, env=child_env, stdin=subprocess.DEVNULL, stdout=out, stderr=err, preexec_fn=join,
            )  # fmt: skip
        self.api = ""
        self.admin = ""

    def rss(self) -> int:
        with open(f"/proc/{self.proc.pid}/statm") as fh:
            return int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")

    def high_water(self) -> int:
        """The kernel's exact peak RSS of the process (``VmHWM``)."""
        with open(f"/proc/{self.proc.pid}/status") as fh:
            for line in fh:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
        raise AssertionError("no VmHWM")


LimitedFactory = Callable[..., LimitedSidecar]


@pytest.fixture
def limited(tmp_path: Path) -> Iterator[LimitedFactory]:
    """Start sidecar processes (``cgroup=`` to run one inside a memory cgroup); killed at teardown."""
    started: list[LimitedSidecar] = []

    def make(upstream: str, *, cgroup: Cgroup | None = None, **env: str) -> LimitedSidecar:
        tmp = tmp_path / f"sidecar{len(started)}"
        tmp.mkdir()
        proc = LimitedSidecar(upstream, tmp, cgroup, env)
        started.append(proc)
        return proc

    yield make
    for proc in started:
        proc.kill()
