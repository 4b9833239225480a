"""Per request and remote rank: which READs to post (by index, by byte ranges, or both), and
the rule that picks.

A remote rank's part of a request is read either by index from its prepared lists
(worker/planner_prepped.py), its partial segments as byte ranges in a second READ, or as
one READ of byte ranges, whole blocks taken straight from the prepared rows (a run of blocks
consecutive on both sides is one range per row) and partial segments planned exactly.
``choose_prepared`` picks whichever its cost rule, measured on real NIXL, predicts cheaper.

Pure: ints and numpy arrays.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from worker.planner import Mask, RankReads, RequestSegments, TransferPlanner, rank_reads
from worker.planner_pairing import Int64Array
from worker.planner_prepped import (
    PreparedRequest,
    PreparedRows,
    RequestSplit,
    SideRows,
    WholeBlocks,
    indexed_request,
    split_request,
)
from worker.planner_ranges import BlockRuns, RowGeometry, block_runs, row_runs

# The cost rule of choose_prepared, in nanoseconds, measured on the 2-core machine with real
# NIXL (benchmarks/plan_bench.py, "prepared" rows): building and posting one index (numpy
# arithmetic plus make_prepped_xfer merging it away), the range path's fixed cost per remote
# rank (planning, descriptors, initialize_xfer), and what each posted descriptor costs the
# range path beyond the prepared one (planning it, validating it in initialize_xfer).
INDEX_NS = 7
RANGE_FIXED_NS = 300_000
RANGE_DESCRIPTOR_EXTRA_NS = 100
TAIL_NS = 80_000  # the index path's second READ (initialize_xfer, post) for partial segments


def _rows_of(side: SideRows, rows: Mask | slice) -> RowGeometry:
    return side.regions[rows], side.offsets[rows], side.strides[rows]


def _whole_ranges(w: WholeBlocks) -> list[tuple[Int64Array, ...]]:
    """The full segments of a group as byte ranges, straight from its rows: a run of blocks
    consecutive on both sides is one range in a joining row, one range per block elsewhere."""
    group = w.group
    selections: list[tuple[Mask | slice, BlockRuns]]
    if group.num_joining == group.num_rows:  # the common case: every row fills its stride
        selections = [(_ALL, block_runs(w.local_blocks, w.remote_blocks, w.breaks))]
    else:
        one_each = (w.local_blocks, w.remote_blocks, np.ones(len(w.local_blocks), np.int64))
        selections = [(_ALL, one_each)]
        if group.num_joining:
            runs = block_runs(w.local_blocks, w.remote_blocks, w.breaks)
            selections = [(group.joining, runs), (~group.joining, one_each)]
    return [
        row_runs(
            _rows_of(group.local, rows), _rows_of(group.remote, rows), group.row_bytes[rows], runs
        )
        for rows, runs in selections
    ]


_ALL = slice(None)


def _estimated_ranges(split: RequestSplit) -> int:
    """Descriptors the range path would post: one per run of blocks consecutive on both sides
    in a joining row, one per block in other rows, one per partial segment and row (a lower
    bound when planes also join)."""
    total = 0
    for w in split.whole:
        group = w.group
        num_blocks = len(w.local_blocks)
        if group.num_joining and num_blocks > 1:
            total += group.num_joining * (int(np.count_nonzero(w.breaks)) + 1)
        elif group.num_joining:
            total += group.num_joining * num_blocks
        total += (group.num_rows - group.num_joining) * num_blocks + w.num_partial * group.num_rows
    return total


def choose_prepared(num_indices: int, num_ranges: int, has_partial: bool) -> bool:
    """The per-request rule: read by index when that costs less than planning byte ranges.

    Both paths post about the same descriptors once NIXL merged the indices; the index path
    pays per index (cheap: numpy and C++), the range path a fixed planning cost and more per
    posted descriptor. With a partial segment the index path plans that segment as ranges
    too (the same fixed cost) and posts a second READ, so only the per-descriptor saving can
    pay for the indices. Measured (real NIXL, 32 layers, benchmarks/prepped_bench.py with
    whole blocks taken from the rows, 2026-11-23): 2k contiguous whole blocks, 8,192 indices
    -> by index (144 us against 221); 32k contiguous, 131,072 -> ranges (301 us against 629);
    fragmented ids -> by index (2k: 0.36 ms against 0.77; 32k: 3.6 ms against 7.5); the rule
    picked the cheaper path in all six of that benchmark's cases.
    """
    if num_indices == 0:
        return False
    index_ns = INDEX_NS * num_indices
    if has_partial:
        return index_ns + TAIL_NS < RANGE_DESCRIPTOR_EXTRA_NS * num_ranges
    return index_ns < RANGE_FIXED_NS + RANGE_DESCRIPTOR_EXTRA_NS * num_ranges


@dataclass(frozen=True)
class RankPlan:
    """What one request reads from one remote rank: by index, by byte ranges, or both (the
    full blocks by index and the partial segments as ranges: two READs)."""

    remote_rank: int
    by_index: PreparedRequest | None
    ranges: RankReads | None

    @property
    def num_reads(self) -> int:
        return (self.by_index is not None) + (self.ranges is not None)

    def sizes(self) -> list[tuple[int, int]]:
        """(bytes, descriptors) of each READ, for the load's timeline; a READ by index counts
        its indices (before NIXL merges them)."""
        found = []
        if self.by_index is not None:
            found.append((self.by_index.num_bytes, len(self.by_index.local_indices)))
        if self.ranges is not None:
            found.append((int(self.ranges.lengths.sum()), len(self.ranges.lengths)))
        return found


def _ranges_from_rows(
    planner: TransferPlanner, segments: RequestSegments, rank: int, split: RequestSplit
) -> RankPlan | None:
    """One READ of byte ranges: full blocks straight from the rows, partial segments planned
    exactly (planner.rank_runs)."""
    parts = [part for w in split.whole if len(w.local_blocks) for part in _whole_ranges(w)]
    if split.num_partial:
        tail = planner.rank_runs(segments, rank, split.partial)
        if tail is not None:
            parts.append((tail.local_regions, tail.local_offsets, tail.remote_regions,
                          tail.remote_offsets, tail.lengths))  # fmt: skip
    if not parts:
        return None
    if len(parts) == 1:
        return RankPlan(rank, None, RankReads(rank, *parts[0]))
    columns = (np.concatenate(column) for column in zip(*parts, strict=True))
    return RankPlan(rank, None, RankReads(rank, *columns))


def _indexed(
    planner: TransferPlanner, segments: RequestSegments, rank: int, split: RequestSplit
) -> RankPlan | None:
    tail = planner.rank_runs(segments, rank, split.partial) if split.num_partial else None
    request = indexed_request(split) if split.num_indices else None
    if request is None and tail is None:
        return None
    return RankPlan(rank, request, None if tail is None else rank_reads(rank, tail))


def plan_by_index(
    planner: TransferPlanner, segments: RequestSegments, rank: int, rows: PreparedRows
) -> RankPlan | None:
    """Full segments by index from ``rows``' lists; partial ones as byte ranges, a second READ."""
    return _indexed(planner, segments, rank, split_request(rows, segments))


def plan_by_ranges(
    planner: TransferPlanner, segments: RequestSegments, rank: int, rows: PreparedRows | None
) -> RankPlan | None:
    """One READ of byte ranges: with ``rows``, full blocks come straight from them."""
    if rows is not None:
        return _ranges_from_rows(planner, segments, rank, split_request(rows, segments))
    runs = planner.rank_runs(segments, rank)
    return None if runs is None else RankPlan(rank, None, rank_reads(rank, runs))


def plan_rank(
    planner: TransferPlanner, segments: RequestSegments, rank: int, rows: PreparedRows | None
) -> RankPlan | None:
    """Plan one request's reads from ``rank``, choosing the path with choose_prepared."""
    if rows is None:
        return plan_by_ranges(planner, segments, rank, None)
    split = split_request(rows, segments)
    num_indices, has_partial = split.num_indices, split.num_partial > 0
    # With no ranges at all the rule is at its strictest: if indices win then, they win.
    if choose_prepared(num_indices, 0, has_partial) or choose_prepared(
        num_indices, _estimated_ranges(split), has_partial
    ):
        return _indexed(planner, segments, rank, split)
    return _ranges_from_rows(planner, segments, rank, split)
