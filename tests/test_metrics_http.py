"""The /metrics endpoint as a network service: its backlog, time and connections are bounded.

Issue 25: a listen backlog of 5 reset concurrent scrapers, a held partial request pinned a
thread forever, an HTTP/0.9 request got a bare body and every path answered 200. Each test
talks raw HTTP to a real MetricsServer on loopback; no test sleeps to wait (a receive timeout
bounds every wait), and every server and socket is closed.
"""

from __future__ import annotations

import shutil
import socket
import subprocess
import time
from collections.abc import Callable, Iterator

import pytest

from connector.observability.metrics import LOADS_FINISHED, MetricsRecorder
from connector.observability.metrics_prometheus import MetricsServer

HOST = "127.0.0.1"
WAIT_S = 10.0  # the longest any test waits for the server to act
SCRAPE = b"GET /metrics HTTP/1.1\r\nHost: localhost\r\n\r\n"


@pytest.fixture
def server() -> Iterator[MetricsServer]:
    recorder = MetricsRecorder()
    recorder.inc(LOADS_FINISHED)
    server = MetricsServer(recorder, HOST, 0)
    try:
        yield server
    finally:
        server.close()


def connect(port: int) -> socket.socket:
    return socket.create_connection((HOST, port), timeout=WAIT_S)


def exchange(port: int, request: bytes) -> bytes:
    """Everything the server sends back before closing (b"" if it closes at once or resets)."""
    with connect(port) as client:
        client.sendall(request)
        return read_to_close(client)


def read_to_close(client: socket.socket) -> bytes:
    chunks = []
    try:
        while chunk := client.recv(65536):
            chunks.append(chunk)
    except ConnectionResetError:
        pass
    return b"".join(chunks)


def wait_until(predicate: Callable[[], bool]) -> None:
    deadline_s = time.monotonic() + WAIT_S
    while not predicate():
        assert time.monotonic() < deadline_s, "the server did not get there in time"
        time.sleep(0.01)


@pytest.mark.parametrize(
    ("request_line", "status", "body_has"),
    [
        pytest.param(b"GET /metrics HTTP/1.1", b"200", b"nixl_pd_loads_finished_total 1.0", id="metrics"),
        pytest.param(b"GET /metrics?x=1 HTTP/1.0", b"200", b"nixl_pd_loads_finished", id="any-query"),
        pytest.param(b"GET / HTTP/1.1", b"404", b"only /metrics", id="root-is-404"),
        pytest.param(b"GET /metrics/ HTTP/1.1", b"404", b"only /metrics", id="trailing-slash-404"),
        pytest.param(b"GET /favicon.ico HTTP/1.1", b"404", b"only /metrics", id="favicon-404"),
        pytest.param(b"GET /metricsx HTTP/1.1", b"404", b"only /metrics", id="prefix-404"),
        pytest.param(b"POST /metrics HTTP/1.1", b"501", b"Unsupported method", id="post-501"),
    ],
)  # fmt: skip
def test_only_metrics_is_served(
    server: MetricsServer, request_line: bytes, status: bytes, body_has: bytes
) -> None:
    reply = exchange(server.port, request_line + b"\r\nHost: localhost\r\n\r\n")

    assert reply.split(b"\r\n", 1)[0].split(b" ")[1] == status
    assert body_has in reply.split(b"\r\n\r\n", 1)[1]


def test_the_name_filter_and_head_are_served(server: MetricsServer) -> None:
    filtered = exchange(
        server.port, b"GET /metrics?name[]=nixl_pd_loads_finished_total HTTP/1.0\r\n\r\n"
    )
    head = exchange(server.port, b"HEAD /metrics HTTP/1.0\r\n\r\n")

    families = [line for line in filtered.split(b"\n") if line.startswith(b"# TYPE")]
    assert families == [b"# TYPE nixl_pd_loads_finished_total counter"]
    assert head.startswith(b"HTTP/1.0 200 ") and head.endswith(b"\r\n\r\n")
    assert b"Content-Length: " in head and b"nixl_pd" not in head


@pytest.mark.parametrize(
    "request_bytes",
    [
        pytest.param(b"GET /metrics\r\n", id="http-0.9-get"),
        pytest.param(b"GET /\r\n", id="http-0.9-root"),
        pytest.param(b"POST /metrics\r\n", id="http-0.9-post"),
        pytest.param(b"GET\r\n", id="one-word"),
    ],
)
def test_http_0_9_gets_no_reply_at_all(server: MetricsServer, request_bytes: bytes) -> None:
    assert exchange(server.port, request_bytes) == b""


def test_a_held_partial_request_is_closed_at_the_deadline() -> None:
    server = MetricsServer(MetricsRecorder(), HOST, 0, timeout_s=0.5)
    try:
        with connect(server.port) as client:
            client.sendall(b"GET /metrics HTTP/1.1\r\nHost: local")  # and then nothing
            assert read_to_close(client) == b""  # closed by the server, before WAIT_S
        wait_until(lambda: server.num_connections == 0)
    finally:
        server.close()


def test_a_trickled_request_is_closed_at_the_deadline_too() -> None:
    """One byte per 50 ms never idles 0.5 s, but the connection's deadline still ends it."""
    server = MetricsServer(MetricsRecorder(), HOST, 0, timeout_s=0.5)
    try:
        with connect(server.port) as client:
            client.settimeout(0.05)
            closed = False
            for _ in range(int(WAIT_S / 0.05)):
                try:
                    closed = client.recv(1) == b""
                except TimeoutError:
                    client.send(b"X-Slow: loris\r\n"[:1])  # the server has not closed: trickle
                except ConnectionResetError:
                    closed = True
                if closed:
                    break
            assert closed
    finally:
        server.close()


def test_beyond_max_connections_a_new_one_is_closed_unserved() -> None:
    server = MetricsServer(MetricsRecorder(), HOST, 0, max_connections=2)
    try:
        held = [connect(server.port) for _ in range(2)]
        for client in held:
            client.sendall(b"GET /metrics HTTP/1.1\r\n")  # partial: each holds a slot
        wait_until(lambda: server.num_connections == 2)

        assert exchange(server.port, SCRAPE) == b""
        assert server.num_refused == 1

        for client in held:
            client.close()
        wait_until(lambda: server.num_connections == 0)
        assert exchange(server.port, SCRAPE).startswith(b"HTTP/1.0 200 ")
    finally:
        server.close()


def test_the_listen_backlog_is_not_five(server: MetricsServer) -> None:
    """The kernel's view (ss: a listening socket's Send-Q is its backlog)."""
    if shutil.which("ss") is None:
        pytest.skip("needs ss (iproute2) to read the listen backlog")
    listing = subprocess.run(
        ["ss", "-ltnH", f"sport = :{server.port}"], capture_output=True, text=True, check=True
    ).stdout.split()

    assert listing[0] == "LISTEN" and int(listing[2]) >= 128
