"""Deployment assets: kustomize output, ConfigMap vs config.yaml, Dockerfile, offline validation.

kubernetes-validate checks the schema (unknown fields, types) but not values, so the facts that
matter for a working sidecar are asserted here: native sidecar shape, probes, securityContext,
resources, ports and the embedded config.

Regenerate the ConfigMap after editing config.yaml with::

    python tests/test_deploy.py --write-configmap
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import dockerfile  # type: ignore[import-not-found]  # ships no type information
import pytest
import yaml

from tests.tools import kustomize, tool_env, which

ROOT = Path(__file__).resolve().parents[1]
K8S = ROOT / "deploy" / "k8s"
CONFIGMAP = K8S / "base" / "configmap.yaml"
DOCKERFILE = ROOT / "deploy" / "Dockerfile"
VALIDATE = ROOT / ".ci" / "validate-deploy"
BASE_IMAGE = "python:3.11-slim-bookworm"

_CONFIGMAP_HEADER = """\
# GENERATED from the top-level config.yaml; tests/test_deploy.py fails when they differ.
# Regenerate after editing config.yaml: python tests/test_deploy.py --write-configmap
# Mounted as a directory at /etc/upshift (no subPath), so edits reach running Pods; upshift
# reads the file at startup only, so restart the Pods (kubectl rollout restart) to apply them.
apiVersion: v1
kind: ConfigMap
metadata:
  name: upshift-config
data:
  config.yaml: |
"""


def render_configmap() -> str:
    """The expected text of the ConfigMap: a header plus config.yaml indented by 4."""
    lines = (ROOT / "config.yaml").read_text(encoding="utf-8").splitlines()
    return _CONFIGMAP_HEADER + "".join(f"    {line}\n" if line else "\n" for line in lines)


# ----------------------------------------------------------------------------- helpers


def _load_kustomize(directory: str) -> list[dict[str, Any]]:
    """Rendered objects: via kubectl kustomize when present, else the plain files."""
    kubectl = which("kubectl")
    if kubectl is not None:
        return kustomize(kubectl, K8S / directory)
    docs: list[dict[str, Any]] = []
    for sub in ("base", directory):
        for path in sorted((K8S / sub).glob("*.yaml")):
            if path.name not in ("kustomization.yaml", "secret.yaml", "peer-secrets.yaml"):
                docs.extend(d for d in yaml.safe_load_all(path.read_text()) if d)
    return docs


def _one(docs: list[dict[str, Any]], kind: str) -> dict[str, Any]:
    found = [d for d in docs if d["kind"] == kind]
    assert len(found) == 1, f"expected one {kind}, got {len(found)}"
    return found[0]


def _env(container: dict[str, Any]) -> dict[str, str]:
    return {e["name"]: e.get("value", "") for e in container.get("env", [])}


def _top_config() -> dict[str, Any]:
    data: dict[str, Any] = yaml.safe_load((ROOT / "config.yaml").read_text())
    return data


@pytest.fixture(scope="module")
def sidecar_docs() -> list[dict[str, Any]]:
    return _load_kustomize("sidecar")


@pytest.fixture(scope="module")
def gateway_docs() -> list[dict[str, Any]]:
    return _load_kustomize("gateway")


@pytest.fixture(scope="module")
def pod(sidecar_docs: list[dict[str, Any]]) -> dict[str, Any]:
    spec: dict[str, Any] = _one(sidecar_docs, "Deployment")["spec"]["template"]["spec"]
    return spec


@pytest.fixture(scope="module")
def proxy(pod: dict[str, Any]) -> dict[str, Any]:
    found = [c for c in pod.get("initContainers", []) if c["name"] == "upshift"]
    assert len(found) == 1, "upshift must be an initContainers entry (native sidecar)"
    container: dict[str, Any] = found[0]
    return container


# ----------------------------------------------------------------------------- sidecar


def test_proxy_is_a_native_sidecar(pod: dict[str, Any], proxy: dict[str, Any]) -> None:
    assert proxy["restartPolicy"] == "Always"
    assert all(c["name"] != "upshift" for c in pod["containers"])


def test_pod_level_settings(pod: dict[str, Any]) -> None:
    assert pod["automountServiceAccountToken"] is False
    assert pod["terminationGracePeriodSeconds"] == 60
    grace = _top_config()["shutdown"]["grace_seconds"]
    assert grace < pod["terminationGracePeriodSeconds"], "proxy drain must fit in the Pod grace"


@pytest.mark.parametrize(
    ("probe", "path", "settings"),
    [
        ("startupProbe", "/readyz", {"periodSeconds": 1, "failureThreshold": 30}),
        ("readinessProbe", "/readyz", {"periodSeconds": 5, "failureThreshold": 3}),
        ("livenessProbe", "/healthz", {"periodSeconds": 10, "timeoutSeconds": 2}),
    ],
)
def test_probes_on_admin_port(proxy: dict[str, Any], probe: str, path: str, settings: dict[str, int]) -> None:
    spec = proxy[probe]
    assert spec["httpGet"] == {"path": path, "port": "admin"}
    assert {k: spec.get(k) for k in settings} == settings
    ports = {p["name"]: p["containerPort"] for p in proxy["ports"]}
    admin_port = int(_top_config()["admin_listen"].rpartition(":")[2])
    assert ports["admin"] == admin_port


def test_admin_listens_on_all_interfaces_and_api_on_loopback(
    proxy: dict[str, Any], gateway_docs: list[dict[str, Any]]
) -> None:
    # The kubelet probes the pod IP, so the manifests put the admin port there; config.yaml keeps
    # it on loopback (a laptop); the sidecar's API must be reachable from this Pod only.
    cfg = _top_config()
    assert cfg["admin_listen"] == "127.0.0.1:9090"
    assert cfg["listen"].startswith("127.0.0.1:")
    (gateway,) = _one(gateway_docs, "Deployment")["spec"]["template"]["spec"]["containers"]
    for container in (proxy, gateway):
        admin = next(p["containerPort"] for p in container["ports"] if p["name"] == "admin")
        assert _env(container)["UPSHIFT_ADMIN_LISTEN"] == f"0.0.0.0:{admin}"


def _assert_restricted(container: dict[str, Any], pod: dict[str, Any]) -> None:
    sc = container["securityContext"]
    assert sc["runAsNonRoot"] is True
    assert isinstance(sc["runAsUser"], int) and sc["runAsUser"] > 0
    assert isinstance(sc["runAsGroup"], int) and sc["runAsGroup"] > 0
    assert sc["readOnlyRootFilesystem"] is True
    assert sc["allowPrivilegeEscalation"] is False
    assert sc["capabilities"] == {"drop": ["ALL"]}
    seccomp = sc.get("seccompProfile") or pod["securityContext"]["seccompProfile"]
    assert seccomp == {"type": "RuntimeDefault"}


def test_security_context(pod: dict[str, Any], proxy: dict[str, Any]) -> None:
    _assert_restricted(proxy, pod)
    assert proxy["securityContext"]["runAsUser"] == 10001
    assert proxy["securityContext"]["runAsGroup"] == 10001
    for container in pod["containers"]:
        _assert_restricted(container, pod)


def test_resources_without_cpu_limit(proxy: dict[str, Any]) -> None:
    assert proxy["resources"] == {"requests": {"cpu": "50m", "memory": "96Mi"}, "limits": {"memory": "256Mi"}}


def test_app_base_url_points_at_listen_port(pod: dict[str, Any]) -> None:
    app = _env(pod["containers"][0])
    url = urlsplit(app["OPENAI_BASE_URL"])
    host, _, port = _top_config()["listen"].rpartition(":")
    assert (url.scheme, url.hostname, url.port, url.path) == ("http", host, int(port), "/v1")
    assert app["OPENAI_API_KEY"], "the openai SDK needs a placeholder key"
    assert "placeholder" in app["OPENAI_API_KEY"]


def test_key_comes_from_a_secret_file(pod: dict[str, Any], proxy: dict[str, Any]) -> None:
    env = _env(proxy)
    assert env["UPSHIFT_API_KEY_SOURCE"] == "file"
    key_dir, _, key_name = env["UPSHIFT_API_KEY_FILE"].rpartition("/")
    mounts = {m["mountPath"]: m for m in proxy["volumeMounts"]}
    assert mounts[key_dir]["readOnly"] is True
    assert "subPath" not in mounts[key_dir], "subPath mounts never see Secret rotation"
    volume = next(v for v in pod["volumes"] if v["name"] == mounts[key_dir]["name"])
    assert volume["secret"]["defaultMode"] == 0o440
    secret = yaml.safe_load((K8S / "sidecar" / "secret.yaml").read_text())
    assert secret["metadata"]["name"] == volume["secret"]["secretName"]
    assert key_name in secret["stringData"]
    assert "placeholder" in secret["stringData"][key_name].lower()
    # No key material in env, only the path.
    assert not any("sk-" in v for v in env.values())


def test_config_mounted_as_directory(pod: dict[str, Any], proxy: dict[str, Any]) -> None:
    mount = next(m for m in proxy["volumeMounts"] if m["mountPath"] == "/etc/upshift")
    assert "subPath" not in mount
    volume = next(v for v in pod["volumes"] if v["name"] == mount["name"])
    assert volume["configMap"]["name"] == "upshift-config"
    assert proxy["args"] == ["--config", "/etc/upshift/config.yaml"]


def test_configmap_embeds_config_yaml(sidecar_docs: list[dict[str, Any]]) -> None:
    top = (ROOT / "config.yaml").read_text(encoding="utf-8")
    assert _one(sidecar_docs, "ConfigMap")["data"]["config.yaml"] == top
    assert CONFIGMAP.read_text(encoding="utf-8") == render_configmap(), (
        "deploy/k8s/base/configmap.yaml is stale: python tests/test_deploy.py --write-configmap"
    )


def test_uses_labels_not_common_labels() -> None:
    for path in K8S.glob("*/kustomization.yaml"):
        assert "commonLabels" not in yaml.safe_load(path.read_text()), path


# ----------------------------------------------------------------------------- gateway


def test_gateway(gateway_docs: list[dict[str, Any]]) -> None:
    deployment = _one(gateway_docs, "Deployment")
    services = {d["metadata"]["name"]: d for d in gateway_docs if d["kind"] == "Service"}
    service, peers = services["upshift-gateway"], services["upshift-gateway-peers"]
    pod = deployment["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    env = _env(container)
    assert env["UPSHIFT_LISTEN"] == "0.0.0.0:8080"
    _assert_restricted(container, pod)
    assert "cpu" not in container["resources"].get("limits", {})
    labels = deployment["spec"]["template"]["metadata"]["labels"]
    # Conversation affinity replaces sticky load balancing: no ClientIP affinity anywhere.
    assert service["spec"].get("sessionAffinity", "None") == "None"
    assert service["spec"]["selector"].items() <= labels.items()
    # The Services expose the API only, never the admin port.
    assert [p["targetPort"] for p in service["spec"]["ports"]] == ["http"]
    # The peer set: a headless Service of the ready replicas' TLS peer listeners, wired into
    # cluster.peers_dns, with each replica named by its pod IP (never by its listen address).
    assert peers["spec"]["clusterIP"] == "None" and not peers["spec"].get("publishNotReadyAddresses", False)
    assert peers["spec"]["selector"].items() <= labels.items()
    assert [p["targetPort"] for p in peers["spec"]["ports"]] == ["peer"]
    port = peers["spec"]["ports"][0]["port"]
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert ports["peer"] == port and env["UPSHIFT_CLUSTER_PEER_LISTEN"] == f"0.0.0.0:{port}"
    assert env["UPSHIFT_CLUSTER_PEERS_DNS"] == f"upshift-gateway-peers:{port}"
    assert env["UPSHIFT_CLUSTER_SELF_URL"] == f"https://$(POD_IP):{port}"  # TLS by default
    assert "UPSHIFT_CLUSTER_PLAIN_HTTP_PEERS" not in env
    pod_ip = next(e for e in container["env"] if e["name"] == "POD_IP")
    assert pod_ip["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP"
    names = [e["name"] for e in container["env"]]
    assert names.index("POD_IP") < names.index("UPSHIFT_CLUSTER_SELF_URL")  # $(POD_IP) expands
    assert int(env["UPSHIFT_WORKERS"]) >= 1
    # Peers prove who they are: the certificate, its CA and the HMAC secret come from Secrets
    # mounted read-only, and the settings point at the mounted files.
    mounts = {m["name"]: m for m in container["volumeMounts"]}
    volumes = {v["name"]: v for v in pod["volumes"]}
    templates = {
        d["metadata"]["name"]: d for d in yaml.safe_load_all((K8S / "gateway" / "peer-secrets.yaml").read_text())
    }
    files = {
        "UPSHIFT_CLUSTER_TLS_CERT_FILE": "tls.crt",
        "UPSHIFT_CLUSTER_TLS_KEY_FILE": "tls.key",
        "UPSHIFT_CLUSTER_TLS_CA_FILE": "ca.crt",
        "UPSHIFT_CLUSTER_SECRET_FILE": "secret",
    }
    for variable, key in files.items():
        folder, _, name = env[variable].rpartition("/")
        assert name == key
        (mount,) = [m for m in mounts.values() if m["mountPath"] == folder]
        assert mount["readOnly"] is True
        secret = volumes[mount["name"]]["secret"]
        assert secret["defaultMode"] == 0o440
        assert key in templates[secret["secretName"]]["stringData"]
        assert "placeholder" in templates[secret["secretName"]]["stringData"][key].lower()
    assert pod["securityContext"]["fsGroup"] == container["securityContext"]["runAsGroup"]
    assert env["UPSHIFT_CLUSTER_TLS_SERVER_NAME"] == peers["metadata"]["name"]
    # The API port: only the apps' namespace; the peer port: only the gateway's own Pods; the
    # admin port: only the monitoring namespace.
    policy = _one(gateway_docs, "NetworkPolicy")["spec"]
    assert policy["podSelector"]["matchLabels"].items() <= labels.items()
    rules = {r["ports"][0]["port"]: r for r in policy["ingress"]}
    assert sorted(rules) == ["admin", "http", "peer"] and all(len(r["ports"]) == 1 for r in rules.values())
    assert rules["http"]["from"] == [{"namespaceSelector": {"matchLabels": {"upshift.io/gateway-client": "true"}}}]
    assert rules["peer"]["from"] == [{"podSelector": {"matchLabels": {"app.kubernetes.io/name": "upshift-gateway"}}}]
    monitoring = {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}}}
    assert rules["admin"]["from"] == [monitoring]
    assert _one(gateway_docs, "ConfigMap")["data"]["config.yaml"] == (ROOT / "config.yaml").read_text()


# ----------------------------------------------------------------------------- Dockerfile


@pytest.fixture(scope="module")
def instructions() -> list[Any]:
    return list(dockerfile.parse_file(str(DOCKERFILE)))


def test_dockerfile_user_is_numeric(instructions: list[Any]) -> None:
    users = [i.value[0] for i in instructions if i.cmd == "USER"]
    assert users == ["10001:10001"]


def test_dockerfile_entrypoint_is_exec_form(instructions: list[Any]) -> None:
    (entry,) = [i for i in instructions if i.cmd == "ENTRYPOINT"]
    assert entry.json and list(entry.value) == ["python", "-m", "proxy"]
    (cmd,) = [i for i in instructions if i.cmd == "CMD"]
    assert cmd.json and list(cmd.value) == ["--config", "/etc/upshift/config.yaml"]


def test_dockerfile_no_add_and_same_base(instructions: list[Any]) -> None:
    assert not [i for i in instructions if i.cmd == "ADD"]
    bases = [i.value[0] for i in instructions if i.cmd == "FROM"]
    assert bases == [BASE_IMAGE, BASE_IMAGE]


def test_dockerfile_read_only_root_ready(instructions: list[Any]) -> None:
    env = " ".join(" ".join(i.value) for i in instructions if i.cmd == "ENV")
    assert "PYTHONDONTWRITEBYTECODE" in env
    runs = " ".join(" ".join(i.value) for i in instructions if i.cmd == "RUN")
    assert "compileall" in runs
    assert [i.value for i in instructions if i.cmd == "EXPOSE"] == [("8080", "9090")]
    copies = [tuple(i.value) for i in instructions if i.cmd == "COPY"]
    assert ("config.yaml", "/etc/upshift/config.yaml") in copies


# ----------------------------------------------------------------------------- validators


def test_validate_deploy_script() -> None:
    needed = ("kubectl", "kubernetes-validate", "yamllint", "hadolint")
    missing = [tool for tool in needed if which(tool) is None]
    if missing:
        pytest.skip(f"not installed: {', '.join(missing)}")
    result = subprocess.run(
        ["bash", str(VALIDATE)], cwd=ROOT, capture_output=True, text=True, timeout=300, env=tool_env()
    )
    assert result.returncode == 0, result.stdout + result.stderr


if __name__ == "__main__":
    if sys.argv[1:] == ["--write-configmap"]:
        CONFIGMAP.write_text(render_configmap(), encoding="utf-8")
        print(f"wrote {CONFIGMAP.relative_to(ROOT)}")
    else:
        sys.exit(f"usage: python {sys.argv[0]} --write-configmap")
