"""Every shipped overlay starts from its rendered manifests and serves an app.

Each test renders an overlay of ``deploy/k8s``, writes what the kubelet would mount (the
ConfigMap, generated Secrets: a test API key, a trustme peer certificate naming
``upshift-gateway-peers``, the HMAC secret), and starts the upshift container as the manifest
runs it: the image's entrypoint with the container's args, its environment, its uid/gid and
``fsGroup``, a read-only root filesystem (:mod:`tests.deploy.kubelet`), every Pod on a loopback
address of a private network namespace (:mod:`tests.deploy.world`). The only substitution in the
product's configuration is the upstream URL: the manifests name api.openai.com, these tests the
emulator on loopback (and the gateway's replicas, which share one network namespace here, bind
their Pod's IP where the manifest says the wildcard address, as explained in
:mod:`tests.deploy.kubelet`).

Needs root, ``unshare`` and ``setpriv`` (mount and network namespaces, bind mounts, an overlay
root): CI runs as root.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.deploy import kubelet

pytestmark = pytest.mark.skipif(
    os.geteuid() != 0 or not shutil.which("unshare") or not shutil.which("setpriv"),
    reason="starts the manifests in mount and network namespaces: needs root, unshare and setpriv",
)

TEST_KEY = "sk-test-deploy-injected-key"


def _trustme() -> Any:
    return pytest.importorskip("trustme", reason="trustme is in the test extra: pip install -e '.[test]'")


def _secrets(overlay: str) -> dict[str, dict[str, str]]:
    """Values for the Secret templates shipped beside ``overlay`` (same names and keys)."""
    ca = _trustme().CA()
    cert = ca.issue_cert("upshift-gateway-peers")
    values = {
        "api-key": TEST_KEY + "\n",
        "secret": secrets.token_hex(32) + "\n",
        "tls.crt": "".join(blob.bytes().decode() for blob in cert.cert_chain_pems),
        "tls.key": cert.private_key_pem.bytes().decode(),
        "ca.crt": ca.cert_pem.bytes().decode(),
    }
    out: dict[str, dict[str, str]] = {}
    for name, keys in kubelet.templates(overlay).items():
        out[name] = {key: values[key] for key in keys}
    return out


def _run(
    tmp_path: Path,
    overlay: str,
    deployment: str,
    *,
    hosts: dict[str, list[int]],
    base_url: str,
    app_key: str,
    tasks: list[str],
    turns: int,
) -> dict[str, Any]:
    """Start the Deployment's replicas with the app's turns; what the world reported. ``hosts``:
    the names in the cluster's ``/etc/hosts``, each with the replicas (by index) it resolves to."""
    docs = kubelet.render(overlay)
    dep = kubelet.one(docs, "Deployment", deployment)
    replicas = int(dep["spec"].get("replicas", 1))
    generated = _secrets(overlay)
    hosts_file = tmp_path / "hosts"
    lines = ["127.0.0.1 localhost", "::1 localhost"]
    for name, indexes in hosts.items():
        for index in indexes:
            lines.append(f"127.0.0.{index + 2} {name} {name}.{kubelet.NAMESPACE}.svc")
    hosts_file.write_text("\n".join(lines) + "\n")
    os.chmod(hosts_file, 0o644)
    pods = []
    for index in range(replicas):
        work = tmp_path / f"pod-{index}"
        pod = kubelet.pod(docs, deployment, index, work, generated)
        script = work / "start.sh"
        script.write_text(kubelet.script(pod, hosts_file, work))
        pods.append({"name": pod.name, "script": str(script), "admin": pod.admin, "probe": pod.probe, "log": pod.log})
    plan = {
        "hosts": str(hosts_file),
        "emulator_log": str(tmp_path / "emulator.log"),
        "key": TEST_KEY,
        "pods": pods,
        "base_url": base_url,
        "app_key": app_key,
        "tasks": tasks,
        "turns": turns,
    }
    plan_file, result_file = tmp_path / "plan.json", tmp_path / "result.json"
    plan_file.write_text(json.dumps(plan))
    proc = subprocess.Popen(
        ["unshare", "--net", "--mount", "--propagation", "private", sys.executable, "-m", "tests.deploy.world"]
        + [str(plan_file), str(result_file)],
        cwd=kubelet.ROOT,
        env={**os.environ, "PYTHONPATH": str(kubelet.ROOT)},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        out, _ = proc.communicate(timeout=100)  # within pytest-timeout's 120 s
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # the world, the emulator and every Pod
        out, _ = proc.communicate()
    assert result_file.exists(), f"the world did not finish: {proc.returncode}\n{out}"
    result: dict[str, Any] = json.loads(result_file.read_text())
    return result


def _explain(result: dict[str, Any]) -> str:
    return "\n".join(f"--- {name}\n{log}" for name, log in result["logs"].items())


def _counter(metrics: dict[str, float], name: str, **labels: str) -> float:
    want = ",".join(f"{k}={v}" for k, v in sorted(labels.items()))
    return sum(v for k, v in metrics.items() if k.startswith(name + "{") and want in k)


def test_sidecar_overlay_serves_its_app_with_the_mounted_key(tmp_path: Path) -> None:
    """The app (its manifest's base URL and placeholder key) is answered 200 over two turns; the
    emulator accepts only the key of the mounted Secret, so the injected key is what reached it."""
    docs = kubelet.render("sidecar")
    dep = kubelet.one(docs, "Deployment", "my-app")
    spec = dep["spec"]["template"]
    app = kubelet.container(spec["spec"], "app")
    app_env = kubelet.environment(app, spec["metadata"], "127.0.0.2", "my-app-0", {})
    assert app_env["OPENAI_API_KEY"] != TEST_KEY
    result = _run(
        tmp_path,
        "sidecar",
        "my-app",
        hosts={},
        base_url=app_env["OPENAI_BASE_URL"],
        app_key=app_env["OPENAI_API_KEY"],
        tasks=["Say hello"],
        turns=2,
    )
    assert result["pods"] == {"my-app-0": "ready"}, _explain(result)
    turns = result["conversations"][0]
    assert [t["ok"] for t in turns] == [True, True], (turns, _explain(result))
    assert all(t["status"] == "completed" for t in turns)
    # No writable directory in this Pod (read-only root, no emptyDir): the learned socket caps are
    # this process's own, which one line says.
    assert result["logs"]["my-app-0"].count("socket caps are not shared") == 1, _explain(result)
    stats = result["emulator"]
    # The second turn went over the upstream WebSocket as a continuation.
    assert stats["continuations"]["ws"] == 1, stats
    assert stats["errors"] == {"http": 0, "ws": 0}, stats
    assert result["exits"] == {"my-app-0": 0}, _explain(result)  # SIGTERM: drained, exit 0


def test_gateway_overlay_two_replicas_forward_over_tls(tmp_path: Path) -> None:
    """Two replicas; the app calls the Service name (the Service took its connections to the
    first replica); conversations the second replica owns are forwarded to it over TLS, signed,
    every turn answered 200 and later turns relayed as continuations."""
    docs = kubelet.render("gateway")
    service = kubelet.one(docs, "Service", "upshift-gateway")
    port = service["spec"]["ports"][0]["port"]
    result = _run(
        tmp_path,
        "gateway",
        "upshift-gateway",
        hosts={"upshift-gateway": [0], "upshift-gateway-peers": [0, 1]},
        base_url=f"http://upshift-gateway:{port}/v1",
        app_key=TEST_KEY,
        tasks=[f"Conversation {i}: say hello" for i in range(6)],
        turns=2,
    )
    assert result["pods"] == {"upshift-gateway-0": "ready", "upshift-gateway-1": "ready"}, _explain(result)
    for conversation in result["conversations"]:
        assert [t["ok"] for t in conversation] == [True, True], (conversation, _explain(result))
    first, second = (result["metrics"][f"upshift-gateway-{i}"] for i in (0, 1))
    sent = _counter(first, "upshift_forwards_total", level="replica", outcome="ok")
    received = _counter(second, "upshift_forwards_received_total", level="replica", verified="true")
    assert received >= 2 and received == sent, (sent, received, _explain(result))
    assert _counter(second, "upshift_forwards_received_total", level="replica", verified="false") == 0
    # Nothing was forwarded to the replica the app reached, and no replica forwarded to itself.
    assert _counter(first, "upshift_forwards_received_total", level="replica") == 0
    assert _counter(second, "upshift_forwards_total", level="replica") == 0
    stats = result["emulator"]
    assert stats["continuations"]["ws"] == len(result["conversations"]), stats
    assert result["exits"] == {"upshift-gateway-0": 0, "upshift-gateway-1": 0}, _explain(result)
    # The replicas' /tmp is an emptyDir: the workers of a replica can share learned socket caps.
    assert all("socket caps are not shared" not in log for log in result["logs"].values()), _explain(result)
