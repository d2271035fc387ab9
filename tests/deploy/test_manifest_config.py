"""The shipped manifests' configuration loads through the real loader (no root needed), and a
gateway replica finds itself among ``https://`` peers however its ``self_url`` is spelled.

:mod:`tests.deploy.test_overlays` starts the overlays for real (root); these checks run anywhere.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from proxy.config import Settings
from proxy.config_load import load_settings
from proxy.errors import ConfigError
from proxy.ingress.cluster import Cluster
from proxy.ingress.peers import peer_key
from tests.deploy import kubelet
from tests.tools import kustomize, which


def _settings_of(overlay: str, deployment: str, tmp_path: Path, pod_ip: str = "127.0.0.2") -> Settings:
    docs = kubelet.render(overlay)
    dep = kubelet.one(docs, "Deployment", deployment)
    template = dep["spec"]["template"]
    c = kubelet.container(template["spec"], "upshift")
    env = kubelet.environment(c, template["metadata"], pod_ip, f"{deployment}-0", {})
    config = tmp_path / "config.yaml"
    config.write_text(kubelet.one(docs, "ConfigMap", "upshift-config")["data"]["config.yaml"])
    args = c["args"]
    assert args[:1] == ["--config"], args
    mounted = args[1]
    assert mounted.startswith("/etc/upshift/"), mounted
    return load_settings({}, env, str(config))


def test_gateway_manifest_configuration_loads(tmp_path: Path) -> None:
    settings = _settings_of("gateway", "upshift-gateway", tmp_path)
    cluster = settings.cluster
    assert cluster.self_url == "https://127.0.0.2:8443"
    assert cluster.peers_dns == "upshift-gateway-peers:8443"
    assert cluster.tls_server_name == "upshift-gateway-peers"
    # The Service's names are the Host names apps may use.
    hosts = settings.listener.allowed_hosts
    assert "upshift-gateway" in hosts and f"upshift-gateway.{kubelet.NAMESPACE}.svc" in hosts


def test_sidecar_manifest_configuration_loads(tmp_path: Path) -> None:
    settings = _settings_of("sidecar", "my-app", tmp_path)
    assert settings.api_key.source == "file"
    assert settings.api_key.file == "/var/run/secrets/openai/api-key"


@pytest.mark.parametrize(
    "url",
    ["https://10.0.0.1:8443", "https://[fd00::5]:8443", "http://10.0.0.1:8080"],
)
def test_peer_urls_https_and_http_load(url: str) -> None:
    peers = {"UPSHIFT_CLUSTER_PEERS": f"{url},https://10.0.0.9:8443", "UPSHIFT_CLUSTER_SELF_URL": url}
    assert load_settings({}, peers, None).cluster.peers
    settings = load_settings({}, {"UPSHIFT_CLUSTER_PEERS_DNS": "peers:8443", "UPSHIFT_CLUSTER_SELF_URL": url}, None)
    assert settings.cluster.self_url == url


@pytest.mark.parametrize(
    "url", ["ftp://10.0.0.1:8443", "https://10.0.0.1:8443/v1", "10.0.0.1:8443", "https://10.0.0.1:99999"]
)
def test_peer_urls_other_than_base_urls_are_refused(url: str) -> None:
    with pytest.raises(ConfigError, match="expected a peer base URL"):
        load_settings({}, {"UPSHIFT_CLUSTER_PEERS_DNS": "peers:8443", "UPSHIFT_CLUSTER_SELF_URL": url}, None)


def test_an_ipv6_self_url_without_brackets_is_refused_with_the_form_to_use() -> None:
    """``https://$(POD_IP):8443`` on an IPv6 cluster: the manifest's comment says to bracket it."""
    env = {"UPSHIFT_CLUSTER_PEERS_DNS": "peers:8443", "UPSHIFT_CLUSTER_SELF_URL": "https://fd00::5:8443"}
    with pytest.raises(ConfigError, match=r"brackets: https://\[fd00::5\]:8443"):
        load_settings({}, env, None)


def test_peer_key_spellings() -> None:
    assert peer_key("https://[fd00:0::5]:8443") == peer_key("https://[FD00::5]:8443/")
    assert peer_key("https://Gateway") == peer_key("https://gateway:443")
    assert peer_key("https://10.0.0.1:8443") != peer_key("http://10.0.0.1:8443")
    assert peer_key("https://10.0.0.1:8443") != peer_key("https://10.0.0.2:8443")


def test_a_replica_finds_itself_among_dns_peers_however_self_url_is_spelled(tmp_path: Path) -> None:
    """``self_url`` in another spelling than DNS gives (IPv6 uncompressed): the replica is not a
    peer of its own, the other one is, and both rank the same names."""
    trustme = pytest.importorskip("trustme", reason="trustme is in the test extra: pip install -e '.[test]'")
    ca = tmp_path / "ca.crt"
    trustme.CA().cert_pem.write_to_path(str(ca))
    env = {
        "UPSHIFT_CLUSTER_PEERS_DNS": "upshift-gateway-peers:8443",
        "UPSHIFT_CLUSTER_SELF_URL": "https://[fd00:0:0::5]:8443",
        "UPSHIFT_CLUSTER_TLS_CA_FILE": str(ca),
    }
    cluster = Cluster(load_settings({}, env, None))
    dns = ["https://[fd00::5]:8443", "https://[fd00::6]:8443"]
    cluster.set_members(dns)
    assert cluster.members == tuple(dns)
    assert cluster.self_url == "https://[fd00::5]:8443"
    assert cluster.query_peer("https://[fd00::5]:8443", 1) is None
    assert cluster.query_peer("https://[fd00::6]:8443", 1) is not None


def test_the_fallback_renderer_renders_what_kubectl_does() -> None:
    """Without kubectl the overlays are rendered from their files: the same upshift container."""
    kubectl = which("kubectl")
    if kubectl is None:
        pytest.skip("kubectl is not on PATH: nothing to compare the fallback renderer with")
    for overlay, deployment in (("sidecar", "my-app"), ("gateway", "upshift-gateway")):
        rendered = [
            kubelet.one(docs, "Deployment", deployment)["spec"]["template"]["spec"]
            for docs in (
                kustomize(kubectl, kubelet.K8S / overlay),
                kubelet.render_files(kubelet.K8S / overlay),
            )
        ]
        ours, theirs = (kubelet.container(spec, "upshift") for spec in rendered)
        ours.pop("image"), theirs.pop("image")  # the images: stanza (a tag) is kustomize's alone
        assert ours == theirs
        assert rendered[0]["volumes"] == rendered[1]["volumes"]
        assert rendered[0]["securityContext"] == rendered[1]["securityContext"]
