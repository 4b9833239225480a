"""A decode request whose prefill blocks were released never starts a load again (issue 19).

vLLM may ask get_num_new_matched_tokens again for a request it already settled: after a
preemption, a prefix-cache reset, or an allocation that failed and is retried. If the first ask
found everything in decode's own prefix cache (possible with a prefill back-off: SSM hybrids,
multi-token prediction) and prefill was told to free, a later ask with a smaller local hit must
not start a load of those freed, possibly reused, blocks. And prefill is told to free only when
the engine decided (at allocation), never at an ask it may repeat.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest

from scheduler.connector import SchedulerConnector
from tests.scheduler_helpers import (
    ABORTED,
    FakeClock,
    RecordingHeartbeats,
    all_ranks,
    decode_request,
    make_decode,
)

NUM_TOKENS = 40  # decode_request's prompt


def full_hit_then_released(decode: SchedulerConnector) -> None:
    """The first ask finds all 40 tokens cached; vLLM allocates nothing external; the ranks
    ack prefill's release."""
    request = decode_request()
    assert decode.get_num_new_matched_tokens(request, NUM_TOKENS) == (0, False)
    decode.update_state_after_alloc(request, ((10, 11, 12),), 0)
    meta = decode.build_connector_meta()
    assert [release.request_id for release in meta.releases] == ["d1"]
    decode.update_connector_output(all_ranks(failed_recving={"d1": ABORTED}))


def preempted(decode: SchedulerConnector) -> None:
    """Preemption or a prefix-cache reset: asked again, only 16 tokens cached now."""


def failed_allocation_retried(decode: SchedulerConnector) -> None:
    """The allocation is retried after a step: asked again before it, nothing cached."""
    decode.build_connector_meta()


@pytest.mark.parametrize(
    "between",
    [preempted, failed_allocation_retried],
    ids=["preemption-or-prefix-cache-reset", "failed-allocation-retried"],
)
@pytest.mark.parametrize("num_cached_again", [16, 0], ids=["smaller-hit", "no-hit"])
def test_a_released_request_asked_again_loads_nothing(
    between: Callable[[SchedulerConnector], None], num_cached_again: int
) -> None:
    heartbeats = RecordingHeartbeats()
    decode = make_decode(FakeClock(), heartbeats)
    full_hit_then_released(decode)
    between(decode)

    request = decode_request()
    assert decode.get_num_new_matched_tokens(request, num_cached_again) == (0, False)
    decode.update_state_after_alloc(request, ((10, 11, 12),), 0)
    meta = decode.build_connector_meta()
    assert meta.loads == (), "a load started on blocks prefill was told to free"
    assert decode.take_finished().finished_recving == ()
    assert decode.request_finished(request, ((10, 11, 12),)) == (False, None)
    assert not decode.has_pending_work()


def test_a_full_local_hit_releases_prefill_at_allocation_not_at_the_ask() -> None:
    heartbeats = RecordingHeartbeats()
    decode = make_decode(FakeClock(), heartbeats)
    request = decode_request()
    for _ in range(3):  # vLLM may ask several times before it allocates
        assert decode.get_num_new_matched_tokens(request, NUM_TOKENS) == (0, False)
    assert heartbeats.released == [], "released at an ask the engine may repeat"
    assert decode.build_connector_meta().releases == ()

    decode.update_state_after_alloc(request, ((10, 11, 12),), 0)
    assert [ids for *_, ids in heartbeats.released] == [("p1",)]
    assert [release.request_id for release in decode.build_connector_meta().releases] == ["d1"]


def test_a_full_hit_then_a_smaller_hit_before_allocation_still_loads() -> None:
    """Nothing was decided at the first ask: a second ask with a smaller hit may claim."""
    decode = make_decode(FakeClock(), RecordingHeartbeats())
    request = decode_request()
    assert decode.get_num_new_matched_tokens(request, NUM_TOKENS) == (0, False)
    assert decode.get_num_new_matched_tokens(request, 16) == (NUM_TOKENS - 16, True)
    decode.update_state_after_alloc(request, ((10, 11, 12),), NUM_TOKENS - 16)
    (load,) = decode.build_connector_meta().loads
    assert (load.num_cached_tokens, load.num_tokens) == (16, NUM_TOKENS)


def test_the_released_record_lives_until_request_finished_and_then_goes() -> None:
    decode = make_decode(FakeClock(), RecordingHeartbeats())
    full_hit_then_released(decode)
    assert decode.num_tracked_loads == 1  # the memo that forbids a reload
    decode.request_finished(decode_request(), ((10, 11, 12),))
    assert decode.num_tracked_loads == 0


def test_a_record_whose_params_changed_before_the_finish_still_ends() -> None:
    """The record is found by request id, not by what the params say at the end: params
    edited to ask for no load (another connector, a plugin) still end it and release
    prefill's blocks (the record used to outlive the request)."""
    heartbeats = RecordingHeartbeats()
    decode = make_decode(FakeClock(), heartbeats)
    request = decode_request()
    assert decode.get_num_new_matched_tokens(request, 16) == (NUM_TOKENS - 16, True)
    request.kv_transfer_params = {"do_remote_prefill": False}
    assert decode.request_finished(request, ((10, 11, 12),)) == (False, None)
    assert [ids for *_, ids in heartbeats.released] == [("p1",)], "prefill was not released"
    decode.build_connector_meta()
    decode.update_connector_output(all_ranks(failed_recving={"d1": ABORTED}))
    assert decode.num_tracked_loads == 0
