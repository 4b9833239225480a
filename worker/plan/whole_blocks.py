"""Stages 2 and 3 of the recipe (worker/plan/recipe.py): whole blocks apart from partial ones, and how
the whole blocks are read.

Where a remote rank has prepared rows (worker/plan/prepared_rows.py), a request's segments split
into full kernel blocks and partial segments (the prompt's last block, a window start). The
full blocks go either by index into the prepared lists (NIXL merges indices contiguous on both
sides; the partial segments then go as exact byte ranges in a second READ) or as byte ranges
straight from the rows (a run of blocks consecutive on both sides is one range per row,
joined with the partial segments' exact runs in one READ). ``choose_prepared`` picks whichever
its cost rule, measured on real NIXL, predicts cheaper.

Pure: ints and numpy arrays.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import numpy.typing as npt

from worker.plan.exact_runs import ByteRuns
from worker.plan.pairing import Int64Array

if TYPE_CHECKING:  # annotations only: no import at run time
    from worker.plan.prepared_rows import IndexArray, PreparedGroup, PreparedRows, SideRows
    from worker.plan.segments import Mask, RequestSegments, Segments

# The cost rule of choose_prepared, in nanoseconds, measured on the 2-core machine with real
# NIXL (benchmarks/plan_bench.py, "prepared" rows): building and posting one index (numpy
# arithmetic plus make_prepped_xfer merging it away), the range path's fixed cost per remote
# rank (planning, descriptors, initialize_xfer), and what each posted descriptor costs the
# range path beyond the prepared one (planning it, validating it in initialize_xfer).
INDEX_NS = 7
RANGE_FIXED_NS = 300_000
RANGE_DESCRIPTOR_EXTRA_NS = 100
TAIL_NS = 80_000  # the index path's second READ (initialize_xfer, post) for partial segments


# --- stage 2: whole blocks apart from partial segments ---------------------------------


@dataclass(frozen=True)
class WholeBlocks:
    """A group's full segments in one request: kernel block ids on each side."""

    group: PreparedGroup
    local_blocks: Int64Array
    remote_blocks: Int64Array
    num_partial: int  # the group's partial segments, left to byte ranges

    @functools.cached_property
    def breaks(self) -> Mask:
        """run_breaks of the blocks: shared by the rule's estimate and the
        range path (computed on first use)."""
        return run_breaks(self.local_blocks, self.remote_blocks)


@dataclass(frozen=True)
class RequestSplit:
    """One request's segments from one remote rank: the full ones per group, the partial ones'
    masks (per group, None: none partial or the group reads nothing)."""

    whole: tuple[WholeBlocks, ...]
    partial: tuple[Mask | None, ...]
    num_partial: int  # partial segments, all groups

    @property
    def num_indices(self) -> int:
        return sum(len(w.local_blocks) * w.group.num_rows for w in self.whole)


def split_request(rows: PreparedRows, segments: RequestSegments) -> RequestSplit:
    """A request's segments read from ``rows``' rank: whole blocks per group, partial masks."""
    whole: list[WholeBlocks] = []
    partial: list[Mask | None] = [None] * len(segments)
    num_partial = 0
    for group in rows.groups:
        seg = segments[group.index]
        if seg is None:
            continue
        full = _full_mask(seg, group.full_tokens)
        if full is None:
            whole.append(WholeBlocks(group, seg.local_blocks, seg.remote_blocks, 0))
            continue
        partial[group.index] = ~full
        num_group_partial = len(full) - int(np.count_nonzero(full))
        num_partial += num_group_partial
        whole.append(
            WholeBlocks(group, seg.local_blocks[full], seg.remote_blocks[full], num_group_partial)
        )
    return RequestSplit(tuple(whole), tuple(partial), num_partial)


def _full_mask(seg: Segments, full_tokens: int) -> Mask | None:
    """Which segments are whole kernel blocks (``full_tokens`` each); None: all of them."""
    if seg.partial_at is not None:  # a hint: the positions of segments short of a kernel block
        if not seg.partial_at:
            return None
        full = np.ones(len(seg.num_tokens), dtype=bool)
        full[list(seg.partial_at)] = False
        return full
    full = seg.num_tokens == full_tokens
    return None if np.count_nonzero(full) == len(full) else full


# --- stage 3a: whole blocks by index ---------------------------------------------------


@dataclass(frozen=True)
class PreparedRequest:
    """One request's READ by index from one remote rank, plus the partial segments' mask."""

    local_indices: IndexArray
    remote_indices: IndexArray
    num_bytes: int  # bytes the READ copies
    partial: tuple[Mask | None, ...]  # per group: segments left to byte ranges


def indexed_request(split: RequestSplit) -> PreparedRequest:
    """Indices of every full segment, plane-major then token order (so NIXL merges a run of
    blocks contiguous on both sides into one descriptor).

    Example: rows with local first [0, 100] (two planes, 100 blocks each) and full segments
    in local blocks [7, 8, 3]: local indices [7, 8, 3, 107, 108, 103].
    """
    local_parts: list[IndexArray] = []
    remote_parts: list[IndexArray] = []
    num_bytes = 0
    for w in split.whole:
        group = w.group
        # int32 throughout: block ids and the lists' indices are below 2**31. Blocks first and
        # a contiguous column: numpy's fast loop (2,048 blocks x 64 rows: 34 us against 48).
        local_parts.append((w.local_blocks.astype(np.int32) + group.local.first).ravel())
        remote_parts.append((w.remote_blocks.astype(np.int32) + group.remote.first).ravel())
        num_bytes += group.block_bytes * len(w.local_blocks)
    return PreparedRequest(_joined(local_parts), _joined(remote_parts), num_bytes, split.partial)


def _joined(parts: list[IndexArray]) -> IndexArray:
    if len(parts) == 1:
        return parts[0]
    return np.concatenate(parts) if parts else np.zeros(0, dtype=np.int32)


# --- stage 3b: whole blocks as byte ranges, straight from the rows ------------------------


BlockRuns = tuple[Int64Array, Int64Array, Int64Array]  # (local first, remote first, blocks)


RowGeometry = tuple[Int64Array, Int64Array, Int64Array]  # per row: region, offset, stride


def run_breaks(local: Int64Array, remote: Int64Array) -> npt.NDArray[np.bool_]:
    """Per pair of neighbours (i, i + 1): block i + 1 does not follow block i on both sides."""
    return (local[1:] - local[:-1] != 1) | (remote[1:] - remote[:-1] != 1)


def block_runs(
    local: Int64Array, remote: Int64Array, breaks: npt.NDArray[np.bool_] | None = None
) -> BlockRuns:
    """Runs of kernel blocks consecutive on both sides: local [7, 8, 9, 3], remote
    [1, 2, 5, 6] -> local firsts [7, 9, 3], remote firsts [1, 5, 6], lengths [2, 1, 1].
    ``breaks``: run_breaks(local, remote), if at hand."""
    if len(local) <= 1:
        return local, remote, np.ones(len(local), dtype=np.int64)
    if breaks is None:
        breaks = run_breaks(local, remote)
    firsts = np.concatenate((_ZERO, np.flatnonzero(breaks) + 1))
    counts = np.diff(np.concatenate((firsts, [len(local)])))
    return local[firsts], remote[firsts], counts


_ZERO = np.zeros(1, dtype=np.int64)


def row_runs(
    local: RowGeometry, remote: RowGeometry, row_bytes: Int64Array, runs: BlockRuns
) -> ByteRuns:
    """The byte runs of ``runs`` in each row, row-major. Kernel block k of row j is ``row_bytes[j]`` bytes at ``offsets[j] +
    k * strides[j]`` in region ``regions[j]`` on each side, so a run of n blocks from block k
    is one range of ``n * row_bytes[j]`` bytes: callers pass runs longer than one block only
    for rows whose blocks fill their stride on both sides."""
    local_first, remote_first, counts = runs
    (local_regions, local_offsets, local_strides) = local
    (remote_regions, remote_offsets, remote_strides) = remote
    return ByteRuns(
        np.repeat(local_regions, len(counts)),
        (local_offsets[:, None] + local_strides[:, None] * local_first).ravel(),
        np.repeat(remote_regions, len(counts)),
        (remote_offsets[:, None] + remote_strides[:, None] * remote_first).ravel(),
        (row_bytes[:, None] * counts).ravel(),
    )


def _rows_of(side: SideRows, rows: Mask | slice) -> RowGeometry:
    return side.regions[rows], side.offsets[rows], side.strides[rows]


def whole_ranges(split: RequestSplit) -> list[ByteRuns]:
    """Every group's full segments as byte ranges, straight from the rows."""
    return [runs for w in split.whole if len(w.local_blocks) for runs in _group_ranges(w)]


def _group_ranges(w: WholeBlocks) -> list[ByteRuns]:
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


# --- stage 3c: the cost rule that picks between them ---------------------------------------


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


def reads_by_index(split: RequestSplit) -> bool:
    """The rule applied to one request's split: True to read its whole blocks by index."""
    num_indices, has_partial = split.num_indices, split.num_partial > 0
    # With no ranges at all the rule is at its strictest: if indices win then, they win.
    return choose_prepared(num_indices, 0, has_partial) or choose_prepared(
        num_indices, _estimated_ranges(split), has_partial
    )
