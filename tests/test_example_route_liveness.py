"""`nixl-pd route` tells a dead server from a busy one (issue 11, finding 6; issue 25, item 2).

Before issue 11, a killed or stopped server showed up only as "timed out after 60 s" on each
request. Here a stand-in server (a ZMQ ROUTER in the test) takes the requests and then either
closes its socket (a killed process) or stays silent (SIGSTOP): the router must end the
requests with that reason within a few seconds, not at its timeout; and so must a real served
engine that is SIGSTOPped or killed.

Issue 25: one engine step held the request socket for 2.9-12 s, longer than the ping deadline,
and `route` declared live servers dead. The socket's own thread now answers pings: an engine
whose steps outlast the deadline many times over is busy, and its requests complete.
"""

from __future__ import annotations

import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator

import pytest
import zmq

from examples.engine import Engine, EngineConfig, RequestOutput
from examples.engine_client import EngineClient
from examples.engine_loop import EngineLoop, Pong, Submit, command_decoder, event_decoder
from examples.request_socket import SocketTransport
from examples.router import InProcessEngine, ToyRouter
from examples.server import connector_config
from worker.fake import FakeFabric, FakeNixl

TIMEOUT_S = 30.0
SLOW_STEP_S = 1.5  # each prefill step: 3x the ping deadline below
PING_AFTER_S = 0.05
DEAD_AFTER_S = 0.5


class StandInServer:
    """A request socket that receives submits and never answers them."""

    def __init__(self) -> None:
        self.socket: zmq.Socket = zmq.Context.instance().socket(zmq.ROUTER)
        self.socket.setsockopt(zmq.LINGER, 0)
        self.socket.bind("tcp://127.0.0.1:*")
        self.port = int(self.socket.getsockopt_string(zmq.LAST_ENDPOINT).rsplit(":", 1)[1])
        self.num_submits = 0

    def drain(self) -> None:
        while not self.socket.closed and self.socket.poll(0):
            frames = self.socket.recv_multipart()
            if isinstance(command_decoder.decode(frames[-1]), Submit):
                self.num_submits += 1

    def close(self) -> None:
        if not self.socket.closed:
            self.socket.close(linger=0)


@pytest.mark.parametrize(
    ("fault", "match"),
    [
        pytest.param("killed", r"prefill: the server at 127.0.0.1:\d+ closed the connection", id="killed"),
        pytest.param("stopped", r"prefill: the server at 127.0.0.1:\d+ stopped answering: no reply to a ping within 1.0 s", id="stopped"),
    ],
)  # fmt: skip
def test_router_ends_requests_of_a_dead_prefill_with_the_reason(fault: str, match: str) -> None:
    server = StandInServer()
    client = EngineClient("127.0.0.1", server.port, ping_after_s=0.2, dead_after_s=1.0)
    decode = InProcessEngine(Engine(EngineConfig("decode-stand-in")))
    router = ToyRouter(client, decode)

    def fault_after_submits() -> float:  # the router's clock: runs the stand-in between polls
        server.drain()
        if fault == "killed" and server.num_submits == 3:
            server.close()
            server.num_submits = -1  # close once
        return time.monotonic()

    router.clock = fault_after_submits
    try:
        start_s = time.monotonic()
        completions = router.run({f"r{i}": [1, 2, 3] for i in range(3)}, 2, timeout_s=TIMEOUT_S)
        elapsed_s = time.monotonic() - start_s
    finally:
        client.close()
        server.close()
    assert elapsed_s < 10.0
    for completion in completions.values():
        assert len(completion.errors) == 1, completion.errors
        assert re.search(match, completion.errors[0]), completion.errors
    assert list(router.problems) == ["prefill"]


class SlowEngine(Engine):
    """An engine whose every step first burns SLOW_STEP_S of CPU, holding the GIL as the
    model's Python does (the issue's 150 x 256-token step took 12 s)."""

    def step(self) -> list[RequestOutput]:
        end_s = time.monotonic() + SLOW_STEP_S
        while time.monotonic() < end_s:
            pass
        return super().step()


class ServedEngine:
    """An engine on the real request socket, its loop on a thread, as `nixl-pd serve` runs."""

    def __init__(self, engine: Engine) -> None:
        self.transport = SocketTransport("127.0.0.1", 0)
        self.port = self.transport.port
        self.stop = threading.Event()
        loop = EngineLoop(engine, self.transport)
        self.thread = threading.Thread(target=loop.serve, args=(self.stop,), name="engine-loop")
        self.thread.start()

    def close(self) -> None:
        self.stop.set()
        self.thread.join(SLOW_STEP_S + 10.0)
        self.transport.close()


def test_the_socket_thread_answers_a_ping_while_the_loop_never_turns() -> None:
    """No engine loop at all (as mid-step): the ping is still answered, within a second."""
    transport = SocketTransport("127.0.0.1", 0)
    client = zmq.Context.instance().socket(zmq.DEALER)
    client.setsockopt(zmq.LINGER, 0)
    try:
        client.connect(f"tcp://127.0.0.1:{transport.port}")
        client.send(b'{"type": "ping"}')
        assert client.poll(1000), "no pong within 1 s"
        assert event_decoder.decode(client.recv()) == Pong()
        client.send(b'{"type": "get_info"}')  # the loop's: relayed, not answered by the thread
        messages = transport.receive(1.0)
        assert messages is not None and [payload for payload, _ in messages] == [
            b'{"type": "get_info"}'
        ]
    finally:
        client.close(linger=0)
        transport.close()


def test_a_prefill_whose_steps_outlast_the_ping_deadline_is_busy_not_dead() -> None:
    fabric = FakeFabric()
    engines = [
        kind(
            EngineConfig(f"{role}-slow", role=role),
            connector_config=connector_config(),
            agent_factory=lambda name: FakeNixl(name, fabric),
        )
        for kind, role in ((SlowEngine, "prefill"), (Engine, "decode"))
    ]
    served = ServedEngine(engines[0])
    client = EngineClient(
        "127.0.0.1", served.port, ping_after_s=PING_AFTER_S, dead_after_s=DEAD_AFTER_S
    )
    try:
        router = ToyRouter(client, InProcessEngine(engines[1]))
        start_s = time.monotonic()
        completions = router.run({f"r{i}": [1, 2, 3, i] for i in range(3)}, 2, timeout_s=TIMEOUT_S)
        elapsed_s = time.monotonic() - start_s
    finally:
        client.close()
        served.close()
        for engine in engines:
            engine.shutdown()
    assert router.problems == {}
    assert [c.errors for c in completions.values()] == [[], [], []]
    assert all(len(c.token_ids) == 3 for c in completions.values())
    assert elapsed_s > SLOW_STEP_S > 2 * DEAD_AFTER_S  # a step really outlasted the deadline


SERVER_SCRIPT = """
import sys, threading
from examples.engine import Engine, EngineConfig
from examples.engine_loop import EngineLoop
from examples.request_socket import SocketTransport
transport = SocketTransport("127.0.0.1", 0)
print(transport.port, flush=True)
stop = threading.Event()
threading.Thread(target=lambda: (sys.stdin.read(), stop.set()), daemon=True).start()
EngineLoop(Engine(EngineConfig("served")), transport).serve(stop)
transport.close()
"""


@pytest.fixture
def server_process() -> Iterator[tuple[subprocess.Popen[str], int]]:
    """A served engine in its own process (so SIGSTOP stops every thread of it); stopped at
    the end whatever state the test left it in."""
    process = subprocess.Popen(
        [sys.executable, "-c", SERVER_SCRIPT],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert process.stdout is not None
        yield process, int(process.stdout.readline())
    finally:
        process.send_signal(signal.SIGCONT)
        process.kill()
        process.wait(10.0)


@pytest.mark.parametrize(
    ("fault", "match"),
    [
        pytest.param(signal.SIGKILL, r"prefill: the server at 127.0.0.1:\d+ closed the connection", id="killed"),
        pytest.param(signal.SIGSTOP, r"prefill: the server at 127.0.0.1:\d+ stopped answering: no reply to a ping within 0.5 s", id="stopped"),
    ],
)  # fmt: skip
def test_a_really_stopped_or_killed_server_is_still_declared_dead(
    server_process: tuple[subprocess.Popen[str], int], fault: signal.Signals, match: str
) -> None:
    process, port = server_process
    client = EngineClient("127.0.0.1", port, ping_after_s=PING_AFTER_S, dead_after_s=DEAD_AFTER_S)
    decode = InProcessEngine(Engine(EngineConfig("decode-stand-in")))
    try:
        client.info(10.0)  # connected, and it answers
        process.send_signal(fault)
        start_s = time.monotonic()
        completions = ToyRouter(client, decode).run({"r0": [1, 2, 3]}, 2, timeout_s=TIMEOUT_S)
        elapsed_s = time.monotonic() - start_s
    finally:
        client.close()
    assert elapsed_s < 5.0
    [completion] = completions.values()
    assert len(completion.errors) == 1 and re.search(match, completion.errors[0]), completion.errors
