"""Per-request byte ranges: token segments -> contiguous runs per plane class -> merged runs.

A *segment* is a token range [a, b) that stays inside one kernel block on both sides: the
token range is cut at every multiple of either side's kernel block size. Example, decode
kernel 16, prefill kernel 8, tokens [4, 30)::

    cuts:      4     8     16    24   30
    segments:  [4,8) [8,16) [16,24) [24,30)
    decode:    kb0   kb0    kb1     kb1       (kernel block of the decode side)
    prefill:   kb0   kb1    kb2     kb3

Within a segment a token's slot is ``t % kernel_block_size`` on each side, so the bytes of
a plane follow from the layout formula (connector/layout.py). Runs are computed once per
plane class in offsets relative to the plane, then shifted by each plane's (region, offset).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from worker.planner_pairing import CopyMode, Int64Array, PlaneClass, SideBlocks


@dataclass(frozen=True)
class Segments:
    """Token segments of one group, each inside one kernel block on both sides."""

    local_blocks: Int64Array  # decode kernel block id
    local_slots: Int64Array  # token slot of the segment's first token in that block
    remote_blocks: Int64Array
    remote_slots: Int64Array
    num_tokens: Int64Array  # tokens in the segment
    # Where known (both sides cut tokens alike), the positions of the segments shorter than
    # a kernel block: a hint that spares the hot path a comparison; None: unknown.
    partial_at: tuple[int, ...] | None = None


@dataclass(frozen=True)
class Runs:
    """Contiguous byte runs: copy ``lengths`` bytes from remote (region, offset) to local."""

    local_regions: Int64Array
    local_offsets: Int64Array
    remote_regions: Int64Array
    remote_offsets: Int64Array
    lengths: Int64Array
    # Indices i where run i might follow run i - 1 out of order or join it; elsewhere the runs
    # are known ascending and unjoinable (one plane's runs, already merged).
    seams: Int64Array


def _cuts(start: int, end: int, local_kernel: int, remote_kernel: int) -> Int64Array:
    """[start, every kernel boundary of either side inside (start, end), end]."""
    small, large = sorted((local_kernel, remote_kernel))
    if large % small == 0:
        inner = np.arange((start // small + 1) * small, end, small, dtype=np.int64)
    else:
        inner = np.union1d(
            np.arange((start // small + 1) * small, end, small, dtype=np.int64),
            np.arange((start // large + 1) * large, end, large, dtype=np.int64),
        )
    return np.concatenate(
        (np.array([start], dtype=np.int64), inner, np.array([end], dtype=np.int64))
    )


def _kernel_blocks(
    starts: Int64Array, side: SideBlocks, logical_ids: Int64Array, first_logical: int
) -> tuple[Int64Array, Int64Array]:
    """(kernel block id, slot) of each token position; ``logical_ids[0]`` is logical block ``first_logical``."""
    logical = logical_ids[starts // side.block_size - first_logical]
    within = starts % side.block_size
    return logical * side.ratio + within // side.kernel_block_size, starts % side.kernel_block_size


def token_segments(
    start: int,
    end: int,
    local: SideBlocks,
    remote: SideBlocks,
    local_ids: Int64Array,
    local_first_logical: int,
    remote_block_ids: Int64Array,
    remote_first_logical: int,
) -> Segments:
    """Segments of tokens [start, end) (non-empty) given each side's logical block ids."""
    cuts = _cuts(start, end, local.kernel_block_size, remote.kernel_block_size)
    starts = cuts[:-1]
    local_blocks, local_slots = _kernel_blocks(starts, local, local_ids, local_first_logical)
    remote_blocks, remote_slots = _kernel_blocks(
        starts, remote, remote_block_ids, remote_first_logical
    )
    return Segments(local_blocks, local_slots, remote_blocks, remote_slots, np.diff(cuts))


def state_segment(local_block: int, remote_block: int) -> Segments:
    """An SSM state block: one slot-less segment."""
    one = np.ones(1, dtype=np.int64)
    zero = np.zeros(1, dtype=np.int64)
    return Segments(one * local_block, zero, one * remote_block, zero, one)


def _segment_starts(segments: Segments, cls: PlaneClass) -> tuple[Int64Array, Int64Array]:
    """Relative byte offset of each segment's first token (first head of the slice), per side."""
    local_bytes, remote_bytes = cls.local, cls.remote
    return (
        segments.local_blocks * local_bytes.kernel_block_bytes
        + segments.local_slots * local_bytes.token_bytes,
        segments.remote_blocks * remote_bytes.kernel_block_bytes
        + segments.remote_slots * remote_bytes.token_bytes,
    )


def _token_starts(segments: Segments, cls: PlaneClass) -> tuple[Int64Array, Int64Array]:
    """Relative byte offset of every token of every segment, per side, in token order."""
    local, remote = _segment_starts(segments, cls)
    counts = segments.num_tokens
    owner = np.repeat(np.arange(len(counts)), counts)
    step = np.arange(int(counts.sum()), dtype=np.int64) - np.repeat(
        np.cumsum(counts) - counts, counts
    )
    return (
        local[owner] + step * cls.local.token_bytes,
        remote[owner] + step * cls.remote.token_bytes,
    )


def _per_head(
    local: Int64Array, remote: Int64Array, lengths: Int64Array, cls: PlaneClass
) -> tuple[Int64Array, Int64Array, Int64Array]:
    """Split each run into one run per head of the slice."""
    heads = np.arange(cls.num_heads, dtype=np.int64)
    return (
        (local[:, None] + heads * cls.local.head_bytes).ravel(),
        (remote[:, None] + heads * cls.remote.head_bytes).ravel(),
        np.repeat(lengths, cls.num_heads),
    )


def _unmerged_runs(
    segments: Segments, cls: PlaneClass
) -> tuple[Int64Array, Int64Array, Int64Array]:
    if cls.mode is CopyMode.SEGMENT:
        local, remote = _segment_starts(segments, cls)
        return local, remote, segments.num_tokens * (cls.num_heads * cls.head_bytes)
    if cls.mode is CopyMode.PER_HEAD:
        local, remote = _segment_starts(segments, cls)
        return _per_head(local, remote, segments.num_tokens * cls.head_bytes, cls)
    local, remote = _token_starts(segments, cls)
    if cls.mode is CopyMode.PER_TOKEN:
        return local, remote, np.full(len(local), cls.num_heads * cls.head_bytes, dtype=np.int64)
    return _per_head(local, remote, np.full(len(local), cls.head_bytes, dtype=np.int64), cls)


def class_runs(segments: Segments, cls: PlaneClass) -> tuple[Int64Array, Int64Array, Int64Array]:
    """(local offset, remote offset, length) runs relative to the plane, sorted and merged.

    Sorting by local offset first lets blocks that are neighbours on both sides merge even
    when they are not neighbours in token order.
    """
    local, remote, lengths = _unmerged_runs(segments, cls)
    if not _ascending(local):
        order = np.argsort(local, kind="stable")
        local, remote, lengths = local[order], remote[order], lengths[order]
    return _merge_relative(local, remote, lengths)


def _ascending(values: Int64Array) -> bool:
    return bool(np.all(values[1:] >= values[:-1]))


def _merge_relative(
    local: Int64Array, remote: Int64Array, lengths: Int64Array
) -> tuple[Int64Array, Int64Array, Int64Array]:
    if len(local) <= 1:
        return local, remote, lengths
    joins = (local[:-1] + lengths[:-1] == local[1:]) & (remote[:-1] + lengths[:-1] == remote[1:])
    firsts = np.flatnonzero(np.concatenate(([True], ~joins)))
    return local[firsts], remote[firsts], np.add.reduceat(lengths, firsts)


def _packed_gap(cls: PlaneClass) -> int | None:
    """Byte gap between consecutive planes if it is uniform and equal on both sides, same region."""
    if len(cls.local_offsets) < 2:
        return None
    local_gaps, remote_gaps = np.diff(cls.local_offsets), np.diff(cls.remote_offsets)
    gap = int(local_gaps[0])
    uniform = bool(np.all(local_gaps == gap) and np.all(remote_gaps == gap))
    same_region = bool(
        np.all(cls.local_regions == cls.local_regions[0])
        and np.all(cls.remote_regions == cls.remote_regions[0])
    )
    return gap if uniform and same_region and gap > 0 else None


def _atom_major(runs: tuple[Int64Array, Int64Array, Int64Array], cls: PlaneClass) -> Runs:
    """Block-outermost: a run that fills its plane's share of the block joins the next plane's.

    Example, 3 planes of 24 bytes side by side in each kernel block: a 24-byte run at relative
    offset x becomes one 72-byte run; a shorter run (a partial block) stays 3 runs of its own.
    """
    local, remote, lengths = runs
    num_planes = len(cls.local_offsets)
    gap = _packed_gap(cls)
    whole = lengths == gap if gap is not None else np.zeros(len(lengths), dtype=bool)
    per_run = np.where(whole, 1, num_planes)
    owner = np.repeat(np.arange(len(lengths)), per_run)
    plane = np.arange(int(per_run.sum()), dtype=np.int64) - np.repeat(
        np.cumsum(per_run) - per_run, per_run
    )
    return Runs(
        cls.local_regions[plane],
        local[owner] + cls.local_offsets[plane],
        cls.remote_regions[plane],
        remote[owner] + cls.remote_offsets[plane],
        np.where(whole[owner], lengths[owner] * num_planes, lengths[owner]),
        np.arange(1, len(owner), dtype=np.int64),
    )


def _planes_share_rows(cls: PlaneClass) -> bool:
    """Decode's planes of the class all sit inside one kernel block's row of one region
    (a block-outermost layout, whatever the engine called it): run by run, plane by plane
    is then decode's memory order, and whole pages of neighbouring planes join."""
    regions, offsets = cls.local_regions, cls.local_offsets
    return (
        len(offsets) > 1
        and bool(np.all(regions == regions[0]))
        and int(offsets.max()) < cls.local.kernel_block_bytes
    )


def broadcast(runs: tuple[Int64Array, Int64Array, Int64Array], cls: PlaneClass) -> Runs:
    """The class's relative runs placed in every plane of the class."""
    if cls.atom_major or _planes_share_rows(cls):  # planes of one block sit side by side
        return _atom_major(runs, cls)
    local, remote, lengths = runs
    num_planes, num_runs = len(cls.local_offsets), len(local)
    return Runs(
        np.repeat(cls.local_regions, num_runs),
        (cls.local_offsets[:, None] + local).ravel(),
        np.repeat(cls.remote_regions, num_runs),
        (cls.remote_offsets[:, None] + remote).ravel(),
        np.tile(lengths, num_planes),
        np.arange(1, num_planes, dtype=np.int64) * num_runs,
    )


def _concatenate(parts: list[Runs]) -> Runs:
    if len(parts) == 1:
        return parts[0]
    starts = np.cumsum([0] + [len(p.lengths) for p in parts])
    seams = [
        np.concatenate(([start], p.seams + start)) for p, start in zip(parts, starts, strict=False)
    ]
    return Runs(
        np.concatenate([p.local_regions for p in parts]),
        np.concatenate([p.local_offsets for p in parts]),
        np.concatenate([p.remote_regions for p in parts]),
        np.concatenate([p.remote_offsets for p in parts]),
        np.concatenate([p.lengths for p in parts]),
        np.concatenate(seams)[1:],
    )


def merge(parts: list[Runs]) -> Runs:
    """Concatenate, sort by local (region, offset) if needed, and join runs contiguous on both sides.

    Local byte ranges are disjoint, so after sorting, a run that could extend another starts
    right after it: no two runs of the result could be merged.
    """
    runs = _concatenate(parts)
    lr, lo, rr, ro, ln = (
        runs.local_regions,
        runs.local_offsets,
        runs.remote_regions,
        runs.remote_offsets,
        runs.lengths,
    )
    seams = runs.seams
    before = seams - 1
    if not bool(
        np.all((lr[seams] > lr[before]) | ((lr[seams] == lr[before]) & (lo[seams] >= lo[before])))
    ):
        order = np.lexsort((lo, lr))
        lr, lo, rr, ro, ln = lr[order], lo[order], rr[order], ro[order], ln[order]
        seams = np.arange(1, len(lo), dtype=np.int64)
        before = seams - 1
    joins = (
        (lr[seams] == lr[before])
        & (rr[seams] == rr[before])
        & (lo[before] + ln[before] == lo[seams])
        & (ro[before] + ln[before] == ro[seams])
    )
    empty = np.zeros(0, dtype=np.int64)
    if not bool(joins.any()):
        return Runs(lr, lo, rr, ro, ln, empty)
    keep = np.ones(len(lo), dtype=bool)
    keep[seams[joins]] = False
    firsts = np.flatnonzero(keep)
    return Runs(lr[firsts], lo[firsts], rr[firsts], ro[firsts], np.add.reduceat(ln, firsts), empty)


# --- whole kernel blocks, row by row (worker/planner_prepped.py's rows) -------------------

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
) -> tuple[Int64Array, ...]:
    """(local regions, local offsets, remote regions, remote offsets, lengths) of ``runs`` in
    each row, row-major. Kernel block k of row j is ``row_bytes[j]`` bytes at ``offsets[j] +
    k * strides[j]`` in region ``regions[j]`` on each side, so a run of n blocks from block k
    is one range of ``n * row_bytes[j]`` bytes: callers pass runs longer than one block only
    for rows whose blocks fill their stride on both sides."""
    local_first, remote_first, counts = runs
    (local_regions, local_offsets, local_strides) = local
    (remote_regions, remote_offsets, remote_strides) = remote
    return (
        np.repeat(local_regions, len(counts)),
        (local_offsets[:, None] + local_strides[:, None] * local_first).ravel(),
        np.repeat(remote_regions, len(counts)),
        (remote_offsets[:, None] + remote_strides[:, None] * remote_first).ravel(),
        (row_bytes[:, None] * counts).ravel(),
    )
