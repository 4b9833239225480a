"""The lease table, decode's uncached-suffix blocks, and exactly-once accounting under any interleaving."""

from __future__ import annotations

from collections.abc import Callable

import pytest
from hypothesis import given
from hypothesis import strategies as st

from connector.errors import TransferPlanError
from connector.metadata import RemoteSource, WorkerReport
from connector.protocol import lease_key
from scheduler.consumer import Consumer
from scheduler.leases import LeaseStats, LeaseTable
from scheduler.producer import LEASE_LIFECYCLE, LeaseState, Producer
from scheduler.requests import (
    REQUEST_LOAD_LIFECYCLE,
    RequestLoadState,
    SiblingLoads,
    uncached_suffix_blocks,
)
from tests.scheduler_helpers import (
    FULL_16,
    SSM_64,
    FakeClock,
    MoveLog,
    RecordingHeartbeats,
    failure,
)

# ---------------------------------------------------------------- LeaseTable


def test_a_lease_expires_at_its_duration() -> None:
    table = LeaseTable(30.0)
    table.lease("a", now=100.0)
    assert table.expired(129.9) == ()
    assert table.expired(130.0) == ("a",)
    assert table.expired(1e9) == ()  # reported once


def test_extend_pushes_expiry_and_counts_only_held_leases() -> None:
    table = LeaseTable(30.0)
    table.lease("a", now=100.0)
    assert table.extend(["a", "ghost"], now=120.0) == 1
    assert table.expired(149.9) == ()
    assert table.expired(150.0) == ("a",)


def test_extend_never_shortens_a_lease() -> None:
    table = LeaseTable(30.0)
    table.lease("a", now=100.0)
    table.extend(["a"], now=50.0)  # a heartbeat stamped by a lagging clock
    assert table.expired(129.0) == ()


def test_release_ends_the_lease_and_is_taken_once() -> None:
    table = LeaseTable(30.0)
    table.lease("a", now=0.0)
    assert table.release(["a", "a", "ghost"]) == 1
    assert "a" not in table
    assert table.take_released() == ("a",)
    assert table.take_released() == ()
    assert table.expired(1e9) == ()


def test_complete_drops_the_lease() -> None:
    table = LeaseTable(30.0)
    table.lease("a", now=0.0)
    assert table.complete("a") is True
    assert table.complete("a") is False
    assert len(table) == 0


ENDINGS: dict[str, Callable[[LeaseTable], object]] = {
    "released": lambda table: table.release(["a"]),
    "completed": lambda table: table.complete("a"),
    "expired": lambda table: table.expired(30.0),  # a's lease ends at 30, b's at 50
}


@pytest.mark.parametrize("ending", list(ENDINGS))
@pytest.mark.parametrize("message", ["heartbeat", "release"])
def test_messages_naming_an_ended_or_unknown_lease_are_stray_and_touch_no_other_lease(
    ending: str, message: str
) -> None:
    """Issue 11: heartbeats and releases naming an id prefill never leased, or already freed,
    are counted as stray and never affect another lease."""
    table = LeaseTable(30.0)
    table.lease("a", now=0.0)
    table.lease("b", now=20.0)
    ENDINGS[ending](table)
    table.take_released()
    ids = ["a", "never-leased", "a"]
    held = table.extend(ids, now=40.0) if message == "heartbeat" else table.release(ids)
    assert held == 0
    assert table.stats == LeaseStats(stray_never_leased=1, stray_already_ended=1)
    assert table.take_released() == ()
    assert table.expired(49.9) == () and table.expired(50.0) == ("b",)  # b untouched


def test_rank_reports_for_ids_with_no_live_lease_are_counted_and_free_nothing() -> None:
    clock = FakeClock()
    leases = LeaseTable(30.0)
    producer = Producer(
        engine_id="p", tp_size=1, leases=leases, clock=clock, address=lambda: ("h", 1)
    )
    producer.request_finished("held", ((1,),), 2, token_ids=[5, 6])
    _, params = producer.request_finished("released", ((2,),), 2, token_ids=[5, 6])
    assert params is not None
    leases.release([lease_key("released", params["remote_lease_id"])])
    producer.take_step()
    producer.on_reports([WorkerReport(tp_rank=0, finished_sending=("never", "released"))])
    assert producer.num_stray_reports == 2
    assert producer.take_finished() == ("released",)  # by its release, not by the report
    assert "held" in leases


def test_a_lease_taken_again_is_no_longer_ended() -> None:
    table = LeaseTable(30.0)
    table.lease("a", now=0.0)
    table.complete("a")
    table.lease("a", now=1.0)  # the same id leased again (an engine that reuses ids)
    assert table.extend(["a"], now=2.0) == 1
    assert table.stats == LeaseStats()


# ---------------------------------------------------------------- uncached suffix

SUFFIX_CASES = [
    ("no cache hit: every block", ((10, 11, 12),), (FULL_16,), 0, 40, ((10, 11, 12),)),
    ("one cached block", ((10, 11, 12),), (FULL_16,), 16, 40, ((11, 12),)),
    ("an unaligned hit keeps its partial block", ((10, 11, 12),), (FULL_16,), 20, 40, ((11, 12),)),
    ("a hit up to the last block", ((10, 11, 12),), (FULL_16,), 32, 40, ((12,),)),
    ("a full hit loads nothing", ((10, 11, 12),), (FULL_16,), 40, 40, ((),)),
    ("extra allocated blocks are not loaded", ((10, 11, 12, 13),), (FULL_16,), 0, 32, ((10, 11),)),
    (
        "an SSM group loads its last block",
        ((1, 2), (7, 8)),
        (FULL_16, SSM_64),
        16,
        32,
        ((2,), (8,)),
    ),
    (
        "an SSM group on a full hit loads nothing",
        ((1, 2), (8,)),
        (FULL_16, SSM_64),
        32,
        32,
        ((), ()),
    ),
]


@pytest.mark.parametrize(
    ("block_ids", "groups", "num_cached", "num_tokens", "expected"),
    [c[1:] for c in SUFFIX_CASES],
    ids=[c[0] for c in SUFFIX_CASES],
)
def test_uncached_suffix_blocks(block_ids, groups, num_cached, num_tokens, expected) -> None:  # type: ignore[no-untyped-def]
    assert (
        uncached_suffix_blocks(
            block_ids, groups, num_cached_tokens=num_cached, num_tokens=num_tokens
        )
        == expected
    )


SUFFIX_ERRORS = [
    ("too few blocks", ((10,),), (FULL_16,), 0, 17, "1 block.*cannot hold 17 tokens"),
    ("a missing group", ((10,),), (FULL_16, SSM_64), 0, 8, "1 block group.*spec has 2"),
    ("an SSM group without blocks", ((10,), ()), (FULL_16, SSM_64), 0, 8, "SSM.*no block"),
    ("more cached than total", ((10,),), (FULL_16,), 9, 8, "outside"),
]


@pytest.mark.parametrize(
    ("block_ids", "groups", "num_cached", "num_tokens", "message"),
    [c[1:] for c in SUFFIX_ERRORS],
    ids=[c[0] for c in SUFFIX_ERRORS],
)
def test_uncached_suffix_blocks_errors(block_ids, groups, num_cached, num_tokens, message) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(TransferPlanError, match=message):
        uncached_suffix_blocks(
            block_ids, groups, num_cached_tokens=num_cached, num_tokens=num_tokens
        )


# ---------------------------------------------------------------- exactly once: prefill

TP_SIZE = 2
IDS = [f"r{i}" for i in range(4)]
request_ids = st.sampled_from(IDS)
ranks = st.integers(0, TP_SIZE - 1)

prefill_actions = st.lists(
    st.one_of(
        st.tuples(st.just("finish"), request_ids),
        st.tuples(st.just("step"), st.none()),
        st.tuples(st.just("report"), st.tuples(ranks, request_ids)),
        st.tuples(st.just("advance"), st.floats(0.0, 20.0)),
        st.tuples(st.just("release"), request_ids),
        st.tuples(st.just("heartbeat"), request_ids),
    ),
    max_size=40,
)


@given(prefill_actions)
def test_every_prefill_request_finishes_sending_exactly_once(
    actions: list[tuple[str, object]],
) -> None:
    clock = FakeClock()
    leases = LeaseTable(30.0)
    log = MoveLog(LEASE_LIFECYCLE, LeaseState.NEW)  # only table edges, one end per lease
    producer = Producer(
        engine_id="p",
        tp_size=TP_SIZE,
        leases=leases,
        clock=clock,
        address=lambda: ("h", 1),
        on_move=log,
    )
    leased: set[str] = set()
    keys: dict[str, str] = {}  # request id -> its lease key, what the ranks count and report
    announced: set[str] = set()  # keys the ranks were told to count (sends, not yet forgotten)
    finished: list[str] = []
    for kind, arg in actions:
        if kind == "finish" and arg not in leased:
            delay, params = producer.request_finished(str(arg), ((1,),), 2, token_ids=[5, 6])
            assert delay is True and params is not None
            leased.add(str(arg))
            keys[str(arg)] = lease_key(str(arg), params["remote_lease_id"])
        elif kind == "step":
            sends, forgotten, _ = producer.take_step()
            assert not set(sends) & set(forgotten)
            assert set(forgotten) <= announced
            announced = (announced | set(sends)) - set(forgotten)
        elif kind == "report":
            rank, request_id = arg  # type: ignore[misc]
            key = keys.get(request_id, request_id)  # never leased: the bare id, stray
            producer.on_reports([WorkerReport(rank, finished_sending=(key,))])
        elif kind == "advance":
            clock.advance(float(arg))  # type: ignore[arg-type]
        elif kind == "release":
            leases.release([str(arg)])
        elif kind == "heartbeat":
            leases.extend([str(arg)], clock())
        finished += producer.take_finished()
    clock.advance(1000.0)
    producer.take_step()
    finished += producer.take_finished()
    assert sorted(finished) == sorted(leased)
    assert producer.num_leased == 0 and len(leases) == 0
    assert not log.live and log.lives_ended == dict.fromkeys(leased, 1)


# ---------------------------------------------------------------- exactly once: decode

REMOTE = RemoteSource("p", "h", 1, 1, "remote", ((1, 2, 3),))

decode_actions = st.lists(
    st.one_of(
        st.tuples(st.just("match"), st.tuples(request_ids, st.sampled_from([0, 16, 40]))),
        st.tuples(st.just("alloc"), request_ids),
        st.tuples(st.just("step"), st.none()),
        st.tuples(st.just("respond"), st.tuples(ranks, request_ids, st.booleans())),
        st.tuples(st.just("finish"), request_ids),
    ),
    max_size=50,
)


class FakeRanks:
    """Worker ranks: each instruction (load or release) gets one answer per rank, in order."""

    def __init__(self) -> None:
        self.pending: dict[str, set[int]] = {}  # request id -> ranks yet to answer

    def instruct(self, request_id: str) -> None:
        assert request_id not in self.pending, "one instruction per request at a time"
        self.pending[request_id] = set(range(TP_SIZE))

    def respond(self, rank: int, request_id: str, ok: bool) -> list[WorkerReport]:
        if rank not in self.pending.get(request_id, set()):
            return []
        self.pending[request_id].discard(rank)
        if not self.pending[request_id]:
            del self.pending[request_id]
        if ok:
            return [WorkerReport(rank, finished_recving=(request_id,))]
        return [WorkerReport(rank, failed_recving={request_id: failure("boom")})]


@given(decode_actions)
def test_every_awaited_decode_request_is_reported_exactly_once(
    actions: list[tuple[str, object]],
) -> None:
    log = MoveLog(
        REQUEST_LOAD_LIFECYCLE, RequestLoadState.NEW
    )  # only table edges, one end per life
    heartbeats = RecordingHeartbeats()
    consumer = Consumer(
        groups=(FULL_16,),
        tp_size=TP_SIZE,
        heartbeats=heartbeats,
        keepalive=heartbeats.keep_alive(interval_s=5.0, stall_limit_s=30.0, clock=FakeClock()),
        siblings=SiblingLoads(max_wait_s=30.0, clock=FakeClock()),
        on_move=log,
    )
    workers = FakeRanks()
    matched: set[str] = set()  # gnnmt said (n, True) and the engine has not finished the request
    waiting: set[str] = set()  # allocated and loading: the engine waits for a report
    finished: set[str] = set()  # the engine called request_finished
    held: set[str] = set()  # request_finished said (True, None): blocks held until reported
    reported: list[str] = []

    def collect() -> None:
        done, failed = consumer.take_finished()
        for request_id in [*done, *failed]:
            assert request_id in waiting or request_id in held or request_id in matched
            waiting.discard(request_id)
            held.discard(request_id)
            reported.append(request_id)

    def step() -> None:
        loads, releases = consumer.take_step()
        for spec in [*loads, *releases]:
            workers.instruct(spec.request_id)
        collect()

    for kind, arg in actions:
        if kind == "match":
            request_id, num_cached = arg  # type: ignore[misc]
            if request_id in finished:
                continue
            _, load = consumer.get_num_new_matched_tokens(request_id, REMOTE, 40, num_cached)
            if load:
                matched.add(request_id)
        elif kind == "alloc" and arg in matched and arg not in finished:
            consumer.update_state_after_alloc(str(arg), ((10, 11, 12),), 1)
            waiting.add(str(arg))
            matched.discard(str(arg))
        elif kind == "step":
            step()
        elif kind == "respond":
            rank, request_id, ok = arg  # type: ignore[misc]
            consumer.on_reports(workers.respond(rank, request_id, ok))
            collect()
        elif kind == "finish" and arg not in finished:
            finished.add(str(arg))
            matched.discard(str(arg))
            if consumer.request_finished(str(arg), REMOTE)[0]:
                held.add(str(arg))
            else:
                waiting.discard(str(arg))
    # Drain: the engine finishes everything; ranks answer every instruction.
    for request_id in IDS:
        if request_id not in finished and consumer.request_finished(request_id, REMOTE)[0]:
            held.add(request_id)
    for _ in range(3):
        step()
        for request_id in list(workers.pending):
            for rank in range(TP_SIZE):
                consumer.on_reports(workers.respond(rank, request_id, True))
        collect()
    assert len(reported) == len(set(reported)), f"reported twice: {reported}"
    assert not held, f"held but never reported: {held}"
    assert consumer.num_tracked == 0 and not log.live


def test_a_stale_release_or_heartbeat_for_an_earlier_lease_of_the_same_id_touches_nothing() -> None:
    """A router reused request id "r": the first lease ended, a second holds other blocks.
    Decode's late messages for the first name its lease key and must leave the second alone."""
    table = LeaseTable(30.0)
    table.lease("r", 0.0, "first")
    table.complete("r")
    table.lease("r", 0.0, "second")  # held until 30.0
    assert table.extend([lease_key("r", "first")], 29.0) == 0
    assert table.release([lease_key("r", "first")]) == 0
    assert table.held([("r", "second")], 30.5) == (False,), "the stale heartbeat extended it"
    assert table.held([("r", "second")], 29.5) == (True,), "the stale release ended it"
    assert table.stats == LeaseStats(stray_already_ended=2)
    assert table.release([lease_key("r", "second")]) == 1
