"""WebSocket replies that are not a response's own event sequence: steering refusals and the
field-observed shapes of ``previous_response_not_found`` (pitfalls.md §A4)."""

from __future__ import annotations

import time
from typing import Any

from . import errors
from .engine import new_id
from .events import lifecycle, stamp

__all__ = ["Miss", "not_found_events", "steer_failed"]

JSON = Any


class Miss(Exception):
    """A continuation whose parent is neither cached nor stored (or a forced miss)."""

    def __init__(self, response_id: str, shape: str) -> None:
        super().__init__(response_id)
        self.response_id = response_id
        self.shape = shape


def steer_failed(event: dict[str, JSON]) -> dict[str, JSON]:
    """The emulator never steers (protocol.md §1.4): ``steering_not_supported``."""
    steer: dict[str, JSON] = {"input": event.get("input"), "previous_response_id": event.get("previous_response_id")}
    return {
        "type": "response.steer.failed",
        "sequence_number": 0,
        "error": {
            "type": "invalid_request_error",
            "code": "steering_not_supported",
            "message": "Steering is not supported for this response.",
        },
        "steer": steer,
    }


def not_found_events(miss: Miss, stream_id: str | None, body: dict[str, JSON]) -> list[dict[str, JSON]]:
    """``previous_response_not_found`` in one of the shapes seen in the field (pitfalls.md §A4)."""
    error = errors.previous_response_not_found(miss.response_id)
    shape = miss.shape
    if shape == "parameterless":
        error.message, error.code = "Invalid `previous_response_id`.", None
    elif shape == "renamed":
        error.code = "codex_previous_response_stale"
    if shape in ("nested", "parameterless", "renamed"):
        return [error.ws_event(stream_id)]
    if shape == "no_type":
        event = error.ws_event(stream_id)
        del event["error"]["type"]
        return [event]
    if shape == "alpha":
        event = error.ws_event(stream_id)
        del event["status"]
        return [event]
    flat: dict[str, JSON] = {"type": "error", "code": error.code, "message": error.message, "param": error.param}
    if shape == "top_level":
        flat["status"] = 400
    else:
        flat["sequence_number"] = 0
    if shape == "response_failed":
        response: dict[str, JSON] = {
            "id": new_id("resp"),
            "object": "response",
            "created_at": int(time.time()),
            "status": "in_progress",
            "model": body.get("model"),
            "output": [],
            "previous_response_id": miss.response_id,
            "error": None,
            "usage": None,
        }
        failed = {**response, "status": "failed", "error": {"code": error.code, "message": error.message}}
        return [
            stamp(lifecycle("response.created", response), 0, stream_id),
            stamp(lifecycle("response.failed", failed), 1, stream_id),
        ]
    if stream_id is not None:
        flat["stream_id"] = stream_id
    return [flat]
