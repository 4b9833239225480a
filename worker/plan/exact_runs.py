"""Stage 4 of the recipe (worker/plan/recipe.py): token segments read as exact, merged byte runs.

Runs are computed once per plane class (worker/plan/pairing.py) in offsets relative to the plane,
then placed in every plane of the class by adding its (region, offset), then merged: a run of
blocks contiguous on both sides in a layer plane is one run. This path reads whatever the
prepared rows cannot: partial blocks, head slices, differing kernel block sizes, packed
planes read by one side only, block-outermost memory.

``ByteRuns`` is the one record for byte runs (five columns) that every stage yielding byte
ranges returns (whole blocks from the prepared rows too); the READ's descriptors are built
from it (worker/reads.py) and the test oracle executes it. Columns, not rows: each stage fills
a column with one numpy call. A frozen msgspec Struct: its constructor costs a fraction of a
frozen dataclass's on the per-request path.

Pure: ints and numpy arrays.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import msgspec
import numpy as np
import numpy.typing as npt

from worker.plan.pairing import CopyMode, GroupPairing, Int64Array, PlaneClass

if TYPE_CHECKING:  # annotations only: no import at run time
    from worker.plan.segments import Mask, RequestSegments, Segments


class ByteRuns(msgspec.Struct, frozen=True):
    """Run i copies ``lengths[i]`` bytes from remote region ``remote_regions[i]`` at
    ``remote_offsets[i]`` to local region ``local_regions[i]`` at ``local_offsets[i]``."""

    local_regions: Int64Array
    local_offsets: Int64Array
    remote_regions: Int64Array
    remote_offsets: Int64Array
    lengths: Int64Array

    def __len__(self) -> int:
        return len(self.lengths)

    @property
    def num_bytes(self) -> int:
        return int(self.lengths.sum())

    def take(self, rows: npt.NDArray[np.intp] | npt.NDArray[np.int64]) -> ByteRuns:
        """The runs at ``rows`` (an index array), in that order."""
        return ByteRuns(*[column[rows] for column in msgspec.structs.astuple(self)])


def concatenate(parts: list[ByteRuns]) -> ByteRuns:
    """The runs of ``parts`` one after the other (no merging)."""
    if len(parts) == 1:
        return parts[0]
    columns = zip(*map(msgspec.structs.astuple, parts), strict=True)  # the parts' columns
    return ByteRuns(*map(np.concatenate, columns))


RelativeRuns = tuple[Int64Array, Int64Array, Int64Array]  # (local offset, remote offset, length)


def exact_runs(
    groups: Sequence[GroupPairing],
    segments: RequestSegments,
    rank: int,
    keep: Sequence[Mask | None] = (),
) -> ByteRuns | None:
    """Merged byte runs reading ``segments`` from remote rank ``rank`` (None: none).

    ``keep[g]``, if given, selects group g's segments to read (a boolean mask; None: all).
    """
    parts = [
        broadcast(class_runs(seg, cls), cls)
        for g, seg in zip(groups, _selected(segments, keep), strict=True)
        if seg is not None
        for cls in g.classes.get(rank, ())
    ]
    return merge(parts) if parts else None


def _selected(segments: RequestSegments, keep: Sequence[Mask | None]) -> list[Segments | None]:
    """Each group's segments, restricted to ``keep[g]`` where given; empty ones become None."""
    if not keep:
        return list(segments)
    chosen: list[Segments | None] = []
    for seg, mask in zip(segments, keep, strict=True):
        if seg is None or mask is None:
            chosen.append(seg)
        elif bool(mask.any()):
            chosen.append(seg.where(mask))
        else:
            chosen.append(None)
    return chosen


@dataclass(frozen=True)
class _Placed:
    """Runs placed in their planes; ``seams``: indices i where run i might follow run i - 1
    out of order or join it; elsewhere the runs are known ascending and unjoinable (one
    plane's runs, already merged)."""

    runs: ByteRuns
    seams: Int64Array


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
    owner, step = _expand(segments.num_tokens)
    return (
        local[owner] + step * cls.local.token_bytes,
        remote[owner] + step * cls.remote.token_bytes,
    )


def _expand(counts: Int64Array) -> tuple[Int64Array, Int64Array]:
    """Entry i repeated ``counts[i]`` times: each copy's owner i and its place among the
    copies. [2, 1] -> owners [0, 0, 1], places [0, 1, 0]."""
    owner = np.repeat(np.arange(len(counts)), counts)
    firsts = np.cumsum(counts) - counts  # where each entry's copies start
    return owner, np.arange(len(owner), dtype=np.int64) - firsts[owner]


def _per_head(
    local: Int64Array, remote: Int64Array, lengths: Int64Array, cls: PlaneClass
) -> RelativeRuns:
    """Split each run into one run per head of the slice."""
    heads = np.arange(cls.num_heads, dtype=np.int64)
    return (
        (local[:, None] + heads * cls.local.head_bytes).ravel(),
        (remote[:, None] + heads * cls.remote.head_bytes).ravel(),
        np.repeat(lengths, cls.num_heads),
    )


def _unmerged_runs(segments: Segments, cls: PlaneClass) -> RelativeRuns:
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


def class_runs(segments: Segments, cls: PlaneClass) -> RelativeRuns:
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


def _merge_relative(local: Int64Array, remote: Int64Array, lengths: Int64Array) -> RelativeRuns:
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


def _atom_major(runs: RelativeRuns, cls: PlaneClass) -> _Placed:
    """Block-outermost: a run that fills its plane's share of the block joins the next plane's.

    Example, 3 planes of 24 bytes side by side in each kernel block: a 24-byte run at relative
    offset x becomes one 72-byte run; a shorter run (a partial block) stays 3 runs of its own.
    """
    local, remote, lengths = runs
    num_planes = len(cls.local_offsets)
    gap = _packed_gap(cls)
    whole = lengths == gap if gap is not None else np.zeros(len(lengths), dtype=bool)
    owner, plane = _expand(np.where(whole, 1, num_planes))
    placed = ByteRuns(
        cls.local_regions[plane],
        local[owner] + cls.local_offsets[plane],
        cls.remote_regions[plane],
        remote[owner] + cls.remote_offsets[plane],
        np.where(whole[owner], lengths[owner] * num_planes, lengths[owner]),
    )
    return _Placed(placed, np.arange(1, len(owner), dtype=np.int64))


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


def broadcast(runs: RelativeRuns, cls: PlaneClass) -> _Placed:
    """The class's relative runs placed in every plane of the class."""
    if cls.atom_major or _planes_share_rows(cls):  # planes of one block sit side by side
        return _atom_major(runs, cls)
    local, remote, lengths = runs
    num_planes, num_runs = len(cls.local_offsets), len(local)
    placed = ByteRuns(
        np.repeat(cls.local_regions, num_runs),
        (cls.local_offsets[:, None] + local).ravel(),
        np.repeat(cls.remote_regions, num_runs),
        (cls.remote_offsets[:, None] + remote).ravel(),
        np.tile(lengths, num_planes),
    )
    return _Placed(placed, np.arange(1, num_planes, dtype=np.int64) * num_runs)


def _concatenate(parts: list[_Placed]) -> _Placed:
    if len(parts) == 1:
        return parts[0]
    starts = np.cumsum([0] + [len(p.runs) for p in parts])
    seams = [
        np.concatenate(([start], p.seams + start)) for p, start in zip(parts, starts, strict=False)
    ]
    return _Placed(concatenate([p.runs for p in parts]), np.concatenate(seams)[1:])


def merge(parts: list[_Placed]) -> ByteRuns:
    """Concatenate, sort by local (region, offset) if needed, and join runs contiguous on both sides.

    Local byte ranges are disjoint, so after sorting, a run that could extend another starts
    right after it: no two runs of the result could be merged.
    """
    placed = _concatenate(parts)
    runs, seams = placed.runs, placed.seams
    lr, lo = runs.local_regions, runs.local_offsets
    before = seams - 1
    if not bool(
        np.all((lr[seams] > lr[before]) | ((lr[seams] == lr[before]) & (lo[seams] >= lo[before])))
    ):
        runs = runs.take(np.lexsort((lo, lr)))
        seams = np.arange(1, len(lo), dtype=np.int64)
        before = seams - 1
    lr, lo, rr, ro, ln = msgspec.structs.astuple(runs)
    joins = (
        (lr[seams] == lr[before])
        & (rr[seams] == rr[before])
        & (lo[before] + ln[before] == lo[seams])
        & (ro[before] + ln[before] == ro[seams])
    )
    if not bool(joins.any()):
        return runs
    keep = np.ones(len(lo), dtype=bool)
    keep[seams[joins]] = False
    firsts = np.flatnonzero(keep)
    return ByteRuns(lr[firsts], lo[firsts], rr[firsts], ro[firsts], np.add.reduceat(ln, firsts))
