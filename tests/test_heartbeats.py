"""Decode's lease heartbeats: when they are due, that they reach prefill, and that they never block."""

from __future__ import annotations

import logging
import socket
import threading
import time
from collections.abc import Callable, Iterator, Sequence

import pytest

from connector.config import ConnectorConfig
from connector.errors import HandshakeError
from connector.metadata import ConnectorMetadata, SideChannelBoot
from connector.net.side_channel_client import send_heartbeat, send_release
from connector.protocol import lease_key
from scheduler.connector import FinishedRequests, RequestInfo, Role, SchedulerConnector
from scheduler.heartbeats import (
    MAX_BACKOFF_S,
    MAX_MESSAGE_TIMEOUT_S,
    Backoff,
    BootIds,
    HeartbeatSender,
)
from scheduler.side_channel import SideChannelServer
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
from tests.test_side_channel import restart_on_port


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
    assert heartbeats.beat_if_due() == 0
    clock.advance(0.1)
    assert heartbeats.beat_if_due() == 2
    assert heartbeats.sent == [
        ("prefill-0", "127.0.0.1", 5600, ("p1",)),
        ("prefill-0", "127.0.0.2", 5600, ("q7",)),
    ]
    decode.update_connector_output(all_ranks(finished_recving=("d1",)))
    decode.request_finished(other, ((),))
    clock.advance(HEARTBEAT_S)
    assert heartbeats.beat_if_due() == 0
    assert len(heartbeats.sent) == 2  # nothing waits any more


def test_decode_heartbeats_reach_the_prefill_side_channel(
    served_prefill: SchedulerConnector, clock: FakeClock
) -> None:
    """Decode's real sender thread keeps prefill's lease alive across several lease lengths
    while the engine steps (a step a lease: heartbeats never wait for one)."""
    delivered = threading.Event()

    def send(destination: SideChannelBoot, ids: Sequence[str]) -> object:
        engine_id, host, port, _ = destination
        held = send_heartbeat(host, port, ids, engine_id=engine_id, secret=None, timeout_s=2.0)
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


@pytest.mark.parametrize(
    ("send", "kind"),
    [(send_heartbeat, "heartbeat"), (send_release, "release")],
    ids=["heartbeat", "release"],
)
def test_a_message_for_an_engine_that_restarted_away_leaves_the_lease_alone(
    served_prefill: SchedulerConnector, clock: FakeClock, send: Callable[..., int], kind: str
) -> None:
    # A late message for the engine that served this host:port before a restart, whose
    # request ids repeat here: refused naming both engines, and p1's lease is untouched.
    served_prefill.request_finished(prefill_request(), ((1,),))
    served_prefill.build_connector_meta()
    clock.advance(LEASE_S - 1.0)
    port = served_prefill.side_channel_port
    with pytest.raises(
        HandshakeError,
        match=f"{kind} for prefill engine 'prefill-old' reached engine 'prefill-0' at this "
        "host:port: that engine restarted",
    ):
        send("127.0.0.1", port, ["p1"], engine_id="prefill-old", secret=None, timeout_s=2.0)
    assert served_prefill.build_connector_meta() == ConnectorMetadata()  # not released
    clock.advance(1.0)  # not extended either: the lease ends when it always would have
    served_prefill.update_connector_output([])
    assert served_prefill.take_finished() == FinishedRequests(finished_sending=("p1",))


def test_heartbeat_failures_are_logged_not_raised(caplog: pytest.LogCaptureFixture) -> None:
    attempted = threading.Event()

    def send(destination: SideChannelBoot, ids: Sequence[str]) -> object:
        attempted.set()
        raise HandshakeError("side channel 127.0.0.9:1 did not answer")

    sender = HeartbeatSender(secret=None, timeout_s=1.0, send=send)
    with caplog.at_level(logging.WARNING):
        assert sender.submit(SideChannelBoot("e", "127.0.0.9", 1), ["p1"])
        assert attempted.wait(5.0)
        sender.stop()
    assert (
        "side-channel message to engine 'e' at 127.0.0.9:1 failed: side channel 127.0.0.9:1 "
        "did not answer; skipping messages to it for 1.0 s" in caplog.text
    )


def test_a_full_heartbeat_queue_drops_instead_of_blocking() -> None:
    sending = threading.Event()  # the sender thread is busy with the first heartbeat
    release = threading.Event()

    def send(destination: SideChannelBoot, ids: Sequence[str]) -> object:
        sending.set()
        return release.wait(5.0)

    sender = HeartbeatSender(secret=None, timeout_s=1.0, max_queued=1, send=send)
    try:
        assert sender.submit(SideChannelBoot("e", "h", 1), ["first"])
        assert sending.wait(5.0)
        assert sender.submit(SideChannelBoot("e", "h", 1), ["queued"])
        started_s = time.monotonic()
        assert not sender.submit(SideChannelBoot("e", "h", 1), ["dropped"])
        assert time.monotonic() - started_s < 0.5
    finally:
        release.set()
        sender.stop()


def test_engines_sharing_an_address_get_one_heartbeat_each(
    decode: SchedulerConnector, clock: FakeClock, heartbeats: RecordingHeartbeats
) -> None:
    # A load still waiting on an engine that restarted, and one from the engine now there: each
    # side channel extends only its own ids, so they must not share one heartbeat.
    decode.get_num_new_matched_tokens(decode_request("d1", remote_engine_id="prefill-old"), 0)
    decode.get_num_new_matched_tokens(decode_request("d2", remote_request_id="p2"), 0)
    clock.advance(HEARTBEAT_S)
    assert heartbeats.beat_if_due() == 2
    assert heartbeats.sent == [
        ("prefill-0", "127.0.0.1", 5600, ("p2",)),
        ("prefill-old", "127.0.0.1", 5600, ("p1",)),
    ]


# ---- backing off from a failing side channel ----

OLD = SideChannelBoot("prefill-old", "127.0.0.1", 5600)
NEW = SideChannelBoot("prefill-new", "127.0.0.1", 5600)  # restarted on OLD's address


@pytest.mark.parametrize(
    ("failure_times_s", "expected_windows_s"),
    [
        ((0.0,), (1.0,)),
        ((0.0, 1.0, 3.0, 7.0, 15.0, 25.0, 35.0), (1.0, 2.0, 4.0, 8.0, 10.0, 10.0, 10.0)),
        ((0.0, 1.0 + MAX_BACKOFF_S), (1.0, 1.0)),
    ],
    ids=["a first failure", "failures double the window up to the cap", "a long quiet forgets"],
)
def test_backoff_windows(
    failure_times_s: tuple[float, ...], expected_windows_s: tuple[float, ...]
) -> None:
    backoff = Backoff(initial_s=1.0, max_s=MAX_BACKOFF_S)
    windows_s = tuple(backoff.failed(OLD, now)[0] for now in failure_times_s)
    assert windows_s == expected_windows_s
    last_s = failure_times_s[-1]
    assert backoff.should_skip(OLD, last_s + windows_s[-1] - 0.01)
    assert not backoff.should_skip(OLD, last_s + windows_s[-1])
    assert not backoff.should_skip(NEW, last_s)  # another engine on the same address


def test_backoff_counts_skips_and_a_success_resets_it() -> None:
    backoff = Backoff(initial_s=1.0, max_s=MAX_BACKOFF_S)
    assert backoff.succeeded(OLD) is None  # never failed
    backoff.failed(OLD, 0.0)
    assert [backoff.should_skip(OLD, now) for now in (0.1, 0.5, 2.0)] == [True, True, False]
    assert backoff.failed(OLD, 2.0) == (2.0, 2)  # doubled; two skipped in the first window
    assert backoff.succeeded(OLD) == 0
    assert len(backoff) == 0
    assert backoff.failed(OLD, 3.0) == (1.0, 0)


class FakeSideChannels:
    """Stands in for the network: records each attempt; engines in ``dead`` fail."""

    MARKER = SideChannelBoot("marker", "127.0.0.1", 1)

    def __init__(self) -> None:
        self.attempts: list[str] = []  # engine ids, in order; appended by the sender thread
        self.dead: set[str] = set()
        self._marker_seen = threading.Event()

    def __call__(self, destination: SideChannelBoot, ids: Sequence[str]) -> object:
        engine_id, host, port, _ = destination
        if engine_id == self.MARKER.engine_id:
            self._marker_seen.set()
            return 0
        self.attempts.append(engine_id)
        if engine_id in self.dead:
            raise HandshakeError(f"side channel {host}:{port} did not answer within 0.5 s")
        return len(ids)

    def drain(self, sender: HeartbeatSender) -> None:
        """Wait until the sender handled everything submitted so far (the queue is FIFO)."""
        self._marker_seen.clear()
        assert sender.submit(self.MARKER, ["m"])
        assert self._marker_seen.wait(5.0)


def submit(sender: HeartbeatSender, destination: SideChannelBoot, num_messages: int) -> None:
    for index in range(num_messages):
        ids = [f"r{index}"]
        assert sender.submit(destination, ids)


def test_a_failing_engine_is_skipped_until_its_window_ends_and_a_success_resets_it(
    caplog: pytest.LogCaptureFixture,
) -> None:
    clock = FakeClock()
    sides = FakeSideChannels()
    sender = HeartbeatSender(secret=None, timeout_s=0.5, send=sides, clock=clock)
    sides.dead.add(OLD.engine_id)
    try:
        with caplog.at_level(logging.INFO, logger="scheduler.heartbeats"):
            submit(sender, OLD, 3)
            submit(sender, NEW, 1)  # same address, other engine: not skipped
            sides.drain(sender)
            assert (sides.attempts, sender.num_skipped) == (["prefill-old", "prefill-new"], 2)
            clock.advance(1.0)  # max(0.5 s timeout, 1 s): the first window ends
            submit(sender, OLD, 2)
            sides.drain(sender)
            assert (sides.attempts[2:], sender.num_skipped) == (["prefill-old"], 3)
            clock.advance(2.0)  # the doubled window ends; the engine is back
            sides.dead.clear()
            submit(sender, OLD, 2)
            sides.drain(sender)
            assert (sides.attempts[3:], sender.num_skipped) == (["prefill-old"] * 2, 3)
            sides.dead.add(OLD.engine_id)  # fails again: the window starts over at 1 s
            submit(sender, OLD, 1)
            sides.drain(sender)
    finally:
        sender.stop()
    lines = [r.getMessage() for r in caplog.records if r.name == "scheduler.heartbeats"]
    assert [line.split(" failed: ")[-1].split("; ")[-1] for line in lines] == [
        "skipping messages to it for 1.0 s",
        "skipping messages to it for 2.0 s (2 message(s) skipped while it was backing off)",
        "side channel of engine 'prefill-old' at 127.0.0.1:5600 answers again "
        "(1 message(s) skipped while it was backing off)",
        "skipping messages to it for 1.0 s",
    ]


def test_a_dead_side_channel_delays_a_live_one_by_one_short_timeout_at_most(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """With the default 10 s handshake timeout, three releases to a dead prefill once cost 30 s
    before a live prefill's heartbeat went out; now one capped timeout, then they are skipped."""
    delivered = threading.Event()

    def on_heartbeat(ids: tuple[str, ...]) -> int:
        delivered.set()
        return len(ids)

    live = SideChannelServer(
        "127.0.0.1", 0, {}, engine_id="prefill-live", on_heartbeat=on_heartbeat, on_release=len
    )
    live.start()
    with socket.socket() as probe:  # a port that was free a moment ago and has no listener
        probe.bind(("127.0.0.1", 0))
        dead_port = probe.getsockname()[1]
    sender = HeartbeatSender(secret=None, timeout_s=10.0, clock=FakeClock())
    try:
        with caplog.at_level(logging.WARNING, logger="scheduler.heartbeats"):
            started_s = time.monotonic()
            for index in range(3):
                sender.submit_release(
                    SideChannelBoot("dead", "127.0.0.1", dead_port), [f"r{index}"]
                )
            sender.submit(SideChannelBoot("prefill-live", "127.0.0.1", live.port), ["p1"])
            assert delivered.wait(15.0)
            elapsed_s = time.monotonic() - started_s
    finally:
        sender.stop()
        live.stop()
    assert MAX_MESSAGE_TIMEOUT_S <= elapsed_s < MAX_MESSAGE_TIMEOUT_S + 1.5
    assert sender.num_skipped == 2
    assert f"did not answer within {MAX_MESSAGE_TIMEOUT_S} s" in caplog.text


# ---- boot ids: a restarted prefill refuses what was meant for its previous boot ----

SECRET = "correct horse battery staple"


class Recorded:
    """Lease callbacks of one side-channel server; ``arrived`` is set on each heartbeat."""

    def __init__(self) -> None:
        self.heartbeats: list[tuple[str, ...]] = []
        self.arrived = threading.Event()

    def on_heartbeat(self, ids: tuple[str, ...]) -> int:
        self.heartbeats.append(ids)
        self.arrived.set()
        return len(ids)


def start_prefill_side_channel(recorded: Recorded, port: int = 0) -> SideChannelServer:
    server = SideChannelServer(
        "127.0.0.1",
        port,
        {handshake.tp_rank: handshake for handshake in handshakes()},
        engine_id="prefill-0",
        on_heartbeat=recorded.on_heartbeat,
        on_release=lambda ids: 0,
        secret=SECRET,
    )
    server.start()
    return server


def test_the_sender_learns_a_boot_id_and_a_restarted_engine_refuses_the_old_one() -> None:
    before, after = Recorded(), Recorded()
    server = start_prefill_side_channel(before)
    port = server.port
    prefill = SideChannelBoot("prefill-0", "127.0.0.1", port)
    sender = HeartbeatSender(secret=SECRET, timeout_s=2.0)
    try:
        assert sender.submit(prefill, ["p1"])
        assert before.arrived.wait(5.0)
        server.stop()
        server = restart_on_port(lambda port: start_prefill_side_channel(after, port), port)
        # p1 was leased by the previous boot: refused, and not backed off; p2 (asked after
        # the sender relearned the boot id) goes through at once.
        assert sender.submit(prefill, ["p1"])
        assert sender.submit(prefill, ["p2"])
        assert after.arrived.wait(5.0)
        assert (before.heartbeats, after.heartbeats) == ([("p1",)], [("p2",)])
        assert (server.num_refused, sender.num_stale, sender.num_skipped) == (1, 1, 0)
    finally:
        sender.stop()
        server.stop()


def test_releases_of_ids_never_leased_or_already_freed_are_stray_over_the_wire(
    served_prefill: SchedulerConnector, clock: FakeClock
) -> None:
    """Issue 11: a release naming a request id prefill never leased, or already released,
    frees nothing; another lease keeps its blocks."""
    served_prefill.request_finished(prefill_request("p1"), ((1,),))
    _, params = served_prefill.request_finished(prefill_request("p2"), ((2,),))
    assert params is not None
    p2 = lease_key("p2", params["remote_lease_id"])
    port = served_prefill.side_channel_port
    open_call: dict[str, object] = {"engine_id": "prefill-0", "secret": None, "timeout_s": 2.0}
    assert send_release("127.0.0.1", port, [p2], **open_call) == 1  # type: ignore[arg-type]
    assert send_release("127.0.0.1", port, [p2, "never"], **open_call) == 0  # type: ignore[arg-type]
    assert send_heartbeat("127.0.0.1", port, [p2, "never"], **open_call) == 0  # type: ignore[arg-type]
    served_prefill.update_connector_output([])
    assert served_prefill.take_finished() == FinishedRequests(finished_sending=("p2",))
    clock.advance(LEASE_S - 1.0)  # p1 still held, until its own lease ends
    served_prefill.update_connector_output([])
    assert served_prefill.take_finished() == NO_FINISHED
    clock.advance(1.0)
    served_prefill.update_connector_output([])
    assert served_prefill.take_finished() == FinishedRequests(finished_sending=("p1",))


def test_boot_ids_are_remembered_per_destination_and_bounded() -> None:
    boot_ids = BootIds(max_destinations=2)
    first, second, third = (SideChannelBoot("prefill-0", "127.0.0.1", port) for port in (1, 2, 3))
    boot_ids.learned(first, "a")
    boot_ids.learned(second, "b")
    boot_ids.learned(first, "a2")  # relearned: now the newest
    boot_ids.learned(third, "c")  # the oldest (second) is forgotten
    assert [boot_ids.get(d) for d in (first, second, third)] == ["a2", None, "c"]
    boot_ids.forget(third)
    assert boot_ids.get(third) is None and len(boot_ids) == 1
