"""Serve a MetricsRecorder on an HTTP ``/metrics`` endpoint in Prometheus' text format.

The edge where prometheus_client is used (the core records into plain counters): a Collector
turns each scrape's ``MetricsSnapshot`` into metric families, every label value of a labelled
counter present from the start (0 until it happens), and ``MetricsServer`` serves them from
its own registry on a background thread.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Iterator
from wsgiref.simple_server import WSGIServer

from prometheus_client.core import CounterMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector, CollectorRegistry

from connector.errors import UnsupportedConfiguration
from connector.metrics import COUNTER, METRICS, MetricSpec, MetricsRecorder, MetricsSnapshot


def _counter(spec: MetricSpec, snapshot: MetricsSnapshot) -> CounterMetricFamily:
    values = snapshot.counters.get(spec.name, {})
    if spec.label is None:
        return CounterMetricFamily(spec.name, spec.help, value=values.get("", 0))
    family = CounterMetricFamily(spec.name, spec.help, labels=[spec.label])
    for label_value in spec.label_values:
        family.add_metric([label_value], values.get(label_value, 0))
    return family


def _histogram(spec: MetricSpec, snapshot: MetricsSnapshot) -> HistogramMetricFamily:
    state = snapshot.histograms[spec.name]
    cumulative, buckets = 0, []
    for upper, count in zip((*spec.buckets, math.inf), state.bucket_counts, strict=True):
        cumulative += count
        buckets.append((_le(upper), cumulative))
    return HistogramMetricFamily(spec.name, spec.help, buckets=buckets, sum_value=state.sum)


def _le(upper: float) -> str:
    """Prometheus' spelling of a bucket bound: "+Inf", "1024.0", "0.005"."""
    return "+Inf" if math.isinf(upper) else repr(float(upper))


class SnapshotCollector(Collector):
    """Every metric of connector.metrics, from ``recorder``'s snapshot at scrape time."""

    def __init__(self, recorder: MetricsRecorder) -> None:
        self._recorder = recorder

    def collect(self) -> Iterator[Metric]:
        snapshot = self._recorder.snapshot()
        for spec in METRICS:
            yield _counter(spec, snapshot) if spec.kind == COUNTER else _histogram(spec, snapshot)


class MetricsServer:
    """``/metrics`` over HTTP on host:port (0: a free port) until ``close()``."""

    def __init__(self, recorder: MetricsRecorder, host: str, port: int) -> None:
        from prometheus_client import start_http_server

        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(SnapshotCollector(recorder))
        try:
            server, thread = start_http_server(port, addr=host, registry=self.registry)
        except OSError as exc:
            raise UnsupportedConfiguration(
                f"metrics endpoint cannot bind {host}:{port} ({exc}); pass a free "
                "--metrics-port (0 picks one)"
            ) from None
        self._server: WSGIServer = server
        self._thread: threading.Thread = thread
        self.host = host
        self.port = int(server.server_port)

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}/metrics"

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=5.0)
