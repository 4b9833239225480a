"""Decode's heartbeats run on the sender thread's own timer, not on the engine thread's hooks.

A long step, a GC pause or a loaded host must not let a live decode's leases expire; a claimed
request (params unread until allocation) keeps its lease while it waits for blocks; a request
that leaves the heartbeating states by any way stops being heartbeated; and an engine thread
wedged past the limit (decode's kv_lease_duration) stops vouching for its leases.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import pytest

from connector.config import ConnectorConfig
from connector.metadata import FailureKind, SideChannelBoot
from connector.net.side_channel_client import send_heartbeat
from scheduler.connector import RequestInfo, Role, SchedulerConnector
from scheduler.heartbeats import HeartbeatSender
from tests.scheduler_helpers import (
    ABORTED,
    DENSE,
    HEARTBEAT_S,
    LEASE_S,
    FakeClock,
    RecordingHeartbeats,
    all_ranks,
    decode_request,
    failure,
    handshakes,
    make_decode,
    prefill_request,
    start_load,
)


class Delivered:
    """A SendFn over the network that counts the heartbeats prefill answered."""

    def __init__(self) -> None:
        self._count = 0
        self._changed = threading.Condition()  # guards _count

    def __call__(self, destination: SideChannelBoot, ids: Sequence[str]) -> object:
        engine_id, host, port, boot_id = destination
        held = send_heartbeat(
            host,
            port,
            ids,
            engine_id=engine_id,
            boot_id=boot_id or None,
            secret=None,
            timeout_s=2.0,
        )
        with self._changed:
            self._count += 1
            self._changed.notify_all()
        return held

    def wait_for(self, count: int, timeout_s: float = 15.0) -> bool:
        """True once ``count`` heartbeats were answered (the sender thread polls every 0.1 s;
        the bound is for a loaded 2-core CI host, where one round trip took over 5 s once)."""
        with self._changed:
            return self._changed.wait_for(lambda: self._count >= count, timeout_s)


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def prefill(clock: FakeClock) -> Iterator[SchedulerConnector]:
    config = ConnectorConfig(side_channel_port=0, kv_lease_duration_s=LEASE_S)
    connector = SchedulerConnector(
        config, engine_id="prefill-0", role=Role.PRODUCER, spec=DENSE, tp_size=1, clock=clock
    )
    connector.start_side_channel(handshakes(tp_size=1))
    yield connector
    connector.shutdown()


def leased(prefill: SchedulerConnector, request_id: str = "p1") -> dict[str, Any]:
    _, params = prefill.request_finished(prefill_request(request_id), ((1, 2, 3),))
    assert params is not None
    return params


def freed(prefill: SchedulerConnector) -> tuple[str, ...]:
    """The prefill requests whose blocks prefill freed since the last call."""
    prefill.update_connector_output([])
    return prefill.take_finished().finished_sending


def test_a_lease_outlives_its_length_while_the_engine_thread_runs_no_hook(
    prefill: SchedulerConnector, clock: FakeClock
) -> None:
    """The engine thread steps once, then is stuck in a long step: no hook runs for 30 s, a
    whole lease, and the sender thread's own timer keeps prefill's lease alive throughout.
    Before the timer, heartbeats went out from build_connector_meta only: none was sent."""
    delivered = Delivered()
    sender = HeartbeatSender(secret=None, timeout_s=2.0, send=delivered)
    decode = make_decode(clock, sender, tp_size=1)
    try:
        decode.get_num_new_matched_tokens(RequestInfo("d1", 40, leased(prefill)), 0)
        decode.build_connector_meta()  # the engine's last hook for a while
        num_intervals = int(LEASE_S / HEARTBEAT_S)
        for interval in range(1, num_intervals + 1):
            clock.advance(HEARTBEAT_S)
            assert delivered.wait_for(interval), f"no heartbeat in interval {interval}"
        clock.advance(HEARTBEAT_S - 0.1)  # past the lease's first end
        assert freed(prefill) == ()
    finally:
        decode.shutdown()


def test_a_claimed_request_keeps_its_lease_while_it_waits_for_blocks(
    prefill: SchedulerConnector, clock: FakeClock
) -> None:
    """vLLM's way (params bound at allocation): a claim waits unallocated for two leases while
    the engine steps; its raw params are read on the sender thread and its lease heartbeated.
    Before, a claim was not heartbeated and prefill freed its blocks after one lease."""
    delivered = Delivered()
    sender = HeartbeatSender(secret=None, timeout_s=2.0, send=delivered)
    decode = make_decode(clock, sender, tp_size=1)
    request = RequestInfo("d1", 40, leased(prefill))
    try:
        assert decode.get_num_new_matched_tokens(request, 0) == (40, True)
        num_intervals = int(2 * LEASE_S / HEARTBEAT_S)
        for interval in range(1, num_intervals + 1):
            clock.advance(HEARTBEAT_S)
            decode.build_connector_meta()  # the engine steps; no block frees up for d1
            assert delivered.wait_for(interval), f"no heartbeat in interval {interval}"
            assert freed(prefill) == ()
        decode.update_state_after_alloc(request, ((10, 11, 12),), 40)
        assert len(decode.build_connector_meta().loads) == 1  # allocated at last: it loads
    finally:
        decode.shutdown()


def test_claimed_params_that_do_not_validate_are_not_heartbeated(clock: FakeClock) -> None:
    heartbeats = RecordingHeartbeats()
    decode = make_decode(clock, heartbeats, tp_size=1)
    good, bad = decode_request("d1"), decode_request("d2", remote_request_id="p2", remote_port=-1)
    for request in (good, bad):
        assert decode.get_num_new_matched_tokens(request, 0) == (40, True)  # claimed, unread
    clock.advance(HEARTBEAT_S)
    assert heartbeats.beat_if_due() == 1
    assert heartbeats.sent == [("prefill-0", "127.0.0.1", 5600, ("p1",))]
    decode.update_state_after_alloc(bad, ((10, 11, 12),), 40)  # the allocation's parse refuses
    refused = decode.take_refused()["d2"]
    assert refused.kind is FailureKind.PARAMS and "remote_port" in refused.message


# ---- every way out of the heartbeating states ----

Steps = Callable[[SchedulerConnector, RequestInfo], None]


def _load_succeeded(decode: SchedulerConnector, request: RequestInfo) -> None:
    start_load(decode, request)
    decode.update_connector_output(all_ranks(1, finished_recving=(request.request_id,)))


def _load_failed(decode: SchedulerConnector, request: RequestInfo) -> None:
    start_load(decode, request)
    decode.update_connector_output(
        all_ranks(1, failed_recving={request.request_id: failure("boom")})
    )


def _aborted_while_loading(decode: SchedulerConnector, request: RequestInfo) -> None:
    start_load(decode, request)
    assert decode.request_finished(request, ((10, 11, 12),)) == (True, None)  # DRAINING
    decode.update_connector_output(all_ranks(1, failed_recving={request.request_id: ABORTED}))


def _aborted_after_allocation(decode: SchedulerConnector, request: RequestInfo) -> None:
    decode.get_num_new_matched_tokens(request, 16)
    decode.update_state_after_alloc(request, ((10, 11, 12),), 24)
    decode.request_finished(request, ((10, 11, 12),))
    releases = decode.build_connector_meta().releases
    decode.update_connector_output(all_ranks(1, finished_recving=(releases[0].request_id,)))


def _aborted_before_allocation(decode: SchedulerConnector, request: RequestInfo) -> None:
    decode.get_num_new_matched_tokens(request, 16)
    decode.request_finished(request, ((),))


def _nothing_to_load_at_allocation(decode: SchedulerConnector, request: RequestInfo) -> None:
    decode.get_num_new_matched_tokens(request, 16)
    decode.update_state_after_alloc(request, ((10, 11, 12),), 0)


def _unplannable(decode: SchedulerConnector, request: RequestInfo) -> None:
    decode.get_num_new_matched_tokens(request, 0)
    decode.update_state_after_alloc(request, ((10,),), 40)  # one block for 40 tokens
    decode.build_connector_meta()  # fails it at once, releasing prefill
    decode.update_connector_output([])
    assert request.request_id in decode.take_finished().failed_recving


def _claim_aborted_while_waiting(decode: SchedulerConnector, request: RequestInfo) -> None:
    aborted = RequestInfo(request.request_id, 40, request.kv_transfer_params, aborted=True)
    assert decode.request_finished(aborted, ((),)) == (False, None)


def _claim_refused_at_allocation(decode: SchedulerConnector, request: RequestInfo) -> None:
    # Another connector edited the params in between: two cache groups for a one-group engine.
    edited = decode_request(request.request_id, remote_block_ids=[[1], [2]])
    decode.update_state_after_alloc(edited, ((10, 11, 12),), 24)
    assert request.request_id in decode.take_refused()


EXITS: dict[str, Steps] = {  # the way out
    "loaded": _load_succeeded,
    "load failed on the ranks": _load_failed,
    "aborted while loading, then drained": _aborted_while_loading,
    "aborted after allocation, before its load": _aborted_after_allocation,
    "aborted before allocation": _aborted_before_allocation,
    "the engine loads nothing after all": _nothing_to_load_at_allocation,
    "unplannable": _unplannable,
    "claimed, aborted while waiting for blocks": _claim_aborted_while_waiting,
    "claimed, refused at allocation": _claim_refused_at_allocation,
}


@pytest.mark.parametrize("way_out", EXITS.values(), ids=EXITS.keys())
def test_a_request_that_leaves_the_heartbeating_states_is_heartbeated_no_more(
    clock: FakeClock, way_out: Steps
) -> None:
    heartbeats = RecordingHeartbeats()
    decode = make_decode(clock, heartbeats, tp_size=1)
    waits = decode_request("d0", remote_request_id="p0")  # stays, so heartbeats keep going
    request = decode_request("d1")
    for asked in (waits, request):
        assert decode.get_num_new_matched_tokens(asked, 16) == (24, True)
    clock.advance(HEARTBEAT_S)
    decode.build_connector_meta()
    assert heartbeats.beat_if_due() == 1  # the control: d1 is heartbeated before it leaves
    assert heartbeats.sent == [("prefill-0", "127.0.0.1", 5600, ("p0", "p1"))]
    way_out(decode, request)
    clock.advance(HEARTBEAT_S)
    decode.build_connector_meta()
    assert heartbeats.beat_if_due() == 1
    assert heartbeats.sent[1:] == [("prefill-0", "127.0.0.1", 5600, ("p0",))]


# ---- a wedged engine thread ----

REGISTRY_LOG = "scheduler.heartbeats"


def test_heartbeats_pause_while_the_engine_thread_is_wedged_past_the_limit(
    clock: FakeClock, caplog: pytest.LogCaptureFixture
) -> None:
    """Limit: decode's kv_lease_duration (30 s). Within it heartbeats go out with no hook; past
    it they pause (prefill ends the leases one lease later) and resume once the engine steps."""
    heartbeats = RecordingHeartbeats()
    decode = make_decode(clock, heartbeats)
    decode.get_num_new_matched_tokens(decode_request("d1"), 16)
    decode.build_connector_meta()
    beats = []
    with caplog.at_level(logging.INFO, logger=REGISTRY_LOG):
        for _ in range(int(LEASE_S / HEARTBEAT_S) + 2):  # 5 s .. 40 s without a step
            clock.advance(HEARTBEAT_S)
            beats.append(heartbeats.beat_if_due())
        decode.build_connector_meta()  # the engine steps again
        clock.advance(HEARTBEAT_S)
        beats.append(heartbeats.beat_if_due())
    assert beats == [1, 1, 1, 1, 1, 1, 0, 0, 1]  # 30 s is within the limit, 35 s is past it
    assert [r.getMessage() for r in caplog.records if r.name == REGISTRY_LOG] == [
        "decode's engine thread has run no step for 35.0 s (limit 30.0 s): not heartbeating "
        "its 1 lease(s) until it steps again; prefill ends them when they expire",
        "decode's engine thread steps again; heartbeats resume",
    ]


def test_a_request_after_an_idle_spell_is_not_taken_for_a_wedged_engine(
    clock: FakeClock, caplog: pytest.LogCaptureFixture
) -> None:
    """An engine idle for minutes (no request, no step) then gets one: the sender may poll
    between the ask and the step that follows it, and must not pause its heartbeats then."""
    heartbeats = RecordingHeartbeats()
    decode = make_decode(clock, heartbeats)
    clock.advance(10 * LEASE_S)
    decode.get_num_new_matched_tokens(decode_request("d1"), 16)
    with caplog.at_level(logging.INFO, logger=REGISTRY_LOG):
        assert heartbeats.beat_if_due() == 1  # due since long ago; the ask shows a live engine
        clock.advance(HEARTBEAT_S)
        assert heartbeats.beat_if_due() == 1
    assert [r for r in caplog.records if r.name == REGISTRY_LOG] == []


def test_prefill_frees_a_wedged_decodes_blocks_one_lease_after_the_limit(
    prefill: SchedulerConnector, clock: FakeClock
) -> None:
    """Over the network: heartbeats while the engine thread is wedged up to the limit, none
    after, and prefill frees the blocks when the last heartbeat's lease runs out."""
    delivered = Delivered()
    sender = HeartbeatSender(secret=None, timeout_s=2.0, send=delivered)
    decode = make_decode(clock, sender, tp_size=1)
    try:
        decode.get_num_new_matched_tokens(RequestInfo("d1", 40, leased(prefill)), 0)
        decode.build_connector_meta()  # its last step
        num_intervals = int(LEASE_S / HEARTBEAT_S)  # the limit: decode's own lease
        for interval in range(1, num_intervals + 1):
            clock.advance(HEARTBEAT_S)
            assert delivered.wait_for(interval)
        clock.advance(LEASE_S - 1.0)  # the sender polls on, wedged: no heartbeat
        assert not delivered.wait_for(num_intervals + 1, timeout_s=0.5)
        assert freed(prefill) == ()
        clock.advance(1.0)  # the last heartbeat's lease ends
        assert freed(prefill) == ("p1",)
    finally:
        decode.shutdown()
