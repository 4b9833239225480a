"""Handshake part of the recipe (worker/plan/recipe.py): pair a decode rank's layout with a prefill engine's.

Everything here runs once per (local rank, remote engine). The result, one ``GroupPairing``
per cache group, holds each side's block sizes and, per remote rank, the ``PlaneClass``es:
sets of planes that share strides and head slices, so a request's byte ranges are computed
once per class and broadcast over its planes by adding each plane's (region, offset).

``validate_pair`` checks first that the pairing can be planned exactly: every rejection raises
UnsupportedConfiguration naming the group, layer or plane, both values, and what must match.
A peer's layout is untrusted input: planes must fit their regions.

Packed planes (``fuse_packed_planes``). In a packed layout (MemoryLayout.NHD_PACKED /
HND_PACKED, vLLM >= 0.33) one (token, head) cell holds every plane of a layer side by side,
e.g. with head_bytes 256::

    cell of (token t, head h):  [ K: 256 bytes | V: 256 bytes ]
    plane K: offset 0,   head_bytes 256, strides S      plane V: offset 256, same strides S

Read plane by plane, each plane is strided (a K head is followed by a V head), so every plane
breaks into one run per (token, head) and only the final merge joins K and V back together:
millions of runs for a long request. When BOTH sides hold a layer's planes this way, the
layer is read as one virtual plane instead: offset of K, the same strides, head_bytes
``num_planes * head_bytes``. That is exact whatever the strides are: byte ``i`` of plane
``p``'s head sits at ``p * head_bytes + i`` of the virtual head on both sides, so the byte
pairs copied are exactly those of the separate planes.

When only one side is packed nothing is fused and the planes are planned one by one, which is
exact but slow (one run per (token, head) per plane): the packed side's K and V heads are
interleaved while the other side's are not, so that many descriptors are unavoidable.
"""

from __future__ import annotations

import enum
import itertools
from collections.abc import Sequence
from dataclasses import dataclass

import msgspec
import numpy as np
import numpy.typing as npt

from connector.errors import UnsupportedConfiguration
from connector.geometry import heads_per_rank
from connector.layout import GroupGeometry, GroupKind, MemoryLayout, PlaneGeometry, RankLayout
from worker.topology import read_sources, tp_ratio

Int64Array = npt.NDArray[np.int64]  # the planner's offsets, lengths and block ids


class CopyMode(enum.Enum):
    """How the bytes of one token segment of one plane break into contiguous runs."""

    SEGMENT = "segment"  # the head slice of all tokens is one run on both sides (NHD, all heads)
    PER_TOKEN = "per_token"  # one run per token (NHD, a head slice on either side)
    PER_HEAD = "per_head"  # one run per head (HND: a head's tokens are contiguous)
    PER_ELEMENT = "per_element"  # one run per (token, head): the sides' layouts disagree


@dataclass(frozen=True)
class SideBlocks:
    """One side's block sizes for one group."""

    block_size: int  # tokens per logical block
    kernel_block_size: int  # tokens per kernel block
    num_blocks: int  # logical blocks in the pool

    @property
    def ratio(self) -> int:
        return self.block_size // self.kernel_block_size


@dataclass(frozen=True)
class Strides:
    """Byte strides of one side's plane; ``first_head_bytes`` is folded into plane offsets."""

    kernel_block_bytes: int
    token_bytes: int
    head_bytes: int  # stride between heads


@dataclass(frozen=True)
class PlaneClass:
    """Planes of one group, read from one remote rank, that share strides and head slices."""

    mode: CopyMode
    local: Strides
    remote: Strides
    head_bytes: int  # contiguous bytes of one head of one token
    num_heads: int  # heads in the slice
    atom_major: bool  # broadcast (run, plane) instead of (plane, run): block-outermost order
    local_regions: Int64Array  # per plane
    local_offsets: Int64Array  # plane offset + first local head * head stride
    remote_regions: Int64Array
    remote_offsets: Int64Array


@dataclass(frozen=True)
class GroupPairing:
    index: int
    kind: GroupKind
    window: int | None
    local: SideBlocks
    remote: SideBlocks
    classes: dict[int, tuple[PlaneClass, ...]]  # remote rank -> its plane classes
    whole_blocks: bool = False  # opaque block format: copy whole kernel blocks (equal both sides)


def _mode(local: Strides, remote: Strides, head_bytes: int, num_heads: int, ssm: bool) -> CopyMode:
    def slice_contiguous(strides: Strides) -> bool:
        return num_heads == 1 or strides.head_bytes == head_bytes

    def tokens_contiguous(strides: Strides) -> bool:
        return ssm or strides.token_bytes == num_heads * head_bytes

    if slice_contiguous(local) and slice_contiguous(remote):
        if tokens_contiguous(local) and tokens_contiguous(remote):
            return CopyMode.SEGMENT
        return CopyMode.PER_TOKEN
    if local.token_bytes == head_bytes and remote.token_bytes == head_bytes:
        return CopyMode.PER_HEAD
    return CopyMode.PER_ELEMENT


def _strides(plane: PlaneGeometry) -> Strides:
    return Strides(
        plane.kernel_block_stride_bytes, plane.token_stride_bytes, plane.head_stride_bytes
    )


@dataclass(frozen=True)
class _ClassKey:
    remote_rank: int
    local: Strides
    remote: Strides
    head_bytes: int
    num_heads: int


# One plane of a class: (local region, local offset, remote region, remote offset), the
# offsets moved to the first head of the slice read.
_Member = tuple[int, int, int, int]


def _plane_class(key: _ClassKey, members: list[_Member], ssm: bool, atom_major: bool) -> PlaneClass:
    columns = np.array(members, dtype=np.int64).T.copy()  # four contiguous columns
    local_regions, local_offsets, remote_regions, remote_offsets = columns
    return PlaneClass(
        mode=_mode(key.local, key.remote, key.head_bytes, key.num_heads, ssm),
        local=key.local,
        remote=key.remote,
        head_bytes=key.head_bytes,
        num_heads=key.num_heads,
        atom_major=atom_major,
        local_regions=local_regions,
        local_offsets=local_offsets,
        remote_regions=remote_regions,
        remote_offsets=remote_offsets,
    )


def _plane_classes(
    group: int, local: RankLayout, remote: RankLayout
) -> dict[int, tuple[PlaneClass, ...]]:
    """Bucket the group's planes by (remote rank, strides, head slice size), keeping plane order.

    The first head of each slice is folded into the plane offsets, so planes reading different
    head slices with equal strides share a class. Packed layers count as one fused plane.
    """
    lg, rg = local.groups[group], remote.groups[group]
    buckets: dict[_ClassKey, list[_Member]] = {}
    for lp, rp in fuse_packed_planes(lg.planes, rg.planes):
        sources = read_sources(
            local.tp_rank, local.tp_size, remote.tp_size, lp.model_heads, replicated=lp.replicated
        )
        for source in sources:
            key = _ClassKey(
                source.remote_rank,
                _strides(lp),
                _strides(rp),
                lp.head_bytes,
                len(source.local_heads),
            )
            local_offset = lp.offset_bytes + source.local_heads.start * lp.head_stride_bytes
            remote_offset = rp.offset_bytes + source.remote_heads.start * rp.head_stride_bytes
            buckets.setdefault(key, []).append((lp.region, local_offset, rp.region, remote_offset))
    ssm = lg.kind is GroupKind.SSM
    atom_major = local.memory_layout is MemoryLayout.BLOCK_OUTERMOST
    classes: dict[int, list[PlaneClass]] = {}
    for key, members in buckets.items():
        classes.setdefault(key.remote_rank, []).append(_plane_class(key, members, ssm, atom_major))
    return {rank: tuple(found) for rank, found in classes.items()}


def pair_groups(local: RankLayout, remote: RankLayout) -> tuple[GroupPairing, ...]:
    """Every group's plane classes per remote rank, for a pairing that passed ``validate_pair``
    (below; worker/plan/recipe.py ``peer_plan`` calls both)."""
    return tuple(
        GroupPairing(
            index=index,
            kind=lg.kind,
            window=lg.window,
            local=SideBlocks(lg.block_size, lg.kernel_block_size, lg.num_blocks),
            remote=SideBlocks(rg.block_size, rg.kernel_block_size, rg.num_blocks),
            classes=_plane_classes(index, local, remote),
            whole_blocks=not lg.block_format.token_addressable,
        )
        for index, (lg, rg) in enumerate(zip(local.groups, remote.groups, strict=True))
    )


def _check_same(group: int, what: str, local: object, remote: object) -> None:
    if local != remote:
        raise UnsupportedConfiguration(
            f"cache group {group}: decode has {what} {local!r} but prefill has {remote!r}; "
            "both engines must serve the same model with the same cache configuration"
        )


def _check_group_blocks(side: str, index: int, group: GroupGeometry) -> None:
    if group.block_size <= 0 or group.kernel_block_size <= 0 or group.num_blocks <= 0:
        raise UnsupportedConfiguration(
            f"{side} cache group {index}: block sizes and num_blocks must be positive"
        )
    if group.block_size % group.kernel_block_size != 0:
        raise UnsupportedConfiguration(
            f"{side} cache group {index}: kernel block size {group.kernel_block_size} does not "
            f"divide the logical block size {group.block_size}"
        )
    if group.kind is GroupKind.SSM and group.ratio != 1:
        raise UnsupportedConfiguration(
            f"{side} cache group {index}: SSM state blocks cannot be split into kernel blocks"
        )


def _check_plane_fits(
    side: str, layout: RankLayout, group: GroupGeometry, plane: PlaneGeometry
) -> None:
    slots = 1 if group.kind is GroupKind.SSM else group.kernel_block_size
    strides = (plane.kernel_block_stride_bytes, plane.token_stride_bytes, plane.head_stride_bytes)
    if not 0 <= plane.region < len(layout.region_bytes) or min(*strides, plane.offset_bytes) < 0:
        raise UnsupportedConfiguration(
            f"{side} layout: layer {plane.layer} plane {plane.plane} has a bad region or stride"
        )
    end_bytes = (
        plane.offset_bytes
        + (group.num_kernel_blocks - 1) * plane.kernel_block_stride_bytes
        + (slots - 1) * plane.token_stride_bytes
        + (plane.num_heads - 1) * plane.head_stride_bytes
        + plane.head_bytes
    )
    if end_bytes > layout.region_bytes[plane.region]:
        raise UnsupportedConfiguration(
            f"{side} layout: layer {plane.layer} plane {plane.plane} ends at byte {end_bytes}, past "
            f"its region of {layout.region_bytes[plane.region]} bytes; the layout is inconsistent"
        )


def _check_heads(side: str, layout: RankLayout, plane: PlaneGeometry) -> None:
    expected = (
        plane.model_heads if plane.replicated else heads_per_rank(plane.model_heads, layout.tp_size)
    )
    if plane.num_heads != expected:
        raise UnsupportedConfiguration(
            f"{side} layout: layer {plane.layer} holds {plane.num_heads} heads per rank, but "
            f"{plane.model_heads} heads over TP {layout.tp_size} give {expected}"
        )


_HEAD_MAJOR = (MemoryLayout.HND, MemoryLayout.HND_PACKED)


def _check_block_format(
    index: int, local: RankLayout, remote: RankLayout, lg: GroupGeometry, rg: GroupGeometry
) -> None:
    """Opaque blocks (a kernel-private order inside each block) only move whole, between equals."""
    local_format, remote_format = lg.block_format, rg.block_format
    if local_format != remote_format:
        raise UnsupportedConfiguration(
            f"cache group {index}: decode's attention kernel stores blocks as "
            f"{local_format.name!r} but prefill's as {remote_format.name!r}; run both engines "
            "with the same attention backend (and, on CPUs, the same instruction set)"
        )
    if local_format.token_addressable:
        return
    if lg.kind is GroupKind.SSM:
        if local.tp_size != remote.tp_size and not local_format.head_chunks:
            raise UnsupportedConfiguration(
                f"cache group {index} holds recurrent (SSM/Mamba) state in format "
                f"{local_format.name!r}, which each rank keeps for its own shard and which "
                f"cannot be re-sharded: decode TP {local.tp_size} cannot read from prefill TP "
                f"{remote.tp_size}; run both engines with the same tensor-parallel size"
            )
        return
    for what, ours, theirs in (
        ("block size", lg.block_size, rg.block_size),
        ("kernel block size", lg.kernel_block_size, rg.kernel_block_size),
        ("memory layout", local.memory_layout.value, remote.memory_layout.value),
    ):
        if ours != theirs:
            raise UnsupportedConfiguration(
                f"cache group {index}: blocks in format {local_format.name!r} are opaque (the "
                f"kernel orders bytes inside a block its own way) and move whole only between "
                f"equal engines, but decode's {what} is {ours!r} and prefill's {theirs!r}; "
                f"use the same {what} on both sides"
            )
    slices_heads = local.tp_size != remote.tp_size
    if slices_heads and not (local_format.head_chunks and local.memory_layout in _HEAD_MAJOR):
        raise UnsupportedConfiguration(
            f"cache group {index}: blocks in format {local_format.name!r} are opaque and cannot "
            f"be split by head, so decode TP {local.tp_size} cannot read from prefill TP "
            f"{remote.tp_size}; use the same tensor-parallel size on both sides"
        )


def _check_planes(index: int, local: GroupGeometry, remote: GroupGeometry) -> None:
    _check_same(index, "planes", len(local.planes), len(remote.planes))
    for lp, rp in zip(local.planes, remote.planes, strict=True):
        where = f"layer {lp.layer} plane {lp.plane}"
        _check_same(index, "a plane at", (lp.layer, lp.plane), (rp.layer, rp.plane))
        _check_same(index, f"{where} head bytes", lp.head_bytes, rp.head_bytes)
        _check_same(index, f"{where} model KV heads", lp.model_heads, rp.model_heads)
        _check_same(index, f"{where} replication", lp.replicated, rp.replicated)


def validate_pair(local: RankLayout, remote: RankLayout) -> None:
    """Raise UnsupportedConfiguration if the two layouts cannot be paired exactly."""
    tp_ratio(local.tp_size, remote.tp_size)
    if not 0 <= local.tp_rank < local.tp_size:
        raise UnsupportedConfiguration(
            f"decode rank {local.tp_rank} is not a rank of TP size {local.tp_size}"
        )
    if len(local.groups) != len(remote.groups):
        raise UnsupportedConfiguration(
            f"decode has {len(local.groups)} cache groups but prefill has {len(remote.groups)}; "
            "both engines must serve the same model"
        )
    for index, (lg, rg) in enumerate(zip(local.groups, remote.groups, strict=True)):
        _check_same(index, "kind", lg.kind.value, rg.kind.value)
        _check_same(index, "sliding window", lg.window, rg.window)
        if lg.kind is GroupKind.SLIDING_WINDOW and (lg.window is None or lg.window <= 0):
            raise UnsupportedConfiguration(
                f"cache group {index} is sliding-window with window {lg.window!r}; it must be positive"
            )
        _check_group_blocks("decode", index, lg)
        _check_group_blocks("prefill", index, rg)
        _check_block_format(index, local, remote, lg, rg)
        _check_planes(index, lg, rg)
        for side, layout, group in (("decode", local, lg), ("prefill", remote, rg)):
            for plane in group.planes:
                _check_heads(side, layout, plane)
                _check_plane_fits(side, layout, group, plane)


def _interleaved(planes: Sequence[PlaneGeometry]) -> bool:
    """True if the planes (of one layer) interleave per cell: plane i is plane 0 moved to
    offset + i * head_bytes, with the same region, strides and heads."""
    if len(planes) < 2:
        return False
    first = planes[0]
    base, step = first.offset_bytes, first.head_bytes
    return all(
        plane == msgspec.structs.replace(first, plane=plane.plane, offset_bytes=base + i * step)
        for i, plane in enumerate(planes)
    )


def _fused(planes: Sequence[PlaneGeometry]) -> PlaneGeometry:
    first = planes[0]
    return msgspec.structs.replace(first, head_bytes=len(planes) * first.head_bytes)


def _by_layer(planes: Sequence[PlaneGeometry]) -> list[tuple[PlaneGeometry, ...]]:
    """Consecutive planes of the same layer (planes are layer-major)."""
    return [tuple(layer) for _, layer in itertools.groupby(planes, key=lambda p: p.layer)]


def fuse_packed_planes(
    local: Sequence[PlaneGeometry], remote: Sequence[PlaneGeometry]
) -> list[tuple[PlaneGeometry, PlaneGeometry]]:
    """(decode plane, prefill plane) pairs, a layer's planes fused where both sides pack them.

    The pairing is validated first (same layers and planes in the same order on both sides).
    """
    pairs: list[tuple[PlaneGeometry, PlaneGeometry]] = []
    for local_layer, remote_layer in zip(_by_layer(local), _by_layer(remote), strict=True):
        if _interleaved(local_layer) and _interleaved(remote_layer):
            pairs.append((_fused(local_layer), _fused(remote_layer)))
        else:  # one side (or neither) packed: plane by plane, exact but slow if one side is
            pairs.extend(zip(local_layer, remote_layer, strict=True))
    return pairs
