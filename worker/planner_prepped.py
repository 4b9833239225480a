"""Prepared descriptor lists: one strided row per plane at handshake, block indices per request.

NIXL can prepare a descriptor list once and build READs from it by index
(``prep_xfer_dlist`` / ``make_prepped_xfer``), merging indices that are contiguous on both
sides. We prepare, per (peer, remote rank), one row per plane of every plane class read from
that rank: "kernel block k of this plane (this head slice)" is entry ``first + k`` of a
strided row ``(address of block 0, length_bytes, device, stride = kernel block bytes,
count = kernel blocks in the pool)``. NIXL keeps a strided row compressed: a peer costs
O(planes) rows, not O(planes x blocks) descriptors (measured: 1M entries prepared in 0.05 ms
with no RSS growth, against 45 ms and about 55 MB expanded).

A pairing is preparable for a remote rank when, for every group read from it, one whole
kernel block of a plane is one contiguous run on both sides (NHD with all heads, HND, MLA,
SSM state, any opaque format) and both sides cut tokens into kernel blocks of the same size,
so a full segment is a full block on both sides. Per request, full segments become indices;
partial segments (the prompt's last block, a window start) stay byte ranges, exact as ever.

Pure: ints and numpy arrays; the edge (worker/prepped.py) calls NIXL.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from connector.layout import GroupKind
from worker.planner import Mask, RankReads, RequestSegments, TransferPlanner, rank_reads
from worker.planner_pairing import GroupPairing, Int64Array, PlaneClass
from worker.planner_ranges import Segments, class_runs

# The cost rule of choose_prepared, in nanoseconds, measured on the 2-core machine with real
# NIXL (benchmarks/plan_bench.py, "prepared" rows): building and posting one index (numpy
# arithmetic plus make_prepped_xfer merging it away), the range path's fixed cost per remote
# rank (planning, descriptors, initialize_xfer), and what each posted descriptor costs the
# range path beyond the prepared one (planning it, validating it in initialize_xfer).
INDEX_NS = 7
RANGE_FIXED_NS = 300_000
RANGE_DESCRIPTOR_EXTRA_NS = 100
TAIL_NS = 80_000  # the index path's second READ (initialize_xfer, post) for partial segments


IndexArray = npt.NDArray[np.int32]  # NIXL's make_prepped_xfer takes int32 indices
MAX_LIST_ENTRIES = 2**31 - 1  # so every index of a prepared list fits in an int32


@dataclass(frozen=True)
class SideRows:
    """One side's rows of a group: entry k of row j (kernel block k of a plane) is the
    ``row_bytes[j]`` bytes at ``offsets[j] + k * strides[j]`` in region ``regions[j]``,
    and index ``first[j, 0] + k`` in the side's prepared list."""

    first: IndexArray  # shape (rows, 1): a contiguous column, the fast operand to broadcast
    regions: Int64Array
    offsets: Int64Array
    strides: Int64Array
    num_kernel_blocks: int  # entries per row: the side's pool in kernel blocks


@dataclass(frozen=True)
class PreparedGroup:
    """One group's rows in a rank's prepared lists: row j of each side pairs with row j."""

    index: int
    full_tokens: int  # tokens of a full segment: the kernel block size (1 for an SSM state)
    local: SideRows
    remote: SideRows
    row_bytes: Int64Array  # per row: bytes of one entry
    joining: npt.NDArray[np.bool_]  # rows whose entries fill their stride on both sides
    # Derived once here, not per request:
    num_rows: int
    num_joining: int  # rows in which blocks k and k + 1 (on both sides) are one run
    block_bytes: int  # bytes of one kernel block over all rows


@dataclass(frozen=True)
class PreparedRows:
    """What to prepare for one (peer, remote rank): strided rows of each side, and the groups.

    Rows are (address, length_bytes, device_id, stride_bytes, count), NIXL's strided form.
    """

    remote_rank: int
    local_rows: Int64Array  # (M, 5)
    remote_rows: Int64Array  # (M, 5)
    groups: tuple[PreparedGroup, ...]

    @property
    def num_rows(self) -> int:
        return len(self.local_rows)


@dataclass(frozen=True)
class PreparedRequest:
    """One request's READ by index from one remote rank, plus the partial segments' mask."""

    local_indices: IndexArray
    remote_indices: IndexArray
    num_bytes: int  # bytes the READ copies
    partial: tuple[Mask | None, ...]  # per group: segments left to byte ranges


def _full_block_run(g: GroupPairing, cls: PlaneClass) -> tuple[int, int, int] | None:
    """(local offset, remote offset, length_bytes) of one whole kernel block of a plane, if it
    is one contiguous run on both sides; None otherwise."""
    one = np.ones(1, dtype=np.int64)
    zero = np.zeros(1, dtype=np.int64)
    tokens = 1 if g.kind is GroupKind.SSM else g.local.kernel_block_size
    full = Segments(zero, zero, zero, zero, one * tokens)
    local, remote, lengths = class_runs(full, cls)
    if len(lengths) != 1:
        return None
    return int(local[0]), int(remote[0]), int(lengths[0])


def _preparable(g: GroupPairing, rank: int) -> bool:
    same_blocks = g.local.kernel_block_size == g.remote.kernel_block_size
    classes = g.classes.get(rank, ())
    return (g.kind is GroupKind.SSM or same_blocks) and not any(c.atom_major for c in classes)


def _strided(
    bases: Int64Array, side: SideRows, length_bytes: Int64Array, device: int
) -> Int64Array:
    """NIXL's strided rows (address, length_bytes, device, stride_bytes, count) of a side."""
    rows = np.empty((len(side.regions), 5), dtype=np.int64)
    rows[:, 0] = bases[side.regions] + side.offsets
    rows[:, 1] = length_bytes
    rows[:, 2] = device
    rows[:, 3] = side.strides
    rows[:, 4] = side.num_kernel_blocks
    return rows


def _side(
    first: int, count: int, regions: Int64Array, offsets: Int64Array, stride: int
) -> SideRows:
    """Rows of one plane class on one side, numbered on from index ``first``."""
    num_planes = len(regions)
    return SideRows(
        (first + count * np.arange(num_planes, dtype=np.int64)).astype(np.int32).reshape(-1, 1),
        regions,
        offsets,
        np.full(num_planes, stride, dtype=np.int64),
        count,
    )


def _joined_sides(sides: list[SideRows]) -> SideRows:
    return SideRows(
        np.concatenate([s.first for s in sides]),
        np.concatenate([s.regions for s in sides]),
        np.concatenate([s.offsets for s in sides]),
        np.concatenate([s.strides for s in sides]),
        sides[0].num_kernel_blocks,
    )


def _prepared_group(
    g: GroupPairing, remote_rank: int, local_next: int, remote_next: int
) -> PreparedGroup | None:
    """The group's rows, numbered on from (local_next, remote_next); None if a plane's whole
    kernel block is not one contiguous run on both sides."""
    local_count = g.local.num_blocks * g.local.ratio
    remote_count = g.remote.num_blocks * g.remote.ratio
    local_sides: list[SideRows] = []
    remote_sides: list[SideRows] = []
    row_bytes: list[Int64Array] = []
    for cls in g.classes.get(remote_rank, ()):
        run = _full_block_run(g, cls)
        if run is None:
            return None
        local_offset, remote_offset, length_bytes = run
        num_planes = len(cls.local_regions)
        local_sides.append(_side(
            local_next, local_count, cls.local_regions, cls.local_offsets + local_offset,
            cls.local.kernel_block_bytes,
        ))  # fmt: skip
        remote_sides.append(_side(
            remote_next, remote_count, cls.remote_regions, cls.remote_offsets + remote_offset,
            cls.remote.kernel_block_bytes,
        ))  # fmt: skip
        row_bytes.append(np.full(num_planes, length_bytes, dtype=np.int64))
        local_next += local_count * num_planes
        remote_next += remote_count * num_planes
    local, remote = _joined_sides(local_sides), _joined_sides(remote_sides)
    lengths = np.concatenate(row_bytes)
    joining = (local.strides == lengths) & (remote.strides == lengths)
    return PreparedGroup(
        g.index,
        1 if g.kind is GroupKind.SSM else g.local.kernel_block_size,
        local,
        remote,
        lengths,
        joining,
        len(lengths),
        int(np.count_nonzero(joining)),
        int(lengths.sum()),
    )


def prepared_rows(
    groups: Sequence[GroupPairing],
    remote_rank: int,
    *,
    local_addresses: Sequence[int],
    local_device: int,
    remote_addresses: Sequence[int],
    remote_device: int,
) -> PreparedRows | None:
    """The strided rows to prepare for ``remote_rank``, or None if some group it serves
    cannot be read by whole-block index (then requests use byte ranges only)."""
    prepared: list[PreparedGroup] = []
    local_next = remote_next = 0
    for g in groups:
        if not g.classes.get(remote_rank, ()):
            continue
        if not _preparable(g, remote_rank):
            return None
        group = _prepared_group(g, remote_rank, local_next, remote_next)
        if group is None:
            return None
        prepared.append(group)
        local_next += group.local.num_kernel_blocks * group.num_rows
        remote_next += group.remote.num_kernel_blocks * group.num_rows
    if not prepared or max(local_next, remote_next) > MAX_LIST_ENTRIES:
        return None
    local_bases = np.asarray(local_addresses, dtype=np.int64)
    remote_bases = np.asarray(remote_addresses, dtype=np.int64)
    local_rows = [_strided(local_bases, p.local, p.row_bytes, local_device) for p in prepared]
    remote_rows = [_strided(remote_bases, p.remote, p.row_bytes, remote_device) for p in prepared]
    return PreparedRows(
        remote_rank, np.concatenate(local_rows), np.concatenate(remote_rows), tuple(prepared)
    )


@dataclass(frozen=True)
class _Whole:
    """A group's full segments in one request: kernel block ids on each side."""

    group: PreparedGroup
    local_blocks: Int64Array
    remote_blocks: Int64Array
    num_partial: int  # the group's partial segments, left to byte ranges


@dataclass(frozen=True)
class _Split:
    """One request's segments from one remote rank: the full ones per group, the partial ones'
    masks (per group, None: none partial or the group reads nothing)."""

    whole: tuple[_Whole, ...]
    partial: tuple[Mask | None, ...]
    num_partial: int  # partial segments, all groups

    @property
    def num_indices(self) -> int:
        return sum(len(w.local_blocks) * w.group.num_rows for w in self.whole)


def _split(rows: PreparedRows, segments: RequestSegments) -> _Split:
    whole: list[_Whole] = []
    partial: list[Mask | None] = [None] * len(segments)
    num_partial = 0
    for group in rows.groups:
        seg = segments[group.index]
        if seg is None:
            continue
        full = _full_mask(seg, group.full_tokens)
        if full is None:
            whole.append(_Whole(group, seg.local_blocks, seg.remote_blocks, 0))
            continue
        partial[group.index] = ~full
        num_group_partial = len(full) - int(np.count_nonzero(full))
        num_partial += num_group_partial
        whole.append(
            _Whole(group, seg.local_blocks[full], seg.remote_blocks[full], num_group_partial)
        )
    return _Split(tuple(whole), tuple(partial), num_partial)


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


def _by_index(split: _Split) -> PreparedRequest:
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


def prepared_request(rows: PreparedRows, segments: RequestSegments) -> PreparedRequest:
    """The READ by index of every full segment (see _by_index), and the partial segments'
    masks, which stay byte ranges."""
    return _by_index(_split(rows, segments))


def _joined(parts: list[IndexArray]) -> IndexArray:
    if len(parts) == 1:
        return parts[0]
    return np.concatenate(parts) if parts else np.zeros(0, dtype=np.int32)


BlockRuns = tuple[Int64Array, Int64Array, Int64Array]  # (local first, remote first, blocks)


def _block_runs(w: _Whole) -> BlockRuns:
    """Runs of blocks consecutive on both sides: local [7, 8, 9, 3], remote [1, 2, 5, 6] ->
    local firsts [7, 9, 3], remote firsts [1, 5, 6], lengths [2, 1, 1] blocks."""
    local, remote = w.local_blocks, w.remote_blocks
    if len(local) <= 1:
        return local, remote, np.ones(len(local), dtype=np.int64)
    breaks = np.flatnonzero((np.diff(local) != 1) | (np.diff(remote) != 1)) + 1
    firsts = np.concatenate((_ZERO, breaks))
    counts = np.diff(np.concatenate((firsts, [len(local)])))
    return local[firsts], remote[firsts], counts


_ZERO = np.zeros(1, dtype=np.int64)


def _row_ranges(
    group: PreparedGroup, rows: npt.NDArray[np.bool_] | slice, runs: BlockRuns
) -> tuple[Int64Array, ...]:
    """(local regions, local offsets, remote regions, remote offsets, lengths) of ``runs``
    in each selected row, row-major: row j, run of n blocks from block k on each side ->
    ``n * row_bytes[j]`` bytes at ``offsets[j] + k * strides[j]``."""
    local_first, remote_first, counts = runs
    local, remote = group.local, group.remote
    return (
        np.repeat(local.regions[rows], len(counts)),
        (local.offsets[rows, None] + local.strides[rows, None] * local_first).ravel(),
        np.repeat(remote.regions[rows], len(counts)),
        (remote.offsets[rows, None] + remote.strides[rows, None] * remote_first).ravel(),
        (group.row_bytes[rows, None] * counts).ravel(),
    )


def _whole_ranges(w: _Whole) -> list[tuple[Int64Array, ...]]:
    """The full segments of a group as byte ranges, straight from its rows: a run of blocks
    consecutive on both sides is one range in a joining row, one range per block elsewhere."""
    group = w.group
    num_joining = group.num_joining
    if num_joining == group.num_rows:
        return [_row_ranges(group, slice(None), _block_runs(w))]
    one_each = (w.local_blocks, w.remote_blocks, np.ones(len(w.local_blocks), dtype=np.int64))
    if num_joining == 0:
        return [_row_ranges(group, slice(None), one_each)]
    return [
        _row_ranges(group, group.joining, _block_runs(w)),
        _row_ranges(group, ~group.joining, one_each),
    ]


def _estimated_ranges(split: _Split) -> int:
    """Descriptors the range path would post: one per run of blocks consecutive on both sides
    in a joining row, one per block in other rows, one per partial segment and row (a lower
    bound when planes also join)."""
    total = 0
    for w in split.whole:
        group = w.group
        num_blocks = len(w.local_blocks)
        if group.num_joining and num_blocks > 1:
            breaks = (np.diff(w.local_blocks) != 1) | (np.diff(w.remote_blocks) != 1)
            total += group.num_joining * (int(np.count_nonzero(breaks)) + 1)
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
    pay for the indices. Measured (real NIXL, 32 layers): 2k contiguous whole blocks, 8,192
    indices -> by index (about 100 us against 380); 16k contiguous, 65,536 -> ranges (340 us
    against 430); fragmented ids -> by index (2k: 0.2 ms against 0.8; 16k: 3.6 ms against 8.6).
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
    planner: TransferPlanner, segments: RequestSegments, rank: int, split: _Split
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
    planner: TransferPlanner, segments: RequestSegments, rank: int, split: _Split
) -> RankPlan | None:
    tail = planner.rank_runs(segments, rank, split.partial) if split.num_partial else None
    request = _by_index(split) if split.num_indices else None
    if request is None and tail is None:
        return None
    return RankPlan(rank, request, None if tail is None else rank_reads(rank, tail))


def plan_by_index(
    planner: TransferPlanner, segments: RequestSegments, rank: int, rows: PreparedRows
) -> RankPlan | None:
    """Full segments by index from ``rows``' lists; partial ones as byte ranges, a second READ."""
    return _indexed(planner, segments, rank, _split(rows, segments))


def plan_by_ranges(
    planner: TransferPlanner, segments: RequestSegments, rank: int, rows: PreparedRows | None
) -> RankPlan | None:
    """One READ of byte ranges: with ``rows``, full blocks come straight from them."""
    if rows is not None:
        return _ranges_from_rows(planner, segments, rank, _split(rows, segments))
    runs = planner.rank_runs(segments, rank)
    return None if runs is None else RankPlan(rank, None, rank_reads(rank, runs))


def plan_rank(
    planner: TransferPlanner, segments: RequestSegments, rank: int, rows: PreparedRows | None
) -> RankPlan | None:
    """Plan one request's reads from ``rank``, choosing the path with choose_prepared."""
    if rows is None:
        return plan_by_ranges(planner, segments, rank, None)
    split = _split(rows, segments)
    num_indices, has_partial = split.num_indices, split.num_partial > 0
    # With no ranges at all the rule is at its strictest: if indices win then, they win.
    if choose_prepared(num_indices, 0, has_partial) or choose_prepared(
        num_indices, _estimated_ranges(split), has_partial
    ):
        return _indexed(planner, segments, rank, split)
    return _ranges_from_rows(planner, segments, rank, split)
