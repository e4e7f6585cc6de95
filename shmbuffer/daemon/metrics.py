"""Prometheus metrics of a daemon (``shmbuffer-daemon start --metrics-port P``).

Two threads, and the line between them is a snapshot. The daemon's event loop is
single-threaded and owns every piece of service state; ``prometheus_client``'s HTTP server
answers scrapes on threads of its own. So the loop does all the reading: it times each request
it answers (two ``perf_counter`` calls and a bucket increment, :meth:`Metrics.observe`) and, at
most every :data:`PUBLISH_EVERY_S`, turns ``BufferService.stats`` and those timings into an
immutable :class:`Snapshot` of plain numbers (:meth:`Metrics.publish`), stored with one
attribute assignment. A scrape reads that attribute once (:class:`SnapshotCollector`) and never
touches the service, so it cannot see a half-updated state or slow the loop down by a lock. A
scrape is at most ``PUBLISH_EVERY_S`` (plus one loop tick) behind.

``prometheus_client`` is imported only by :func:`serve_metrics`: a daemon without
``--metrics-port`` starts without it installed.

Exposed (all prefixed ``shmbuffer_``): the stats counters as ``*_total`` (rows_committed,
episodes_committed, rows_sampled, samples, messages, errors, ...), gauges ``rows``,
``episodes``, ``capacity_rows``, ``fill_ratio``, ``reservations``, ``reserved_rows``,
``leases``, ``stalled_writer_rows`` (rows pinned to stopped or disconnected local writers),
``clients{role}``, ``insert_rows_per_second``, ``sample_rows_per_second``,
``waiting_requests{queue}``, ``uptime_seconds`` and
``info{name,unit,mode,sampler,rate_limiter,protocol}`` (the default table's kinds); per table
(``default`` without ``--table``), ``sampler_figure{table,figure}``,
``table_rows_sampled_total{table}``, ``table_priority_updates_total{table}`` and
``table_info{table,sampler,rate_limiter}``; the counter
``rate_limiter_blocked_seconds_total{queue}``; histograms ``sample_seconds`` (handling of
``sample`` requests) and ``request_seconds{op}`` (every op). A request's handling time is the
time from dispatch to its reply sent; a parked request counts only the attempt that answered
it (the time it waited is in the blocked seconds).
"""

from __future__ import annotations

import bisect
import ipaddress
import logging
import math
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any, Literal

from shmbuffer.errors import ConfigError

log = logging.getLogger("shmbuffer.daemon")

PUBLISH_EVERY_S = 0.5
PREFIX = "shmbuffer_"
#: Upper bounds (seconds) of the request-time buckets: a sample is handled in tens of
#: microseconds, a checkpoint may take seconds.
BUCKETS = (
    1e-5,
    2.5e-5,
    5e-5,
    1e-4,
    2.5e-4,
    5e-4,
    1e-3,
    2.5e-3,
    5e-3,
    1e-2,
    2.5e-2,
    5e-2,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
)
#: stats counters -> what their ``*_total`` metric counts.
COUNTERS = {
    "rows_committed": "Rows committed since the start (kept across --resume and checkpoints).",
    "episodes_committed": "Episodes committed.",
    "rows_sampled": "Rows sampled (a slice of L rows counts L).",
    "samples": "Sample requests served.",
    "messages": "Requests handled.",
    "errors": "Error replies sent.",
    "reservations_expired": (
        "Reservations aborted uncommitted: by reservation_ttl, or pinned to a writer that "
        "exited after its connection went."
    ),
    "leases_expired": "Leases ended by lease_ttl.",
    "clients_reaped": "Local clients forgotten because their process died.",
    "clients_expired": "Clients forgotten after client_idle_ttl of silence.",
    "priority_updates": "Rows whose priority update_priorities set.",
    "priority_updates_stale": "Rows update_priorities skipped: overwritten since sampled.",
    "rows_rewritten": "Committed rows changed in place (rewrite).",
}
#: stats gauges -> (metric name, help).
GAUGES = {
    "rows": ("rows", "Committed rows stored."),
    "episodes": ("episodes", "Committed episodes stored."),
    "capacity": ("capacity_rows", "Rows the buffer holds at most."),
    "fill": ("fill_ratio", "rows / capacity."),
    "reservations": ("reservations", "Open reservations."),
    "reserved_rows": ("reserved_rows", "Rows held by open reservations."),
    "leases": ("leases", "Live leases."),
    "insert_rows_per_s": ("insert_rows_per_second", "Rows committed per second, last 3 s."),
    "sample_rows_per_s": ("sample_rows_per_second", "Rows sampled per second, last 3 s."),
    "uptime_s": ("uptime_seconds", "Seconds since the daemon started."),
}
ROLES = ("writer", "reader", "admin")

Kind = Literal["counter", "gauge", "histogram"]
#: A histogram sample: (cumulative count per bucket bound, +Inf last), sum of observations.
HistogramValue = tuple[tuple[int, ...], float]


@dataclass(frozen=True)
class Family:
    """One metric family as plain data: ``samples`` pairs label values with a number (a
    :data:`HistogramValue` for a histogram)."""

    name: str
    kind: Kind
    doc: str
    labels: tuple[str, ...]
    samples: tuple[tuple[tuple[str, ...], Any], ...]


@dataclass(frozen=True)
class Snapshot:
    families: tuple[Family, ...]


class RequestTimes:
    """Per-op histograms of handling times. Loop thread only (no lock: never shared)."""

    def __init__(self) -> None:
        self._counts: dict[str, list[int]] = {}  # per bucket, +Inf last; not cumulative
        self._sums: dict[str, float] = {}

    def observe(self, op: str, seconds: float) -> None:
        counts = self._counts.get(op)
        if counts is None:
            counts = self._counts[op] = [0] * (len(BUCKETS) + 1)
            self._sums[op] = 0.0
        counts[bisect.bisect_left(BUCKETS, seconds)] += 1
        self._sums[op] += seconds

    def frozen(self) -> dict[str, HistogramValue]:
        """A copy, cumulative as Prometheus wants it."""
        out = {}
        for op, counts in self._counts.items():
            running, cumulative = 0, []
            for count in counts:
                running += count
                cumulative.append(running)
            out[op] = (tuple(cumulative), self._sums[op])
        return out


class Metrics:
    """The loop's side: :meth:`observe` each answered request, :meth:`publish` on each loop
    pass; the HTTP thread reads :attr:`snapshot` only."""

    def __init__(self, every_s: float = PUBLISH_EVERY_S) -> None:
        self.every_s = every_s
        self.times = RequestTimes()
        self.snapshot: Snapshot | None = None  # replaced whole, never changed in place
        self._next = -math.inf
        self._failed = False  # logged once

    def observe(self, op: str, seconds: float) -> None:
        self.times.observe(op, seconds)

    def publish(self, now: float, stats: Callable[[float], Mapping[str, Any]]) -> bool:
        """Store a fresh snapshot if the last one is ``every_s`` old (``stats(now)``: the
        service's stats reply); True if it did."""
        if now < self._next:
            return False
        self._next = now + self.every_s
        try:
            self.snapshot = Snapshot(families(stats(now), self.times.frozen()))
        except Exception:  # a bug here must not stop the daemon's loop: scrapes keep the last
            if not self._failed:
                log.exception("metrics snapshot failed; scrapes keep the previous one")
            self._failed = True
            return False
        return True


def _number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _table_families(stats: Mapping[str, Any]) -> list[Family]:
    """Each table's series, labelled by its name: its sampler's figures, the rows it handed
    out, its priority updates, and its kinds (a daemon before tables: its one sampler, as the
    table ``default``)."""
    tables = stats.get("tables") or {
        "default": {
            "sampler": stats.get("sampler") or {},
            "rate_limiter": stats.get("rate_limiter") or {},
            "priority_updates": stats.get("priority_updates", 0),
        }
    }
    figures, sampled, updates, kinds = [], [], [], []
    for name, table in tables.items():
        sampler, limiter = table.get("sampler") or {}, table.get("rate_limiter") or {}
        figures += [
            ((name, k), float(v)) for k, v in sampler.get("figures", {}).items() if _number(v)
        ]
        sampled.append(((name,), int(limiter.get("sampled", 0))))
        updates.append(((name,), int(table.get("priority_updates", 0))))
        kinds.append(((name, str(sampler.get("kind", "")), str(limiter.get("kind", ""))), 1))
    doc = "The sampler's own figures (items, epoch, consumed episodes, ...), by table and kind."
    return [
        Family(PREFIX + "sampler_figure", "gauge", doc, ("table", "figure"), tuple(figures)),
        Family(
            PREFIX + "table_rows_sampled",
            "counter",
            "Rows each table handed out (its limiter's count: a slice of L rows counts L).",
            ("table",),
            tuple(sampled),
        ),
        Family(
            PREFIX + "table_priority_updates",
            "counter",
            "Rows whose priority update_priorities set, by table.",
            ("table",),
            tuple(updates),
        ),
        Family(
            PREFIX + "table_info",
            "gauge",
            "Each table's sampler and rate limiter kinds, as labels (value 1).",
            ("table", "sampler", "rate_limiter"),
            tuple(kinds),
        ),
    ]


def families(stats: Mapping[str, Any], times: Mapping[str, HistogramValue]) -> tuple[Family, ...]:
    """The metric families of one stats reply and the request timings (plain data, built in
    the loop thread)."""
    out = [
        Family(PREFIX + key, "counter", doc, (), (((), int(stats.get(key, 0))),))
        for key, doc in COUNTERS.items()
    ]
    out += [
        Family(PREFIX + name, "gauge", doc, (), (((), float(stats[key])),))
        for key, (name, doc) in GAUGES.items()
        if _number(stats.get(key))
    ]
    stalled = stats.get("stalled_writers")
    if stalled is not None:  # a daemon before protocol 1.6 has none
        rows = float(sum(w["rows"] for w in stalled))
        doc = "Rows held for local writers stopped past their TTL or whose connection is gone."
        out.append(Family(PREFIX + "stalled_writer_rows", "gauge", doc, (), (((), rows),)))
    roles = dict.fromkeys(ROLES, 0)
    for client in stats.get("clients", ()):
        roles[client["role"]] = roles.get(client["role"], 0) + 1
    if "clients" not in stats:  # a stats reply without the list: the two counts it has
        roles.update(writer=stats.get("writers", 0), reader=stats.get("readers", 0))
    out.append(
        Family(
            PREFIX + "clients",
            "gauge",
            "Clients connected, by the role they said hello as.",
            ("role",),
            tuple(((role,), count) for role, count in roles.items()),
        )
    )
    limiter = stats.get("rate_limiter") or {}
    queues = ("insert", "sample")
    out.append(
        Family(
            PREFIX + "rate_limiter_blocked_seconds",
            "counter",
            "Seconds requests spent parked by the rate limiter (or by FIFO flow control).",
            ("queue",),
            tuple(((q,), float(limiter.get(f"{q}_blocked_s", 0.0))) for q in queues),
        )
    )
    out.append(
        Family(
            PREFIX + "waiting_requests",
            "gauge",
            "Requests parked now, by queue.",
            ("queue",),
            tuple(((q,), int(limiter.get(f"{q}s_waiting", 0))) for q in queues),
        )
    )
    sampler = stats.get("sampler") or {}
    out += _table_families(stats)
    info = {
        "name": str(stats.get("name", "")),
        "unit": str(stats.get("unit", "")),
        "mode": str(stats.get("mode", "")),
        "sampler": str(sampler.get("kind", "")),
        "rate_limiter": str(limiter.get("kind", "")),
        "protocol": str(stats.get("protocol", "")),
    }
    out.append(
        Family(
            PREFIX + "info",
            "gauge",
            "The buffer's settings, as labels (value 1).",
            tuple(info),
            ((tuple(info.values()), 1),),
        )
    )
    out.append(
        Family(
            PREFIX + "request_seconds",
            "histogram",
            "Time the daemon spent handling a request, reply sent, by op.",
            ("op",),
            tuple(((op,), value) for op, value in sorted(times.items())),
        )
    )
    no_samples: HistogramValue = ((0,) * (len(BUCKETS) + 1), 0.0)  # shown as zeros, not absent
    out.append(
        Family(
            PREFIX + "sample_seconds",
            "histogram",
            "Time the daemon spent handling a sample request, reply sent.",
            (),
            (((), times.get("sample", no_samples)),),
        )
    )
    return tuple(out)


class SnapshotCollector:
    """A ``prometheus_client`` collector of the last :class:`Snapshot` (HTTP thread): it
    reads ``metrics.snapshot`` once per scrape and nothing of the service."""

    def __init__(self, metrics: Metrics) -> None:
        self.metrics = metrics

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import (
            CounterMetricFamily,
            GaugeMetricFamily,
            HistogramMetricFamily,
        )

        snapshot = self.metrics.snapshot  # one read: the loop replaces it whole
        if snapshot is None:
            return
        bounds = [repr(float(b)) for b in BUCKETS] + ["+Inf"]  # "1e-05", "0.1", "1.0"
        for family in snapshot.families:
            labels = list(family.labels)
            metric: Any
            if family.kind == "counter":
                metric = CounterMetricFamily(family.name, family.doc, labels=labels)
            elif family.kind == "gauge":
                metric = GaugeMetricFamily(family.name, family.doc, labels=labels)
            else:
                metric = HistogramMetricFamily(family.name, family.doc, labels=labels)
            for values, value in family.samples:
                if family.kind == "histogram":
                    cumulative, total = value
                    buckets = list(zip(bounds, cumulative, strict=True))
                    metric.add_metric(list(values), buckets, total)
                else:
                    metric.add_metric(list(values), value)
            yield metric


class MetricsServer:
    """The HTTP side: ``prometheus_client``'s server thread over a registry that holds only the
    :class:`SnapshotCollector` and the process collector (CPU, memory, open files of this
    process, read from ``/proc``)."""

    def __init__(self, metrics: Metrics, httpd: Any, thread: Any) -> None:
        self.metrics = metrics
        self._httpd = httpd
        self._thread = thread
        host, port = httpd.server_address[:2]
        self.host, self.port = str(host), int(port)

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}/metrics"

    def close(self) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()
        self._thread.join(5.0)


def serve_metrics(host: str, port: int, metrics: Metrics | None = None) -> MetricsServer:
    """Listen on ``host:port`` (0: any free port) and serve ``metrics``' snapshots; a
    ConfigError naming the flag if ``prometheus_client`` is missing or the port cannot be
    bound."""
    try:
        from prometheus_client import CollectorRegistry, ProcessCollector, start_http_server
    except ImportError:
        raise ConfigError(
            "--metrics-port needs prometheus_client, which is not installed: "
            "pip install 'shmbuffer[live]'"
        ) from None
    metrics = metrics or Metrics()
    registry = CollectorRegistry()
    registry.register(SnapshotCollector(metrics))
    ProcessCollector(namespace="shmbuffer", registry=registry)
    try:
        httpd, thread = start_http_server(port, addr=host, registry=registry)
    except OSError as exc:
        raise ConfigError(
            f"--metrics-port {port}: cannot listen on {host}:{port}: {exc.strerror or exc}"
        ) from None
    server = MetricsServer(metrics, httpd, thread)
    if not _loopback(host):
        log.warning(
            "metrics served on %s, not a loopback address: anyone who reaches it sees the "
            "buffer's name, sizes and rates",
            server.url,
        )
    log.info("metrics: %s", server.url)
    return server


def _loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False
