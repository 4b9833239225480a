"""Decode's lease heartbeats: when they are due, that they reach prefill, and that they never block."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterator, Sequence

import pytest

from connector.config import ConnectorConfig
from connector.errors import HandshakeError
from connector.side_channel_client import send_heartbeat
from scheduler.connector import RequestInfo, Role, SchedulerConnector
from scheduler.heartbeats import HeartbeatSender
from tests.scheduler_helpers import (
    DENSE,
    HEARTBEAT_S,
    LEASE_S,
    NO_FINISHED,
    FakeClock,
    RecordingHeartbeats,
    all_ranks,
    decode_request,
    handshakes,
    make_decode,
    prefill_request,
    start_load,
)


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def heartbeats() -> RecordingHeartbeats:
    return RecordingHeartbeats()


@pytest.fixture
def decode(clock: FakeClock, heartbeats: RecordingHeartbeats) -> Iterator[SchedulerConnector]:
    connector = make_decode(clock, heartbeats)
    yield connector
    connector.shutdown()


@pytest.fixture
def served_prefill(clock: FakeClock) -> Iterator[SchedulerConnector]:
    config = ConnectorConfig(side_channel_port=0, kv_lease_duration_s=LEASE_S)
    connector = SchedulerConnector(
        config, engine_id="prefill-0", role=Role.PRODUCER, spec=DENSE, tp_size=2, clock=clock
    )
    connector.start_side_channel(handshakes())
    yield connector
    connector.shutdown()


def test_heartbeats_go_to_each_prefill_engine_while_loads_wait(
    decode: SchedulerConnector, clock: FakeClock, heartbeats: RecordingHeartbeats
) -> None:
    start_load(decode, decode_request("d1"))
    other = decode_request("d2", remote_request_id="q7", remote_host="127.0.0.2")
    decode.get_num_new_matched_tokens(other, 0)  # waiting for blocks
    clock.advance(HEARTBEAT_S - 0.1)
    decode.build_connector_meta()
    assert heartbeats.sent == []
    clock.advance(0.1)
    decode.build_connector_meta()
    assert heartbeats.sent == [("127.0.0.1", 5600, ("p1",)), ("127.0.0.2", 5600, ("q7",))]
    decode.update_connector_output(all_ranks(finished_recving=("d1",)))
    decode.request_finished(other, ((),))
    clock.advance(HEARTBEAT_S)
    decode.build_connector_meta()
    assert len(heartbeats.sent) == 2  # nothing waits any more


def test_decode_heartbeats_reach_the_prefill_side_channel(
    served_prefill: SchedulerConnector, clock: FakeClock
) -> None:
    """Decode's real sender thread keeps prefill's lease alive across several lease lengths."""
    delivered = threading.Event()

    def send(host: str, port: int, ids: Sequence[str]) -> object:
        held = send_heartbeat(host, port, ids, secret=None, timeout_s=2.0)
        delivered.set()
        return held

    sender = HeartbeatSender(secret=None, timeout_s=2.0, send=send)
    decode = make_decode(clock, sender, tp_size=1)
    try:
        _, params = served_prefill.request_finished(prefill_request(), ((1, 2, 3),))
        assert params is not None
        decode.get_num_new_matched_tokens(RequestInfo("d1", 40, params), 0)
        for _ in range(4):  # 4 x 25 s: the lease would have lapsed without heartbeats
            clock.advance(25.0)
            delivered.clear()
            decode.build_connector_meta()
            assert delivered.wait(5.0)
            served_prefill.update_connector_output([])
            assert served_prefill.take_finished() == NO_FINISHED
    finally:
        decode.shutdown()


def test_heartbeat_failures_are_logged_not_raised(caplog: pytest.LogCaptureFixture) -> None:
    attempted = threading.Event()

    def send(host: str, port: int, ids: Sequence[str]) -> object:
        attempted.set()
        raise HandshakeError("side channel 127.0.0.9:1 did not answer")

    sender = HeartbeatSender(secret=None, timeout_s=1.0, send=send)
    with caplog.at_level(logging.WARNING):
        assert sender.submit("127.0.0.9", 1, ["p1"])
        assert attempted.wait(5.0)
        sender.stop()
    assert (
        "side-channel message to 127.0.0.9:1 failed: side channel 127.0.0.9:1 did not answer"
        in caplog.text
    )


def test_a_full_heartbeat_queue_drops_instead_of_blocking() -> None:
    sending = threading.Event()  # the sender thread is busy with the first heartbeat
    release = threading.Event()

    def send(host: str, port: int, ids: Sequence[str]) -> object:
        sending.set()
        return release.wait(5.0)

    sender = HeartbeatSender(secret=None, timeout_s=1.0, max_queued=1, send=send)
    try:
        assert sender.submit("h", 1, ["first"])
        assert sending.wait(5.0)
        assert sender.submit("h", 1, ["queued"])
        started_s = time.monotonic()
        assert not sender.submit("h", 1, ["dropped"])
        assert time.monotonic() - started_s < 0.5
    finally:
        release.set()
        sender.stop()
