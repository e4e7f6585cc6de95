"""Prometheus metrics (shmbuffer/daemon/metrics.py) over a real BufferService: the loop side
publishes snapshots, the collector serves them through prometheus_client's own exposition and
parser; ``--metrics-port`` is validated like every other flag. The HTTP scrape of a real daemon
is in tests/e2e/test_status_watch.py."""

from __future__ import annotations

import socket
import sys
import urllib.request
from collections.abc import Iterator
from typing import Any

import pytest

pytest.importorskip("prometheus_client")
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from shmbuffer.daemon.config import DaemonConfig
from shmbuffer.daemon.metrics import Metrics, SnapshotCollector, serve_metrics
from shmbuffer.errors import ConfigError
from tests.test_service import SPEC, Harness, storage  # noqa: F401  (fixture)

W, R = b"writer-1", b"reader-1"


@pytest.fixture
def h(storage: str) -> Iterator[Harness]:  # noqa: F811  (the fixture imported above)
    harness = Harness(storage, capacity=32)
    harness.hello(W)
    harness(W, "define_schema", schema=SPEC)
    harness.hello(R, "reader")
    yield harness
    harness.close()


def scrape(metrics: Metrics) -> dict[str, float]:
    """``{'name{label="v",...}': value}`` as prometheus_client's parser reads the exposition."""
    registry = CollectorRegistry()
    registry.register(SnapshotCollector(metrics))
    text = generate_latest(registry).decode()
    out = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels = ",".join(f'{k}="{v}"' for k, v in sorted(sample.labels.items()))
            out[f"{sample.name}{{{labels}}}" if labels else sample.name] = sample.value
    return out


def test_snapshot_follows_the_service_only_when_published(h: Harness) -> None:
    metrics = Metrics(every_s=0.5)
    assert scrape(metrics) == {}  # nothing published yet: an empty scrape, not an error
    assert metrics.publish(0.0, h.service.stats)
    before = scrape(metrics)
    assert before["shmbuffer_rows_committed_total"] == 0
    assert before["shmbuffer_capacity_rows"] == 32
    assert before['shmbuffer_clients{role="writer"}'] == 1
    assert before['shmbuffer_clients{role="reader"}'] == 1

    h.write(W, 4, 1.0)
    h(R, "sample", kind="rows", n=3)
    metrics.observe("sample", 2e-5)
    metrics.observe("sample", 0.3)
    metrics.observe("commit", 1e-4)
    assert not metrics.publish(0.2, h.service.stats)  # too soon: the old snapshot stays
    assert scrape(metrics) == before
    assert metrics.publish(0.6, h.service.stats)
    after = scrape(metrics)
    assert after["shmbuffer_rows_committed_total"] == 4
    assert after["shmbuffer_episodes_committed_total"] == 1
    assert after["shmbuffer_rows_sampled_total"] == 3
    assert after["shmbuffer_samples_total"] == 1
    assert after["shmbuffer_rows"] == 4
    assert after["shmbuffer_fill_ratio"] == pytest.approx(4 / 32)
    assert after["shmbuffer_reservations"] == 0
    assert after["shmbuffer_leases"] == 0
    assert after['shmbuffer_rate_limiter_blocked_seconds_total{queue="insert"}'] == 0
    assert after["shmbuffer_sample_seconds_count"] == 2
    assert after["shmbuffer_sample_seconds_sum"] == pytest.approx(0.30002)
    assert after['shmbuffer_sample_seconds_bucket{le="2.5e-05"}'] == 1
    assert after['shmbuffer_sample_seconds_bucket{le="0.25"}'] == 1
    assert after['shmbuffer_sample_seconds_bucket{le="0.5"}'] == 2
    assert after['shmbuffer_sample_seconds_bucket{le="+Inf"}'] == 2
    assert after['shmbuffer_request_seconds_count{op="commit"}'] == 1
    assert after['shmbuffer_request_seconds_count{op="sample"}'] == 2
    info = [k for k in after if k.startswith("shmbuffer_info{")]
    assert len(info) == 1 and 'sampler="uniform"' in info[0]


def test_stats_lists_each_client_with_its_figures(h: Harness) -> None:
    h.write(W, 5, 1.0)
    h.now = 2.0
    h(R, "sample", kind="rows", n=4)
    h.now = 3.5
    clients = {c["role"]: c for c in h.service.stats(h.now)["clients"]}
    assert set(clients) == {"writer", "reader"}
    writer, reader = clients["writer"], clients["reader"]
    assert (writer["rows_committed"], writer["rows_sampled"]) == (5, 0)
    assert (reader["rows_committed"], reader["rows_sampled"]) == (0, 4)
    assert writer["idle_s"] == pytest.approx(3.5)  # its last request was at 0.0
    assert reader["idle_s"] == pytest.approx(1.5)
    assert writer["host"] == "test-host" and writer["pid"] == 1
    held = h(R, "sample", kind="episodes", n=1, lease=True)
    reader = next(c for c in h.service.stats(h.now)["clients"] if c["role"] == "reader")
    assert reader["leases"] == 1 and "lease" in held


@pytest.mark.parametrize(
    ("port", "words"),
    [(70000, ["--metrics-port", "70000"]), (-1, ["--metrics-port"]), ("9100", ["'9100'"])],
)
def test_bad_metrics_port_is_a_config_error_naming_the_flag(port: Any, words: list[str]) -> None:
    with pytest.raises(ConfigError) as info:
        DaemonConfig(metrics_port=port)
    for word in words:
        assert word in str(info.value)


def test_bad_metrics_host_is_refused() -> None:
    with pytest.raises(ConfigError, match="--metrics-host"):
        DaemonConfig(metrics_port=0, metrics_host="")


def test_missing_prometheus_client_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    DaemonConfig()  # without the flag the module is never needed
    monkeypatch.setitem(sys.modules, "prometheus_client", None)  # as if not installed
    DaemonConfig()
    with pytest.raises(ConfigError, match=r"--metrics-port needs prometheus_client.*\[live\]"):
        DaemonConfig(metrics_port=0)
    with pytest.raises(ConfigError, match=r"shmbuffer\[live\]"):
        serve_metrics("127.0.0.1", 0)


def test_serve_metrics_over_http_and_a_busy_port(h: Harness) -> None:
    metrics = Metrics()
    server = serve_metrics("127.0.0.1", 0, metrics)
    try:
        assert server.url == f"http://127.0.0.1:{server.port}/metrics"
        metrics.publish(0.0, h.service.stats)
        with urllib.request.urlopen(server.url, timeout=5) as reply:
            text = reply.read().decode()
        assert "shmbuffer_rows_committed_total 0.0" in text
        assert "shmbuffer_process_cpu_seconds_total" in text
        with pytest.raises(ConfigError, match=f"--metrics-port {server.port}: cannot listen"):
            serve_metrics("127.0.0.1", server.port)
    finally:
        server.close()
    with pytest.raises(OSError), socket.create_connection(("127.0.0.1", server.port), 1):
        pass  # closed for good


def test_rows_pinned_to_a_stalled_writer_are_a_gauge(h: Harness) -> None:
    """A vouched writer's reservation past its TTL is kept for it (daemon/pins.py), shown in
    ``stalled_writers`` and as the ``stalled_writer_rows`` gauge; gone once its process is."""
    import subprocess

    from shmbuffer.daemon.processes import process_of

    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        stalled = b"\x01lane-stalled"
        h.service.peer_process = lambda identity: process_of(child.pid)
        h.hello(stalled)
        reservation = h(stalled, "reserve", rows=5)["reservation"]
        h.now += h.config.reservation_ttl + 1
        h.service.tick(h.now)  # past its TTL: kept, its writer still runs
        (entry,) = h.service.stats(h.now)["stalled_writers"]
        assert (entry["pid"], entry["reservation"], entry["rows"]) == (child.pid, reservation, 5)
        metrics = Metrics(every_s=0.5)
        metrics.publish(h.now, h.service.stats)
        assert scrape(metrics)["shmbuffer_stalled_writer_rows"] == 5
        child.kill()
        child.wait(10)
        h.service.disconnected(stalled, h.now)  # its connection closes as it dies
        h.now += 1
        h.service.tick(h.now)  # the next sweep finds the process gone: the rows go
        assert h.service.stats(h.now)["stalled_writers"] == []
        assert h.service.stats(h.now)["reservations"] == 0
    finally:
        child.kill()
        child.wait(10)
