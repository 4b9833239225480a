"""SchedulerConnector in multi-turn mode, engine-agnostic, on an injected clock.

Decode holds a finished request under a lease of ``decoder_kv_blocks_ttl``; the lease table
answers lease checks for it, a free notification completes it, expiry or a release ends it.
The next turn's prefill turns decode's params into a load of the history it lacks.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import msgspec
import pytest

from connector.lease_binding import block_digest, token_digest
from connector.metadata import StageSpec, WorkerReport
from connector.net.side_channel_client import check_leases_status
from connector.protocol import LeaseRef, LeaseStatus, lease_key
from scheduler.connector import RequestInfo, Role, SchedulerConnector
from tests.scheduler_helpers import (
    CONFIG,
    DENSE,
    HYBRID,
    FakeClock,
    RecordingHeartbeats,
    all_ranks,
    decode_request,
    handshakes,
    prompt_ids,
    start_load,
)

TTL_S = 100.0
MODE = msgspec.structs.replace(
    CONFIG, bidirectional_kv_xfer=True, decoder_kv_blocks_ttl_s=TTL_S, kv_recompute_threshold=8
)


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def heartbeats() -> RecordingHeartbeats:
    return RecordingHeartbeats()


def _connector(
    clock: FakeClock,
    heartbeats: RecordingHeartbeats,
    engine_id: str,
    host_staging: bool = False,
    **config: Any,
) -> SchedulerConnector:
    return SchedulerConnector(
        msgspec.structs.replace(MODE, side_channel_port=0, **config),
        engine_id=engine_id,
        role=Role.CONSUMER if engine_id.startswith("decode") else Role.PRODUCER,
        spec=DENSE,
        tp_size=2,
        clock=clock,
        heartbeat_sender=heartbeats,
        host_staging=host_staging,
    )


@pytest.fixture
def decode(clock: FakeClock, heartbeats: RecordingHeartbeats) -> Iterator[SchedulerConnector]:
    connector = _connector(clock, heartbeats, "decode-0")
    connector.start_side_channel(handshakes("decode-0"))
    yield connector
    connector.shutdown()


def _finish_turn1(decode: SchedulerConnector) -> dict[str, Any]:
    """Decode loads, reports, decodes 9 tokens and finishes: returns its params."""
    start_load(decode)
    decode.update_connector_output(all_ranks(finished_recving=("d1",)))
    decode.take_finished()
    finished = RequestInfo(
        "d1",
        40,
        decode_request().kv_transfer_params,
        num_computed_tokens=48,
        token_ids=prompt_ids(49),  # the last one sampled: its KV not computed yet
    )
    delay, params = decode.request_finished(finished, ((10, 11, 12, 13),))
    assert delay is True and params is not None
    return params


def _held(params: dict[str, Any]) -> bool:
    """Decode's side channel's answer to the lease check a pulling prefill makes."""
    num_tokens = params["remote_num_tokens"]
    ref = LeaseRef(
        params["remote_request_id"],
        params["remote_lease_id"],
        (),
        token_digest(prompt_ids(num_tokens), num_tokens),
        block_digest(params["remote_block_ids"], num_tokens),
    )
    return check_leases_status(
        params["remote_host"],
        params["remote_port"],
        [ref],
        engine_id=params["remote_engine_id"],
        boot_id=params["remote_boot_id"],
        secret=None,
        timeout_s=2.0,
    ).held[0]


def test_decode_holds_the_finished_request_and_returns_vllm_keys(
    decode: SchedulerConnector, clock: FakeClock
) -> None:
    params = _finish_turn1(decode)
    assert params["do_remote_decode"] is True and params["do_remote_prefill"] is False
    assert params["remote_engine_id"] == "decode-0" and params["remote_request_id"] == "d1"
    assert params["remote_block_ids"] == [[10, 11, 12]]  # 48 tokens: the blocks holding them
    assert params["remote_num_tokens"] == 48 and params["tp_size"] == 2
    assert params["remote_blocks_expiry_time"] == clock.now_s + TTL_S
    meta = decode.build_connector_meta()
    assert meta.sends == (lease_key("d1", params["remote_lease_id"]),)
    assert _held(params)


def test_the_next_turns_free_notifications_end_the_hold(decode: SchedulerConnector) -> None:
    params = _finish_turn1(decode)
    key = decode.build_connector_meta().sends[0]
    decode.update_connector_output(all_ranks(finished_sending=(key,)))
    assert decode.take_finished().finished_sending == ("d1",)
    assert not decode.has_pending_work()
    assert params["remote_lease_id"]


def test_an_unpulled_hold_ends_at_the_ttl(decode: SchedulerConnector, clock: FakeClock) -> None:
    params = _finish_turn1(decode)
    decode.build_connector_meta()
    clock.advance(TTL_S - 1.0)
    decode.build_connector_meta()
    assert decode.take_finished().finished_sending == ()
    clock.advance(1.0)
    assert not _held(params)  # at expiry: no longer vouched for
    meta = decode.build_connector_meta()
    assert meta.forgotten == (lease_key("d1", params["remote_lease_id"]),)
    assert decode.take_finished().finished_sending == ("d1",)


@pytest.mark.parametrize(
    ("aborted", "mode"), [(True, True), (False, False)], ids=["aborted", "mode-off"]
)
def test_no_hold_for_an_aborted_request_or_without_the_mode(
    clock: FakeClock, heartbeats: RecordingHeartbeats, aborted: bool, mode: bool
) -> None:
    decode = _connector(clock, heartbeats, "decode-0", bidirectional_kv_xfer=mode)
    try:
        decode.start_side_channel(handshakes("decode-0"))
        start_load(decode)
        decode.update_connector_output(all_ranks(finished_recving=("d1",)))
        info = RequestInfo("d1", 40, decode_request().kv_transfer_params, aborted, 48)
        assert decode.request_finished(info, ((10, 11, 12),)) == (False, None)
    finally:
        decode.shutdown()


def test_a_model_with_an_ssm_group_is_not_held(
    clock: FakeClock, heartbeats: RecordingHeartbeats
) -> None:
    decode = SchedulerConnector(
        msgspec.structs.replace(MODE, side_channel_port=0),
        engine_id="decode-0",
        role=Role.CONSUMER,
        spec=HYBRID,
        tp_size=2,
        clock=clock,
        heartbeat_sender=heartbeats,
    )
    try:
        info = RequestInfo("d9", 40, {"do_remote_prefill": False}, num_computed_tokens=48)
        assert decode.request_finished(info, ((1, 2, 3), (4,))) == (False, None)
    finally:
        decode.shutdown()


PULL = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": "decode-0",
    "remote_request_id": "d1",
    "remote_block_ids": [[10, 11, 12]],
    "remote_host": "127.0.0.1",
    "remote_port": 5700,
    "remote_num_tokens": 48,
    "remote_lease_id": "abc",
    "tp_size": 2,
}


@pytest.mark.parametrize(
    ("num_prompt_tokens", "num_cached", "threshold", "expected"),
    [
        (60, 32, 8, (16, True)),  # the answer's block past prefill's cache: pulled
        (40, 32, 8, (8, True)),  # a prompt shorter than decode's history: its own tokens only
        (60, 48, 0, (0, False)),  # prefill caches all decode holds
        (60, 40, 8, (8, True)),  # exactly the threshold: pulled
        (60, 40, 9, (0, False)),  # below it: computed
    ],
    ids=["pull", "short-prompt", "all-cached", "at-threshold", "below-threshold"],
)
def test_prefill_claims_the_uncached_history_decode_holds(
    clock: FakeClock,
    heartbeats: RecordingHeartbeats,
    num_prompt_tokens: int,
    num_cached: int,
    threshold: int,
    expected: tuple[int, bool],
) -> None:
    prefill = _connector(clock, heartbeats, "prefill-0", kv_recompute_threshold=threshold)
    try:
        info = RequestInfo("t2", num_prompt_tokens, dict(PULL))
        assert prefill.get_num_new_matched_tokens(info, num_cached) == expected
    finally:
        prefill.shutdown()


@pytest.mark.parametrize(
    "changes",
    [
        {"remote_block_ids": [[10, 11, 12], [4]]},
        {"remote_num_tokens": None},
    ],
    ids=["other-group-count", "no-token-count"],
)
def test_params_a_pull_cannot_use_are_computed_not_failed(
    clock: FakeClock, heartbeats: RecordingHeartbeats, changes: dict[str, Any]
) -> None:
    prefill = _connector(clock, heartbeats, "prefill-0")
    try:
        info = RequestInfo("t2", 60, {**PULL, **changes})
        assert prefill.get_num_new_matched_tokens(info, 0) == (0, False)
    finally:
        prefill.shutdown()


def test_prefill_loads_the_pull_then_leases_its_own_blocks_for_decode(
    clock: FakeClock, heartbeats: RecordingHeartbeats
) -> None:
    prefill = _connector(clock, heartbeats, "prefill-0")
    try:
        prefill.start_side_channel(handshakes("prefill-0"))
        info = RequestInfo("t2", 60, dict(PULL), token_ids=prompt_ids(60))
        assert prefill.get_num_new_matched_tokens(info, 32) == (16, True)
        prefill.update_state_after_alloc(info, ((20, 21, 22, 23),), 16)
        (load,) = prefill.build_connector_meta().loads
        assert (load.num_cached_tokens, load.num_tokens, load.local_block_ids) == (32, 48, ((22,),))
        assert load.source.remote_num_tokens == 48 and load.source.lease_id == "abc"
        prefill.update_connector_output(all_ranks(finished_recving=("t2",)))
        assert prefill.take_finished().finished_recving == ("t2",)
        delay, params = prefill.request_finished(info, ((20, 21, 22, 23),))
        assert delay is True and params is not None and params["do_remote_prefill"] is True
    finally:
        prefill.shutdown()


def test_a_skipped_pull_releases_decode_at_once(
    clock: FakeClock, heartbeats: RecordingHeartbeats
) -> None:
    prefill = _connector(clock, heartbeats, "prefill-0", kv_recompute_threshold=64)
    try:
        prefill.start_side_channel(handshakes("prefill-0"))
        info = RequestInfo("t2", 60, dict(PULL))
        assert prefill.get_num_new_matched_tokens(info, 32) == (0, False)
        prefill.request_finished(info, ((20, 21, 22, 23),))
        assert heartbeats.released == [("decode-0", "127.0.0.1", 5700, (lease_key("d1", "abc"),))]
    finally:
        prefill.shutdown()


def _status(params: dict[str, Any]) -> LeaseStatus:
    return check_leases_status(
        params["remote_host"],
        params["remote_port"],
        [_pull_ref(params)],
        engine_id=params["remote_engine_id"],
        boot_id=params["remote_boot_id"],
        secret=None,
        timeout_s=2.0,
    )


def _pull_ref(params: dict[str, Any]) -> LeaseRef:
    """The ref a next turn's prefill sends to pull every token a hold's ``params`` offer."""
    num_tokens = params["remote_num_tokens"]
    return LeaseRef(
        params["remote_request_id"],
        params["remote_lease_id"],
        (),
        token_digest(prompt_ids(num_tokens), num_tokens),
        block_digest(params["remote_block_ids"], num_tokens),
    )


@pytest.mark.parametrize("verify_kv", [False, True], ids=["plain", "verify-kv"])
def test_with_host_staging_a_hold_is_readable_only_once_every_rank_copied_it(
    clock: FakeClock, heartbeats: RecordingHeartbeats, verify_kv: bool
) -> None:
    """A staged hold's answer is on the device only: the next metadata asks the ranks to
    copy its blocks to the host (stage_out); until both ranks reported the copy its lease
    answers pending (not held), then held and staged (it was not readable at first). With
    verify_kv its digests go out only after the copy: they must digest the copy."""
    decode = _connector(clock, heartbeats, "decode-0", host_staging=True, verify_kv=verify_kv)
    decode.start_side_channel(handshakes("decode-0"))
    try:
        params = _finish_turn1(decode)
        key = lease_key("d1", params["remote_lease_id"])
        assert _status(params) == LeaseStatus((False,), pending=(True,), staged=(True,))
        meta = decode.build_connector_meta()
        assert meta.stage_out == (StageSpec(key, "d1", ((10, 11, 12),)),)
        assert meta.sends == (key,) and meta.digests == ()
        decode.update_connector_output([WorkerReport(0, staged=(key,)), WorkerReport(1)])
        assert _status(params).pending == (True,), "one rank's copy is not the lease's"
        assert decode.build_connector_meta().stage_out == ()  # asked once
        decode.update_connector_output([WorkerReport(1, staged=(key,))])
        assert _status(params) == LeaseStatus((True,), staged=(True,))
        digests = decode.build_connector_meta().digests
        assert [spec.key for spec in digests] == ([key] if verify_kv else [])
    finally:
        decode.shutdown()


def test_a_staged_hold_a_rank_reports_unsaved_ends_at_once(
    clock: FakeClock, heartbeats: RecordingHeartbeats
) -> None:
    decode = _connector(clock, heartbeats, "decode-0", host_staging=True, verify_kv=True)
    decode.start_side_channel(handshakes("decode-0"))
    try:
        params = _finish_turn1(decode)
        key = decode.build_connector_meta().stage_out[0].key
        decode.update_connector_output(
            [WorkerReport(0, staged=(key,)), WorkerReport(1, unsaved=("d1",))]
        )
        assert _status(params) == LeaseStatus((False,))
        assert decode.take_finished().finished_sending == ("d1",)
    finally:
        decode.shutdown()


def test_without_host_staging_a_hold_is_readable_at_once(decode: SchedulerConnector) -> None:
    params = _finish_turn1(decode)
    assert _status(params) == LeaseStatus((True,))
    assert decode.build_connector_meta().stage_out == ()
