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

from connector.layout import GroupKind
from worker.planner import RankReads, RequestSegments, TransferPlanner, rank_reads
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


@dataclass(frozen=True)
class PreparedGroup:
    """One group's rows in a rank's prepared lists: row j of each side pairs with row j."""

    index: int
    full_tokens: int  # tokens of a full segment: the kernel block size (1 for an SSM state)
    local_first: Int64Array  # per row: index of the row's kernel block 0 in the local list
    remote_first: Int64Array
    row_bytes: Int64Array  # per row: bytes of one entry
    num_joining: int  # rows whose entries fill their block stride on both sides: k, k+1 join


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

    local_indices: Int64Array
    remote_indices: Int64Array
    lengths: Int64Array  # bytes of each entry read
    partial: tuple[Int64Array | None, ...]  # per group: segments left to byte ranges


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


def _side_rows(
    bases: Int64Array, regions: Int64Array, offsets: Int64Array, run_offset: int,
    length_bytes: int, stride_bytes: int, num_kernel_blocks: int, device: int,
) -> Int64Array:  # fmt: skip
    rows = np.empty((len(regions), 5), dtype=np.int64)
    rows[:, 0] = bases[regions] + offsets + run_offset
    rows[:, 1] = length_bytes
    rows[:, 2] = device
    rows[:, 3] = stride_bytes
    rows[:, 4] = num_kernel_blocks
    return rows


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
    local_bases = np.asarray(local_addresses, dtype=np.int64)
    remote_bases = np.asarray(remote_addresses, dtype=np.int64)
    local_parts: list[Int64Array] = []
    remote_parts: list[Int64Array] = []
    prepared: list[PreparedGroup] = []
    local_next = remote_next = 0
    for g in groups:
        classes = g.classes.get(remote_rank, ())
        if not classes:
            continue
        if not _preparable(g, remote_rank):
            return None
        local_first: list[Int64Array] = []
        remote_first: list[Int64Array] = []
        row_bytes: list[Int64Array] = []
        num_joining = 0
        for cls in classes:
            run = _full_block_run(g, cls)
            if run is None:
                return None
            local_offset, remote_offset, length_bytes = run
            local_count = g.local.num_blocks * g.local.ratio
            remote_count = g.remote.num_blocks * g.remote.ratio
            local_parts.append(_side_rows(
                local_bases, cls.local_regions, cls.local_offsets, local_offset, length_bytes,
                cls.local.kernel_block_bytes, local_count, local_device,
            ))  # fmt: skip
            remote_parts.append(_side_rows(
                remote_bases, cls.remote_regions, cls.remote_offsets, remote_offset,
                length_bytes, cls.remote.kernel_block_bytes, remote_count, remote_device,
            ))  # fmt: skip
            num_planes = len(cls.local_regions)
            row_bytes.append(np.full(num_planes, length_bytes, dtype=np.int64))
            strides = (cls.local.kernel_block_bytes, cls.remote.kernel_block_bytes)
            num_joining += num_planes if strides == (length_bytes, length_bytes) else 0
            local_first.append(local_next + local_count * np.arange(num_planes, dtype=np.int64))
            remote_first.append(remote_next + remote_count * np.arange(num_planes, dtype=np.int64))
            local_next += local_count * num_planes
            remote_next += remote_count * num_planes
        full_tokens = 1 if g.kind is GroupKind.SSM else g.local.kernel_block_size
        prepared.append(
            PreparedGroup(
                g.index,
                full_tokens,
                np.concatenate(local_first),
                np.concatenate(remote_first),
                np.concatenate(row_bytes),
                num_joining,
            )
        )
    if not prepared:
        return None
    return PreparedRows(
        remote_rank, np.concatenate(local_parts), np.concatenate(remote_parts), tuple(prepared)
    )


def prepared_request(rows: PreparedRows, segments: RequestSegments) -> PreparedRequest:
    """Indices of every full segment, plane-major then token order (so NIXL merges a run of
    blocks contiguous on both sides into one descriptor), and the partial segments' masks.

    Example: rows with local_first [0, 100] (two planes, 100 blocks each) and full segments
    in local blocks [7, 8, 3]: local indices [7, 8, 3, 107, 108, 103].
    """
    local_parts: list[Int64Array] = []
    remote_parts: list[Int64Array] = []
    length_parts: list[Int64Array] = []
    partial: list[Int64Array | None] = [None] * len(segments)
    for group in rows.groups:
        seg = segments[group.index]
        if seg is None:
            continue
        full = seg.num_tokens == group.full_tokens
        partial[group.index] = ~full
        if bool(full.all()):
            local_blocks, remote_blocks = seg.local_blocks, seg.remote_blocks
        else:
            local_blocks, remote_blocks = seg.local_blocks[full], seg.remote_blocks[full]
        local_parts.append((group.local_first[:, None] + local_blocks).ravel())
        remote_parts.append((group.remote_first[:, None] + remote_blocks).ravel())
        length_parts.append(np.repeat(group.row_bytes, len(local_blocks)))
    return PreparedRequest(
        _joined(local_parts), _joined(remote_parts), _joined(length_parts), tuple(partial)
    )


def _joined(parts: list[Int64Array]) -> Int64Array:
    if len(parts) == 1:
        return parts[0]
    return np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)


def estimated_ranges(rows: PreparedRows, segments: RequestSegments) -> int:
    """Descriptors the range path would post: one per segment and row, except that rows whose
    entries fill their block stride join a run of blocks contiguous on both sides into one
    (a lower bound when planes also join)."""
    total = 0
    for group in rows.groups:
        seg = segments[group.index]
        if seg is None:
            continue
        breaks = (np.diff(seg.local_blocks) != 1) | (np.diff(seg.remote_blocks) != 1)
        num_rows = len(group.local_first)
        joined = group.num_joining * (int(np.count_nonzero(breaks)) + 1)
        total += joined + (num_rows - group.num_joining) * len(seg.num_tokens)
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

    def lengths(self) -> list[Int64Array]:
        """Descriptor lengths of each READ, for the load's timeline."""
        found = [self.by_index.lengths] if self.by_index is not None else []
        return found + ([self.ranges.lengths] if self.ranges is not None else [])


def _full_counts(rows: PreparedRows, segments: RequestSegments) -> tuple[int, bool]:
    """(indices a READ by index would take, whether some segment is partial)."""
    num_indices, has_partial = 0, False
    for group in rows.groups:
        seg = segments[group.index]
        if seg is None:
            continue
        num_full = int(np.count_nonzero(seg.num_tokens == group.full_tokens))
        num_indices += num_full * len(group.local_first)
        has_partial = has_partial or num_full < len(seg.num_tokens)
    return num_indices, has_partial


def plan_rank(
    planner: TransferPlanner, segments: RequestSegments, rank: int, rows: PreparedRows | None
) -> RankPlan | None:
    """Plan one request's reads from ``rank``, choosing the path with choose_prepared."""
    if rows is not None:
        num_indices, has_partial = _full_counts(rows, segments)
        # With no ranges at all the rule is at its strictest: if indices win then, they win.
        by_index = choose_prepared(num_indices, 0, has_partial) or choose_prepared(
            num_indices, estimated_ranges(rows, segments), has_partial
        )
        if by_index:
            request = prepared_request(rows, segments)
            tail = planner.rank_runs(segments, rank, request.partial) if has_partial else None
            return RankPlan(rank, request, None if tail is None else rank_reads(rank, tail))
    runs = planner.rank_runs(segments, rank)
    return None if runs is None else RankPlan(rank, None, rank_reads(rank, runs))
