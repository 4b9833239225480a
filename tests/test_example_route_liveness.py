"""`nixl-pd route` reports a dead server as such (issue 11, finding 6).

Before, a killed or stopped server showed up only as "timed out after 60 s" on each request.
Here a stand-in server (a ZMQ ROUTER in the test) takes the requests and then either closes
its socket (a killed process) or stays silent (SIGSTOP): the router must end the requests
with that reason within a few seconds, not at its timeout.
"""

from __future__ import annotations

import re
import time

import pytest
import zmq

from examples.engine import Engine, EngineConfig
from examples.engine_client import EngineClient
from examples.engine_loop import Submit, command_decoder
from examples.router import InProcessEngine, ToyRouter

TIMEOUT_S = 30.0


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
