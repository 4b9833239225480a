"""No lease expires on the holder's clock while its own side channel cannot read (issue 31).

In the run that failed 7 requests, prefill's engine thread expired six leases while prefill's
side-channel thread was in one 16.5 s turn: heartbeats that decode sent meanwhile could only
wait unread in its queue. Here prefill's serving thread is held inside its heartbeat callback
(the injected clock blocks when that thread reads it) while a heartbeat is in flight and the
lease falls due: the engine thread must not expire it while the serving thread is behind, the
heartbeat must then extend it, and a serving thread stuck for longer than a lease must not
pin the blocks forever.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest

from connector.config import ConnectorConfig
from connector.net.side_channel_client import send_heartbeat
from connector.protocol import lease_key
from scheduler.connector import FinishedRequests, Role, SchedulerConnector
from scheduler.producer import DEAF_AFTER_S
from scheduler.side_channel import SideChannelServer
from tests.scheduler_helpers import DENSE, NO_FINISHED, FakeClock, handshakes, prefill_request

HOST = "127.0.0.1"


class GatedClock(FakeClock):
    """A fake clock that the side channel's serving thread cannot read while ``gate`` is
    closed: it stops inside its callback, as a thread that gets no CPU or GIL would."""

    def __init__(self) -> None:
        super().__init__()
        self.gate = threading.Event()
        self.gate.set()
        self.held = threading.Event()  # the serving thread is waiting at the gate

    def __call__(self) -> float:
        if threading.current_thread().name.startswith("nixl-pd-side-channel"):
            self.held.set()
            self.gate.wait(30.0)
        return self.now_s


def served_prefill(clock: GatedClock, lease_s: float) -> SchedulerConnector:
    config = ConnectorConfig(side_channel_port=0, kv_lease_duration_s=lease_s)
    connector = SchedulerConnector(
        config, engine_id="prefill-0", role=Role.PRODUCER, spec=DENSE, tp_size=2, clock=clock
    )
    connector.start_side_channel(handshakes())
    return connector


@pytest.fixture
def clock() -> Iterator[GatedClock]:
    gated = GatedClock()
    yield gated
    gated.gate.set()  # never leave a serving thread waiting


def heartbeat_in_flight(connector: SchedulerConnector, key: str) -> tuple[threading.Thread, list]:
    """Send one heartbeat from a thread (its answer waits for the gate); returns the thread
    and the list its answer lands in."""
    answers: list[Any] = []

    def send() -> None:
        port = connector.side_channel_port
        answers.append(send_heartbeat(HOST, port, [key], engine_id="prefill-0", secret=None,
                                      timeout_s=20.0))  # fmt: skip

    thread = threading.Thread(target=send, daemon=True)
    thread.start()
    return thread, answers


def finished(connector: SchedulerConnector) -> FinishedRequests:
    connector.update_connector_output([])
    return connector.take_finished()


def test_a_lease_does_not_expire_while_the_side_channel_has_its_heartbeat_unread(
    clock: GatedClock,
) -> None:
    connector = served_prefill(clock, lease_s=30.0)
    try:
        _, params = connector.request_finished(prefill_request(), ((1,),))
        connector.build_connector_meta()
        assert params is not None
        clock.gate.clear()
        sender, answers = heartbeat_in_flight(
            connector, lease_key(params["remote_request_id"], params["remote_lease_id"])
        )
        assert clock.held.wait(10.0)  # the serving thread is stuck with the heartbeat
        clock.advance(31.0)  # the lease is due on the engine thread's clock
        time.sleep(DEAF_AFTER_S + 0.3)  # and the serving thread is behind by more than that

        assert finished(connector) == NO_FINISHED  # old code: expired here, p1 freed

        clock.gate.set()  # the serving thread reads the heartbeat: the lease runs to +30 s
        sender.join(20.0)
        assert answers == [1]
        clock.advance(29.0)
        assert finished(connector) == NO_FINISHED
        clock.advance(2.0)
        assert finished_within(connector, 20.0) == FinishedRequests(finished_sending=("p1",))
    finally:
        clock.gate.set()
        connector.shutdown()


def finished_within(connector: SchedulerConnector, timeout_s: float) -> FinishedRequests:
    """What finishes once the serving thread keeps up again: on a loaded machine it may lag
    over DEAF_AFTER_S in real time at any moment, and then, rightly, no lease expires."""
    deadline = time.monotonic() + timeout_s
    while (done := finished(connector)) == NO_FINISHED and time.monotonic() < deadline:
        time.sleep(0.05)
    return done


def test_a_side_channel_stuck_longer_than_a_lease_does_not_pin_the_blocks(
    clock: GatedClock,
) -> None:
    lease_s = 2.0
    connector = served_prefill(clock, lease_s=lease_s)
    try:
        _, params = connector.request_finished(prefill_request(), ((1,),))
        connector.build_connector_meta()
        assert params is not None
        clock.gate.clear()
        heartbeat_in_flight(connector, lease_key(params["remote_request_id"], "unknown"))
        assert clock.held.wait(10.0)
        clock.advance(lease_s + 1.0)
        time.sleep(DEAF_AFTER_S + 0.3)
        assert finished(connector) == NO_FINISHED  # deaf for ~1.3 s: not yet

        time.sleep(lease_s)  # deaf for longer than a lease: the lease ends anyway

        assert finished(connector) == FinishedRequests(finished_sending=("p1",))
    finally:
        clock.gate.set()
        connector.shutdown()


def test_lag_is_zero_unless_serving_and_small_while_the_serving_thread_keeps_up() -> None:
    server = SideChannelServer(
        HOST, 0, {}, engine_id="p", on_heartbeat=lambda keys: 0, on_release=lambda keys: 0
    )
    assert server.lag_s() == 0.0
    server.start()
    try:
        time.sleep(0.2)
        assert server.lag_s() < DEAF_AFTER_S / 2  # idle: a 50 ms poll per turn
    finally:
        server.stop()
    assert server.lag_s() == 0.0
