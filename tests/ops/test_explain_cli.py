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

from proxy.emulator import Emulator
from tests.clients.support import READ_FILE, task_text
from tests.sidecar import ROOT, Sidecar

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


async def post(session: aiohttp.ClientSession, sc: Sidecar, body: dict[str, Any]) -> bytes:
    async with session.post(sc.base_url + "/responses", json=body, headers=HEADERS) as resp:
        assert resp.status == 200
        return await resp.read()


async def test_explain_matches_the_access_log(
    stack: tuple[Emulator, Sidecar], access_log: tuple[AccessLines, io.StringIO], tmp_path: Path
) -> None:
    _, sc = stack
    lines, _ = access_log
    first: dict[str, Any] = {
        "model": "gpt-5",
        "store": False,
        "tools": [READ_FILE],
        "input": [{"role": "system", "content": "Now: 10:00"}, {"role": "user", "content": task_text(2, "cli")}],
    }
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
        keys = ("reason", "miss_item", "miss_type", "miss_field", "miss_detail", "candidate_items")
        assert {k: said[k] for k in keys} == {k: logged[k] for k in keys}
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
    (tmp_path / "a.json").write_text('{"model": "gpt-5", "input": "hi"}')
    (tmp_path / "r.txt").write_text("not a response")
    out = run_explain(str(tmp_path / "a.json"), str(tmp_path / "r.txt"), str(tmp_path / "a.json"))
    assert out.returncode == 2 and "upshift explain:" in out.stderr
    out = run_explain(str(tmp_path / "a.json"), str(tmp_path / "missing"), str(tmp_path / "a.json"))
    assert out.returncode == 2
