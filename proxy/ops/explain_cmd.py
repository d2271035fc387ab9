"""``upshift explain PREVIOUS RESPONSE NEXT``: would the next request continue the previous one?

For bug reports about new clients. Give it three files the app's traffic was saved to: the
previous ``POST /v1/responses`` body, the response the app got for it (the JSON body, or the
SSE stream as text), and the next request body. It runs the sidecar's own matcher
(:class:`~proxy.core.conversation.HeadTable`) on them, exactly as the sidecar would for one
credential on one open socket, and prints whether the next request continues the previous one
and, if not, where it departs: the same ``reason``, ``miss_item``, ``miss_type``,
``miss_field`` as the access log. Nothing is sent anywhere; no value of the files is printed.

Exit codes: 0 it would continue, 1 it would not (a miss), 2 unusable arguments or files.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import orjson

from proxy.config_load import load_settings
from proxy.core.conversation import HeadTable, MissReason
from proxy.core.explain import Detail, Explanation
from proxy.core.explainer import MissExplainer
from proxy.core.request import parse_request
from proxy.errors import ConfigError, InvalidRequest
from proxy.reasons import Tolerance
from proxy.wire import sse

__all__ = ["main", "read_response"]

_IDENTITY = "explain"
_ANCHOR = "previous"


class _Unusable(Exception):
    """A file that cannot be used (message for the user)."""


def read_response(data: bytes) -> dict[str, Any]:
    """The response object from a JSON body, an event object, or an SSE stream.

    Raises:
        _Unusable: no response object found.
    """
    text = data.strip()
    if text.startswith(b"{"):
        try:
            value = orjson.loads(text)
        except orjson.JSONDecodeError as exc:
            raise _Unusable(f"not JSON ({exc})") from None
        if isinstance(value, dict) and isinstance(value.get("response"), dict) and value.get("object") != "response":
            value = value["response"]  # one event such as {"type": "response.completed", "response": {...}}
        if not isinstance(value, dict):
            raise _Unusable("not a JSON object")
        return value
    found: dict[str, Any] | None = None
    for sse_event in sse.decode_all(data):
        payload = sse_event.data.strip()
        if not payload or payload == b"[DONE]":
            continue
        try:
            event = orjson.loads(payload)
        except orjson.JSONDecodeError:
            continue
        if isinstance(event, dict) and isinstance(event.get("response"), dict):
            found = event["response"]  # the last one wins: response.completed ends the stream
    if found is None:
        raise _Unusable("neither a JSON response nor an SSE stream with a response event")
    return found


def _read(path: str) -> bytes:
    try:
        return Path(path).read_bytes()
    except OSError as exc:
        raise _Unusable(f"{path}: {exc.strerror}") from None


def explain_files(previous: bytes, response: dict[str, Any], following: bytes, *, tolerate: Iterable[Tolerance]) -> Any:
    """Run the matcher with ``matching.tolerate``: ``("continuation", items sent, items avoided,
    the echo's tolerated departures)`` or ``("miss", Explanation)``.

    Raises:
        _Unusable: a body the sidecar itself would refuse.
    """
    heads = HeadTable(max_heads=4, ttl_seconds=float("inf"), tolerate=tolerate)
    misses = MissExplainer(heads)
    try:
        prev = parse_request(previous)
    except InvalidRequest as exc:
        raise _Unusable(f"previous request: {exc.message}") from None
    if response.get("status") == "completed":
        heads.record(_IDENTITY, _ANCHOR, prev, response, 0.0)
    try:
        req = heads.parse(_IDENTITY, following)
    except InvalidRequest as exc:
        raise _Unusable(f"next request: {exc.message}") from None
    found = heads.lookup(_IDENTITY, req, 1.0)
    if found.match is not None:
        tolerated = {Tolerance.REASONING: found.dropped_reasoning, Tolerance.PHASE: found.dropped_phase}
        return "continuation", len(found.match.new_items), found.match.items_avoided, tolerated
    assert isinstance(found.reason, MissReason)  # no match: a miss
    explanation = misses.explain(_IDENTITY, req, found.reason) or Explanation(found.reason)
    return "miss", explanation


def _describe(exp: Explanation, status: Any) -> list[str]:
    lines = [f"miss: {exp.reason} (the next request would go upstream with its full history)"]
    if exp.reason == MissReason.NO_HEAD and status != "completed":
        lines.append(f"  the previous response's status is {status!r}: only completed responses can be continued")
        return lines
    if exp.reason == MissReason.APP_CHAINED:
        lines.append("  the app sets previous_response_id itself: the sidecar relays it as is")
        return lines
    if exp.reason == MissReason.PRUNED_AT_COMPACTION:
        lines.append(
            "  the history starts at a compaction item: the previous output did not hold that item, or the"
            " echo after it differs from that output"
        )
        return lines
    if exp.detail is None:
        lines.append("  no candidate: the next request shares nothing with the previous turn")
        return lines
    where = WHERE[exp.detail].format(i=exp.miss_item, t=exp.miss_type or "unknown type", f=exp.miss_field)
    lines.append("  " + where)
    if (tolerance := _TOLERABLE.get(exp.reason)) is not None:
        lines.append(
            f"  matching.tolerate: [{tolerance}] would continue it (the model then sees what the app left out)"
        )
    lines.append(f"  candidate: the previous turn, {exp.candidate_items} items (its input and output)")
    return lines


WHERE: dict[Detail, str] = {
    Detail.FIELD: "input item {i} ({t}) differs at field {f}",
    Detail.FIELD_UNKNOWN: "input item {i} ({t}) differs",
    Detail.MISSING: "the request has no item {i} where the previous turn has one ({t})",
    Detail.SETTING: "the setting {f} differs from the previous turn's",
    Detail.REASONING_DROPPED: "the echo leaves out the reasoning item expected at input item {i}",
    Detail.PHASE_DROPPED: "input item {i} ({t}) is sent back without the phase the previous output gave it",
    Detail.NO_NEW_ITEMS: "the request ends after the echo of the previous output (item {i} would be new)",
    Detail.RETRY: "the request repeats the previous input; the echo of its output ({t}) should start at item {i}",
}
"""Where a miss departs, for people: one line per :class:`Detail` (every one; a test checks)."""

_TOLERABLE = {MissReason.DROPPED_REASONING: Tolerance.REASONING, MissReason.DROPPED_PHASE: Tolerance.PHASE}


def _tolerances(values: list[str], allow_dropped_reasoning: bool) -> frozenset[Tolerance]:
    """The flags read as the sidecar reads ``matching.tolerate`` and its deprecated spelling
    (the same parsing, check and suggestions; nothing else of the configuration)."""
    flags = {"matching.tolerate": ",".join(values) or None, "matching.allow_dropped_reasoning": allow_dropped_reasoning}
    try:
        return load_settings(flags, {}, None).matching.tolerances()
    except ConfigError as exc:
        raise _Unusable(str(exc)) from None


def main(argv: list[str] | None = None) -> int:
    """``upshift explain``; returns the exit code."""
    p = argparse.ArgumentParser(
        prog="upshift explain",
        description="Say whether the next request would continue the previous one through upshift, "
        "and if not, where it departs (the access log's explanation). Nothing is sent anywhere.",
    )
    p.add_argument("previous", help="the previous POST /v1/responses body (JSON file)")
    p.add_argument("response", help="the response the app got for it: the JSON body or the SSE stream")
    p.add_argument("next", help="the next POST /v1/responses body (JSON file)")
    p.add_argument("--json", action="store_true", help="print one JSON object (the access-log fields)")
    p.add_argument(
        "--tolerate",
        action="append",
        default=[],
        metavar="KINDS",
        help="as the sidecar's matching.tolerate: comma-separated, of " + ", ".join(t.value for t in Tolerance),
    )
    p.add_argument(
        "--allow-dropped-reasoning",
        action="store_true",
        help="deprecated, as matching.allow_dropped_reasoning: --tolerate reasoning",
    )
    args = p.parse_args(argv)
    try:
        tolerate = _tolerances(args.tolerate, args.allow_dropped_reasoning)
        previous, following = _read(args.previous), _read(args.next)
        response = read_response(_read(args.response))
        result = explain_files(previous, response, following, tolerate=tolerate)
    except _Unusable as exc:
        print(f"upshift explain: {exc}", file=sys.stderr)
        return 2
    if result[0] == "continuation":
        _, sent, avoided, tolerated = result
        if args.json:
            fields = {"mode": "continuation", "items_sent": sent, "items_avoided": avoided}
            print(orjson.dumps({**fields, "tolerated": {str(k): n for k, n in tolerated.items()}}).decode())
        else:
            print(f"continuation: previous_response_id + {sent} new item(s); {avoided} item(s) not re-sent")
            for kind, count in tolerated.items():
                if count:
                    print(f"  tolerated ({kind}): {count} item(s) of the previous output sent back without it")
        return 0
    exp: Explanation = result[1]
    if args.json:
        print(orjson.dumps({"mode": "full", "reason": exp.reason, **exp.fields()}).decode())
    else:
        print("\n".join(_describe(exp, response.get("status"))))
    return 1
