"""SchedulerConnector lifecycles with fabricated worker reports: prefill leases, decode loads."""

from __future__ import annotations

import logging
import re
from collections.abc import Iterator
from typing import Any

import msgspec
import pytest

from connector.config import ConnectorConfig
from connector.errors import UnsupportedConfiguration
from connector.metadata import ConnectorMetadata, FailureKind, LoadSpec, ReleaseSpec
from connector.net.side_channel_client import fetch_boot_id, send_heartbeat, send_release
from connector.protocol import WorkerHandshake, lease_key
from scheduler.connector import FinishedRequests, RequestInfo, Role, SchedulerConnector
from tests.scheduler_helpers import (
    ABORTED,
    CONFIG,
    DENSE,
    HYBRID,
    LEASE_S,
    NO_FINISHED,
    REMOTE,
    REMOTE_PARAMS,
    FakeClock,
    RecordingHeartbeats,
    all_ranks,
    decode_request,
    failure,
    handshakes,
    make_decode,
    prefill_request,
    prompt_ids,
    report,
    start_load,
)


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def heartbeats() -> RecordingHeartbeats:
    return RecordingHeartbeats()


@pytest.fixture
def prefill(clock: FakeClock) -> Iterator[SchedulerConnector]:
    connector = SchedulerConnector(
        CONFIG, engine_id="prefill-0", role=Role.PRODUCER, spec=DENSE, tp_size=2, clock=clock
    )
    yield connector
    connector.shutdown()


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


# ---------------------------------------------------------------- prefill (producer)


def key_of(params: dict[str, Any] | None) -> str:
    """The lease key prefill's ranks count free notifications by, for these params."""
    assert params is not None
    return lease_key(params["remote_request_id"], params["remote_lease_id"])


def test_prefill_lifecycle_reports_finished_sending_once_all_ranks_freed(
    prefill: SchedulerConnector,
) -> None:
    request = prefill_request()
    assert prefill.get_num_new_matched_tokens(request, 0) == (0, False)
    delay, params = prefill.request_finished(request, ((1, 2, 3),))
    assert delay is True and params is not None
    lease_id = params["remote_lease_id"]
    assert re.fullmatch("[0-9a-f]{16}", lease_id), lease_id  # random per lease
    assert params == {
        "do_remote_prefill": True,
        "do_remote_decode": False,
        "remote_engine_id": "prefill-0",
        "remote_request_id": "p1",
        "remote_block_ids": [[1, 2, 3]],
        "remote_host": "127.0.0.1",
        "remote_port": 5600,
        "tp_size": 2,
        "transfer_mode": "pull",
        "remote_num_tokens": 40,
        "remote_lease_id": lease_id,  # no remote_boot_id: this side channel never started
    }
    key = lease_key("p1", lease_id)  # the ranks count free notifications by lease key
    assert prefill.build_connector_meta() == ConnectorMetadata(sends=(key,))
    assert prefill.build_connector_meta() == ConnectorMetadata()
    prefill.update_connector_output([report(0, finished_sending=(key,)), report(1)])
    assert prefill.take_finished() == NO_FINISHED
    prefill.update_connector_output([report(1, finished_sending=(key,))])
    assert prefill.take_finished() == FinishedRequests(finished_sending=("p1",))
    prefill.update_connector_output(all_ranks(finished_sending=(key,)))
    assert prefill.take_finished() == NO_FINISHED


@pytest.mark.parametrize("role", [Role.PRODUCER, Role.CONSUMER, Role.BOTH])
def test_roles_are_advisory_as_in_vllm(
    clock: FakeClock, heartbeats: RecordingHeartbeats, role: Role
) -> None:
    connector = SchedulerConnector(
        CONFIG,
        engine_id="e",
        role=role,
        spec=DENSE,
        tp_size=1,
        clock=clock,
        heartbeat_sender=heartbeats,
    )
    prefill_side = prefill_request()
    assert connector.get_num_new_matched_tokens(prefill_side, 0) == (0, False)
    delay, params = connector.request_finished(prefill_side, ((1, 2),))
    assert delay is True and params is not None and params["remote_request_id"] == "p1"
    decode_side = decode_request()
    assert connector.get_num_new_matched_tokens(decode_side, 0) == (40, True)
    connector.update_state_after_alloc(decode_side, ((4, 5, 6),), 40)
    step = connector.build_connector_meta()
    assert step.sends == (key_of(params),) and [load.request_id for load in step.loads] == ["d1"]
    connector.shutdown()


def test_a_rank_reporting_twice_does_not_count_for_another(prefill: SchedulerConnector) -> None:
    _, params = prefill.request_finished(prefill_request(), ((1,),))
    prefill.update_connector_output([report(0, finished_sending=(key_of(params),))] * 2)
    assert prefill.take_finished() == NO_FINISHED


def test_lease_expiry_frees_and_forgets_with_a_warning(
    prefill: SchedulerConnector, clock: FakeClock, caplog: pytest.LogCaptureFixture
) -> None:
    _, params = prefill.request_finished(prefill_request(), ((1,),))
    key = key_of(params)
    assert prefill.build_connector_meta().sends == (key,)
    clock.advance(LEASE_S - 0.001)
    assert prefill.build_connector_meta() == ConnectorMetadata()
    clock.advance(0.001)
    with caplog.at_level(logging.WARNING):
        assert prefill.build_connector_meta() == ConnectorMetadata(forgotten=(key,))
    assert "lease of 30.0 s expired" in caplog.text
    assert prefill.take_finished() == FinishedRequests(finished_sending=("p1",))
    prefill.update_connector_output(all_ranks(finished_sending=(key,)))  # late readers
    assert prefill.take_finished() == NO_FINISHED


def test_expiry_before_the_sends_went_out_is_never_forgotten_to_the_ranks(
    prefill: SchedulerConnector, clock: FakeClock
) -> None:
    prefill.request_finished(prefill_request(), ((1,),))
    clock.advance(LEASE_S + 1)
    assert prefill.build_connector_meta() == ConnectorMetadata()
    assert prefill.take_finished() == FinishedRequests(finished_sending=("p1",))


def test_lease_expiry_is_also_checked_on_update_connector_output(
    prefill: SchedulerConnector, clock: FakeClock
) -> None:
    _, params = prefill.request_finished(prefill_request(), ((1,),))
    prefill.build_connector_meta()
    clock.advance(LEASE_S)
    prefill.update_connector_output([])
    assert prefill.take_finished() == FinishedRequests(finished_sending=("p1",))
    assert prefill.build_connector_meta() == ConnectorMetadata(forgotten=(key_of(params),))


@pytest.mark.parametrize(
    ("request_info", "expected"),
    [
        (RequestInfo("p1", 40, None), (False, None)),
        (RequestInfo("p1", 40, {"do_remote_decode": False}), (False, None)),
        (RequestInfo("p1", 40, {"do_remote_decode": True}, aborted=True), (False, None)),
        (RequestInfo("p1", 40, {"do_remote_decode": "yes"}), (False, None)),
    ],
    ids=[
        "no params",
        "do_remote_decode false",
        "aborted before the prompt was computed",
        "malformed params",
    ],
)
def test_prefill_requests_without_a_transfer_are_freed_at_once(
    prefill: SchedulerConnector, request_info: RequestInfo, expected: tuple[bool, None]
) -> None:
    assert prefill.request_finished(request_info, ((1,),)) == expected
    assert prefill.build_connector_meta() == ConnectorMetadata()


def test_prefill_without_a_reachable_side_channel_does_not_lease(clock: FakeClock) -> None:
    config = ConnectorConfig(side_channel_port=0)
    connector = SchedulerConnector(
        config, engine_id="p", role=Role.PRODUCER, spec=DENSE, tp_size=1, clock=clock
    )
    assert connector.request_finished(prefill_request(), ((1,),)) == (False, None)


def test_params_carry_the_bound_side_channel_port(served_prefill: SchedulerConnector) -> None:
    _, params = served_prefill.request_finished(prefill_request(), ((1,),))
    assert params is not None and params["remote_port"] == served_prefill.side_channel_port != 0


def test_the_side_channel_starts_once(served_prefill: SchedulerConnector) -> None:
    with pytest.raises(UnsupportedConfiguration, match="already serves on port"):
        served_prefill.start_side_channel(handshakes())


HOST = "127.0.0.1"
AS_PREFILL_0: dict[str, Any] = {"engine_id": "prefill-0", "secret": None, "timeout_s": 2.0}


def test_a_prefill_that_computed_past_its_prompt_leases_only_the_prompts_blocks(
    served_prefill: SchedulerConnector,
) -> None:
    """A client asked prefill for more than one token: the request's table also holds its
    answer's blocks. The lease and the params name only the three holding the 40-token prompt
    (seen on real engines: all seven went out, and decode's plan refused the load)."""
    request = msgspec.structs.replace(prefill_request(), num_computed_tokens=100)
    _, params = served_prefill.request_finished(request, ((1, 2, 3, 4, 5, 6, 7),))
    assert params is not None and params["remote_block_ids"] == [[1, 2, 3]]


def test_a_hybrid_prefill_that_computed_past_its_prompt_offers_nothing(
    clock: FakeClock, caplog: pytest.LogCaptureFixture
) -> None:
    """Its SSM state is the one after the answer's tokens, not the prompt's: a load of it
    would decode from the wrong state, so nothing is offered. One that stopped at its prompt
    is offered, as before."""
    config = ConnectorConfig(side_channel_port=0, kv_lease_duration_s=LEASE_S)
    connector = SchedulerConnector(
        config, engine_id="prefill-0", role=Role.PRODUCER, spec=HYBRID, tp_size=2, clock=clock
    )
    connector.start_side_channel(handshakes())
    try:
        past = msgspec.structs.replace(prefill_request(), num_computed_tokens=41)
        with caplog.at_level(logging.WARNING):
            assert connector.request_finished(past, ((1, 2, 3, 4), (9,))) == (False, None)
        assert "past its 40-token prompt" in caplog.text
        at_prompt = msgspec.structs.replace(prefill_request("p2"), num_computed_tokens=40)
        _, params = connector.request_finished(at_prompt, ((1, 2, 3), (9,)))
        assert params is not None and params["remote_block_ids"] == [[1, 2, 3], [9]]
    finally:
        connector.shutdown()


def test_params_carry_the_side_channels_boot_and_a_fresh_lease_id_per_lease(
    served_prefill: SchedulerConnector, clock: FakeClock
) -> None:
    _, first = served_prefill.request_finished(prefill_request(), ((1,),))
    clock.advance(LEASE_S + 1)
    served_prefill.build_connector_meta()  # the first lease expired: p1 may be leased again
    _, second = served_prefill.request_finished(prefill_request(), ((2,),))
    assert first is not None and second is not None
    port = served_prefill.side_channel_port
    boot_id = fetch_boot_id(HOST, port, engine_id="prefill-0", secret=None, timeout_s=2.0)
    assert first["remote_boot_id"] == second["remote_boot_id"] == boot_id
    assert first["remote_lease_id"] != second["remote_lease_id"]


def test_heartbeats_over_the_side_channel_extend_the_lease(
    served_prefill: SchedulerConnector, clock: FakeClock
) -> None:
    port = served_prefill.side_channel_port
    _, params = served_prefill.request_finished(prefill_request(), ((1,),))
    served_prefill.build_connector_meta()
    for _ in range(3):  # 3 x 20 s, each within the 30 s lease
        clock.advance(20.0)
        names = [key_of(params), "p1", "unknown"]  # a bare id names no lease that has an id
        assert send_heartbeat(HOST, port, names, **AS_PREFILL_0) == 1
        served_prefill.update_connector_output([])
        assert served_prefill.take_finished() == NO_FINISHED
    clock.advance(LEASE_S)
    served_prefill.update_connector_output([])
    assert served_prefill.take_finished() == FinishedRequests(finished_sending=("p1",))


def test_a_release_over_the_side_channel_frees_at_the_next_step(
    served_prefill: SchedulerConnector,
) -> None:
    _, params = served_prefill.request_finished(prefill_request(), ((1,),))
    served_prefill.build_connector_meta()
    port = served_prefill.side_channel_port
    assert send_release(HOST, port, ["p1"], **AS_PREFILL_0) == 0  # the bare id: no lease
    assert send_release(HOST, port, [key_of(params)], **AS_PREFILL_0) == 1
    assert send_release(HOST, port, [key_of(params)], **AS_PREFILL_0) == 0
    assert served_prefill.build_connector_meta() == ConnectorMetadata(forgotten=(key_of(params),))
    assert served_prefill.take_finished() == FinishedRequests(finished_sending=("p1",))


@pytest.mark.parametrize(
    ("given", "message"),
    [
        (handshakes(tp_size=1), r"one handshake per rank 0..1, got ranks \[0\]"),
        (handshakes() + handshakes()[:1], r"got ranks \[0, 1, 0\]"),
        (handshakes(engine_id="other"), "says engine 'other'"),
    ],
    ids=["a missing rank", "a duplicate rank", "another engine's handshakes"],
)
def test_start_side_channel_checks_the_handshakes(
    prefill: SchedulerConnector, given: list[WorkerHandshake], message: str
) -> None:
    with pytest.raises(UnsupportedConfiguration, match=message):
        prefill.start_side_channel(given)


@pytest.mark.parametrize(
    ("role", "params", "message"),
    [
        (Role.BOTH, {"remote_port": 0}, "'remote_port'"),
        (Role.CONSUMER, {"remote_port": 0}, "'remote_port'"),
        (Role.BOTH, {**REMOTE_PARAMS, "remote_block_ids": [[1], [2]]}, "2 cache group.*has 1"),
        (Role.BOTH, {**REMOTE_PARAMS, "remote_request_id": "p\udc80"}, "not valid Unicode"),
    ],
    ids=[
        "malformed params",
        "malformed params on a decode engine",
        "wrong group count",
        "a remote_request_id no encoder accepts",
    ],
)
def test_bad_params_never_raise_and_are_announced_as_a_failed_load_once(
    clock: FakeClock,
    heartbeats: RecordingHeartbeats,
    role: Role,
    params: dict[str, Any],
    message: str,
) -> None:
    """Params bind at allocation: refused ones park the request (its tokens claimed), never
    load, and come back once from take_refused with the reason."""
    connector = SchedulerConnector(
        CONFIG,
        engine_id="e",
        role=role,
        spec=DENSE,
        tp_size=1,
        clock=clock,
        heartbeat_sender=heartbeats,
    )
    request = RequestInfo("r1", 40, params)
    assert connector.get_num_new_matched_tokens(request, 0) == (40, True)
    connector.update_state_after_alloc(request, ((1, 2, 3),), 40)
    assert connector.build_connector_meta() == ConnectorMetadata()
    refused = connector.take_refused()
    assert list(refused) == ["r1"]
    assert re.search(message, refused["r1"].message)
    assert connector.take_refused() == {}
    assert connector.get_num_new_matched_tokens(request, 0) == (0, False)
    assert connector.request_finished(request, ((1, 2, 3),)) == (False, None)
    connector.update_connector_output(
        [report(0, finished_recving=("r1",), finished_sending=("r1",))]
    )
    assert connector.take_finished() == NO_FINISHED


def test_reports_from_ranks_outside_tp_size_are_ignored(
    prefill: SchedulerConnector, caplog: pytest.LogCaptureFixture
) -> None:
    _, params = prefill.request_finished(prefill_request(), ((1,),))
    key = key_of(params)
    with caplog.at_level(logging.ERROR):
        prefill.update_connector_output(
            [report(0, finished_sending=(key,)), report(7, finished_sending=(key,))]
        )
    assert "tp_rank 7" in caplog.text
    assert prefill.take_finished() == NO_FINISHED


# ---------------------------------------------------------------- decode (consumer)


def test_decode_lifecycle_loads_the_uncached_suffix_then_reports_once(
    decode: SchedulerConnector,
) -> None:
    request = decode_request()
    assert decode.get_num_new_matched_tokens(request, 16) == (24, True)
    assert decode.get_num_new_matched_tokens(request, 16) == (24, True)  # retried scheduling
    decode.update_state_after_alloc(request, ((10, 11, 12),), 24)
    assert decode.get_num_new_matched_tokens(request, 16) == (0, False)
    # The ranks check the lease as this reader, expecting the request's first tokens (the
    # engine's ids, handed on for the ranks to digest).
    remote = msgspec.structs.replace(REMOTE, reader=decode.reader)
    assert decode.build_connector_meta() == ConnectorMetadata(
        loads=(
            LoadSpec(
                "d1",
                ((11, 12),),
                num_tokens=40,
                num_cached_tokens=16,
                source=remote,
                token_ids=prompt_ids(40),
            ),
        )
    )
    assert decode.build_connector_meta() == ConnectorMetadata()
    decode.update_connector_output([report(0, finished_recving=("d1",)), report(1)])
    assert decode.take_finished() == NO_FINISHED
    decode.update_connector_output([report(1, finished_recving=("d1",))])
    assert decode.take_finished() == FinishedRequests(finished_recving=("d1",))
    decode.update_connector_output(all_ranks(finished_recving=("d1",)))
    assert decode.take_finished() == NO_FINISHED
    assert decode.get_num_new_matched_tokens(request, 40) == (0, False)
    assert decode.request_finished(request, ((10, 11, 12),)) == (False, None)


def test_one_failing_rank_fails_the_request_with_its_reason(decode: SchedulerConnector) -> None:
    start_load(decode)
    decode.update_connector_output(
        [
            report(0, finished_recving=("d1",)),
            report(1, failed_recving={"d1": failure("peer gone")}),
        ]
    )
    assert decode.take_finished() == FinishedRequests(failed_recving={"d1": failure("peer gone")})
    assert decode.get_num_new_matched_tokens(decode_request(), 16) == (0, False)


ENGINE_OUTCOMES = [
    ("received", ["d1"], [], FinishedRequests(finished_recving=("d1",))),
    (
        "failed",
        ["d1"],
        ["d1"],
        FinishedRequests(
            failed_recving={
                "d1": failure("the engine reported the load as failed", FailureKind.ENGINE)
            }
        ),
    ),
    ("not a load we track", ["other"], [], NO_FINISHED),
]


@pytest.mark.parametrize(
    ("finished", "failed", "expected"),
    [case[1:] for case in ENGINE_OUTCOMES],
    ids=[case[0] for case in ENGINE_OUTCOMES],
)
def test_the_engines_own_aggregate_ends_a_load_whose_reports_are_missing(
    decode: SchedulerConnector, finished: list[str], failed: list[str], expected: FinishedRequests
) -> None:
    # vLLM aggregates the ranks' results itself; rank 1's report never reached us.
    start_load(decode)
    decode.update_connector_output([report(0, finished_recving=("d1",))])
    decode.on_engine_outcomes(finished, failed)
    assert decode.take_finished() == expected
    if expected == NO_FINISHED:  # still waiting for rank 1
        assert decode.request_finished(decode_request(), ((10, 11, 12),)) == (True, None)
        return
    decode.update_connector_output([report(1, finished_recving=("d1",))])  # late: ignored
    assert decode.take_finished() == NO_FINISHED
    assert decode.request_finished(decode_request(), ((10, 11, 12),)) == (False, None)


def test_the_ranks_reasons_win_over_the_engines_aggregate(decode: SchedulerConnector) -> None:
    start_load(decode)
    decode.update_connector_output(all_ranks(failed_recving={"d1": failure("peer gone")}))
    decode.on_engine_outcomes(["d1"], ["d1"])
    assert decode.take_finished() == FinishedRequests(failed_recving={"d1": failure("peer gone")})


# The side-channel release decode sends for REMOTE's request: (engine, host, port, ids).
RELEASE_P1 = [(REMOTE.engine_id, REMOTE.host, REMOTE.port, (REMOTE.remote_request_id,))]


def test_a_failed_load_also_releases_prefill_over_the_side_channel(
    decode: SchedulerConnector, heartbeats: RecordingHeartbeats
) -> None:
    # A failed handshake leaves no NIXL path to notify prefill; the side channel still frees it.
    start_load(decode)
    assert heartbeats.released == []
    decode.update_connector_output(all_ranks(failed_recving={"d1": failure("handshake refused")}))
    assert decode.take_finished() == FinishedRequests(
        failed_recving={"d1": failure("handshake refused")}
    )
    assert heartbeats.released == RELEASE_P1


def test_a_successful_load_sends_no_release(
    decode: SchedulerConnector, heartbeats: RecordingHeartbeats
) -> None:
    start_load(decode)
    decode.update_connector_output(all_ranks(finished_recving=("d1",)))
    assert decode.take_finished() == FinishedRequests(finished_recving=("d1",))
    assert heartbeats.released == []


def test_an_abort_before_the_load_releases_over_the_side_channel_too(
    decode: SchedulerConnector, heartbeats: RecordingHeartbeats
) -> None:
    request = decode_request()
    decode.get_num_new_matched_tokens(request, 16)
    decode.request_finished(request, ((),))
    assert heartbeats.released == RELEASE_P1


def test_an_abort_before_the_engine_ever_asked_releases_prefill(
    decode: SchedulerConnector, heartbeats: RecordingHeartbeats
) -> None:
    assert decode.request_finished(decode_request(), ((),)) == (False, None)
    assert heartbeats.released == RELEASE_P1
    assert decode.build_connector_meta() == ConnectorMetadata()
    assert not decode.has_pending_work()


def test_a_finished_load_is_not_released_again_at_request_finished(
    decode: SchedulerConnector, heartbeats: RecordingHeartbeats
) -> None:
    start_load(decode)
    assert decode.has_pending_work()
    decode.update_connector_output(all_ranks(finished_recving=("d1",)))
    decode.take_finished()
    assert decode.request_finished(decode_request(), ((10, 11, 12),)) == (False, None)
    assert heartbeats.released == []
    assert not decode.has_pending_work()


def test_different_rank_failures_name_the_lowest_rank(decode: SchedulerConnector) -> None:
    start_load(decode)
    decode.update_connector_output(
        [
            report(0, failed_recving={"d1": failure("timeout", FailureKind.TRANSFER_TIMEOUT)}),
            report(1, failed_recving={"d1": failure("bad descriptor")}),
        ]
    )
    assert decode.take_finished().failed_recving == {
        "d1": failure(
            "tp_rank 0: timeout (1 other rank(s) failed too)", FailureKind.TRANSFER_TIMEOUT
        )
    }


def test_a_full_prefix_hit_only_releases_the_prefill_blocks(decode: SchedulerConnector) -> None:
    request = decode_request()
    assert decode.get_num_new_matched_tokens(request, 40) == (0, False)
    assert decode.get_num_new_matched_tokens(request, 40) == (0, False)
    decode.update_state_after_alloc(request, ((10, 11, 12),), 0)
    assert decode.build_connector_meta() == ConnectorMetadata(releases=(ReleaseSpec("d1", REMOTE),))
    decode.update_connector_output(all_ranks(failed_recving={"d1": ABORTED}))
    assert decode.take_finished() == NO_FINISHED
    assert decode.request_finished(request, ((10, 11, 12),)) == (False, None)


def test_abort_before_allocation_releases_and_frees_at_once(
    decode: SchedulerConnector, heartbeats: RecordingHeartbeats
) -> None:
    """A claim aborted before allocation: no rank ever heard of it, so the scheduler releases
    prefill itself, over the side channel."""
    request = decode_request()
    decode.get_num_new_matched_tokens(request, 16)
    assert decode.request_finished(request, ((),)) == (False, None)
    assert decode.build_connector_meta() == ConnectorMetadata()
    assert heartbeats.released == RELEASE_P1
    decode.update_connector_output(all_ranks(failed_recving={"d1": ABORTED}))
    assert decode.take_finished() == NO_FINISHED


def test_abort_after_allocation_holds_blocks_until_ranks_confirm(
    decode: SchedulerConnector,
) -> None:
    request = decode_request()
    decode.get_num_new_matched_tokens(request, 16)
    decode.update_state_after_alloc(request, ((10, 11, 12),), 24)
    assert decode.request_finished(request, ((10, 11, 12),)) == (True, None)
    assert decode.build_connector_meta() == ConnectorMetadata(releases=(ReleaseSpec("d1", REMOTE),))
    decode.update_connector_output([report(0, failed_recving={"d1": ABORTED})])
    assert decode.take_finished() == NO_FINISHED
    decode.update_connector_output([report(1, failed_recving={"d1": ABORTED})])
    assert decode.take_finished() == FinishedRequests(failed_recving={"d1": ABORTED})
    assert decode.build_connector_meta() == ConnectorMetadata()


def test_abort_while_loading_waits_for_the_load(decode: SchedulerConnector) -> None:
    start_load(decode)
    assert decode.request_finished(decode_request(), ((10, 11, 12),)) == (True, None)
    assert decode.request_finished(decode_request(), ((10, 11, 12),)) == (True, None)
    assert decode.build_connector_meta() == ConnectorMetadata()  # the READ is in flight
    decode.update_connector_output(all_ranks(finished_recving=("d1",)))
    assert decode.take_finished() == FinishedRequests(finished_recving=("d1",))


def test_a_finish_after_the_load_frees_at_once(decode: SchedulerConnector) -> None:
    start_load(decode)
    decode.update_connector_output(all_ranks(finished_recving=("d1",)))
    decode.take_finished()
    assert decode.request_finished(decode_request(), ((10, 11, 12),)) == (False, None)
    assert decode.build_connector_meta() == ConnectorMetadata()


def test_too_few_blocks_fails_the_request_and_releases_prefill(decode: SchedulerConnector) -> None:
    request = decode_request()
    decode.get_num_new_matched_tokens(request, 16)
    decode.update_state_after_alloc(request, ((10, 11),), 24)
    meta = decode.build_connector_meta()
    assert meta == ConnectorMetadata(releases=(ReleaseSpec("d1", REMOTE),))
    finished = decode.take_finished()
    assert finished.failed_recving == {
        "d1": failure(
            "cannot plan the load: cache group 0: 2 block(s) of 16 tokens cannot hold 40 "
            "tokens (need 3)",
            FailureKind.PLAN,
        )
    }
    decode.update_connector_output(all_ranks(failed_recving={"d1": ABORTED}))
    assert decode.take_finished() == NO_FINISHED
    assert decode.request_finished(request, ((10, 11),)) == (False, None)


def test_a_hybrid_model_loads_the_ssm_state_block(
    clock: FakeClock, heartbeats: RecordingHeartbeats
) -> None:
    decode = make_decode(clock, heartbeats, spec=HYBRID, tp_size=1)
    request = decode_request(remote_block_ids=[[1, 2, 3], [9]])
    assert decode.get_num_new_matched_tokens(request, 32) == (8, True)
    decode.update_state_after_alloc(request, ((10, 11, 12), (0, 5)), 8)
    (load,) = decode.build_connector_meta().loads
    assert load.local_block_ids == ((12,), (5,))
    assert load.source.remote_block_ids == ((1, 2, 3), (9,))


def test_reports_for_unknown_or_unemitted_requests_are_ignored(decode: SchedulerConnector) -> None:
    request = decode_request()
    decode.get_num_new_matched_tokens(request, 16)
    decode.update_connector_output(all_ranks(finished_recving=("d1", "stranger")))
    assert decode.take_finished() == NO_FINISHED
    decode.update_state_after_alloc(request, ((10, 11, 12),), 24)
    assert len(decode.build_connector_meta().loads) == 1


def drive_to(decode: SchedulerConnector, stage: str) -> list[str]:
    """Take decode request d1 to ``stage``; returns the instructions the ranks received."""
    request = decode_request()
    instructions: list[str] = []
    steps = ["matched", "allocated", "emitted", "one rank reported", "loaded"]
    for index, name in enumerate(steps[: steps.index(stage) + 1]):
        if name == "matched":
            decode.get_num_new_matched_tokens(request, 16)
        elif name == "allocated":
            decode.update_state_after_alloc(request, ((10, 11, 12),), 24)
        elif name == "emitted":
            instructions += [load.request_id for load in decode.build_connector_meta().loads]
        else:
            decode.update_connector_output([report(index - 3, finished_recving=("d1",))])
    return instructions


ABORT_STAGES = [
    ("after matching", "matched", False, 0),
    ("after allocation", "allocated", True, 1),
    ("after the load was emitted", "emitted", True, 1),
    ("after one rank reported", "one rank reported", True, 1),
    ("after the load finished", "loaded", False, 1),
]


@pytest.mark.parametrize(
    ("stage", "delay", "num_reports"),
    [c[1:] for c in ABORT_STAGES],
    ids=[c[0] for c in ABORT_STAGES],
)
def test_abort_at_every_stage_is_reported_at_most_once_and_leaks_nothing(
    decode: SchedulerConnector, stage: str, delay: bool, num_reports: int
) -> None:
    loading = drive_to(decode, stage)  # loads the ranks already work on
    finished = decode.take_finished()
    reports = [*finished.finished_recving, *finished.failed_recving]
    assert decode.request_finished(decode_request(), ((10, 11, 12),)) == (delay, None)
    for _ in range(3):  # every rank answers every instruction, a few steps in a row
        meta = decode.build_connector_meta()
        loading += [load.request_id for load in meta.loads]
        answers = {release.request_id: "aborted" for release in meta.releases}
        decode.update_connector_output(
            [
                report(rank, finished_recving=tuple(loading), failed_recving=answers)
                for rank in (0, 1)
            ]
        )
        finished = decode.take_finished()
        reports += [*finished.finished_recving, *finished.failed_recving]
    assert reports.count("d1") == num_reports
    # No state outlives the request: the same id would start afresh.
    assert decode.get_num_new_matched_tokens(decode_request(), 16) == (24, True)


def test_params_are_parsed_once_per_request_and_again_for_new_params(
    decode: SchedulerConnector, monkeypatch: pytest.MonkeyPatch
) -> None:
    import scheduler.requests as module

    calls: list[object] = []
    real_parse = module.parse_kv_transfer_params

    def counting_parse(raw: Any) -> Any:
        calls.append(raw)
        return real_parse(raw)

    monkeypatch.setattr(module, "parse_kv_transfer_params", counting_parse)
    request = decode_request()
    assert decode.get_num_new_matched_tokens(request, 16) == (24, True)  # claimed, unread
    assert decode.get_num_new_matched_tokens(request, 16) == (24, True)
    assert len(calls) == 0
    decode.update_state_after_alloc(request, ((10, 11, 12),), 24)  # read at allocation
    assert len(decode.build_connector_meta().loads) == 1
    assert len(calls) == 1
    request.kv_transfer_params = dict(request.kv_transfer_params or {})  # a new object
    decode.request_finished(request, ((10, 11, 12),))
    assert len(calls) == 2
