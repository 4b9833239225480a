"""Lifecycles as data: connector/lifecycle.py's TransitionTable, the scheduler's Book that moves
records through one, and the shape of every scheduler-side table (total, reachable, ends)."""

from __future__ import annotations

import dataclasses
import enum
from typing import Any

import pytest

from connector.errors import IllegalTransition
from connector.lifecycle import Book, TransitionTable
from scheduler.producer import LEASE_LIFECYCLE, LeaseState
from scheduler.requests import REQUEST_LOAD_LIFECYCLE, RequestLoadState
from tests.scheduler_helpers import MoveLog


class Light(enum.Enum):
    GREEN = enum.auto()
    AMBER = enum.auto()
    RED = enum.auto()
    BROKEN = enum.auto()


LIGHTS = TransitionTable(
    "traffic light",
    {
        Light.GREEN: {Light.AMBER, Light.BROKEN},
        Light.AMBER: {Light.RED},
        Light.RED: {Light.GREEN, Light.BROKEN},
        Light.BROKEN: (),
    },
)

MOVES = [
    ("a listed edge", Light.GREEN, Light.AMBER, True),
    ("another state's edge", Light.GREEN, Light.RED, False),
    ("staying put when no self-edge is listed", Light.RED, Light.RED, False),
    ("out of a terminal state", Light.BROKEN, Light.GREEN, False),
]


@pytest.mark.parametrize(
    ("current", "target", "allowed"), [c[1:] for c in MOVES], ids=[c[0] for c in MOVES]
)
def test_the_table_allows_exactly_its_edges(current: Light, target: Light, allowed: bool) -> None:
    assert LIGHTS.allows(current, target) is allowed
    if allowed:
        assert LIGHTS.move("light 1", current, target) is target
    else:
        with pytest.raises(IllegalTransition, match=f"cannot go from {current.name}"):
            LIGHTS.move("light 1", current, target)


def test_an_illegal_move_names_the_table_the_record_and_the_way_out() -> None:
    message = (
        "traffic light: light 7 cannot go from AMBER to GREEN (allowed from AMBER: RED); "
        "this is a connector bug"
    )
    with pytest.raises(IllegalTransition, match=message.replace("(", r"\(").replace(")", r"\)")):
        LIGHTS.move("light 7", Light.AMBER, Light.GREEN)
    with pytest.raises(IllegalTransition, match="allowed from BROKEN: nothing"):
        LIGHTS.move("light 7", Light.BROKEN, Light.RED)


def test_terminal_states_are_those_without_a_way_out() -> None:
    assert LIGHTS.terminal == {Light.BROKEN}


# ---------------------------------------------------------------- the scheduler's tables

TABLES = [
    ("decode load", REQUEST_LOAD_LIFECYCLE, RequestLoadState, {RequestLoadState.ENDED}),
    (
        "prefill lease",
        LEASE_LIFECYCLE,
        LeaseState,
        {LeaseState.COMPLETED, LeaseState.EXPIRED, LeaseState.RELEASED},
    ),
]
TABLE_IDS = [c[0] for c in TABLES]


def _reachable(table: TransitionTable[Any], start: enum.Enum) -> set[enum.Enum]:
    seen, frontier = {start}, [start]
    while frontier:
        for target in table.moves[frontier.pop()]:
            if target not in seen:
                seen.add(target)
                frontier.append(target)
    return seen


@pytest.mark.parametrize(("table", "states", "terminal"), [c[1:] for c in TABLES], ids=TABLE_IDS)
def test_every_lifecycle_starts_at_new_reaches_every_state_and_can_always_end(
    table: TransitionTable[Any], states: type[enum.Enum], terminal: set[enum.Enum]
) -> None:
    assert set(table.moves) == set(states), "every state has a row"
    assert table.terminal == terminal
    assert _reachable(table, states["NEW"]) == set(states)
    assert not any(states["NEW"] in targets for targets in table.moves.values())
    for state in states:
        assert _reachable(table, state) & terminal, f"{state.name} can never end"


@pytest.mark.parametrize(
    "state",
    [
        RequestLoadState.RELEASING,
        RequestLoadState.RELEASED,
        RequestLoadState.REFUSING,
        RequestLoadState.REFUSED,
        RequestLoadState.REPORTED,
    ],
    ids=lambda state: state.name,
)
def test_a_released_refused_or_reported_request_can_never_load_again(
    state: RequestLoadState,
) -> None:
    """Issue 19: prefill's blocks may be reused once it was told to free them."""
    reachable = _reachable(REQUEST_LOAD_LIFECYCLE, state)
    assert RequestLoadState.LOADING not in reachable
    assert RequestLoadState.MATCHED not in reachable


# ---------------------------------------------------------------- Book


@dataclasses.dataclass
class Bulb:
    state: Light = Light.GREEN


def test_the_book_moves_records_along_the_table_and_drops_them_at_the_end() -> None:
    log = MoveLog(LIGHTS, Light.GREEN)
    book: Book[Light, Bulb] = Book(LIGHTS, what="bulb", on_move=log)
    first = book.add("b1", Bulb())
    book.add("b2", Bulb())
    assert book.move("b1", Light.AMBER) is first and first.state is Light.AMBER
    assert book.ids(Light.GREEN) == ("b2",) and book.ids(Light.AMBER) == ("b1",)
    assert book.count(Light.GREEN, Light.AMBER) == 2
    assert book.in_state(Light.AMBER) == [("b1", first)]
    book.move("b2", Light.BROKEN)
    assert book.get("b2") is None and len(book) == 1 and book.ids(Light.BROKEN) == ()
    assert log.live == {"b1": Light.AMBER} and log.lives_ended == {"b2": 1}


def test_an_illegal_move_in_the_book_changes_nothing() -> None:
    book: Book[Light, Bulb] = Book(LIGHTS, what="bulb")
    bulb = book.add("b1", Bulb())
    with pytest.raises(IllegalTransition, match="bulb of request b1 cannot go from GREEN to RED"):
        book.move("b1", Light.RED)
    assert bulb.state is Light.GREEN and book.ids(Light.GREEN) == ("b1",)


def test_a_second_record_for_one_request_is_a_bug() -> None:
    book: Book[Light, Bulb] = Book(LIGHTS, what="bulb")
    book.add("b1", Bulb())
    with pytest.raises(IllegalTransition, match="request b1 already has a bulb in state GREEN"):
        book.add("b1", Bulb())
