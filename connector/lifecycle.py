"""Lifecycles as data: a state enum plus the table of moves it allows, and the Book that keeps
records moving only through it.

Every record with a lifecycle (a decode load in the scheduler, a load on a worker rank, a
prefill lease, a peer) keeps one state field and moves it only through its table's ``move``,
so the legal paths are written down in one place and property tests can walk them. A ``Book``
holds one lifecycle's records by request id and is the only place their ``state`` changes; a
record that reaches a terminal state leaves the book: deleting it is the cleanup.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Collection, Iterable, Mapping
from typing import Any, Generic, Protocol, TypeVar

from connector.errors import IllegalTransition

State = TypeVar("State", bound=enum.Enum)
_NOWHERE: frozenset[Any] = frozenset()


class LifecycleState(enum.Enum):
    """Base of the scheduler side's state enums: members are singletons, so they hash by
    identity in C (Enum's own __hash__ is a Python call, and each move hashes several)."""

    __hash__ = object.__hash__


class TransitionTable(Generic[State]):
    """The moves a lifecycle allows: state -> the states it may go to next."""

    def __init__(self, name: str, moves: Mapping[State, Iterable[State]]) -> None:
        self.name = name
        self.moves: dict[State, frozenset[State]] = {
            state: frozenset(targets) for state, targets in moves.items()
        }

    @property
    def terminal(self) -> frozenset[State]:
        """States with no way out."""
        return frozenset(state for state, targets in self.moves.items() if not targets)

    def allows(self, current: State, target: State) -> bool:
        return target in self.moves.get(current, _NOWHERE)

    def move(self, subject: str, current: State, target: State) -> State:
        """``target`` if the table allows current -> target; else raise IllegalTransition
        naming ``subject`` (the record, e.g. "load of request r1")."""
        if target not in self.moves.get(current, _NOWHERE):
            allowed = sorted(state.name for state in self.moves.get(current, _NOWHERE))
            raise IllegalTransition(
                f"{self.name}: {subject} cannot go from {current.name} to {target.name} "
                f"(allowed from {current.name}: {', '.join(allowed) or 'nothing'}); this is "
                "a connector bug, please report it with the log above"
            )
        return target


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
        self._on_leave: Callable[[str], None] = on_leave or (lambda request_id: None)
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

    def count(self, *states: State) -> int:
        return sum(len(self._by_state[state]) for state in states)

    def __len__(self) -> int:
        return len(self._records)
