"""Prefill's chunk tracker: whole blocks of written KV, announced only after the forward."""

from __future__ import annotations

import pytest

from connector.staging import ScheduledRow
from scheduler.chunk_tracker import ChunkAnnouncement, ChunkTracker

BLOCK = 16


def _row(
    request_id: str,
    blocks: tuple[tuple[int, ...], ...] | None,
    computed: int,
    scheduled: int,
    *,
    full: bool = False,
) -> ScheduledRow:
    return ScheduledRow(request_id, blocks, full, computed, scheduled)


def test_a_chunk_is_announced_only_once_its_step_is_saved_and_only_whole_blocks() -> None:
    tracker = ChunkTracker((BLOCK,))
    assert tracker.track("r", 100)
    # step 1: tokens [0, 40) in blocks 7, 8, 9 (the third half-filled)
    assert tracker.step(1, [_row("r", ((7, 8, 9),), 0, 40, full=True)]) == ()
    assert tracker.saved(0) == []  # step 1's forward has not run on every rank
    assert tracker.saved(1) == [ChunkAnnouncement("r", ((7, 8),), 32, 1)]
    # step 2: tokens [40, 80) add blocks 3, 4 (5 blocks: 80 tokens)
    tracker.step(2, [_row("r", ((3, 4),), 40, 40)])
    assert tracker.saved(2) == [ChunkAnnouncement("r", ((7, 8, 9, 3, 4),), 80, 2)]
    assert tracker.saved(2) == []  # nothing new: no announcement


def test_with_async_scheduling_a_step_ahead_announces_only_what_the_saved_step_wrote() -> None:
    tracker = ChunkTracker((BLOCK,))
    tracker.track("r", 64)
    tracker.step(1, [_row("r", ((1, 2),), 0, 32, full=True)])
    tracker.step(2, [_row("r", ((3, 4),), 32, 32)])  # scheduled before step 1's forward ended
    assert tracker.saved(1) == [ChunkAnnouncement("r", ((1, 2),), 32, 1)]
    assert tracker.saved(2) == [ChunkAnnouncement("r", ((1, 2, 3, 4),), 64, 2)]


def test_a_chunk_smaller_than_a_block_waits_for_the_next() -> None:
    tracker = ChunkTracker((BLOCK,))
    tracker.track("r", 64)
    tracker.step(1, [_row("r", ((1,),), 0, 10, full=True)])
    assert tracker.saved(1) == []
    tracker.step(2, [_row("r", ((2,),), 10, 30)])
    assert tracker.saved(2) == [ChunkAnnouncement("r", ((1, 2),), 32, 1)]


def test_the_prompt_caps_what_a_step_writes_decode_tokens_are_not_announced() -> None:
    tracker = ChunkTracker((BLOCK,))
    tracker.track("r", 40)
    tracker.step(1, [_row("r", ((1, 2, 3, 4),), 0, 64, full=True)])
    assert tracker.saved(1) == [ChunkAnnouncement("r", ((1, 2),), 32, 1)]


def test_groups_of_different_block_sizes_announce_a_common_multiple() -> None:
    tracker = ChunkTracker((16, 32))
    tracker.track("r", 200)
    tracker.step(1, [_row("r", ((1, 2, 3), (9, 10)), 0, 48, full=True)])
    assert tracker.saved(1) == [ChunkAnnouncement("r", ((1, 2), (9,)), 32, 1)]


def test_a_preempted_request_with_announced_blocks_ends_its_lease_and_restarts_clean() -> None:
    tracker = ChunkTracker((BLOCK,))
    tracker.track("r", 96)
    tracker.step(1, [_row("r", ((1, 2),), 0, 32, full=True)])
    tracker.saved(1)
    tracker.step(2, [_row("r", ((3, 4),), 32, 32)])
    # vLLM preempts r in step 3's schedule (blocks 1-4 freed) while step 2's forward runs
    assert tracker.step(3, [], preempted=["r"]) == ("r",)
    assert tracker.saved(2) == []  # step 2 wrote into blocks no longer the request's
    # resumed in step 5 with a new table, recomputing from 0
    tracker.step(5, [_row("r", ((11, 12, 13),), 0, 48, full=True)])
    assert tracker.saved(5) == [ChunkAnnouncement("r", ((11, 12, 13),), 48, 2)]
    tracker.step(6, [_row("r", ((14, 15, 16),), 48, 48)])
    assert tracker.saved(6) == [ChunkAnnouncement("r", ((11, 12, 13, 14, 15, 16),), 96, 3)]


def test_a_preemption_before_any_announcement_ends_no_lease() -> None:
    tracker = ChunkTracker((BLOCK,))
    tracker.track("r", 96)
    tracker.step(1, [_row("r", ((1, 2),), 0, 32, full=True)])
    assert tracker.step(2, [], preempted=["r", "untracked"]) == ()
    tracker.step(3, [_row("r", ((5, 6),), 0, 32, full=True)])
    assert tracker.saved(3) == [ChunkAnnouncement("r", ((5, 6),), 32, 1)]


def test_untracked_and_forgotten_requests_are_never_announced() -> None:
    tracker = ChunkTracker((BLOCK,))
    tracker.track("r", 64)
    tracker.step(1, [_row("r", ((1, 2),), 0, 32, full=True), _row("x", ((5,),), 0, 16)])
    tracker.forget("r")
    assert tracker.saved(1) == [] and len(tracker) == 0


def test_the_table_is_bounded_a_request_past_it_gets_only_its_final_announcement() -> None:
    tracker = ChunkTracker((BLOCK,), max_requests=2)
    assert tracker.track("a", 32) and tracker.track("b", 32)
    assert not tracker.track("c", 32)
    assert tracker.track("a", 32)  # already tracked
    tracker.step(1, [_row("c", ((1, 2),), 0, 32, full=True)])
    assert tracker.saved(1) == []


def test_rows_with_fewer_blocks_than_tokens_announce_nothing() -> None:
    tracker = ChunkTracker((BLOCK,))
    tracker.track("r", 64)
    tracker.step(1, [_row("r", ((1,),), 0, 32, full=True)])
    assert tracker.saved(1) == []


@pytest.mark.parametrize("sizes", [(), (0,), (16, -1)], ids=["none", "zero", "negative"])
def test_block_sizes_must_be_positive(sizes: tuple[int, ...]) -> None:
    with pytest.raises(ValueError, match="block sizes must be positive"):
        ChunkTracker(sizes)
