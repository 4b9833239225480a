"""Worker-side lifecycles as data: random event sequences take only table edges, and every
load ends in a terminal state exactly once (worker/load_lifecycle.py, worker/peers.py).

Loads are driven through a real LoadTable against the recording agent double, with the peer's
handshake, READ outcomes, prefill's answers to lease checks, aborts and the clock chosen by
hypothesis.
"""

from __future__ import annotations

import collections
import itertools
import logging

from hypothesis import given, settings
from hypothesis import strategies as st

from connector.errors import ConnectorError, IllegalTransition
from connector.geometry import build_rank_layout
from connector.metadata import FailureKind, LoadSpec, RemoteSource
from tests.test_worker_connector import RecordingAgent, remote_handshake, source
from tests.test_worker_parts import BASE, Clock
from worker.load_lifecycle import AFTER_READS, RANK_LOAD_LIFECYCLE, RankLoadState, lease_failure
from worker.loads import QUARANTINE_WARN_TIMEOUTS, LoadTable
from worker.nixl_api import TransferState
from worker.peers import PEER_LIFECYCLE, Peer, PeerLink, PeerState
from worker.plan.recipe import peer_plan

NUM_REQUESTS = 4
HANDSHAKE_WAIT_S = 10.0
TRANSFER_TIMEOUT_S = 30.0

EVENTS = st.lists(
    st.one_of(
        st.tuples(st.just("load"), st.integers(0, NUM_REQUESTS - 1)),
        st.tuples(st.just("abort"), st.integers(0, NUM_REQUESTS - 1)),
        st.tuples(st.sampled_from(["ready", "handshake failed", "step"]), st.just(0)),
        st.tuples(st.sampled_from(["read done", "read failed"]), st.integers(0, 7)),
        st.tuples(st.sampled_from(["lease held", "lease lost", "lease unanswered"]), st.just(0)),
        st.tuples(st.just("wait s"), st.sampled_from([1, 11, 31])),
    ),
    max_size=30,
)


class ScriptedProofs:
    """LeaseProofs' interface, answered by the test on its own thread (no check threads)."""

    def __init__(self) -> None:
        self._tickets = itertools.count(1)
        self.pending: dict[int, tuple[RemoteSource, str]] = {}  # submitted, not yet answered
        self.answers: dict[int, str | None] = {}  # answered, not yet taken
        self.proven: collections.Counter[str] = collections.Counter()  # held after the READs

    def submit(
        self,
        remote: RemoteSource,
        when: str = AFTER_READS,
        claims: tuple[object, ...] = (),
        *,
        seen_held: bool = False,
    ) -> int:
        ticket = next(self._tickets)
        self.pending[ticket] = (remote, when)
        return ticket

    def take(self, ticket: int) -> tuple[bool, str | None]:
        if ticket not in self.answers:
            return False, None
        return True, self.answers.pop(ticket)

    def abandon(self, ticket: int) -> None:
        self.pending.pop(ticket, None)
        self.answers.pop(ticket, None)

    def dispatch(self) -> None:
        pass  # the test answers what is pending when it chooses (answer_all)

    def close(self) -> None:
        pass

    def answer_all(self, held: bool | ConnectorError) -> None:
        for ticket, (remote, when) in self.pending.items():
            self.answers[ticket] = lease_failure(remote, held, when)
            self.proven[remote.remote_request_id] += held is True and when == AFTER_READS
        self.pending.clear()


class World:
    def __init__(self) -> None:
        self.clock = Clock()
        self.agent = RecordingAgent("decode-r0")
        self.proofs = ScriptedProofs()
        self.moves: list[tuple[str, RankLoadState, RankLoadState]] = []
        # Prefill TP2 -> decode TP1: two READs per load, so one can fail while one is live.
        self.peer = Peer("p", "127.0.0.1", 7001, 2, {0: 1, 1: 1})
        layout = build_rank_layout(BASE, 0, 1)
        self.table = LoadTable(
            self.agent, local_region_addresses=[1 << 20] * len(layout.region_bytes),
            clock=self.clock, transfer_timeout_s=TRANSFER_TIMEOUT_S,
            handshake_wait_s=HANDSHAKE_WAIT_S, on_peer_failure=lambda peer: None,
            proofs=self.proofs,  # type: ignore[arg-type]  # the same interface, scripted
            on_move=lambda rid, old, new: self.moves.append((rid, old, new)),
        )  # fmt: skip
        self.num_created = 0  # load records made (a request id may come back after it ended)
        self.outcomes: list[tuple[str, str | None]] = []

    def apply(self, kind: str, value: int) -> None:
        request_id = f"r{value}"
        existed = request_id in self.table
        if kind == "load":
            ids = ((2 * value, 2 * value + 1),)
            remote = source(f"p-{request_id}")
            self.table.add(LoadSpec(request_id, ids, 8, 0, remote), self.peer)
        elif kind == "abort":
            self.table.abort(request_id, source(f"p-{request_id}"), self.peer)
        elif kind == "ready" and self.peer.waiting:
            self._connect()
        elif kind == "handshake failed" and self.peer.waiting:
            self.peer.fail("connection refused")
        elif kind in ("read done", "read failed") and self.agent.reads:
            read = self.agent.reads[value % len(self.agent.reads)]
            read.state = TransferState.DONE
            read.error = "remote disconnected" if kind == "read failed" else None
        elif kind == "lease held":
            self.proofs.answer_all(True)
        elif kind == "lease lost":
            self.proofs.answer_all(False)
        elif kind == "lease unanswered":
            self.proofs.answer_all(ConnectorError("side channel h:1 did not answer"))
        elif kind == "wait s":
            self.clock.now_s += value
        self.num_created += not existed and request_id in self.table
        self.outcomes += self.table.advance()

    def _connect(self) -> None:
        handshakes = {rank: remote_handshake("p", rank, 2) for rank in (0, 1)}
        planner = peer_plan(
            build_rank_layout(BASE, 0, 1), handshakes[0].layout, duty=self.peer.duty
        )
        names = {rank: h.agent_name for rank, h in handshakes.items()}
        self.agent.remotes.update(names.values())
        self.peer.connect(PeerLink(planner, handshakes, names, {}))

    def drain(self) -> None:
        """Let everything finish: handshake answered, every READ done; bounded."""
        if self.peer.waiting:
            self._connect()
        for _ in range(5):
            for read in self.agent.reads:
                read.state = TransferState.DONE
            self.outcomes += self.table.advance()
            self.proofs.answer_all(True)
        assert len(self.table) == 0, "a load never ended"


class Errors(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.ERROR)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


@settings(max_examples=300, deadline=None)
@given(events=EVENTS)
def test_loads_take_only_table_edges_and_end_exactly_once(events: list[tuple[str, int]]) -> None:
    world = World()
    start_s = world.clock.now_s
    errors = Errors()
    logging.getLogger("worker.loads").addHandler(errors)
    try:
        for kind, value in events:
            world.apply(kind, value)
        world.drain()
    finally:
        logging.getLogger("worker.loads").removeHandler(errors)
    # The one error a load may log: a READ quarantined past QUARANTINE_WARN_TIMEOUTS timeouts is
    # stuck, an operator's matter (hypothesis finds it with five waits of 31 s).
    stuck = [message for message in errors.messages if "has not ended" in message]
    assert [message for message in errors.messages if message not in stuck] == []
    assert not stuck or world.clock.now_s - start_s > QUARANTINE_WARN_TIMEOUTS * TRANSFER_TIMEOUT_S
    for _, old, new in world.moves:
        assert RANK_LOAD_LIFECYCLE.allows(old, new), (old, new)
    ended = [rid for rid, _, new in world.moves if new in RANK_LOAD_LIFECYCLE.terminal]
    assert ended == [rid for rid, _ in world.outcomes]  # each end reported, in order
    assert len(ended) == world.num_created  # every load record ended exactly once
    assert world.peer.num_live_transfers == 0 and world.peer.num_loads == 0
    assert all(
        reason is None or reason.kind is not FailureKind.INTERNAL for _, reason in world.outcomes
    )
    # Every load here reads, so a success needs prefill's word that its lease held.
    succeeded = collections.Counter(f"p-{rid}" for rid, reason in world.outcomes if reason is None)
    assert all(count <= world.proofs.proven[remote] for remote, count in succeeded.items())
    assert not world.proofs.pending and not world.proofs.answers  # no check left behind


PEER_CALLS = st.lists(st.sampled_from(["connect", "fail", "retire", "close"]), max_size=8)


@settings(max_examples=200, deadline=None)
@given(st.sampled_from([PeerState.HANDSHAKING, PeerState.PROBING]), PEER_CALLS)
def test_peer_moves_follow_its_table_and_illegal_ones_raise(
    start: PeerState, calls: list[str]
) -> None:
    handshake = remote_handshake("p", 0, 1)
    layout = build_rank_layout(BASE, 0, 1)
    link = PeerLink(peer_plan(layout, handshake.layout), {0: handshake}, {0: "p-r0"}, {})
    peer = Peer("p", "127.0.0.1", 7001, 1, {0: 1}, start)
    for call in calls:
        before = peer.state
        try:
            {"connect": lambda: peer.connect(link), "fail": lambda: peer.fail("x"),
             "retire": lambda: peer.retire(None), "close": peer.close}[call]()  # fmt: skip
        except IllegalTransition as error:
            assert peer.state is before and "connector bug" in str(error)
            continue
        assert PEER_LIFECYCLE.allows(before, peer.state)
        assert (peer.state is PeerState.READY) <= (peer.link is not None)
