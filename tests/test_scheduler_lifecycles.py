"""The scheduler's lifecycles walked: a hypothesis state machine drives Consumer with vLLM's
calls in any interleaving (repeated, late, for unknown ids, ids reused after they finished)
and the ranks answering in any order, while MoveLog checks only table edges are taken; named
paths through Consumer and Producer together take every edge of the load and lease tables.
"""

from __future__ import annotations

import collections

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from connector.metadata import RemoteSource, WorkerReport
from connector.protocol import lease_key
from scheduler.consumer import Consumer
from scheduler.leases import LeaseTable
from scheduler.producer import LEASE_LIFECYCLE, LeaseState, Producer
from scheduler.requests import REQUEST_LOAD_LIFECYCLE, RequestLoadState, SiblingLoads
from tests.scheduler_helpers import (
    FULL_16,
    REMOTE_PARAMS,
    FakeClock,
    MoveLog,
    RecordingHeartbeats,
    failure,
)

TP_SIZE = 2
NUM_TOKENS = 40
REQUEST_IDS = ("r0", "r1")
IDS = st.sampled_from(REQUEST_IDS)
RANKS = st.integers(0, TP_SIZE - 1)
SOURCE = RemoteSource("p", "h", 1, 1, "remote", ((1, 2, 3),))
_L = RequestLoadState
KEPT = {_L.CLAIMED, _L.MATCHED, _L.ALLOCATED, _L.LOADING, _L.DRAINING}  # prefill holds the KV


class DecodeEngine(RuleBasedStateMachine):
    """The engine's view of each request, next to the Consumer under test.

    ``waiting``: parked for a load (claimed, then allocated with tokens to load) and not yet
    reported. ``held``: request_finished was told to keep the blocks, until reported. Every
    report must be awaited in one of those ways; blocks are kept exactly while ranks may write.
    """

    def __init__(self) -> None:
        super().__init__()
        self.log = MoveLog(REQUEST_LOAD_LIFECYCLE, RequestLoadState.NEW)
        heartbeats = RecordingHeartbeats()
        self.keepalive = heartbeats.keep_alive(
            interval_s=5.0, stall_limit_s=30.0, clock=FakeClock()
        )
        self.consumer = Consumer(
            groups=(FULL_16,),
            tp_size=TP_SIZE,
            heartbeats=heartbeats,
            keepalive=self.keepalive,
            siblings=SiblingLoads(max_wait_s=30.0, clock=FakeClock()),
            on_move=self.log,
        )
        self.claimed: set[str] = set()  # the last get_num_new_matched_tokens said (n, True)
        self.waiting: set[str] = set()
        self.held: set[str] = set()
        self.reported: set[str] = set()  # reported while the engine still runs the request
        self.refused: set[str] = set()  # params refused: never offered a load in this life
        self.parked_refused: set[str] = set()  # parked, its failed load not yet announced
        self.instructed: collections.Counter[tuple[str, int]] = collections.Counter()

    @rule(request_id=IDS, num_cached=st.sampled_from([0, 16, 40]))
    def match(self, request_id: str, num_cached: int) -> None:
        if request_id in self.held:
            return  # finished: the engine never asks again for this life
        num_tokens, pending = self.consumer.get_num_new_matched_tokens(
            request_id, SOURCE, NUM_TOKENS, num_cached
        )
        assert pending is (num_tokens > 0)
        if request_id in self.waiting | self.reported | self.refused:
            assert not pending, "a parked, reported or refused load was offered again"
        elif pending:
            self.claimed.add(request_id)
        else:
            self.claimed.discard(request_id)

    def _unread_or_new(self, request_id: str) -> bool:
        record = self.consumer.record(request_id)
        return record is None or record.state is RequestLoadState.CLAIMED

    @rule(request_id=IDS, num_cached=st.sampled_from([0, 16]))
    def claim(self, request_id: str, num_cached: int) -> None:
        """Params bound at allocation: claimed on their word (SchedulerConnector claims only
        a new request or one still unread)."""
        if request_id in self.held or not self._unread_or_new(request_id):
            return
        num_tokens, pending = self.consumer.claim(
            request_id, NUM_TOKENS - num_cached, num_cached, REMOTE_PARAMS
        )
        assert (num_tokens, pending) == (NUM_TOKENS - num_cached, True)
        assert request_id not in self.waiting | self.reported | self.refused
        self.claimed.add(request_id)

    @rule(request_id=IDS, num_cached=st.sampled_from([0, 16, 40]))
    def refuse(self, request_id: str, num_cached: int) -> None:
        """Params refused at an ask (an unread claim is read at an ask only with nothing to
        load)."""
        record = self.consumer.record(request_id)
        num_new = NUM_TOKENS - num_cached
        if request_id in self.held or not self._unread_or_new(request_id):
            return
        if record is not None and num_new > 0:
            return
        _, pending = self.consumer.refuse(request_id, "bad params", num_new)
        assert pending is (record is None and num_new > 0)
        self.refused.add(request_id)
        if pending:
            self.claimed.add(request_id)
        else:
            self.claimed.discard(request_id)

    @rule(request_id=IDS, parked=st.booleans())
    def refuse_at_allocation(self, request_id: str, parked: bool) -> None:
        """A claim whose params, read at allocation, give no load."""
        record = self.consumer.record(request_id)
        if request_id not in self.claimed or record is None:
            return
        if record.state is not RequestLoadState.CLAIMED:
            return
        self.claimed.discard(request_id)
        self.consumer.refuse_claim(request_id, "changed", 24 if parked else 0)
        self.refused.add(request_id)
        if parked:
            self.parked_refused.add(request_id)

    @rule(request_id=IDS)
    def drop(self, request_id: str) -> None:
        """A claim whose params ask for no load at allocation, with nothing parked."""
        record = self.consumer.record(request_id)
        if request_id not in self.claimed or record is None:
            return
        if record.state is RequestLoadState.CLAIMED:
            self.claimed.discard(request_id)
            self.consumer.drop_claim(request_id)

    @precondition(lambda self: bool(self.claimed))
    @rule(request_id=IDS, load=st.booleans(), num_blocks=st.sampled_from([1, 3]))
    def alloc(self, request_id: str, load: bool, num_blocks: int) -> None:
        """One block is too few for the prompt: the load cannot be planned and fails."""
        if request_id not in self.claimed:
            return  # vLLM allocates external tokens only for a claimed load
        self.claimed.discard(request_id)
        record = self.consumer.record(request_id)
        state = None if record is None else record.state
        if state is RequestLoadState.CLAIMED:  # read at allocation, as SchedulerConnector does
            assert record is not None
            self.consumer.get_num_new_matched_tokens(
                request_id, SOURCE, NUM_TOKENS, record.num_cached_tokens
            )
        elif state in (RequestLoadState.REFUSING, RequestLoadState.REFUSED):
            self.consumer.refuse_claim(request_id, "", 24 if load else 0)
            if load and state is RequestLoadState.REFUSING:
                self.parked_refused.add(request_id)
            return
        block_ids = ((10, 11, 12)[:num_blocks],)
        self.consumer.update_state_after_alloc(request_id, block_ids, 24 if load else 0)
        if load:
            self.waiting.add(request_id)

    @rule()
    def step(self) -> None:
        loads, releases = self.consumer.take_step()
        for spec in [*loads, *releases]:
            for tp_rank in range(TP_SIZE):
                self.instructed[spec.request_id, tp_rank] += 1
        self.collect()

    @rule(request_id=IDS, tp_rank=RANKS, ok=st.booleans(), asked=st.booleans())
    def respond(self, request_id: str, tp_rank: int, ok: bool, asked: bool) -> None:
        """A rank answers an instruction, or (``asked`` False) reports out of the blue."""
        if asked:
            if self.instructed[request_id, tp_rank] == 0:
                return
            self.instructed[request_id, tp_rank] -= 1
        failed = {} if ok else {request_id: failure("boom")}
        finished = (request_id,) if ok else ()
        report = WorkerReport(tp_rank, finished_recving=finished, failed_recving=failed)
        self.consumer.on_reports([report])
        self.collect()

    @precondition(lambda self: any(self.instructed.values()))
    @rule(request_id=IDS, ok=st.booleans())
    def answer_all(self, request_id: str, ok: bool) -> None:
        """Every rank answers every instruction it holds for ``request_id``."""
        for tp_rank in range(TP_SIZE):
            for _ in range(self.instructed[request_id, tp_rank]):
                self.respond(request_id, tp_rank, ok, True)

    @rule(request_id=IDS, failed=st.booleans())
    def engine_outcome(self, request_id: str, failed: bool) -> None:
        self.consumer.on_engine_outcomes([request_id], [request_id] if failed else [])
        self.collect()

    @rule(request_id=IDS)
    def finish(self, request_id: str) -> None:
        if request_id in self.held:
            return  # vLLM finishes a request once
        delay, _ = self.consumer.request_finished(request_id, SOURCE)
        assert delay is (request_id in self.waiting), "blocks kept iff ranks may still write"
        self.claimed.discard(request_id)
        self.reported.discard(request_id)
        self.refused.discard(request_id)
        if delay:
            self.waiting.discard(request_id)
            self.held.add(request_id)

    def collect(self) -> None:
        for request_id in self.consumer.take_refused():
            assert request_id in self.parked_refused, f"{request_id} announced twice or unparked"
            self.parked_refused.discard(request_id)
        done, failed = self.consumer.take_finished()
        for request_id in [*done, *failed]:
            assert request_id in self.waiting | self.held, f"{request_id} reported unawaited"
            if request_id in self.waiting:
                self.reported.add(request_id)
            self.waiting.discard(request_id)
            self.held.discard(request_id)

    @invariant()
    def the_book_matches_the_moves(self) -> None:
        assert self.consumer.num_tracked == len(self.log.live)

    @invariant()
    def exactly_the_records_prefill_must_keep_are_heartbeated(self) -> None:
        """Every way out of the heartbeating states drops the lease from the registry, and
        claims are held while their params are unread (raw params, as SchedulerConnector
        passes them), so no lease is heartbeated past its need, nor one missed."""
        expected = {request_id for request_id, state in self.log.live.items() if state in KEPT}
        assert self.keepalive.held_ids() == expected

    def teardown(self) -> None:
        """The engine finishes everything and the ranks answer every instruction."""
        for request_id in REQUEST_IDS:
            self.finish(request_id)
        for _ in range(3):
            self.step()
            for request_id in REQUEST_IDS:
                self.answer_all(request_id, True)
        assert not self.held, f"blocks held but never reported: {self.held}"
        assert not self.parked_refused, f"parked, refused, never announced: {self.parked_refused}"
        assert self.consumer.num_tracked == 0 and not self.log.live
        assert self.keepalive.held_ids() == frozenset(), "a lease heartbeated past its need"
        assert not self.consumer.has_pending_work


# Named paths that together take every edge of the table, each ending in teardown's checks.
PATHS = {
    "load, report, finish": "match 16, alloc 3, step, answer ok, finish",
    "load fails on a rank": "match 0, alloc 3, step, answer fail, finish",
    "abort while loading": "match 16, alloc 3, step, finish, answer ok",
    "abort after allocation": "match 16, alloc 3, finish, step, answer fail",
    "the prefix hit grows to full": "match 0, match 16, match 40, step, answer ok",
    "the engine loads nothing after all": "match 16, alloc 0, step, answer ok",
    "full prefix hit": "match 40, step, answer ok, finish",
    "unplannable, ranks ack first": "match 16, alloc 1, step, answer ok, finish",
    "unplannable, finished first": "match 16, alloc 1, step, finish, step, answer ok",
    "abort before allocation": "match 16, finish, step, answer ok",
    "claimed, read at allocation, loaded": "claim 16, alloc 3, step, answer ok, finish",
    "claimed, read at an ask with nothing left": "claim 16, match 40, step, finish",
    "claimed, finished unread": "claim 16, finish",
    "claimed, refused when read at allocation": "claim 16, refusealloc, step, finish",
    "claimed, asking for no load at allocation": "claim 0, drop",
    "refused, parked, announced": "refuse 16, alloc 3, step, finish",
    "refused, finished before it was parked": "refuse 16, finish",
    "refused with nothing to load": "refuse 40, finish",
}


@pytest.mark.parametrize("path", PATHS.values(), ids=PATHS.keys())
def test_named_paths_end_cleanly(path: str) -> None:
    walk(path)


def test_the_named_paths_take_every_edge_of_the_load_table() -> None:
    taken = set().union(*(walk(path).log.edges for path in PATHS.values()))
    every = {
        (current, target)
        for current, targets in REQUEST_LOAD_LIFECYCLE.moves.items()
        for target in targets
    }
    assert every - taken == set()


def walk(path: str) -> DecodeEngine:
    engine = DecodeEngine()
    for call in path.split(", "):
        name, _, arg = call.partition(" ")
        if name == "match":
            engine.match("r0", int(arg))
        elif name == "alloc":
            engine.alloc("r0", arg != "0", int(arg) or 3)
        elif name == "answer":
            engine.answer_all("r0", arg == "ok")
        elif name == "finish":
            engine.finish("r0")
        elif name == "claim":
            engine.claim("r0", int(arg))
        elif name == "refuse":
            engine.refuse("r0", int(arg))
        elif name == "refusealloc":
            engine.refuse_at_allocation("r0", True)
        elif name == "drop":
            engine.drop("r0")
        else:
            engine.step()
        engine.exactly_the_records_prefill_must_keep_are_heartbeated()
    engine.teardown()
    return engine


DecodeEngine.TestCase.settings = settings(max_examples=200, stateful_step_count=40, deadline=None)
test_the_decode_load_lifecycle_under_any_engine_order = DecodeEngine.TestCase


# ---------------------------------------------------------------- the prefill lease

# path -> (ids in sends, ids in forgotten): the ranks forget only what they were sent.
LEASE_PATHS = {
    "announced, then every rank freed it": ("finish, step, report 0, report 1", 1, 0),
    "every rank reported before the sends went out": ("finish, report 0, report 1, step", 0, 0),
    "expired before the sends went out": ("finish, expire, step", 0, 0),
    "expired after the sends": ("finish, step, expire, step", 1, 1),
    "released before the sends went out": ("finish, release, step", 0, 0),
    "released after the sends": ("finish, step, release, step", 1, 1),
}


@pytest.mark.parametrize(
    ("path", "num_sends", "num_forgotten"), LEASE_PATHS.values(), ids=LEASE_PATHS.keys()
)
def test_every_lease_path_frees_once_and_tells_the_ranks_consistently(
    path: str, num_sends: int, num_forgotten: int
) -> None:
    log, sends, forgotten, finished = lease_walk(path)
    assert finished == ["p1"] and log.lives_ended == {"p1": 1}
    # The ranks count by lease key ("p1@<lease id>"), never by the bare request id.
    assert len(set(sends + forgotten)) <= 1
    assert all(key.startswith("p1@") for key in sends + forgotten)
    assert (len(sends), len(forgotten)) == (num_sends, num_forgotten)


def test_the_lease_paths_take_every_edge_of_the_lease_table() -> None:
    taken = set().union(*(lease_walk(path)[0].edges for path, _, _ in LEASE_PATHS.values()))
    every = {
        (current, target)
        for current, targets in LEASE_LIFECYCLE.moves.items()
        for target in targets
    }
    assert every - taken == set()


def lease_walk(path: str) -> tuple[MoveLog, list[str], list[str], list[str]]:
    """Drive one prefill request "p1" along ``path``: (moves, sends, forgotten, finished)."""
    clock = FakeClock()
    leases = LeaseTable(30.0)
    log = MoveLog(LEASE_LIFECYCLE, LeaseState.NEW)
    producer = Producer(
        engine_id="p",
        tp_size=TP_SIZE,
        leases=leases,
        clock=clock,
        address=lambda: ("h", 1),
        on_move=log,
    )
    sends: list[str] = []
    forgotten: list[str] = []
    key = ""  # the lease key the ranks count p1's notifications by, once leased
    for call in path.split(", "):
        name, _, arg = call.partition(" ")
        if name == "finish":
            delay, params = producer.request_finished("p1", ((1,),), 2, token_ids=[5, 6])
            assert delay is True and params is not None
            key = lease_key("p1", params["remote_lease_id"])
        elif name == "report":
            producer.on_reports([WorkerReport(int(arg), finished_sending=(key,))])
        elif name == "expire":
            clock.advance(31.0)
        elif name == "release":
            leases.release([key])  # the lease's key, as decode names it
        else:
            step_sends, step_forgotten, _ = producer.take_step()  # no digests: verify_kv off
            sends += step_sends
            forgotten += step_forgotten
    assert not producer.has_pending_work and len(leases) == 0 and not log.live
    return log, sends, forgotten, list(producer.take_finished())
