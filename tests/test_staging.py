"""connector.staging: which kernel blocks a step copies, and when a prefill's blocks are saved."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from connector.errors import TransferPlanError
from connector.metadata import BlockIds
from connector.staging import (
    SaveTracker,
    ScheduledRow,
    StagedBlocks,
    contiguous_runs,
    kernel_block_ids,
)

KERNEL_CASES = [
    ("ratio 1 passes ids through, sorted", [((5, 3),)], [1], [[3, 5]]),
    ("ratio 2 expands each block to two", [((3, 5),)], [2], [[6, 7, 10, 11]]),
    (
        "requests of one step are merged, shared blocks once",
        [((1, 2),), ((2, 4),)],
        [1],
        [[1, 2, 4]],
    ),
    ("the null block is never copied", [((0, 0, 7),)], [1], [[7]]),
    ("groups keep their own ratios", [((1,), (1, 2))], [4, 1], [[4, 5, 6, 7], [1, 2]]),
    ("no entries copy nothing", [], [1, 2], [[], []]),
]


@pytest.mark.parametrize(
    ("entries", "ratios", "expected"),
    [case[1:] for case in KERNEL_CASES],
    ids=[case[0] for case in KERNEL_CASES],
)
def test_kernel_block_ids(
    entries: list[BlockIds], ratios: list[int], expected: list[list[int]]
) -> None:
    assert [ids.tolist() for ids in kernel_block_ids(entries, ratios)] == expected


@given(
    st.lists(st.lists(st.integers(0, 40), max_size=6), max_size=4),
    st.integers(1, 4),
)
def test_kernel_block_ids_copy_exactly_the_requests_kernel_blocks(
    requests: list[list[int]], ratio: int
) -> None:
    """Oracle: a kernel block is copied iff it lies inside a non-null block of some request."""
    (got,) = kernel_block_ids([(tuple(ids),) for ids in requests], [ratio])
    num_kernel_blocks = 41 * ratio
    inside = np.zeros(num_kernel_blocks, dtype=bool)
    for ids in requests:
        for block in ids:
            if block != 0:
                inside[block * ratio : (block + 1) * ratio] = True
    assert got.tolist() == np.flatnonzero(inside).tolist()


@pytest.mark.parametrize(
    ("entries", "ratios", "seen"),
    [
        ([((1,), (2,))], [1], 2),  # a row of every cache group, one of them outside transfers
        ([((1,),)], [1, 1], 1),
    ],
    ids=["more groups than the host buffer mirrors", "fewer groups than it mirrors"],
)
def test_kernel_block_ids_refuse_entries_that_are_not_the_transfer_groups(
    entries: list[BlockIds], ratios: list[int], seen: int
) -> None:
    """Never copy one group's ids into another's tensors (stale host bytes for the lease)."""
    with pytest.raises(
        TransferPlanError,
        match=f"staged blocks name {seen} cache groups, but the host buffer mirrors "
        f"{len(ratios)} transfer groups",
    ):
        kernel_block_ids(entries, ratios)


def _row(
    request_id: str, blocks: BlockIds | None, *, full: bool, done: int, now: int
) -> ScheduledRow:
    return ScheduledRow(request_id, blocks, full, done, now)


def test_a_whole_prefill_is_saved_in_its_one_step() -> None:
    tracker = SaveTracker()
    tracker.track("a", 40)
    saves = tracker.step([_row("a", ((1, 2, 3),), full=True, done=0, now=40)])
    assert saves == (StagedBlocks("a", ((1, 2, 3),)),)
    assert len(tracker) == 0


def test_chunked_prefill_saves_every_block_when_the_last_chunk_runs() -> None:
    tracker = SaveTracker()
    tracker.track("a", 100)
    assert tracker.step([_row("a", ((1, 2, 3),), full=True, done=0, now=40)]) == ()
    assert tracker.step([_row("a", ((4, 5),), full=False, done=40, now=40)]) == ()
    saves = tracker.step([_row("a", ((6, 7),), full=False, done=80, now=20)])
    assert saves == (StagedBlocks("a", ((1, 2, 3, 4, 5, 6, 7),)),)


def test_a_resumed_request_replaces_its_block_table() -> None:
    tracker = SaveTracker()
    tracker.track("a", 64)
    tracker.step([_row("a", ((1, 2),), full=True, done=0, now=32)])
    saves = tracker.step([_row("a", ((8, 9, 10, 11),), full=True, done=0, now=64)])
    assert saves == (StagedBlocks("a", ((8, 9, 10, 11),)),)


def test_untracked_and_forgotten_requests_are_never_saved() -> None:
    tracker = SaveTracker()
    tracker.track("a", 16)
    tracker.forget("a")
    rows = [
        _row("a", ((1,),), full=True, done=0, now=16),
        _row("local", ((2,),), full=True, done=0, now=16),
    ]
    assert tracker.step(rows) == ()


def test_a_step_without_new_blocks_still_completes_the_prefill() -> None:
    tracker = SaveTracker()
    tracker.track("a", 20)
    tracker.step([_row("a", ((1, 2),), full=True, done=0, now=10)])
    saves = tracker.step([_row("a", None, full=False, done=10, now=10)])
    assert saves == (StagedBlocks("a", ((1, 2),)),)


RUN_CASES = [
    ("one run", [4, 5, 6], [4, 5, 6], [[4, 4, 3]]),
    ("a gap splits", [4, 5, 6, 9], [4, 5, 6, 9], [[4, 4, 3], [9, 9, 1]]),
    ("the target's gap splits too", [1, 2, 3], [7, 8, 10], [[1, 7, 2], [3, 10, 1]]),
    ("no blocks, no runs", [], [], []),
]


@pytest.mark.parametrize(
    ("source", "target", "expected"),
    [case[1:] for case in RUN_CASES],
    ids=[case[0] for case in RUN_CASES],
)
def test_contiguous_runs(source: list[int], target: list[int], expected: list[list[int]]) -> None:
    runs = contiguous_runs(np.array(source, dtype=np.int64), np.array(target, dtype=np.int64))
    assert runs.tolist() == expected


@given(st.lists(st.integers(0, 30), unique=True, max_size=20), st.integers(0, 5))
def test_runs_cover_exactly_the_block_pairs(blocks: list[int], shift: int) -> None:
    """Oracle: expanding the runs block by block gives back every (source, target) pair."""
    source = np.array(sorted(blocks), dtype=np.int64)
    target = source + shift
    pairs = [
        (start_s + k, start_t + k)
        for start_s, start_t, num in contiguous_runs(source, target).tolist()
        for k in range(num)
    ]
    assert pairs == list(zip(source.tolist(), target.tolist(), strict=True))
