"""``python -m proxy explain PREVIOUS RESPONSE NEXT``: the access log's explanation, offline.

The files are what an app's traffic through a real sidecar gave (the response saved both as
the SSE stream and as a JSON body); the command's answer must equal the sidecar's access line
for the same next request.
"""

from __future__ import annotations

import io
import subprocess
import sys
from pathlib import Path
from typing import Any

import aiohttp
import orjson

from proxy.core.explain import Detail
from proxy.ops.explain_cmd import WHERE
from tests.clients.support import READ_FILE, task_text
from tests.sidecar import ROOT, Sidecar
from upshift_emulator import Emulator

from .conftest import AccessLines

HEADERS = {"Authorization": "Bearer sk-test-explain-cli"}


def run_explain(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "proxy", "explain", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def tool_task(*messages: dict[str, Any]) -> dict[str, Any]:
    """A first request of a task whose model calls ``read_file`` (the emulator's tool script)."""
    return {"model": "gpt-6.1-sol", "store": False, "tools": [READ_FILE], "input": list(messages)}


LOGGED = ("reason", "miss_item", "miss_type", "miss_field", "miss_detail", "candidate_items")
"""The access line's explanation fields, which ``--json`` prints too."""


async def post(session: aiohttp.ClientSession, sc: Sidecar, body: dict[str, Any]) -> bytes:
    async with session.post(sc.base_url + "/responses", json=body, headers=HEADERS) as resp:
        assert resp.status == 200
        return await resp.read()


async def test_explain_matches_the_access_log(
    stack: tuple[Emulator, Sidecar], access_log: tuple[AccessLines, io.StringIO], tmp_path: Path
) -> None:
    _, sc = stack
    lines, _ = access_log
    first = tool_task({"role": "system", "content": "Now: 10:00"}, {"role": "user", "content": task_text(2, "cli")})
    async with aiohttp.ClientSession() as session:
        sse = await post(session, sc, {**first, "stream": True})
        # the same turn as a JSON body, from the stream's response.completed
        completed = [orjson.loads(line[5:]) for line in sse.splitlines() if line.startswith(b"data:")][-1]
        response = completed["response"]
        call = next(o for o in response["output"] if o["type"] == "function_call")
        result = {"type": "function_call_output", "call_id": call["call_id"], "output": "ok"}
        good = {**first, "input": [*first["input"], *response["output"], result]}
        edited = {**good, "input": [{"role": "system", "content": "Now: 10:05"}, *good["input"][1:]]}
        await post(session, sc, edited)
    logged = lines()[-1]
    assert logged["reason"] == "diverged"

    files = {
        "previous.json": orjson.dumps(first),
        "response.sse": sse,
        "response.json": orjson.dumps(response),
        "good.json": orjson.dumps(good),
        "edited.json": orjson.dumps(edited),
    }
    for name, data in files.items():
        (tmp_path / name).write_bytes(data)
    p = lambda name: str(tmp_path / name)  # noqa: E731

    for saved in ("response.sse", "response.json"):
        out = run_explain(p("previous.json"), p(saved), p("edited.json"), "--json")
        assert out.returncode == 1, out.stderr
        said = orjson.loads(out.stdout)
        assert {k: said[k] for k in LOGGED} == {k: logged[k] for k in LOGGED}
        assert (said["miss_item"], said["miss_type"], said["miss_field"]) == (0, "message", "content[0].text")

    human = run_explain(p("previous.json"), p("response.sse"), p("edited.json"))
    assert human.returncode == 1
    assert (
        "miss: diverged" in human.stdout and "input item 0 (message) differs at field content[0].text" in human.stdout
    )
    assert "10:05" not in human.stdout and "10:00" not in human.stdout

    ok = run_explain(p("previous.json"), p("response.json"), p("good.json"))
    assert ok.returncode == 0, ok.stdout + ok.stderr
    assert ok.stdout.startswith("continuation: previous_response_id + 1 new item(s); 3 item(s) not re-sent")


def test_explain_refuses_unusable_files(tmp_path: Path) -> None:
    (tmp_path / "a.json").write_text('{"model": "gpt-6.1-sol", "input": "hi"}')
    (tmp_path / "r.txt").write_text("not a response")
    out = run_explain(str(tmp_path / "a.json"), str(tmp_path / "r.txt"), str(tmp_path / "a.json"))
    assert out.returncode == 2 and "upshift explain:" in out.stderr
    out = run_explain(str(tmp_path / "a.json"), str(tmp_path / "missing"), str(tmp_path / "a.json"))
    assert out.returncode == 2


async def test_explain_a_phaseless_echo_as_the_access_log_does_and_with_the_tolerance(
    stack: tuple[Emulator, Sidecar], access_log: tuple[AccessLines, io.StringIO], tmp_path: Path
) -> None:
    """pydantic-ai and llama-index send an assistant message back without its ``phase``: the
    sidecar's default is a full send, ``dropped_phase``. The command says the same, in both
    forms (the human one included), and with ``--tolerate phase``
    says what a sidecar with ``matching.tolerate: [phase]`` does: a continuation."""
    _, sc = stack
    lines, _ = access_log
    first = tool_task({"role": "user", "content": task_text(2, "phase", preamble=True)})
    async with aiohttp.ClientSession() as session:
        response = orjson.loads(await post(session, sc, first))
        commentary = next(o for o in response["output"] if o["type"] == "message")
        assert commentary["phase"] == "commentary"
        call = next(o for o in response["output"] if o["type"] == "function_call")
        echo = [{k: v for k, v in o.items() if k != "phase"} for o in response["output"]]
        result = {"type": "function_call_output", "call_id": call["call_id"], "output": "ok"}
        phaseless = {**first, "input": [*first["input"], *echo, result]}
        await post(session, sc, phaseless)
    logged = lines()[-1]
    assert logged["reason"] == "dropped_phase"
    files = {"previous.json": first, "response.json": response, "phaseless.json": phaseless}
    for name, value in files.items():
        (tmp_path / name).write_bytes(orjson.dumps(value))
    args = [str(tmp_path / name) for name in files]

    out = run_explain(*args, "--json")
    assert out.returncode == 1, out.stderr
    said = orjson.loads(out.stdout)
    assert {k: said[k] for k in LOGGED} == {k: logged[k] for k in LOGGED}
    assert (said["miss_item"], said["miss_field"], said["miss_detail"]) == (1, "phase", "phase_dropped")

    human = run_explain(*args)
    assert human.returncode == 1, human.stderr
    assert "miss: dropped_phase" in human.stdout
    assert "input item 1 (message) is sent back without the phase" in human.stdout
    assert "matching.tolerate: [phase] would continue it" in human.stdout

    tolerant = run_explain(*args, "--tolerate", "phase", "--json")
    assert tolerant.returncode == 0, tolerant.stdout + tolerant.stderr
    assert orjson.loads(tolerant.stdout) == {
        "mode": "continuation",
        "items_sent": 1,
        "items_avoided": 1 + len(response["output"]),
        "tolerated": {"reasoning": 0, "phase": 1},
    }
    # the other tolerance does not cover it
    assert run_explain(*args, "--tolerate", "reasoning").returncode == 1


def test_every_miss_detail_has_words() -> None:
    assert set(WHERE) == set(Detail)


def test_explain_refuses_an_unknown_tolerance(tmp_path: Path) -> None:
    (tmp_path / "a.json").write_text('{"model": "gpt-6.1-sol", "input": "hi"}')
    (tmp_path / "r.json").write_text('{"object": "response", "status": "completed", "output": []}')
    out = run_explain(*(str(tmp_path / n) for n in ("a.json", "r.json", "a.json")), "--tolerate", "phase,typos")
    assert out.returncode == 2 and "matching.tolerate: expected a list of" in out.stderr, out.stderr
    assert "got 'typos'" in out.stderr, out.stderr
