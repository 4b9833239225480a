"""Scheduler-side request lifecycles as data: each record's states and the moves between them.

Two lifecycles live here: a request's load in the scheduler (Consumer: the one record of a
decode request, claim to finish) and a prefill lease (Producer). ``Book`` holds one lifecycle's records by request id and is the only place their
``state`` changes, always through the lifecycle's TransitionTable. A record that reaches a
terminal state leaves the book: deleting it is the cleanup.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Collection, Iterator
from typing import Any, Generic, Protocol, TypeVar

from connector.errors import IllegalTransition
from connector.lifecycle import TransitionTable


class LifecycleState(enum.Enum):
    """Base of the scheduler side's state enums: members are singletons, so they hash by
    identity in C (Enum's own __hash__ is a Python call, and each move hashes several)."""

    __hash__ = object.__hash__


class RequestLoadState(LifecycleState):
    """Where one request's load stands in the scheduler: the request's only record there,
    from the engine's first ask to request_finished (scheduler/consumer.py)."""

    NEW = enum.auto()  # record made; moved on before the call that made it returns
    CLAIMED = enum.auto()  # tokens claimed on the params' word; params unread (bind at alloc)
    REFUSING = enum.auto()  # params refused; tokens claimed so the engine parks the request
    REFUSED = enum.auto()  # params refused (announced as a failed load if parked): never loads
    MATCHED = enum.auto()  # params read; get_num_new_matched_tokens claimed its tokens
    ALLOCATED = enum.auto()  # decode's blocks known; its LoadSpec goes out at the next step
    LOADING = enum.auto()  # LoadSpec sent; the engine waits for every rank's report
    DRAINING = enum.auto()  # request finished while ranks hold its blocks; report, then forget
    REPORTED = enum.auto()  # reported to the engine; forgotten at request_finished
    REPORTED_RELEASING = enum.auto()  # reported failed (unplannable); ranks still ack a release
    RELEASING = enum.auto()  # release only: ranks ack a ReleaseSpec; the engine waits for nothing
    RELEASED = enum.auto()  # prefill told to free, the request lives on: it never loads again
    ENDED = enum.auto()


_L = RequestLoadState
# No way leads from RELEASING, RELEASED or REFUSED back to LOADING: once prefill was told
# to free (or the params were refused) the request never reads a block again.
REQUEST_LOAD_LIFECYCLE = TransitionTable(
    "request load",
    {
        _L.NEW: {_L.CLAIMED, _L.REFUSING, _L.REFUSED, _L.MATCHED},
        # read at allocation (or at an ask with nothing left to load): valid, refused, or
        # asking for no load with nothing parked (ENDED; also finished while unread)
        _L.CLAIMED: {_L.MATCHED, _L.REFUSED, _L.ENDED},
        _L.REFUSING: {_L.REFUSED, _L.ENDED},  # REFUSED at allocation (announced if parked)
        _L.REFUSED: {_L.ENDED},  # at request_finished
        # asked again before allocation: no move; nothing to load at allocation: release only
        _L.MATCHED: {_L.ALLOCATED, _L.RELEASING},
        _L.ALLOCATED: {_L.LOADING, _L.DRAINING, _L.REPORTED_RELEASING},
        _L.LOADING: {_L.DRAINING, _L.REPORTED},
        _L.DRAINING: {_L.ENDED},
        _L.REPORTED: {_L.ENDED},
        _L.REPORTED_RELEASING: {_L.REPORTED, _L.RELEASING},
        _L.RELEASING: {_L.ENDED, _L.RELEASED},  # RELEASED: acked while the request lives
        _L.RELEASED: {_L.ENDED},  # at request_finished
        _L.ENDED: (),
    },
)


class LeaseState(LifecycleState):
    """Where one prefill lease stands: its blocks stay held until it ends."""

    NEW = enum.auto()
    LEASED = enum.auto()  # blocks held; the ranks hear of it in the next metadata's sends
    ANNOUNCED = enum.auto()  # in a sends: the ranks count its decode readers' free notifications
    COMPLETED = enum.auto()  # every rank saw its free notifications
    EXPIRED = enum.auto()  # no heartbeat kept it alive
    RELEASED = enum.auto()  # decode said over the side channel it will never read


_P = LeaseState
LEASE_LIFECYCLE = TransitionTable(
    "prefill lease",
    {
        _P.NEW: {_P.LEASED},
        _P.LEASED: {_P.ANNOUNCED, _P.COMPLETED, _P.EXPIRED, _P.RELEASED},
        _P.ANNOUNCED: {_P.COMPLETED, _P.EXPIRED, _P.RELEASED},
        _P.COMPLETED: (),
        _P.EXPIRED: (),
        _P.RELEASED: (),
    },
)

State = TypeVar("State", bound=enum.Enum)


class Stateful(Protocol):
    state: Any  # the record's lifecycle state: read freely, written only by Book.move


Record = TypeVar("Record", bound=Stateful)
OnMove = Callable[[str, Any, Any], None]  # (request id, from state, to state): tests watch moves


class Book(Generic[State, Record]):
    """One lifecycle's records by request id, also indexed by state (in arrival order) so a
    caller can walk e.g. the ALLOCATED loads without scanning every record."""

    def __init__(
        self,
        table: TransitionTable[State],
        *,
        what: str,
        on_move: OnMove | None = None,
        watched: Collection[State] = (),
        on_leave: Callable[[str], None] | None = None,
    ) -> None:
        """``on_leave(request_id)`` runs whenever a record moves from a ``watched`` state to
        one that is not (a terminal one included): one place sees every way out."""
        self._table = table
        self._what = what  # names the record in errors, e.g. "load"
        self._on_move = on_move
        self._watched = frozenset(watched) if on_leave is not None else frozenset()
        self._on_leave: Callable[[str], None] = on_leave or _ignore
        self._terminal = table.terminal
        self._moves = table.moves  # read on every move: one dict lookup, no call
        self._records: dict[str, Record] = {}
        # The record of an id, or None: the dict's own get, so a lookup runs no Python frame.
        self.get: Callable[[str], Record | None] = self._records.get
        self._by_state: dict[State, dict[str, None]] = {state: {} for state in table.moves}

    def add(self, request_id: str, record: Record) -> Record:
        """Take in a record in its first state; the caller moves it on."""
        if request_id in self._records:
            raise IllegalTransition(
                f"{self._table.name}: request {request_id} already has a {self._what} in state "
                f"{self._records[request_id].state.name}; this is a connector bug, please "
                "report it with the log above"
            )
        self._records[request_id] = record
        self._by_state[record.state][request_id] = None
        return record

    def start(self, request_id: str, record: Record, state: State) -> Record:
        """``add`` then ``move`` to ``state``, in one step (the hooks start records often)."""
        initial = record.state
        if request_id in self._records or state not in self._moves[initial]:
            self.add(request_id, record)  # raises for a duplicate id
            return self.move(request_id, state)  # raises for an illegal first move
        record.state = state
        self._records[request_id] = record
        if state in self._terminal:
            del self._records[request_id]
        else:
            self._by_state[state][request_id] = None
        if self._on_move is not None:
            self._on_move(request_id, initial, state)
        return record

    def move(self, request_id: str, target: State) -> Record:
        """Move the record along the table (IllegalTransition if it may not); a terminal
        target removes it. Returns the record."""
        record = self._records[request_id]
        current = record.state
        if target not in self._moves[current]:  # the table names the illegal move and raises
            self._table.move(f"{self._what} of request {request_id}", current, target)
        record.state = target
        del self._by_state[current][request_id]
        if target in self._terminal:
            del self._records[request_id]
        else:
            self._by_state[target][request_id] = None
        watched = self._watched
        if current in watched and target not in watched:
            self._on_leave(request_id)
        if self._on_move is not None:
            self._on_move(request_id, current, target)
        return record

    def ids(self, state: State) -> tuple[str, ...]:
        """The ids in ``state``, oldest arrival first."""
        return tuple(self._by_state[state])

    def in_state(self, state: State) -> list[tuple[str, Record]]:
        """The (id, record) pairs in ``state``, oldest arrival first: a snapshot, so the
        caller may move them."""
        records = self._records
        return [(request_id, records[request_id]) for request_id in self._by_state[state]]

    def records(self, *states: State) -> Iterator[tuple[str, Record]]:
        """The records in any of ``states``, oldest arrival first (a walk over every record)."""
        wanted = frozenset(states)
        for request_id, record in self._records.items():
            if record.state in wanted:
                yield request_id, record

    def count(self, *states: State) -> int:
        return sum(len(self._by_state[state]) for state in states)

    def __len__(self) -> int:
        return len(self._records)


def _ignore(request_id: str) -> None:
    """A Book's on_leave when nothing watches."""
