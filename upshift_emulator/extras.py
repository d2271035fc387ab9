"""Endpoints other than ``/v1/responses``, so the sidecar's plain passthrough can be tested:
models, chat completions, embeddings, files (multipart) and conversations."""

from __future__ import annotations

import base64
import hashlib
import struct
import time
from typing import Any

import orjson
from aiohttp import web

from .appkeys import OWNER, STATE
from .engine import new_id
from .errors import ApiError, not_found
from .http import json_response
from .oracle import Segment, normalize_input
from .state import Conversation
from .stores import CHAT_COMPLETIONS

__all__ = ["routes"]

JSON = Any
routes = web.RouteTableDef()
_CREATED = 1_700_000_000


def _model(model_id: str) -> dict[str, JSON]:
    return {"id": model_id, "object": "model", "created": _CREATED, "owned_by": "openai"}


@routes.get("/v1/models")
async def list_models(request: web.Request) -> web.Response:
    """The configured model ids."""
    request.app[STATE].stats.other("models")
    data = [_model(m) for m in request.app[STATE].config.models]
    return json_response({"object": "list", "data": data})


@routes.get("/v1/models/{model}")
async def get_model(request: web.Request) -> web.Response:
    """One model, or 404 ``model_not_found``."""
    model = request.match_info["model"]
    if model not in request.app[STATE].config.models:
        raise ApiError(404, f"The model '{model}' does not exist", param="model", code="model_not_found")
    return json_response(_model(model))


async def _json_body(request: web.Request) -> dict[str, JSON]:
    try:
        body = orjson.loads(await request.read())
    except orjson.JSONDecodeError:
        raise ApiError(400, "We could not parse the JSON body of your request.") from None
    if not isinstance(body, dict):
        raise ApiError(400, "Invalid request body: expected a JSON object.")
    if not body.get("model"):
        raise ApiError(400, "Missing required parameter: 'model'.", param="model", code="missing_required_parameter")
    return body


@routes.post("/v1/chat/completions")
async def chat_completions(request: web.Request) -> web.StreamResponse:
    """A deterministic one-line reply, JSON or SSE (with ``[DONE]``, as Chat Completions does)."""
    request.app[STATE].stats.other("chat.completions")
    body = await _json_body(request)
    messages = body.get("messages") or []
    digest = hashlib.sha256(orjson.dumps(messages, option=orjson.OPT_SORT_KEYS)).hexdigest()[:12]
    last = messages[-1].get("content", "") if messages and isinstance(messages[-1], dict) else ""
    text = f"[{digest}] Chat echo: {last if isinstance(last, str) else orjson.dumps(last).decode()}"
    ident, created = "chatcmpl-" + new_id("x", 12)[2:], int(time.time())
    usage = {"prompt_tokens": len(orjson.dumps(messages)) // 4, "completion_tokens": len(text) // 4}
    usage["total_tokens"] = usage["prompt_tokens"] + usage["completion_tokens"]
    head = {"id": ident, "created": created, "model": body["model"]}
    message: dict[str, JSON] = {"role": "assistant", "content": text, "refusal": None, "annotations": []}
    choice = {"index": 0, "message": message, "logprobs": None, "finish_reason": "stop"}
    completion = {**head, "object": "chat.completion", "choices": [choice], "usage": usage}
    if body.get("store") is True:
        request.app[CHAT_COMPLETIONS][ident] = (request[OWNER], completion)
    if body.get("stream") is not True:
        return json_response(completion)
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream; charset=utf-8"})
    await response.prepare(request)
    deltas = [{"role": "assistant", "content": ""}, {"content": text}, {}]
    for index, delta in enumerate(deltas):
        finish = "stop" if index == len(deltas) - 1 else None
        choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
        chunk = {**head, "object": "chat.completion.chunk", "choices": [choice]}
        await response.write(b"data: " + orjson.dumps(chunk) + b"\n\n")
    await response.write(b"data: [DONE]\n\n")
    await response.write_eof()
    return response


def _vector(text: str, dims: int) -> list[float]:
    digest = b""
    counter = 0
    while len(digest) < dims * 2:
        digest += hashlib.sha256(f"{counter}:{text}".encode()).digest()
        counter += 1
    return [round((int.from_bytes(digest[2 * i : 2 * i + 2], "big") / 32767.5) - 1.0, 6) for i in range(dims)]


@routes.post("/v1/embeddings")
async def embeddings(request: web.Request) -> web.Response:
    """Deterministic vectors (``dimensions``, default 8); ``float`` or ``base64`` encoding."""
    request.app[STATE].stats.other("embeddings")
    body = await _json_body(request)
    inputs = body.get("input")
    texts = [inputs] if isinstance(inputs, str) else list(inputs or [])
    dims = int(body.get("dimensions") or 8)
    data = []
    for index, text in enumerate(texts):
        vector = _vector(text if isinstance(text, str) else orjson.dumps(text).decode(), dims)
        encoded: JSON = vector
        if body.get("encoding_format") == "base64":
            encoded = base64.b64encode(struct.pack(f"<{dims}f", *vector)).decode()
        data.append({"object": "embedding", "index": index, "embedding": encoded})
    tokens = sum(len(str(t)) for t in texts) // 4
    usage = {"prompt_tokens": tokens, "total_tokens": tokens}
    return json_response({"object": "list", "data": data, "model": body["model"], "usage": usage})


@routes.post("/v1/files")
async def upload_file(request: web.Request) -> web.Response:
    """Multipart upload: echoes the file name and byte count."""
    request.app[STATE].stats.other("files")
    form = await request.post()
    upload, purpose = form.get("file"), form.get("purpose")
    if not isinstance(upload, web.FileField):
        raise ApiError(400, "Missing required parameter: 'file'.", param="file", code="missing_required_parameter")
    size = len(upload.file.read())
    return json_response(
        {
            "id": "file-" + new_id("x", 12)[2:],
            "object": "file",
            "bytes": size,
            "created_at": int(time.time()),
            "filename": upload.filename,
            "purpose": str(purpose or "user_data"),
            "status": "processed",
            "expires_at": None,
            "status_details": None,
        }
    )


def _conversation_object(conv: Conversation) -> dict[str, JSON]:
    return {"id": conv.id, "object": "conversation", "created_at": conv.created_at, "metadata": {}}


@routes.post("/v1/conversations")
async def create_conversation(request: web.Request) -> web.Response:
    """A new conversation, optionally seeded with ``items``."""
    state = request.app[STATE]
    state.stats.other("conversations")
    raw = await request.read()
    body = orjson.loads(raw) if raw else {}
    conv = Conversation(new_id("conv"), request[OWNER], Segment.root().extend(normalize_input(body.get("items"))))
    state.conversations[conv.id] = conv
    return json_response(_conversation_object(conv))


@routes.get("/v1/conversations/{conversation_id}")
async def get_conversation(request: web.Request) -> web.Response:
    """A conversation visible to the caller."""
    conv = request.app[STATE].conversations.get(request.match_info["conversation_id"])
    if conv is None or conv.owner != request[OWNER]:
        raise not_found("Conversation", request.match_info["conversation_id"])
    return json_response(_conversation_object(conv))
