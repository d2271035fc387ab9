"""One overlay's Pods, the emulator and an app in a private network and mount namespace.

Run by :mod:`tests.deploy.test_overlays` as
``unshare --net --mount --propagation private python -m tests.deploy.world PLAN RESULT``: the
namespace's loopback is the cluster network (each Pod one loopback address, the emulator on
127.0.0.1:9100, the Services' names in ``/etc/hosts``), so the manifests' fixed ports never meet
another process of this machine. Each Pod is started by its script (:func:`tests.deploy.kubelet.script`)
in a mount namespace of its own and probed as the kubelet probes it (its startup probe's path
on the admin port); then the app's turns run through the real openai SDK, and what the app got,
what the emulator saw and each replica's metrics go to ``RESULT`` (JSON) for the test to judge.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from openai import OpenAI
from prometheus_client.parser import text_string_to_metric_families

from tests.clients.support import MODEL

EMULATOR = "127.0.0.1:9100"


def _get(url: str, host: str | None = None) -> tuple[int, str]:
    request = urllib.request.Request(url, headers={"Host": host} if host else {})
    try:
        with urllib.request.urlopen(request, timeout=5) as answer:
            return int(answer.status), answer.read().decode()
    except urllib.error.HTTPError as exc:
        return int(exc.code), exc.read().decode()
    except OSError as exc:
        return 0, str(exc)


def _wait(url: str, proc: subprocess.Popen[bytes], seconds: float) -> str:
    """Probe ``url`` until it answers 200 (``""``), the process exits or time runs out (why not)."""
    deadline = time.monotonic() + seconds
    status, text = 0, ""
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            return f"exited with {proc.returncode}"
        status, text = _get(url)
        if status == 200:
            return ""
        time.sleep(0.2)
    return f"not ready after {seconds:g} s: {status} {text[:200]}"


def _metrics(admin: str) -> dict[str, float]:
    """The replica's counters as ``name{label=value,...}`` -> value."""
    status, text = _get(f"http://{admin}/metrics")
    out: dict[str, float] = {}
    if status != 200:
        return out
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(sample.labels.items()))
            out[f"{sample.name}{{{labels}}}"] = float(sample.value)
    return out


def _conversation(client: OpenAI, task: str, turns: int) -> list[dict[str, Any]]:
    """A conversation the way a Responses app keeps it: the full history every turn."""
    history: list[Any] = []
    out: list[dict[str, Any]] = []
    for turn in range(turns):
        history.append({"role": "user", "content": f"{task} (turn {turn + 1})"})
        try:
            response = client.responses.create(model=MODEL, input=history, store=False)
        except Exception as exc:  # noqa: BLE001 - the test reports what the app got
            out.append({"ok": False, "error": f"{type(exc).__name__}: {exc}"})
            return out
        out.append({"ok": True, "status": response.status, "text": response.output_text})
        history.extend(item.model_dump(exclude_none=True) for item in response.output)
    return out


def main(plan_path: str, result_path: str) -> None:
    plan = json.loads(Path(plan_path).read_text())
    subprocess.run(["ip", "link", "set", "lo", "up"], check=True)
    # The app resolves the Services' names as the Pods do.
    subprocess.run(["mount", "--bind", plan["hosts"], "/etc/hosts"], check=True)
    result: dict[str, Any] = {"pods": {}, "conversations": [], "metrics": {}, "logs": {}}
    procs: list[subprocess.Popen[bytes]] = []
    started: list[tuple[dict[str, Any], subprocess.Popen[bytes]]] = []
    env = {**os.environ, "PYTHONDONTWRITEBYTECODE": "1"}
    try:
        emulator_log = open(plan["emulator_log"], "wb")  # noqa: SIM115 - closed with the process
        emulator = subprocess.Popen(
            [sys.executable, "-m", "upshift_emulator", "--listen", EMULATOR, "--require-key", plan["key"]],
            stdout=emulator_log,
            stderr=subprocess.STDOUT,
            env=env,
        )
        procs.append(emulator)
        why = _wait(f"http://{EMULATOR}/_emulator/health", emulator, 30)
        assert not why, f"emulator: {why}"
        for pod in plan["pods"]:
            log = open(pod["log"], "wb")  # noqa: SIM115 - closed with the process
            proc = subprocess.Popen(
                ["unshare", "--mount", "--propagation", "private", "sh", pod["script"]],
                stdout=log,
                stderr=subprocess.STDOUT,
                env=env,
            )
            procs.append(proc)
            started.append((pod, proc))
        for pod, proc in started:
            why = _wait(f"http://{pod['admin']}{pod['probe']}", proc, 60)
            result["pods"][pod["name"]] = why or "ready"
        if all(v == "ready" for v in result["pods"].values()):
            client = OpenAI(base_url=plan["base_url"], api_key=plan["app_key"], max_retries=0, timeout=30)
            with client:
                for task in plan["tasks"]:
                    result["conversations"].append(_conversation(client, task, plan["turns"]))
            for pod, _ in started:
                result["metrics"][pod["name"]] = _metrics(pod["admin"])
            status, text = _get(f"http://{EMULATOR}/_emulator/stats")
            result["emulator"] = json.loads(text) if status == 200 else {}
    finally:
        for proc in reversed(procs):
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in procs:
            try:
                proc.wait(15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(5)
        result["exits"] = {pod["name"]: proc.returncode for pod, proc in started}
        for pod in plan["pods"]:
            result["logs"][pod["name"]] = Path(pod["log"]).read_text(errors="replace")[-100_000:]
        Path(result_path).write_text(json.dumps(result))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
