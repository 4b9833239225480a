"""Whole kernel blocks: rows prepared at handshake, and a request's whole blocks read from them.

Handshake stage (``prepared_rows``, called by ``peer_plan``): per (peer, remote rank), one
strided row per plane of every plane class read from that rank, for NIXL's lists prepared once
and read by index (``prep_xfer_dlist`` / ``make_prepped_xfer``, which merges indices
contiguous on both sides): "kernel block k of this plane (this head slice)" is entry
``first + k`` of the row ``(address of block 0, length_bytes, device, stride = kernel block
bytes, count = kernel blocks in the pool)``; NIXL keeps it compressed, so a peer costs
O(planes) rows (worker/reads.py prepares them). A pairing is preparable for a remote rank
when, for every group read from it, one whole kernel block of a plane is one contiguous run
on both sides (NHD with all heads, HND, MLA, SSM state, any opaque format) and both sides cut
tokens into kernel blocks of one size, so a full segment is a full block on both sides.

Request stages 2 and 3 of the recipe: where a remote rank has prepared rows, a request's
segments split into full kernel blocks and partial segments (the prompt's last block, a window
start). The full blocks go either by index into the prepared lists (NIXL merges indices
contiguous on both sides; the partial segments then go as exact byte ranges in a second READ)
or as byte ranges straight from the rows (a run of blocks consecutive on both sides is one
range per row, joined with the partial segments' exact runs in one READ). ``choose_prepared``
picks whichever its cost rule, measured on real NIXL, predicts cheaper.

Pure: ints and numpy arrays.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import numpy.typing as npt

from connector.layout import GroupKind
from worker.plan.exact_runs import ByteRuns, class_runs
from worker.plan.pairing import Int64Array
from worker.plan.segments import one_segment

if TYPE_CHECKING:  # annotations only: no import at run time
    from worker.plan.pairing import GroupPairing
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


# --- handshake stage: prepared rows ----------------------------------------------------


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


# One plane class on one side: its planes' regions, the offsets of their whole kernel blocks,
# and the class's kernel block bytes (the rows' stride).
ClassRows = tuple[Int64Array, Int64Array, int]


def _side(first: int, count: int, classes: list[ClassRows]) -> SideRows:
    """One side's rows of a group, one per plane, numbered on from index ``first``
    (``count`` entries per row)."""
    num_planes = [len(regions) for regions, _, _ in classes]
    firsts = first + count * np.arange(sum(num_planes), dtype=np.int64)
    return SideRows(
        firsts.astype(np.int32).reshape(-1, 1),
        np.concatenate([regions for regions, _, _ in classes]),
        np.concatenate([offsets for _, offsets, _ in classes]),
        np.repeat(np.array([stride for _, _, stride in classes], dtype=np.int64), num_planes),
        count,
    )


def _prepared_group(
    g: GroupPairing, remote_rank: int, local_next: int, remote_next: int
) -> PreparedGroup | None:
    """The group's rows, numbered on from (local_next, remote_next); None if a plane's whole
    kernel block is not one contiguous run on both sides."""
    full_tokens = 1 if g.kind is GroupKind.SSM else g.local.kernel_block_size
    full_block = one_segment(0, 0, num_tokens=full_tokens)
    local_classes: list[ClassRows] = []
    remote_classes: list[ClassRows] = []
    row_bytes: list[Int64Array] = []
    for cls in g.classes.get(remote_rank, ()):
        local_run, remote_run, run_bytes = class_runs(full_block, cls)  # relative to the plane
        if len(run_bytes) != 1:
            return None
        local_offsets = cls.local_offsets + local_run[0]
        remote_offsets = cls.remote_offsets + remote_run[0]
        local_classes.append((cls.local_regions, local_offsets, cls.local.kernel_block_bytes))
        remote_classes.append((cls.remote_regions, remote_offsets, cls.remote.kernel_block_bytes))
        row_bytes.append(np.full(len(cls.local_regions), run_bytes[0], dtype=np.int64))
    local = _side(local_next, g.local.num_blocks * g.local.ratio, local_classes)
    remote = _side(remote_next, g.remote.num_blocks * g.remote.ratio, remote_classes)
    lengths = np.concatenate(row_bytes)
    joining = (local.strides == lengths) & (remote.strides == lengths)
    return PreparedGroup(
        g.index,
        full_tokens,
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


def block_runs(local: Int64Array, remote: Int64Array, breaks: npt.NDArray[np.bool_]) -> BlockRuns:
    """Runs of kernel blocks consecutive on both sides: local [7, 8, 9, 3], remote
    [1, 2, 5, 6] -> local firsts [7, 9, 3], remote firsts [1, 5, 6], lengths [2, 1, 1].
    ``breaks``: run_breaks(local, remote)."""
    if len(local) <= 1:
        return local, remote, np.ones(len(local), dtype=np.int64)
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
    pay for the indices. The rule picked the cheaper path in every case of
    benchmarks/prepped_bench.py (real NIXL; benchmarks/README.md).
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
