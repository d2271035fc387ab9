"""The learned socket caps shared by the workers of one machine (proxy/upstream/caps.py)."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import orjson

from proxy.core.conversation import HeadTable
from proxy.core.lanes import LaneLimits
from proxy.core.planner import Planner
from proxy.core.request import parse_request
from proxy.upstream.caps import CapFile


def _planner() -> Planner:
    return Planner(LaneLimits(cap_probe_seconds=600.0), HeadTable(max_heads=10, ttl_seconds=60))


def _refused(p: Planner, now: float) -> None:
    plan = p.plan("id", parse_request(orjson.dumps({"model": "m", "input": "hi"})), now)
    assert plan.open_socket and plan.lane is not None
    assert p.open_failed(plan.lane[0], now, status=429, headers={"retry-after": "30"})


def test_a_cap_learned_by_one_worker_holds_for_the_others(tmp_path: Path) -> None:
    shared = tmp_path / "caps"
    one, other = CapFile(str(shared)), CapFile(str(shared))
    assert stat.S_IMODE(os.stat(shared).st_mode) == 0o700
    a, b = _planner(), _planner()
    _refused(a, 10.0)
    one.publish(a, "id", 10.0)
    other.merge_into(b, 11.0)
    assert b.learned_cap("id") == 1 and b.held_off("id", 20.0) and not b.held_off("id", 41.0)
    other.merge_into(b, 700.0)  # nothing new: the file is not read again


def test_a_directory_others_may_enter_is_not_used(tmp_path: Path) -> None:
    """An attacker who pre-creates the directory (a shared /tmp) cannot feed or read the caps."""
    open_dir = tmp_path / "caps"
    open_dir.mkdir(mode=0o777)
    os.chmod(open_dir, 0o777)
    assert CapFile(str(open_dir)).path is None
    os.chmod(open_dir, 0o700)
    assert CapFile(str(open_dir)).path is not None  # the control: a private one is used
    assert CapFile("off").path is None


def test_stale_entries_are_not_merged(tmp_path: Path) -> None:
    caps = CapFile(str(tmp_path / "caps"))
    a = _planner()
    _refused(a, 10.0)
    caps.publish(a, "id", 10.0)
    b = _planner()
    caps.merge_into(b, 10.0 + 601.0)  # past its probe time: a probe would be allowed anyway
    assert b.learned_cap("id") is None
