"""The streaming event sequence of one response (protocol.md §2.3), as plain dicts.

Events are built without ``sequence_number`` values; the sender stamps them (0, 1, … per
response) because a fault may cut the sequence short or replace its tail.
Items in ``output_item.done`` are the very objects of ``response.completed.response.output``.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from .model import tokens

__all__ = ["Event", "build_events", "chunks", "lifecycle", "stamp"]

JSON = Any


@dataclass(frozen=True, slots=True)
class Event:
    """One event payload plus what pacing needs to know about it."""

    payload: dict[str, JSON]
    tokens: int = 0
    """Output tokens this event carries (deltas only)."""
    output: bool = False
    """First event of the output phase (time to first token is paid before it)."""


def chunks(text: str, size: int) -> Iterator[str]:
    """Split ``text`` into deltas of ``size`` characters (at least one, possibly empty)."""
    size = max(1, size)
    if not text:
        return
    for start in range(0, len(text), size):
        yield text[start : start + size]


def lifecycle(kind: str, response: dict[str, JSON]) -> dict[str, JSON]:
    """``response.created`` / ``in_progress`` / ``completed`` / ``failed`` / ``incomplete``."""
    return {"type": kind, "sequence_number": None, "response": response}


def _event(kind: str, **fields: JSON) -> dict[str, JSON]:
    return {"type": kind, "sequence_number": None, **fields}


def _reasoning(item: dict[str, JSON], index: int, size: int) -> list[Event]:
    added = {"id": item["id"], "type": "reasoning", "summary": []}
    out = [Event(_event("response.output_item.added", output_index=index, item=added))]
    for s_index, part in enumerate(item.get("summary", [])):
        text = str(part.get("text", ""))
        ref = {"item_id": item["id"], "output_index": index, "summary_index": s_index}
        out.append(
            Event(_event("response.reasoning_summary_part.added", **ref, part={"type": "summary_text", "text": ""}))
        )
        for delta in chunks(text, size):
            out.append(Event(_event("response.reasoning_summary_text.delta", **ref, delta=delta), tokens(delta)))
        out.append(Event(_event("response.reasoning_summary_text.done", **ref, text=text)))
        out.append(
            Event(_event("response.reasoning_summary_part.done", **ref, part={"type": "summary_text", "text": text}))
        )
    return out


def _message(item: dict[str, JSON], index: int, size: int) -> list[Event]:
    added = {"id": item["id"], "type": "message", "status": "in_progress", "content": [], "role": "assistant"}
    if "phase" in item:
        added["phase"] = item["phase"]
    out = [Event(_event("response.output_item.added", output_index=index, item=added))]
    for c_index, part in enumerate(item.get("content", [])):
        text = str(part.get("text", ""))
        ref = {"item_id": item["id"], "output_index": index, "content_index": c_index}
        empty = {"type": "output_text", "annotations": [], "logprobs": [], "text": ""}
        out.append(Event(_event("response.content_part.added", **ref, part=empty)))
        for delta in chunks(text, size):
            out.append(Event(_event("response.output_text.delta", **ref, delta=delta, logprobs=[]), tokens(delta)))
        out.append(Event(_event("response.output_text.done", **ref, text=text, logprobs=[])))
        out.append(Event(_event("response.content_part.done", **ref, part=copy.deepcopy(part))))
    return out


def _function_call(item: dict[str, JSON], index: int, size: int) -> list[Event]:
    added = {**item, "status": "in_progress", "arguments": ""}
    out = [Event(_event("response.output_item.added", output_index=index, item=added))]
    ref = {"item_id": item["id"], "output_index": index}
    for delta in chunks(str(item["arguments"]), size):
        out.append(Event(_event("response.function_call_arguments.delta", **ref, delta=delta), tokens(delta)))
    # ``name``: required by the OpenAPI file, undeclared (extra) in the SDK types; sent (docs/emulator.md)
    done = _event("response.function_call_arguments.done", **ref, name=item["name"], arguments=item["arguments"])
    out.append(Event(done))
    return out


def _compaction(item: dict[str, JSON], index: int) -> list[Event]:
    added = {**item, "encrypted_content": ""}
    return [
        Event(_event("response.output_item.added", output_index=index, item=added)),
        Event(_event("response.compaction.compacting", item_id=item["id"], output_index=index)),
    ]


def build_events(shell: dict[str, JSON], final: dict[str, JSON], terminal: str, delta_chars: int) -> list[Event]:
    """The whole sequence: created, in_progress, each item's events, then ``terminal``.

    ``shell`` is the in-progress response object (``output: []``, ``usage: null``); ``final`` the
    finished one whose ``output`` items are placed, unchanged, in the ``output_item.done`` events.
    """
    events = [
        Event(lifecycle("response.created", shell)),
        Event(lifecycle("response.in_progress", shell)),
    ]
    for index, item in enumerate(final["output"]):
        kind = item.get("type")
        if kind == "compaction":
            body = _compaction(item, index)
        elif kind in ("program", "program_output"):
            body = [Event(_event("response.output_item.added", output_index=index, item=item))]
        elif kind == "reasoning":
            body = _reasoning(item, index, delta_chars)
        elif kind == "function_call":
            body = _function_call(item, index, delta_chars)
        else:
            body = _message(item, index, delta_chars)
        events.extend(body)
        events.append(Event(_event("response.output_item.done", output_index=index, item=item)))
    events.append(Event(lifecycle(terminal, final)))
    if len(events) > 2:
        events[2] = Event(events[2].payload, events[2].tokens, output=True)
    return events


def stamp(payload: dict[str, JSON], sequence: int, stream_id: str | None) -> dict[str, JSON]:
    """A copy of ``payload`` with its ``sequence_number`` (and ``stream_id`` on a named lane)."""
    out = dict(payload)
    out["sequence_number"] = sequence
    if stream_id is not None:
        out["stream_id"] = stream_id
    return out
