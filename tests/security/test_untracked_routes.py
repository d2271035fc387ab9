"""Behind an injected key, a ``/v1`` route naming objects the sidecar does not track is refused.

The attack: the sidecar owner-checks the collections it knows (files, conversations, ...);
were any other ``/v1`` route forwarded unchecked behind the one injected key, Bob would read the
fine-tuning job in the upstream's store (``GET /v1/fine_tuning/jobs/{id}``) and list every
tenant's jobs. The emulator's store is keyed by the credential it receives, so
behind the injected key it would serve Bob anything: every refusal is the sidecar's. Each case
beside its control: the stateless routes are still answered, an operator can open the untracked
routes, and with the app's own key nothing is refused (the upstream's key check separates them).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import aiohttp
import pytest

from tests.reliability.helpers import Reply, assert_openai_error
from tests.security.support import ALICE, BOB, INJECTED, MODEL, call, forwarded, injected_env, start_process
from tests.sidecar import SidecarProcess
from upshift_emulator import Emulator

pytestmark = pytest.mark.timeout(120)

SECRET = "alice-private-suffix-KILO-7"


async def stored_job(http: aiohttp.ClientSession, emulator: Emulator) -> str:
    """A fine-tuning job in the upstream's store under the injected key (made there by whoever
    holds the key: the sidecar never saw it created)."""
    body = {"model": MODEL, "training_file": "file-abc", "suffix": SECRET}
    created = await call(http, "POST", emulator.base_url + "/fine_tuning/jobs", INJECTED, body)
    assert created.status == 200, created.raw[:300]
    job_id: str = created.json["id"]
    return job_id


def assert_refused(reply: Reply, method: str, path: str) -> None:
    error = assert_openai_error(reply, 403, "not_shared")
    assert f"{method} {path}" in error["message"], error
    assert "identity.shared_objects: [untracked]" in error["message"], error
    assert "x-upshift-mode" not in reply.headers and SECRET.encode() not in reply.raw


def assert_forwarded(reply: Reply) -> None:
    assert reply.headers.get("x-upshift-mode") == "passthrough", (reply.status, reply.raw[:300])


async def test_untracked_routes_are_refused_for_every_tenant_behind_an_injected_key(
    emulator: Emulator, spawn: Callable[..., SidecarProcess], http: aiohttp.ClientSession
) -> None:
    proc = await start_process(spawn, emulator.base_url, env=injected_env())
    api = proc.api
    job = await stored_job(http, emulator)
    before = forwarded(emulator)
    refused: list[tuple[str, str, Any]] = [
        ("GET", f"/v1/fine_tuning/jobs/{job}", None),
        ("GET", "/v1/fine_tuning/jobs", None),
        ("POST", f"/v1/fine_tuning/jobs/{job}/cancel", None),
        ("POST", "/v1/fine_tuning/jobs", {"model": MODEL, "training_file": "file-abc"}),
        ("GET", "/v1/evals/eval_1/runs", None),
        ("GET", "/v1/assistants", None),
        ("POST", "/v1/threads", {}),
        ("GET", "/v1/videos", None),
        ("GET", "/v1/audio/voices", None),  # under a stateless prefix, but not a stateless route
        ("DELETE", f"/v1/models/{MODEL}", None),  # a model is stateless to read, not to delete
        ("GET", "/v1/organization/projects", None),
        ("POST", "/v1/realtime/calls/rtc_1/hangup", {}),
    ]
    for key in (ALICE, BOB):
        for method, path, body in refused:
            assert_refused(await call(http, method, api + path, key, body), method, path)
        # A query string changes nothing.
        path = f"/v1/fine_tuning/jobs/{job}"
        assert_refused(await call(http, "GET", api + path + "?limit=1", key), "GET", path)
    assert forwarded(emulator) == before  # nothing of theirs reached the upstream
    # The control: the routes that name no stored object are answered behind the key.
    models = await call(http, "GET", api + "/v1/models", BOB)
    assert models.status == 200 and MODEL in {m["id"] for m in models.json["data"]}, models.raw[:300]
    assert_forwarded(models)
    model = await call(http, "GET", api + f"/v1/models/{MODEL}", BOB)
    assert model.status == 200 and model.json["id"] == MODEL, model.raw[:300]
    vectors = await call(http, "POST", api + "/v1/embeddings", BOB, {"model": MODEL, "input": "hi"})
    assert vectors.status == 200 and vectors.json["data"][0]["object"] == "embedding", vectors.raw[:300]
    # The others of the stateless list are relayed too (the emulator has no such routes: its 404).
    for path in ("/v1/moderations", "/v1/audio/speech", "/v1/images/generations", "/v1/realtime/client_secrets"):
        assert_forwarded(await call(http, "POST", api + path, BOB, {"model": MODEL, "input": "hi"}))


async def test_an_operator_opens_the_untracked_routes(
    emulator: Emulator, spawn: Callable[..., SidecarProcess], http: aiohttp.ClientSession
) -> None:
    env = injected_env(UPSHIFT_IDENTITY_SHARED_OBJECTS="untracked")
    proc = await start_process(spawn, emulator.base_url, env=env)
    job = await stored_job(http, emulator)
    # Shared: every tenant sees every other's objects on these routes (what the setting says).
    reply = await call(http, "GET", proc.api + f"/v1/fine_tuning/jobs/{job}", BOB)
    assert reply.status == 200 and reply.json["id"] == job, reply.raw[:300]
    assert_forwarded(reply)
    listed = await call(http, "GET", proc.api + "/v1/fine_tuning/jobs", BOB)
    assert listed.status == 200 and job in {j["id"] for j in listed.json["data"]}, listed.raw[:300]
    # What is not listed stays walled: the known collections' lists, and the ids a body names.
    assert_openai_error(await call(http, "GET", proc.api + "/v1/files", BOB), 403, "not_shared")
    body = {"model": MODEL, "training_file": "file-of-nobody"}
    error = assert_openai_error(await call(http, "POST", proc.api + "/v1/fine_tuning/jobs", BOB, body), 404)
    assert error["code"] == "object_not_found" and error["param"] == "training_file", error


async def test_with_the_apps_own_key_untracked_routes_are_forwarded(
    emulator: Emulator, spawn: Callable[..., SidecarProcess], http: aiohttp.ClientSession
) -> None:
    proc = await start_process(spawn, emulator.base_url)
    body = {"model": MODEL, "training_file": "file-abc", "suffix": SECRET}
    created = await call(http, "POST", proc.api + "/v1/fine_tuning/jobs", ALICE, body)
    assert created.status == 200, created.raw[:300]
    job = created.json["id"]
    own = await call(http, "GET", proc.api + f"/v1/fine_tuning/jobs/{job}", ALICE)
    assert own.status == 200 and own.json["suffix"] == SECRET, own.raw[:300]
    listed = await call(http, "GET", proc.api + "/v1/fine_tuning/jobs", ALICE)
    assert listed.status == 200 and [j["id"] for j in listed.json["data"]] == [job], listed.raw[:300]
    # Bob's key is his own: the upstream's key check keeps Alice's job from him (its 404).
    other = await call(http, "GET", proc.api + f"/v1/fine_tuning/jobs/{job}", BOB)
    assert other.status == 404 and SECRET.encode() not in other.raw, other.raw[:300]
    assert_forwarded(other)
