"""The path of one continuation, traced on a real server (``python -m bench.walk``), may not get
longer than it measures now; and the tool's reading of a trace counts what it says it counts."""

from __future__ import annotations

import pytest

from bench.walk import Call, Walk, figures, import_graph, measure, upward
from proxy.build import build_kind
from proxy.reasons import Build

MAIN_LINE_STOPS = 60
"""The main line's stops, measured (the goal is 60)."""
MAIN_LINE_FILES = 28
"""The files the main line crosses, measured (the goal is 22)."""

compiled = pytest.mark.skipif(
    build_kind() is Build.COMPILED,
    reason="the profiler sees no frame of a compiled module: the walk needs the pure build",
)


@pytest.fixture(scope="module")
def walk() -> Walk:
    return measure()


@compiled
def test_the_main_line_is_no_longer_than_measured(walk: Walk) -> None:
    assert walk.mode == "continuation"
    stops, files = len(walk.main_line.stops), walk.main_line.files
    assert stops <= MAIN_LINE_STOPS and files <= MAIN_LINE_FILES, walk.main_line.line()


@compiled
def test_the_walk_runs_from_the_handler_to_the_access_line(walk: Walk) -> None:
    first, last = walk.all_functions.stops[0], walk.all_functions.stops[-1]
    assert first[0] == "ingress/front.py" and first[1][0] == "post_responses"
    assert last[0] == "observe/log.py" and last[1][-1] == "access_log"
    # The main line is the all-functions walk with helpers folded: shorter, never longer.
    assert 40 <= len(walk.main_line.stops) < len(walk.all_functions.stops)
    assert walk.main_line.files <= walk.all_functions.files


def test_a_stop_is_a_run_of_calls_in_one_file() -> None:
    calls = [
        Call("serve/handlers.py", "serve", 1, None, None),
        Call("serve/handlers.py", "_parse", 9, 0, "serve/handlers.py"),
        Call("core/request.py", "make_request", 5, 1, "serve/handlers.py"),
        Call("serve/handlers.py", "_perform", 20, 0, "serve/handlers.py"),
    ]
    figs = figures(calls, [True] * 4, import_graph())
    assert [file for file, _ in figs.stops] == ["serve/handlers.py", "core/request.py", "serve/handlers.py"]
    assert figs.files == 2 and figs.upward == []
    # Folding the core call away joins the two handler stops into one.
    folded = figures(calls, [True, True, False, True], import_graph())
    assert folded.stops == [("serve/handlers.py", ["serve", "_parse", "_perform"])]


def test_a_call_into_a_higher_layer_or_an_importer_goes_up() -> None:
    graph = import_graph()
    assert upward("serve/streaming.py", "ingress/listener.py", graph)  # serve -> ingress
    assert upward("core/conversation.py", "intake/memory.py", graph)  # core -> serve (a hook)
    assert upward("core/conversation.py", "core/planner.py", graph)  # planner imports conversation
    assert not upward("core/planner.py", "core/conversation.py", graph)
    assert not upward("serve/handlers.py", "core/request.py", graph)
    assert not upward("serve/handlers.py", "serve/handlers.py", graph)


def test_a_folded_callers_call_is_counted_from_its_nearest_counted_caller() -> None:
    calls = [
        Call("core/conversation.py", "HeadTable.record", 1, None, None),
        Call("core/conversation.py", "_helper", 2, 0, "core/conversation.py"),
        Call("intake/memory.py", "MemoryGate.keep", 3, 1, "core/conversation.py"),
    ]
    figs = figures(calls, [True, False, True], import_graph())
    assert figs.upward == [("core/conversation.py", "intake/memory.py:MemoryGate.keep")]
