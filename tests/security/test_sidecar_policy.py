"""The sidecar overlay ships a NetworkPolicy: its admin port (on the pod IP for the kubelet's
probes) is reachable only from the monitoring namespace, and no rule opens anything else; the
API listens on loopback, out of the network's reach."""

from __future__ import annotations

from typing import Any

from tests.test_deploy import _env, _load_kustomize, _one, _top_config


def test_the_sidecar_admin_port_is_admitted_only_from_monitoring() -> None:
    docs = _load_kustomize("sidecar")
    # The attack: any Pod of the cluster read /metrics and /status of every app's sidecar.
    policies = [d for d in docs if d["kind"] == "NetworkPolicy"]
    assert len(policies) == 1, "the sidecar overlay must ship its NetworkPolicy"
    policy: dict[str, Any] = policies[0]["spec"]
    template = _one(docs, "Deployment")["spec"]["template"]
    assert policy["podSelector"]["matchLabels"].items() <= template["metadata"]["labels"].items()
    assert policy["policyTypes"] == ["Ingress"]
    (sidecar,) = [c for c in template["spec"]["initContainers"] if c["name"] == "upshift"]
    admin = next(p["containerPort"] for p in sidecar["ports"] if p["name"] == "admin")
    assert _env(sidecar)["UPSHIFT_ADMIN_LISTEN"] == f"0.0.0.0:{admin}"
    monitoring = {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}}}
    (rule,) = policy["ingress"]
    assert rule["from"] == [monitoring]
    assert rule["ports"] == [{"port": admin, "protocol": "TCP"}]
    # The control: the API stays on loopback (the app reaches it inside the Pod, no rule needed).
    assert _top_config()["listen"].startswith("127.0.0.1:") and "UPSHIFT_LISTEN" not in _env(sidecar)
