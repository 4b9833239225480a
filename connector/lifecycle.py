"""Lifecycles as data: a state enum plus the table of moves it allows.

Every record with a lifecycle (a decode load in the scheduler, a load on a worker rank, a
prefill lease, a peer) keeps one state field and moves it only through its table's ``move``,
so the legal paths are written down in one place and property tests can walk them.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable, Mapping
from typing import Any, Generic, TypeVar

from connector.errors import IllegalTransition

State = TypeVar("State", bound=enum.Enum)
_NOWHERE: frozenset[Any] = frozenset()


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
            allowed = sorted(state.name for state in self.moves.get(current, frozenset()))
            raise IllegalTransition(
                f"{self.name}: {subject} cannot go from {current.name} to {target.name} "
                f"(allowed from {current.name}: {', '.join(allowed) or 'nothing'}); this is "
                "a connector bug, please report it with the log above"
            )
        return target
