"""Serve a MetricsRecorder on an HTTP ``/metrics`` endpoint in Prometheus' text format.

The edge where prometheus_client is used (the core records into plain counters): a Collector
turns each scrape's ``MetricsSnapshot`` into metric families, every label value of a labelled
counter present from the start (0 until it happens), and ``MetricsServer`` serves them from
its own registry on a background thread, with bounded connections, threads and time.
"""

from __future__ import annotations

import gzip
import io
import itertools
import logging
import socket
import socketserver
import threading
import time
from collections.abc import Iterator
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs, urlsplit

from prometheus_client.core import CounterMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.exposition import choose_encoder, gzip_accepted
from prometheus_client.registry import Collector, CollectorRegistry

from connector.errors import UnsupportedConfiguration
from connector.observability.metrics import (
    COUNTER,
    METRICS,
    MetricSpec,
    MetricsRecorder,
    MetricsSnapshot,
)

logger = logging.getLogger(__name__)


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
    bounds = [*(repr(float(upper)) for upper in spec.buckets), "+Inf"]  # "0.005", "1024.0"
    buckets = list(zip(bounds, itertools.accumulate(state.bucket_counts), strict=True))
    return HistogramMetricFamily(spec.name, spec.help, buckets=buckets, sum_value=state.sum)


class SnapshotCollector(Collector):
    """Every metric of ``metrics.METRICS``, from ``recorder``'s snapshot at scrape time."""

    def __init__(self, recorder: MetricsRecorder) -> None:
        self._recorder = recorder

    def describe(self) -> Iterator[Metric]:
        """The families ``collect`` yields: their names let a scrape's ``name[]`` pick them."""
        return self.collect()

    def collect(self) -> Iterator[Metric]:
        snapshot = self._recorder.snapshot()
        for spec in METRICS:
            yield _counter(spec, snapshot) if spec.kind == COUNTER else _histogram(spec, snapshot)


LISTEN_BACKLOG = 512  # connections the kernel queues for accept (capped at net.core.somaxconn)
CONNECTION_TIMEOUT_S = 5.0  # the longest one connection may live: request read, body written
MAX_CONNECTIONS = 64  # connections served at once; beyond it a new one is closed unserved
SHUTDOWN_POLL_S = 0.1  # how often the accept loop checks for close()
METRICS_PATH = "/metrics"


class MetricsServer:
    """``/metrics`` over HTTP on host:port (0: a free port) until ``close()``.

    A network service, bounded: at most ``max_connections`` served at once (each on its own
    thread; one more is closed as soon as it is accepted), each connection closed
    ``timeout_s`` after it was accepted, whatever the client does, and a listen backlog of
    ``LISTEN_BACKLOG``. One request per connection (HTTP/1.0 replies); only GET and HEAD of
    ``/metrics`` are served (any query, Prometheus' ``name[]`` filter honoured), any other
    path is a 404 and an HTTP/0.9 request (no version) is closed with no reply.
    """

    def __init__(
        self,
        recorder: MetricsRecorder,
        host: str,
        port: int,
        *,
        timeout_s: float = CONNECTION_TIMEOUT_S,
        max_connections: int = MAX_CONNECTIONS,
    ) -> None:
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(SnapshotCollector(recorder))
        try:
            server = _HTTPServer(host, port, self.registry, timeout_s, max_connections)
        except OSError as exc:
            raise UnsupportedConfiguration(
                f"metrics endpoint cannot bind {host}:{port} ({exc}); pass a free "
                "--metrics-port (0 picks one)"
            ) from None
        self._server = server
        self.host = host
        self.port = int(server.server_address[1])
        self._thread = threading.Thread(
            target=server.serve_forever,
            args=(SHUTDOWN_POLL_S,),
            name=f"nixl-pd-metrics-{self.port}",
            daemon=True,
        )
        self._thread.start()

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}{METRICS_PATH}"

    @property
    def num_connections(self) -> int:
        """Connections being served now."""
        return self._server.num_connections

    @property
    def num_refused(self) -> int:
        """Connections closed unserved since start because ``max_connections`` were busy."""
        return self._server.num_refused

    def close(self) -> None:
        """Stop accepting, then wait for the connections being served (each at most
        ``timeout_s``) and the accept thread."""
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=5.0)


class _HTTPServer(ThreadingHTTPServer):
    """A thread per connection, up to a bound; the handler threads are joined on close."""

    request_queue_size = LISTEN_BACKLOG
    daemon_threads = False  # so server_close() joins them; each lives at most timeout_s
    block_on_close = True

    def __init__(
        self,
        host: str,
        port: int,
        registry: CollectorRegistry,
        timeout_s: float,
        max_connections: int,
    ) -> None:
        # The family host resolves to first, as prometheus_client's own server picks it.
        self.address_family = socket.getaddrinfo(
            host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
        )[0][0]
        self.registry = registry
        self.timeout_s = timeout_s
        self._max_connections = max_connections
        self._lock = threading.Lock()  # guards num_connections and num_refused
        self.num_connections = 0
        self.num_refused = 0
        super().__init__((host, port), _MetricsHandler)

    def server_bind(self) -> None:
        # TCPServer's bind only: HTTPServer's also looks up the host's FQDN (DNS) for nothing.
        socketserver.TCPServer.server_bind(self)

    def process_request(self, request: Any, client_address: Any) -> None:
        with self._lock:
            admitted = self.num_connections < self._max_connections
            if admitted:
                self.num_connections += 1
            else:
                self.num_refused += 1
        if not admitted:
            self.shutdown_request(request)  # at the bound: close it now, start no thread
            return
        try:
            super().process_request(request, client_address)
        except BaseException:
            self._release()  # no thread started (socketserver closes the request)
            raise

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._release()

    def _release(self) -> None:
        with self._lock:
            self.num_connections -= 1

    def handle_error(self, request: Any, client_address: Any) -> None:
        # A client that resets or stops reading mid-reply: its problem, not a traceback on stderr.
        logger.debug("metrics endpoint: connection from %s failed", client_address, exc_info=True)


class _DeadlineReader(io.RawIOBase):
    """A connection's bytes until a deadline (monotonic seconds); past it a read raises
    TimeoutError, so a client trickling a request a byte at a time cannot keep its thread."""

    def __init__(self, connection: socket.socket, deadline_s: float) -> None:
        self._connection = connection
        self._deadline_s = deadline_s

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        remaining_s = self._deadline_s - time.monotonic()
        if remaining_s <= 0:
            raise TimeoutError("the connection's deadline passed")
        self._connection.settimeout(remaining_s)  # also bounds the reply's sendall
        return self._connection.recv_into(buffer)


class _MetricsHandler(BaseHTTPRequestHandler):
    server: _HTTPServer
    raw_requestline: bytes  # the base class's, set before parse_request
    default_request_version = "HTTP/1.0"  # error replies to a malformed line get a status line

    def setup(self) -> None:
        super().setup()
        self.rfile.close()
        self.connection.settimeout(self.server.timeout_s)
        deadline_s = time.monotonic() + self.server.timeout_s
        self.rfile = io.BufferedReader(_DeadlineReader(self.connection, deadline_s))

    def parse_request(self) -> bool:
        # "GET /metrics" (no version) is HTTP/0.9, whose reply would be a bare body: none.
        if len(self.raw_requestline.split()) != 3:
            self.close_connection = True
            return False
        return super().parse_request()

    def do_GET(self) -> None:
        self._reply(with_body=True)

    def do_HEAD(self) -> None:
        self._reply(with_body=False)

    def _reply(self, *, with_body: bool) -> None:
        url = urlsplit(self.path)
        if url.path != METRICS_PATH:
            self.send_error(HTTPStatus.NOT_FOUND, f"only {METRICS_PATH} is served here")
            return
        registry = self.server.registry
        names = parse_qs(url.query).get("name[]")
        encoder, content_type = choose_encoder(self.headers.get("Accept", ""))
        body = encoder(registry.restricted_registry(names) if names else registry)
        gzipped = gzip_accepted(self.headers.get("Accept-Encoding", ""))
        if gzipped:
            body = gzip.compress(body)
        self.send_response(HTTPStatus.OK)
        self.send_header("Content-Type", content_type)
        if gzipped:
            self.send_header("Content-Encoding", "gzip")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if with_body:
            self.wfile.write(body)

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - the base's name
        logger.debug("metrics endpoint: %s " + format, self.address_string(), *args)
