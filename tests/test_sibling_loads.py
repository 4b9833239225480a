"""scheduler/requests.py SiblingLoads: one load per lease on an engine, the others wait, then compute."""

from __future__ import annotations

from typing import Any

from scheduler.requests import SiblingLoads, params_key
from tests.scheduler_helpers import REMOTE_PARAMS, FakeClock

PARAMS = {**REMOTE_PARAMS, "remote_lease_id": "00ff00ff00ff00ff"}
KEY = "p1@00ff00ff00ff00ff"


def _siblings(clock: FakeClock, max_wait_s: float = 30.0) -> SiblingLoads:
    return SiblingLoads(max_wait_s=max_wait_s, clock=clock)


def test_params_name_their_lease_or_transfer_key() -> None:
    assert params_key(PARAMS) == KEY
    assert params_key(REMOTE_PARAMS) == "p1"  # no lease id: the bare request id
    assert params_key({"do_remote_prefill": True, "transfer_key": "k"}) == "transfer:k"
    unkeyed: list[dict[str, Any]] = [{"do_remote_decode": True}, {"remote_request_id": 7}]
    assert [params_key(raw) for raw in unkeyed] == [None, None]


def test_a_second_request_waits_for_the_reader_then_computes_locally() -> None:
    siblings = _siblings(FakeClock())
    assert siblings.answer("a", PARAMS) is None  # nobody reads it: load
    siblings.reading("a", KEY)
    assert siblings.answer("b", PARAMS) == (None, False)  # ask again later
    assert siblings.answer("a", PARAMS) is None  # the reader itself is never held back
    siblings.done("a")
    assert siblings.answer("b", PARAMS) == (0, False)  # it waited: compute locally
    # One arriving after the load (resent params, a replay) loads; its proof decides.
    assert siblings.answer("c", PARAMS) is None


def test_a_wait_lasts_at_most_max_wait() -> None:
    clock = FakeClock()
    siblings = _siblings(clock, max_wait_s=5.0)
    siblings.reading("a", KEY)
    assert siblings.answer("b", PARAMS) == (None, False)
    clock.advance(4.9)
    assert siblings.answer("b", PARAMS) == (None, False)
    clock.advance(0.2)
    assert siblings.answer("b", PARAMS) == (0, False)


def test_only_the_reader_releases() -> None:
    siblings = _siblings(FakeClock())
    assert not siblings.used_by_another("a", KEY)  # nobody read it: the finish releases
    siblings.reading("a", KEY)
    assert siblings.answer("b", PARAMS) == (None, False)
    assert siblings.used_by_another("b", KEY)  # b waited, then ended: a's lease stays
    siblings.done("a")
    assert not siblings.used_by_another("c", KEY)  # its release is a no-op at prefill


def test_a_request_that_waited_and_ended_leaves_nothing() -> None:
    siblings = _siblings(FakeClock())
    siblings.reading("a", KEY)
    assert siblings.answer("b", PARAMS) == (None, False)
    siblings.used_by_another("b", KEY)  # b finished while waiting
    siblings.done("a")
    assert siblings.answer("b", PARAMS) is None  # a new request under the same id loads
