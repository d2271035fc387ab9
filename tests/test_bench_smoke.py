"""`python -m bench --quick` runs A, B and C end to end and writes a well-formed report.

No timing is asserted (shared, noisy machines): only that every setup ran, that the sidecar
used continuations and that it sent fewer bytes upstream than the full-history app.
"""

from __future__ import annotations

import json
import socket
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.timeout(200)
def test_quick_bench_runs_and_reports(tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "bench", "--quick", "--out", str(tmp_path)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    reports = list(tmp_path.glob("*-quick.json"))
    assert len(reports) == 1, list(tmp_path.iterdir())
    report = json.loads(reports[0].read_text())
    for comparison in report["comparisons"]:
        a, b, c = comparison["A"], comparison["B"], comparison["C"]
        assert a["error_count"] == b["error_count"] == c["error_count"] == 0
        assert b["modes"].get("continuation", 0) >= b["turns_per_rollout"] - 1  # all but each first turn
        assert b["upstream_bytes_total"] < a["upstream_bytes_total"]
        assert b["client_bytes_total"] == a["client_bytes_total"]  # same app, same bytes sent
    assert all(o["modes"] == {"continuation": o["turns"]} for o in report["overhead"])
    # The bare relay (bench.floor) ran the same sizes beside the sidecar, continuing its chains.
    for name in ("floor", "floor_aiohttp"):
        assert all(o[name]["turns"] > 0 and o[name]["cpu_ms_per_request"] > 0 for o in report["overhead"])
        # ... taking turns with it a conversation at a time: the ratios see one machine, not two minutes.
        assert all(o[name]["interleaved"] for o in report["overhead"]), [o[name] for o in report["overhead"]]
    # The capacity phase saturates the aiohttp floor relay too, on the same core, same clients.
    for row in report["capacity"]["saturation"]:
        assert row["floor_aiohttp"]["turns"] > 0 and row["floor_aiohttp"]["errors"] == 0, row
        assert row["capacity_ratio_sidecar_over_floor"] > 0, row
    assert {t["target"] for t in report["targets"]}, "targets are reported"
    # The docs are only rewritten by a full run.
    assert not (tmp_path / "benchmarks.md").exists()


@pytest.mark.timeout(200)
def test_ab_compares_a_commit_with_the_working_tree(tmp_path: Path) -> None:
    """`python -m bench.ab`: the base commit runs from its own worktree (removed afterwards); its
    turns here ask for JSON answers (``--no-stream``; the quick run above measures SSE turns)."""
    if subprocess.run(["git", "-C", str(ROOT), "rev-parse", "HEAD"], capture_output=True).returncode != 0:
        pytest.skip("not a git checkout: bench.ab needs the base commit")
    before = subprocess.run(["git", "-C", str(ROOT), "worktree", "list"], capture_output=True, text=True).stdout
    out = tmp_path / "ab.json"
    argv = [sys.executable, "-m", "bench.ab", "--base", "HEAD", "--sizes", "1k", "--rounds", "2", "--reps", "10",
            "--no-stream", "--json", str(out)]  # fmt: skip
    proc = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    report = json.loads(out.read_text())
    assert report["stream"] is False
    row = report["sizes"]["1k"]
    for side in ("A", "B"):
        assert len(row[side]["cpu_rounds"]) == 2 and all(c > 0 for c in row[side]["cpu_rounds"])
    assert row["B_over_A_cpu"] > 0 and "1k: CPU/turn A" in proc.stdout
    after = subprocess.run(["git", "-C", str(ROOT), "worktree", "list"], capture_output=True, text=True).stdout
    assert after == before  # the base worktree is gone


def test_ab_saturated_compares_turns_per_cpu_second(tmp_path: Path) -> None:
    """`python -m bench.ab --saturate N`: the capacity phase's load on A and on B in turn, each
    side's turns per sidecar CPU-second per round."""
    if subprocess.run(["git", "-C", str(ROOT), "rev-parse", "HEAD"], capture_output=True).returncode != 0:
        pytest.skip("not a git checkout: bench.ab needs the base commit")
    out = tmp_path / "ab.json"
    argv = [sys.executable, "-m", "bench.ab", "--base", "HEAD", "--saturate", "4", "--seconds", "1", "--rounds", "2",
            "--json", str(out)]  # fmt: skip
    proc = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    row = json.loads(out.read_text())["saturated"]
    for side in ("A", "B"):
        assert len(row[side]["rounds"]) == 2 and all(rate > 0 for rate in row[side]["rounds"])
    assert row["B_over_A"] > 0 and "saturated (4 clients, 1 KB turns): turns per sidecar CPU-second A" in proc.stdout


# -- bench.budget: perf's samples into rows ----------------------------------------------------------

_SCRIPT_FLAT = """\
   1001001  ffffffff817003a2 __d_lookup_rcu ([kernel.kallsyms])
   2002002      7fbdaa69c624 _PyEval_EvalFrameDefault (/usr/lib/libpython3.11.so.1.0)
   3003003      7f7e723d662a CPyDef_proxy___core___planner___Planner___plan (/r/proxy/_compiled__mypyc.so)
   1001001      7f7e723d6000 CPy_GetItem (/r/proxy/_compiled__mypyc.so)
   1001001      7f7e723d6000 loads (/site-packages/orjson/orjson.cpython-311-x86_64-linux-gnu.so)
"""

_SCRIPT_STACKS = """\
   1001001
\t          16a14d _PyObject_Free (/root/.pyenv/versions/3.13.0/lib/libpython3.13.so.1.0)
\t    7fd7f3cee7b5 py::Channel.feed:{repo}/proxy/core/channel.py (/tmp/perf-9623.map)
\t    7fd7f3cee7e5 py::pump:{repo}/proxy/serve/streaming.py (/tmp/perf-9623.map)

   2002002
\t          16a14d _PyEval_EvalFrameDefault (/root/.pyenv/versions/3.13.0/lib/libpython3.13.so.1.0)
\t    7fd7f3cee7e5 py::StreamResponse.write:/v/lib/python3.13/site-packages/aiohttp/web_response.py (/tmp/perf-1.map)

   4004004
\t          16a14d _PyEval_EvalFrameDefault (/root/.pyenv/versions/3.13.0/lib/libpython3.13.so.1.0)
\t    7fd7f3cee7e5 py::BaseEventLoop._run_once:/py/lib/python3.13/asyncio/base_events.py (/tmp/perf-1.map)

   1001001
\t    ffffffff8225bc41 do_syscall_64 ([kernel.kallsyms])
\t          20d07 send (/usr/lib/x86_64-linux-gnu/libc.so.6)
"""


def test_budget_rows_follow_the_leaf_frame_and_the_innermost_python_function() -> None:
    from bench import budget

    flat = budget.rows_of(_SCRIPT_FLAT)
    assert flat == {
        budget.KERNEL: 1001001,
        budget.INTERPRETER: 2002002,
        "upshift compiled: core.planner": 3003003,  # a full name, or a short one: the same row
        budget.MYPYC_RUNTIME: 1001001,
        "orjson (JSON)": 1001001,
    }
    stacks = budget.rows_of(_SCRIPT_STACKS.format(repo=ROOT))
    assert stacks == {
        "upshift interpreted: proxy/core/channel.py": 1001001,  # the innermost Python frame
        "aiohttp (Python)": 2002002,
        "asyncio (stdlib, Python)": 4004004,
        budget.KERNEL: 1001001,  # the leaf decides: a system call, whoever made it
    }
    by_function = budget.rows_of(_SCRIPT_STACKS.format(repo=ROOT), functions=True)
    assert by_function["upshift interpreted: proxy/core/channel.py Channel.feed"] == 1001001
    # Rows sum into the steps of a turn; nothing is lost on the way.
    steps = budget.steps_of({k: v / 1000 for k, v in (flat + stacks).items()})
    assert abs(sum(steps.values()) - sum((flat + stacks).values()) / 1000) < 1e-6
    matching = next(name for name, _ in budget.STEPS if name.startswith("matching"))
    assert steps[matching] == 3003.003  # core.planner; the interpreted channel.py is an event step
    assert steps["other"] == 0


def test_every_module_of_the_sidecar_is_in_a_step_of_a_turn() -> None:
    """A sample in any of upshift's modules, interpreted or compiled, or in the standard
    library, is placed in a named step, never in "other"."""
    from bench import budget
    from proxy.build import COMPILED

    modules = sorted(p.relative_to(ROOT).as_posix() for p in (ROOT / "proxy").rglob("*.py"))
    assert len(modules) > 50
    rows = [f"upshift interpreted: {m}" for m in modules]
    rows += [f"upshift compiled: {name.removeprefix('proxy.')}" for name in COMPILED]
    rows += ["socket (stdlib, Python)", "enum (stdlib, Python)", "importlib (Python)", budget.MYPYC_RUNTIME]
    rows += [budget.row("/usr/lib/python3.13/lib-dynload/_heapq.cpython-313-x86_64-linux-gnu.so", "heappush")]
    unplaced = [row for row in rows if budget.steps_of({row: 1.0})["other"]]
    assert unplaced == []

    def step(row: str) -> str:
        return next(name for name, value in budget.steps_of({row: 1.0}).items() if value)

    # A module is in the same step whichever build ran it.
    for name in COMPILED:
        path = name.replace(".", "/") + ".py"
        assert step(f"upshift compiled: {name.removeprefix('proxy.')}") == step(f"upshift interpreted: {path}"), name


def _perf_allowed() -> str | None:
    import shutil

    if shutil.which("perf") is None:
        return "perf is not installed (Debian: linux-perf)"
    probe = subprocess.run(["perf", "record", "-o", "/dev/null", "-q", "--", "true"], capture_output=True, text=True)
    return None if probe.returncode == 0 else f"perf may not sample here: {probe.stderr.strip()[-200:]}"


@pytest.mark.timeout(200)
def test_budget_samples_the_sidecar_and_the_floor_and_the_rows_add_up(tmp_path: Path) -> None:
    why = _perf_allowed()
    if why is not None:
        pytest.skip(why)
    out = tmp_path / "budget.json"
    proc = subprocess.run(
        [sys.executable, "-m", "bench.budget", "--turns", "20", "--json", str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    result = json.loads(out.read_text())
    assert len(result["relays"]) == 2
    for relay in result["relays"].values():
        assert relay["turns"] == 20
        # What perf sampled during the turns is the process's CPU over them (within sampling
        # noise and perf's own cost): the rows account for the turn, nothing is left out.
        assert 0.6 * relay["cpu_us_per_turn"] <= relay["sampled_us_per_turn"] <= 1.6 * relay["cpu_us_per_turn"], relay


def test_ports_named_before_a_server_starts_are_never_an_outgoing_connections() -> None:
    """Ports handed out for a server to bind later come from below the kernel's ephemeral range:
    in the moment between the check and the bind, no outgoing connection can take one (a port
    from port 0 can: "address already in use" at the bind)."""
    from bench.ports import free_port, free_ports

    low, _high = (int(x) for x in Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split())
    ports = free_ports(20)
    assert len(set(ports)) == 20
    assert all(10_000 <= port < low for port in ports)
    hosts = ("127.0.0.1", "127.0.0.2")
    shared = free_ports(1, hosts)[0]
    for host in hosts:  # free on each of them
        with socket.socket() as sock:
            sock.bind((host, shared))
    # Where the range cannot be read, the kernel's choices, still free on every host.
    from bench import ports as module

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(module, "_RANGE_FILE", Path("/nonexistent/ip_local_port_range"))
        elsewhere = free_ports(5, hosts)
    assert len(set(elsewhere)) == 5 and all(port >= low for port in elsewhere)
    # A port in use is never handed out.
    with socket.socket() as held:
        held.bind(("127.0.0.1", free_port()))
        taken = held.getsockname()[1]
        assert taken not in free_ports(200)
