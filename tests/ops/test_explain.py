"""MissExplainer: where a miss departs from its best candidate head (pure, no sockets)."""

from __future__ import annotations

import gc
import sys
import tracemalloc
from typing import Any

from proxy.core.conversation import HeadTable, MissReason
from proxy.core.explain import Detail, echo_fields, first_field_diff
from proxy.core.explainer import MissExplainer
from proxy.reasons import Hit, Mode, Tolerance
from tests.core.test_conversation import call, reasoning, req, response, result

SYSTEM = {"role": "system", "content": "You are helpful. Today is 2026-12-01T10:00."}
USER = {"role": "user", "content": "do 3 steps"}


def three_turns(heads: HeadTable, first: list[Any]) -> list[Any]:
    """Record a 3-turn tool loop on socket s1; returns the history after turn 3's output."""
    history = list(first)
    for turn in (1, 2, 3):
        r = req(history)
        assert heads.lookup("id", r, turn).reason in ("continuation", MissReason.NO_HEAD)
        heads.record("id", "s1", r, response(f"resp_{turn}", call(turn)), turn)
        history += [call(turn), result(turn)]
    return history


def miss(misses: MissExplainer, items: list[Any], **fields: Any) -> tuple[str, Any]:
    r = req(items, **fields)
    found = misses.heads.lookup("id", r, 10)
    assert found.match is None
    return found.reason, misses.explain("id", r, found.reason)


def test_edited_first_item_is_diverged_at_zero_not_no_head() -> None:
    misses = MissExplainer(HeadTable(max_heads=100, ttl_seconds=600))
    heads = misses.heads
    history = three_turns(heads, [SYSTEM, USER])
    edited = [dict(SYSTEM, content="You are helpful. Today is 2026-12-01T10:05."), *history[1:]]
    reason, exp = miss(misses, edited)
    assert reason == MissReason.NO_HEAD  # the matcher alone cannot tell
    assert exp is not None and exp.reason == MissReason.DIVERGED
    assert (exp.miss_item, exp.miss_type, exp.miss_field, exp.detail) == (0, "message", "content[0].text", Detail.FIELD)
    assert exp.candidate_items == 7  # 6 input items + 1 output item of turn 3
    assert exp.identity == "id"


def test_cold_head_says_field_unknown() -> None:
    misses = MissExplainer(HeadTable(max_heads=100, ttl_seconds=600, hot_seconds=0.5))
    heads = misses.heads
    history = three_turns(heads, [SYSTEM, USER])
    heads.expire(100.0)  # bodies go cold, heads stay (ttl 600)
    edited = [SYSTEM, dict(USER, content="do 4 steps"), *history[2:]]
    _, exp = miss(misses, edited)
    assert exp is not None and exp.reason == MissReason.DIVERGED
    assert (exp.miss_item, exp.miss_type, exp.miss_field, exp.detail) == (1, "message", None, Detail.FIELD_UNKNOWN)


def test_new_conversation_sharing_the_system_prompt_stays_no_head() -> None:
    misses = MissExplainer(HeadTable(max_heads=100, ttl_seconds=600))
    heads = misses.heads
    three_turns(heads, [SYSTEM, USER])
    reason, exp = miss(misses, [SYSTEM, dict(USER, content="another task")])
    assert reason == MissReason.NO_HEAD
    assert exp is not None and exp.reason == MissReason.NO_HEAD and exp.miss_item is None


def test_reserialised_arguments_equal_continue_but_changed_ones_are_reported() -> None:
    misses = MissExplainer(HeadTable(max_heads=100, ttl_seconds=600))
    heads = misses.heads
    heads.record("id", "s1", req([USER]), response("resp_1", call(1, '{"path":"a.py","n":2}')), 0)
    same = req([USER, call(1, '{ "n": 2.0, "path": "a.py" }'), result(1)])
    assert heads.lookup("id", same, 1).match is not None
    reason, exp = miss(misses, [USER, call(1, '{"path":"a.py","n":"2"}'), result(1)])
    assert reason == MissReason.DIVERGED
    assert exp is not None
    assert (exp.reason, exp.miss_item, exp.miss_type, exp.miss_field) == ("diverged", 1, "function_call", "arguments")


def test_changed_tools_name_the_setting() -> None:
    misses = MissExplainer(HeadTable(max_heads=100, ttl_seconds=600))
    heads = misses.heads
    heads.record("id", "s1", req([USER]), response("resp_1", call(1)), 0)
    tools = [{"type": "function", "name": "read"}, {"type": "function", "name": "write"}]
    reason, exp = miss(misses, [USER, call(1), result(1)], tools=tools)
    assert reason == MissReason.SETTINGS_CHANGED
    assert exp is not None
    assert (exp.reason, exp.miss_item, exp.miss_field, exp.detail) == (
        "settings_changed",
        None,
        "tools",
        Detail.SETTING,
    )


def test_dropped_reasoning_retry_and_no_new_items() -> None:
    misses = MissExplainer(HeadTable(max_heads=100, ttl_seconds=600))
    heads = misses.heads
    heads.record("id", "s1", req([USER]), response("resp_1", reasoning(1), call(1)), 0)
    reason, exp = miss(misses, [USER, call(1), result(1)])
    assert reason == MissReason.DROPPED_REASONING
    assert exp is not None and (exp.reason, exp.miss_item, exp.miss_type) == ("dropped_reasoning", 1, "reasoning")
    reason, exp = miss(misses, [USER])
    assert reason == MissReason.RETRY
    assert exp is not None and (exp.reason, exp.miss_item, exp.miss_type, exp.detail) == (
        "retry",
        1,
        "reasoning",
        Detail.RETRY,
    )
    reason, exp = miss(misses, [USER, reasoning(1), call(1)])
    assert reason == MissReason.NO_NEW_ITEMS
    assert exp is not None and (exp.reason, exp.miss_item, exp.detail) == ("no_new_items", 3, Detail.NO_NEW_ITEMS)


def test_echoed_message_text_changed() -> None:
    misses = MissExplainer(HeadTable(max_heads=100, ttl_seconds=600))
    heads = misses.heads
    out = {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "done"}]}
    heads.record("id", "s1", req([USER]), response("resp_1", out), 0)
    as_string = {"role": "assistant", "content": "done"}
    assert heads.lookup("id", req([USER, as_string, USER]), 1).match is not None
    edited = {"role": "assistant", "content": [{"type": "output_text", "text": "done!"}]}
    _, exp = miss(misses, [USER, edited, USER])
    assert exp is not None and (exp.miss_item, exp.miss_type, exp.miss_field) == (1, "message", "content[0].text")


def test_field_diff_paths_are_names_and_indices_only() -> None:
    old = {"type": "function_call_output", "call_id": "c", "output": [{"type": "input_text", "text": "SECRET"}]}
    new = {"type": "function_call_output", "call_id": "c", "output": [{"type": "input_text", "text": "OTHER"}]}
    assert first_field_diff(old, new) == "output[0].text"
    assert (
        first_field_diff(
            {"role": "user", "content": "a"}, {"role": "user", "content": [{"type": "input_text", "text": "a"}]}
        )
        is None
    )
    assert first_field_diff({"a": {"weird key!": 1}}, {"a": {"weird key!": 2}}) == "a.?"


def test_memory_per_head_of_the_explanation_data() -> None:
    """Measured and bounded: 8 bytes an input item, about 100-120 bytes an output item."""
    misses = MissExplainer(HeadTable(max_heads=10_000, ttl_seconds=600))
    heads = misses.heads
    history = [USER]
    for n in range(10):
        history += [call(n), result(n)]
    r = req(history)
    r.item_keys()  # computed by lookup anyway
    message = {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "done"}]}
    output = [reasoning(99), call(99), message]
    digests = heads._item_digests(r)
    assert digests is not None and len(digests) == 8 * 21
    tuple(echo_fields(i) for i in output)  # the shared path tuples exist once per process

    echo = tuple(echo_fields(i) for i in output)
    again = tuple(echo_fields(i) for i in output)
    assert all(a[0] is b[0] for a, b in zip(echo, again, strict=True))  # paths: shared, not per head
    # What one head holds for explanations (the shared path tuples excluded).
    size = sys.getsizeof(digests) + sys.getsizeof(echo)
    size += sum(sys.getsizeof(pair) + sys.getsizeof(pair[1]) for pair in echo)
    print(f"explanation data per head (21 input items, 3 output items): {size} bytes", file=sys.stderr)
    assert sys.getsizeof(digests) == 33 + 8 * 21
    assert size < 8 * 21 + 33 + 64 + 3 * 130


def test_same_task_again_is_no_head_with_where_it_stops() -> None:
    """A new conversation that starts like a finished one (the demo run twice) is no edit."""
    misses = MissExplainer(HeadTable(max_heads=100, ttl_seconds=600))
    heads = misses.heads
    three_turns(heads, [SYSTEM, USER])
    reason, exp = miss(misses, [SYSTEM, USER])
    assert reason == MissReason.NO_HEAD
    assert exp is not None and exp.reason == MissReason.NO_HEAD
    assert (exp.miss_item, exp.detail, exp.candidate_items) == (2, Detail.MISSING, 7)


def test_explained_later_sees_the_heads_of_the_miss_not_those_recorded_since() -> None:
    """The shell computes the explanation after the answer: by then the request's own head is
    in the table (it replaced its lane's previous head); the verdict is the one at the miss."""
    misses = MissExplainer(HeadTable(max_heads=100, ttl_seconds=600))
    heads = misses.heads
    history = three_turns(heads, [SYSTEM, USER])
    edited = [dict(SYSTEM, content="You are helpful. Today is 2026-12-01T10:05."), *history[1:]]
    r = req(edited)
    found = heads.lookup("id", r, 10)
    at_miss = misses.explain("id", r, found.reason)
    later = misses.explain_later("id", r, found.reason)
    assert later is not None and at_miss is not None
    heads.record("id", "s1", r, response("resp_9", call(9)), 11)  # the full send's own head, on s1
    assert later() == at_miss and (at_miss.reason, at_miss.miss_item) == (MissReason.DIVERGED, 0)
    # Asked now, the request's own head (identical to it) is the best candidate instead.
    assert misses.explain("id", r, found.reason) != at_miss


async def test_the_access_line_waits_for_the_explanation_only_when_the_verdict_stood(
    access_log: tuple[Any, Any],
) -> None:
    import asyncio
    import threading

    from proxy.core.explain import Explanation
    from proxy.serve.record import Record

    lines, _ = access_log
    calls: list[str] = []

    def explainer() -> Explanation:
        calls.append(threading.current_thread().name)
        return Explanation(MissReason.DIVERGED, miss_item=0, identity="id")

    rec = Record("req_1", mode=Mode.FULL, reason=MissReason.NO_HEAD, status=200)
    rec.explain(explainer, MissReason.NO_HEAD)
    rec.finish()
    assert calls == [] and lines() == []  # not on the request's path
    await asyncio.sleep(0)
    assert calls == [threading.current_thread().name]  # a small request: the loop's next round
    (line,) = lines()
    assert (line["reason"], line["miss_item"]) == (MissReason.DIVERGED, 0)
    replayed = Record("req_2", mode=Mode.CONTINUATION, reason=Hit.CONTINUATION, status=200)
    replayed.explain(explainer, MissReason.NO_HEAD)
    replayed.finish()  # the verdict did not stand: nothing computed, the line at once
    assert len(calls) == 1 and len(lines()) == 2
    # A large request's miss is explained in a thread of its own, never on the loop.
    large = Record("req_3", mode=Mode.FULL, reason=MissReason.NO_HEAD, status=200, bytes_in=4 * 1024 * 1024)
    large.explain(explainer, MissReason.NO_HEAD)
    large.finish()
    for _ in range(200):
        if len(lines()) == 3:
            break
        await asyncio.sleep(0.01)
    assert len(calls) == 2 and calls[1] != threading.current_thread().name, calls
    assert lines()[-1]["reason"] == MissReason.DIVERGED


def test_score_agrees_with_a_position_by_position_count() -> None:
    """score() counts agreement with one XOR of the digest strings; the count, the first
    difference and the agreement after it are those of comparing item by item."""
    import random

    from proxy.core.explain import DIGEST, Candidate, score

    rng = random.Random(14)
    for _ in range(2000):
        n, m = rng.randint(0, 40), rng.randint(0, 40)
        base = [rng.randbytes(DIGEST) for _ in range(max(n, m))]
        theirs = list(base[:n])
        keys = [d + rng.randbytes(8) for d in base[:m]]  # item keys are longer than their digest
        for _ in range(rng.randint(0, 4)):  # edits anywhere, zero bytes included
            if theirs:
                theirs[rng.randrange(len(theirs))] = rng.choice([bytes(DIGEST), rng.randbytes(DIGEST)])
        cand = Candidate(n_input=n, items=b"".join(theirs), output=(), echo=(), same_settings=True, settings=None)
        agree, first, after = 0, None, 0
        for i in range(min(n, m)):
            if keys[i][:DIGEST] == theirs[i]:
                agree, after = agree + 1, after + (first is not None)
            elif first is None:
                first = i
        got = score(cand, keys, [{}] * m)
        assert (got.agree, got.first, got.after) == (agree, first, after)


def test_an_edit_is_explained_behind_thousands_of_heads_found_by_how_its_input_ends() -> None:
    """A gateway's key: 2,000 conversations share the system prompt after the edited one was
    recorded, far beyond any scan of recent heads. The edited conversation's head is found by its
    last input item, which the edit left in place; a head that left the table, or one recorded
    after the miss, is not a candidate."""
    misses = MissExplainer(HeadTable(max_heads=5000, ttl_seconds=600))
    heads = misses.heads
    history = three_turns(heads, [SYSTEM, USER])
    for i in range(2000):
        other = req([SYSTEM, {"role": "user", "content": f"task {i}"}])
        heads.record("id", f"other-{i}", other, response(f"resp_o{i}", call(100 + i)), 5)
    edited = [dict(SYSTEM, content="You are helpful. Today is 2026-12-01T10:05."), *history[1:]]
    reason, exp = miss(misses, edited)
    assert reason == MissReason.NO_HEAD and exp is not None
    assert (exp.reason, exp.miss_item, exp.candidate_items) == (MissReason.DIVERGED, 0, len(history) - 1)
    # No longer than the head's input (no echo to compare): only the digests tell it is an edit.
    reason, exp = miss(misses, edited[:6])
    assert exp is not None and (exp.reason, exp.miss_item) == (MissReason.DIVERGED, 0)
    heads.discard("s1")  # its lane went to another conversation: no longer a candidate
    _, exp = miss(misses, edited)
    assert exp is not None and (exp.reason, exp.miss_item) == (MissReason.NO_HEAD, None)
    # Recorded after the miss: the explanation, computed later, does not see it.
    fresh = [{"role": "system", "content": "Another agent."}, USER]
    r = req([dict(fresh[0], content="Another agent, edited."), *fresh[1:], call(1), result(1)])
    later = misses.explain_later("id", r, heads.lookup("id", r, 10).reason)
    heads.record("id", "s2", req(fresh), response("resp_f1", call(1)), 12)
    assert later is not None
    exp = later()
    assert exp is not None and (exp.reason, exp.miss_item) == (MissReason.NO_HEAD, None)
    now = misses.explain("id", r, MissReason.NO_HEAD)
    assert now is not None and (now.reason, now.miss_item) == (MissReason.DIVERGED, 0)


def test_a_head_the_table_let_go_is_not_kept_alive_for_explanations() -> None:
    """The explainer's index of heads by how their input ends names heads, it does not hold
    them: heads the table discarded give their memory back (else up to 10,000 of them would
    stay, outside the memory budget's count of heads)."""
    misses = MissExplainer(HeadTable(max_heads=5000, ttl_seconds=600))
    heads = misses.heads
    long = [SYSTEM, *({"role": "user", "content": f"step {i}"} for i in range(400))]
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        for i in range(300):
            r = req([*long, {"role": "user", "content": f"task {i}"}])
            heads.record("id", f"lane-{i}", r, response(f"resp_{i}", call(i)), 5)
        del r
        kept = tracemalloc.get_traced_memory()[0] - before
        for i in range(300):
            heads.discard(f"lane-{i}")
        gc.collect()
        left = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert len(heads) == 0
    # Each head held 402 item digests (8 bytes each), its output's fingerprints and fields, and
    # its body (hot, for the next turn's prefix): all of it goes but the index's small entries.
    digests = 300 * 402 * 8
    assert kept > digests, kept
    assert left < digests / 2, (left, kept)


def test_a_conversations_turns_leave_one_index_entry() -> None:
    """Each turn of a conversation records a head on its anchor, replacing the last one: the
    explainer's index keeps one entry for it, not one a turn (a soak of 10,000 turns grew by the
    entries of heads long gone, up to the table's 10,000)."""
    misses = MissExplainer(HeadTable(max_heads=5000, ttl_seconds=600))
    heads = misses.heads
    steps = [{"role": "user", "content": f"step {i}"} for i in range(2_020)]

    def turn(i: int) -> None:  # a sliding window: every turn's input is 21 items long
        heads.record("id", "lane-0", req([SYSTEM, *steps[i : i + 20]]), response(f"resp_{i}", call(i)), 5)

    for i in range(200):
        turn(i)
    gc.collect()
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        for i in range(200, 2_000):
            turn(i)
        gc.collect()
        grown = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert len(heads) == 1
    # 1,800 index entries (a key tuple, its serial, anchor and response id, a dict slot) would be
    # well over 300 KB.
    assert grown < 1_800 * 100, grown


COMMENTARY = {
    "id": "msg_c1",
    "type": "message",
    "status": "completed",
    "role": "assistant",
    "phase": "commentary",
    "content": [{"type": "output_text", "text": "Reading step 1.", "annotations": [], "logprobs": []}],
}


def test_dropped_phase_is_explained_at_the_message_and_names_the_field() -> None:
    """A phase-less echo (pydantic-ai, llama-index): miss ``dropped_phase`` at the message,
    ``miss_field`` ``phase``; a changed phase is an ordinary divergence at ``phase``; with the
    tolerance on, the same echo continues."""
    phaseless = {k: v for k, v in COMMENTARY.items() if k != "phase"}
    for tolerate in ((), ("reasoning",)):
        misses = MissExplainer(HeadTable(max_heads=100, ttl_seconds=600, tolerate=[Tolerance(t) for t in tolerate]))
        heads = misses.heads
        heads.record("id", "s1", req([USER]), response("resp_1", COMMENTARY, call(1)), 0)
        reason, exp = miss(misses, [USER, phaseless, call(1), result(1)])
        assert reason == MissReason.DROPPED_PHASE
        assert exp is not None
        assert (exp.reason, exp.miss_item, exp.miss_type, exp.miss_field, exp.detail) == (
            "dropped_phase",
            1,
            "message",
            "phase",
            Detail.PHASE_DROPPED,
        )
        assert exp.fields()["miss_detail"] == "phase_dropped"
    misses = MissExplainer(HeadTable(max_heads=100, ttl_seconds=600))
    heads = misses.heads
    heads.record("id", "s1", req([USER]), response("resp_1", COMMENTARY, call(1)), 0)
    reason, exp = miss(misses, [USER, dict(COMMENTARY, phase="final_answer"), call(1), result(1)])
    assert reason == MissReason.DIVERGED
    assert exp is not None and (exp.miss_item, exp.miss_field, exp.detail) == (1, "phase", Detail.FIELD)
    tolerant = HeadTable(max_heads=100, ttl_seconds=600, tolerate=[Tolerance.PHASE])
    tolerant.record("id", "s1", req([USER]), response("resp_1", COMMENTARY, call(1)), 0)
    found = tolerant.lookup("id", req([USER, phaseless, call(1), result(1)]), 10)
    assert found.match is not None and found.dropped_phase == 1
