"""Cluster settings: validation, env names, and the supervisor's metrics merge."""

from __future__ import annotations

from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from proxy.config import Settings, peer_urls
from proxy.config_load import load_settings
from proxy.errors import ConfigError
from proxy.server import Server
from proxy.supervisor import merge_metrics

PEERS = "http://10.0.0.1:8080, http://10.0.0.2:8080/"


def test_env_names_and_parsing() -> None:
    env = {
        "UPSHIFT_WORKERS": "3",
        "UPSHIFT_CLUSTER_PEERS": PEERS,
        "UPSHIFT_CLUSTER_SELF_URL": "http://10.0.0.2:8080",
        "UPSHIFT_LISTENER_HEADER_TIMEOUT_SECONDS": "2.5",
    }
    s = load_settings(None, env, None)
    assert s.workers == 3 and s.listener.header_timeout_seconds == 2.5
    assert peer_urls(s.cluster.peers) == ("http://10.0.0.1:8080", "http://10.0.0.2:8080")
    assert load_settings({"workers": "2"}, env, None).workers == 2  # --workers wins over env


@pytest.mark.parametrize(
    ("env", "needle"),
    [
        ({"UPSHIFT_CLUSTER_PEERS": PEERS}, "cluster.self_url is required"),
        ({"UPSHIFT_CLUSTER_PEERS": PEERS, "UPSHIFT_CLUSTER_SELF_URL": "http://10.0.0.9:8080"}, "not one of"),
        (
            {
                "UPSHIFT_CLUSTER_PEERS": PEERS,
                "UPSHIFT_CLUSTER_PEERS_DNS": "peers:8080",
                "UPSHIFT_CLUSTER_SELF_URL": "http://10.0.0.1:8080",
            },
            "not both",
        ),
        ({"UPSHIFT_CLUSTER_PEERS": "https://10.0.0.1:8080/v1"}, "peer base URL"),
        ({"UPSHIFT_CLUSTER_PEERS_DNS": "no-port"}, "host:port"),
        ({"UPSHIFT_WORKERS": "0"}, "> 0"),
        ({"UPSHIFT_LISTENER_MAX_CONNECTIONS": "0"}, "> 0"),
    ],
)
def test_invalid_cluster_settings(env: dict[str, str], needle: str) -> None:
    with pytest.raises(ConfigError, match=needle):
        load_settings(None, env, None)


async def test_an_unreadable_secret_file_is_a_configuration_error(tmp_path: Path) -> None:
    settings = load_settings(
        None,
        {
            "UPSHIFT_CLUSTER_PEERS": PEERS,
            "UPSHIFT_CLUSTER_SELF_URL": "http://10.0.0.1:8080",
            "UPSHIFT_CLUSTER_SECRET_FILE": str(tmp_path / "missing"),
            "UPSHIFT_LISTEN": "127.0.0.1:0",
            "UPSHIFT_ADMIN_LISTEN": "127.0.0.1:0",
        },
        None,
    )
    server = Server(settings)
    with pytest.raises(ConfigError, match="cluster.secret_file"):
        await server.start()
    await server.stop()


def test_merge_metrics_labels_every_sample_with_its_worker() -> None:
    texts = []
    for worker in range(2):
        registry = CollectorRegistry()
        c = Counter("upshift_requests", "Requests.", ["mode"], registry=registry)
        c.labels("full").inc(worker + 1)
        h = Histogram("upshift_added_latency_seconds", "Added.", buckets=(0.1, 1.0), registry=registry)
        h.observe(0.5)
        restarts = Counter("upshift_worker_restarts", "Supervisor only.", registry=registry)
        restarts.inc()
        texts.append((worker, generate_latest(registry).decode()))
    merged = CollectorRegistry()

    class Static:
        def collect(self):  # type: ignore[no-untyped-def]
            return merge_metrics(texts)

    merged.register(Static())  # type: ignore[arg-type]
    samples = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for f in text_string_to_metric_families(generate_latest(merged).decode())
        for s in f.samples
    }
    assert samples[("upshift_requests_total", (("mode", "full"), ("worker", "0")))] == 1
    assert samples[("upshift_requests_total", (("mode", "full"), ("worker", "1")))] == 2
    assert samples[("upshift_added_latency_seconds_bucket", (("le", "1.0"), ("worker", "1")))] == 1
    assert not any(name.startswith("upshift_worker_restarts") for name, _ in samples)  # the supervisor's own
    assert Settings().workers == 1
