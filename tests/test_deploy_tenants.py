"""The sidecar manifest makes tenants real. Its app placeholder key is made per app
from the Pod itself (namespace and ``app.kubernetes.io/name``), and the sidecar tells tenants
apart by it, so the template copied twice (another name, another namespace) is two tenants:
the second copy's app is refused on the first one's response ids. Offline: the manifests are
rendered with kustomize (when installed) and the Kubernetes env expansion is done here."""

from __future__ import annotations

import os
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import yaml

from tests.security.support import Tenant, injected_env, start_process
from tests.sidecar import SidecarProcess
from tests.tools import kustomize, which
from upshift_emulator import Emulator

ROOT = Path(__file__).resolve().parents[1]
SIDECAR = ROOT / "deploy" / "k8s" / "sidecar"
_REF = re.compile(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)")
_LABEL = re.compile(r"metadata\.labels\['([^']+)'\]")


def render(tmp: Path, *, namespace: str | None = None, app: str | None = None) -> list[dict[str, Any]]:
    """The sidecar overlay as deployed: as it is, or copied into ``namespace`` / renamed ``app``
    (an overlay on top of it, as a team copying the template would write one)."""
    kubectl = which("kubectl")
    if kubectl is None:
        pytest.skip("kubectl not installed")
    overlay = tmp / f"copy-{namespace}-{app}"
    overlay.mkdir()
    spec: dict[str, Any] = {
        "apiVersion": "kustomize.config.k8s.io/v1beta1",
        "kind": "Kustomization",
        "resources": [os.path.relpath(SIDECAR, overlay)],
    }
    if namespace:
        spec["namespace"] = namespace
    if app:
        spec["nameSuffix"] = f"-{app}"
        spec["labels"] = [{"pairs": {"app.kubernetes.io/name": app}, "includeSelectors": True}]
    (overlay / "kustomization.yaml").write_text(yaml.safe_dump(spec))
    return kustomize(kubectl, overlay)


def app_key(docs: list[dict[str, Any]]) -> str:
    """``OPENAI_API_KEY`` of the app container as the kubelet sets it (fieldRefs resolved,
    ``$(VAR)`` expanded in order)."""
    deployment = next(d for d in docs if d["kind"] == "Deployment")
    pod = deployment["spec"]["template"]
    container = next(c for c in pod["spec"]["containers"] if c["name"] == "app")
    values: dict[str, str] = {}
    for env in container["env"]:
        if "valueFrom" in env:
            path = env["valueFrom"]["fieldRef"]["fieldPath"]
            if path == "metadata.namespace":
                values[env["name"]] = deployment["metadata"].get("namespace", "default")
            else:
                label = _LABEL.fullmatch(path)
                assert label is not None, path
                values[env["name"]] = pod["metadata"]["labels"][label.group(1)]
        else:
            values[env["name"]] = _REF.sub(lambda m: values.get(m.group(1), m.group(0)), env["value"])
    return values["OPENAI_API_KEY"]


def test_the_placeholder_is_made_per_app(tmp_path: Path) -> None:
    key = app_key(render(tmp_path))
    assert key == "sk-placeholder-default-my-app"
    copies = {
        key,
        app_key(render(tmp_path, namespace="team-b")),
        app_key(render(tmp_path, app="billing")),
        app_key(render(tmp_path, namespace="team-b", app="billing")),
    }
    assert len(copies) == 4, copies
    assert all("placeholder" in k and "$(" not in k for k in copies)


async def test_two_copies_of_the_template_are_two_tenants(
    tmp_path: Path, emulator: Emulator, spawn: Callable[..., SidecarProcess]
) -> None:
    first, second = app_key(render(tmp_path)), app_key(render(tmp_path, namespace="team-b"))
    # Both apps behind one sidecar that injects the real key (a gateway serving both copies).
    proc = await start_process(spawn, emulator.base_url, env=injected_env())
    async with aiohttp.ClientSession() as http:
        a, b = Tenant(first, http), Tenant(second, http)
        rid = (await a.create(proc.api, "first copy's secret"))["id"]
        assert (await b.get(proc.api, rid)).status == 404
        assert (await b.chain(proc.api, rid)).status == 400
        assert (await a.get(proc.api, rid)).status == 200
        assert (await a.chain(proc.api, rid)).status == 200
