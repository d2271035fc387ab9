"""Stored-object routes beyond files and conversations, as small as the sidecar's owner tests need:
vector stores (create, add a file, add a file batch, retrieve), items added to a conversation,
uploads (create, complete: the answer carries the new file), stored chat completions (retrieve)
and fine-tuning jobs (create, retrieve, list: an object the sidecar does not track).

Each object belongs to the credential the emulator received (one injected key: every tenant's),
as the real store does; nothing here checks which of the sidecar's tenants asks.
"""

from __future__ import annotations

import time
from typing import Any

import orjson
from aiohttp import web

from .appkeys import OWNER, STATE
from .errors import ApiError, not_found
from .http import json_response
from .oracle import normalize_input
from .turn import new_id

__all__ = ["CHAT_COMPLETIONS", "routes"]

JSON = Any
routes = web.RouteTableDef()
_VECTOR_STORES = web.AppKey("emulator_vector_stores", dict)
_UPLOADS = web.AppKey("emulator_uploads", dict)
_FINE_TUNING = web.AppKey("emulator_fine_tuning_jobs", dict)
CHAT_COMPLETIONS = web.AppKey("emulator_chat_completions", dict)
"""Stored chat completions (``store: true``): id → (owner, object)."""


def install(app: web.Application) -> None:
    """The routes and their tables."""
    app[_VECTOR_STORES] = {}
    app[_UPLOADS] = {}
    app[_FINE_TUNING] = {}
    app[CHAT_COMPLETIONS] = {}
    app.add_routes(routes)


async def _body(request: web.Request) -> dict[str, JSON]:
    raw = await request.read()
    try:
        body = orjson.loads(raw) if raw else {}
    except orjson.JSONDecodeError:
        raise ApiError(400, "We could not parse the JSON body of your request.") from None
    if not isinstance(body, dict):
        raise ApiError(400, "Invalid request body: expected a JSON object.")
    return body


def _mine(table: dict[str, tuple[str, JSON]], request: web.Request, key: str, kind: str) -> JSON:
    object_id = request.match_info[key]
    found = table.get(object_id)
    if found is None or found[0] != request[OWNER]:
        raise not_found(kind, object_id)
    return found[1]


@routes.post("/v1/vector_stores")
async def create_vector_store(request: web.Request) -> web.Response:
    request.app[STATE].stats.other("vector_stores")
    body = await _body(request)
    store = {
        "id": new_id("vs", 12),
        "object": "vector_store",
        "created_at": int(time.time()),
        "name": body.get("name"),
        "file_ids": list(body.get("file_ids") or []),
    }
    request.app[_VECTOR_STORES][store["id"]] = (request[OWNER], store)
    return json_response(store)


@routes.get("/v1/vector_stores/{store_id}")
async def get_vector_store(request: web.Request) -> web.Response:
    request.app[STATE].stats.other("vector_stores")
    return json_response(_mine(request.app[_VECTOR_STORES], request, "store_id", "Vector store"))


@routes.post("/v1/vector_stores/{store_id}/files")
async def add_vector_store_file(request: web.Request) -> web.Response:
    request.app[STATE].stats.other("vector_stores")
    store = _mine(request.app[_VECTOR_STORES], request, "store_id", "Vector store")
    file_id = (await _body(request)).get("file_id")
    if not isinstance(file_id, str):
        message = "Missing required parameter: 'file_id'."
        raise ApiError(400, message, param="file_id", code="missing_required_parameter")
    store["file_ids"].append(file_id)
    return json_response({"id": file_id, "object": "vector_store.file", "vector_store_id": store["id"]})


@routes.post("/v1/vector_stores/{store_id}/file_batches")
async def add_vector_store_batch(request: web.Request) -> web.Response:
    request.app[STATE].stats.other("vector_stores")
    store = _mine(request.app[_VECTOR_STORES], request, "store_id", "Vector store")
    file_ids = [f for f in (await _body(request)).get("file_ids") or [] if isinstance(f, str)]
    store["file_ids"].extend(file_ids)
    counts = {"completed": len(file_ids), "in_progress": 0, "failed": 0, "cancelled": 0, "total": len(file_ids)}
    batch = {"id": new_id("vsfb", 12), "object": "vector_store.files_batch", "vector_store_id": store["id"]}
    return json_response({**batch, "status": "completed", "file_counts": counts})


@routes.post("/v1/conversations/{conversation_id}/items")
async def add_conversation_items(request: web.Request) -> web.Response:
    """Items appended to a conversation, each given an id (and resolvable by ``item_reference``)."""
    state = request.app[STATE]
    state.stats.other("conversations")
    conv = state.conversations.get(request.match_info["conversation_id"])
    if conv is None or conv.owner != request[OWNER]:
        raise not_found("Conversation", request.match_info["conversation_id"])
    added = []
    for raw in normalize_input((await _body(request)).get("items")):
        item = {"id": new_id("msg", 12), "type": "message", **raw} if isinstance(raw, dict) else raw
        state.items[item["id"]] = (conv.owner, item)
        added.append(item)
    conv.chain = conv.chain.extend(added)
    first, last = (added[0]["id"], added[-1]["id"]) if added else (None, None)
    return json_response({"object": "list", "data": added, "first_id": first, "last_id": last, "has_more": False})


@routes.post("/v1/uploads")
async def create_upload(request: web.Request) -> web.Response:
    request.app[STATE].stats.other("uploads")
    body = await _body(request)
    upload = {
        "id": new_id("upload", 12),
        "object": "upload",
        "status": "pending",
        "filename": body.get("filename"),
        "bytes": body.get("bytes"),
        "purpose": body.get("purpose"),
        "created_at": int(time.time()),
        "file": None,
    }
    request.app[_UPLOADS][upload["id"]] = (request[OWNER], upload)
    return json_response(upload)


@routes.post("/v1/uploads/{upload_id}/complete")
async def complete_upload(request: web.Request) -> web.Response:
    """The upload completed: its ``file`` is a new file."""
    request.app[STATE].stats.other("uploads")
    upload = _mine(request.app[_UPLOADS], request, "upload_id", "Upload")
    upload["status"] = "completed"
    upload["file"] = {
        "id": "file-" + new_id("x", 12)[2:],
        "object": "file",
        "bytes": upload["bytes"],
        "filename": upload["filename"],
        "purpose": upload["purpose"],
        "created_at": int(time.time()),
        "status": "processed",
    }
    return json_response(upload)


@routes.get("/v1/chat/completions/{completion_id}")
async def get_chat_completion(request: web.Request) -> web.Response:
    request.app[STATE].stats.other("chat.completions")
    return json_response(_mine(request.app[CHAT_COMPLETIONS], request, "completion_id", "Chat completion"))


@routes.post("/v1/fine_tuning/jobs")
async def create_fine_tuning_job(request: web.Request) -> web.Response:
    """A job that never runs (``validating_files``): only its id, model and files are kept."""
    request.app[STATE].stats.other("fine_tuning")
    body = await _body(request)
    job = {
        "id": new_id("ftjob", 12),
        "object": "fine_tuning.job",
        "created_at": int(time.time()),
        "model": body.get("model"),
        "training_file": body.get("training_file"),
        "suffix": body.get("suffix"),
        "status": "validating_files",
    }
    request.app[_FINE_TUNING][job["id"]] = (request[OWNER], job)
    return json_response(job)


@routes.get("/v1/fine_tuning/jobs/{job_id}")
async def get_fine_tuning_job(request: web.Request) -> web.Response:
    request.app[STATE].stats.other("fine_tuning")
    return json_response(_mine(request.app[_FINE_TUNING], request, "job_id", "Fine-tuning job"))


@routes.get("/v1/fine_tuning/jobs")
async def list_fine_tuning_jobs(request: web.Request) -> web.Response:
    """Every job of the credential (one injected key: every tenant's)."""
    request.app[STATE].stats.other("fine_tuning")
    data = [job for owner, job in request.app[_FINE_TUNING].values() if owner == request[OWNER]]
    return json_response({"object": "list", "data": data, "has_more": False})
