"""Handshake part of the recipe (worker/plan.py): pair a decode rank's layout with a prefill engine's.

Everything here runs once per (local rank, remote engine). The result, one ``GroupPairing``
per cache group, holds each side's block sizes and, per remote rank, the ``PlaneClass``es:
sets of planes that share strides and head slices, so a request's byte ranges are computed
once per class and broadcast over its planes by adding each plane's (region, offset).
A layer whose planes are packed per cell on both sides (vLLM >= 0.33) is paired as one fused
plane first (worker/pairing_packed.py).
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from connector.layout import GroupKind, MemoryLayout, PlaneGeometry, RankLayout
from worker.byte_runs import Int64Array
from worker.pairing_packed import fuse_packed_planes
from worker.topology import ReadSource, read_sources


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
    whole_blocks: bool = (
        False  # opaque block format: copy whole kernel blocks (equal on both sides)
    )


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


def _plane_class(
    key: _ClassKey,
    members: list[tuple[PlaneGeometry, PlaneGeometry, ReadSource]],
    ssm: bool,
    atom_major: bool,
) -> PlaneClass:
    return PlaneClass(
        mode=_mode(key.local, key.remote, key.head_bytes, key.num_heads, ssm),
        local=key.local,
        remote=key.remote,
        head_bytes=key.head_bytes,
        num_heads=key.num_heads,
        atom_major=atom_major,
        local_regions=np.array([lp.region for lp, _, _ in members], dtype=np.int64),
        local_offsets=np.array(
            [lp.offset_bytes + s.local_heads.start * lp.head_stride_bytes for lp, _, s in members],
            dtype=np.int64,
        ),
        remote_regions=np.array([rp.region for _, rp, _ in members], dtype=np.int64),
        remote_offsets=np.array(
            [rp.offset_bytes + s.remote_heads.start * rp.head_stride_bytes for _, rp, s in members],
            dtype=np.int64,
        ),
    )


def _plane_classes(
    group: int,
    local: RankLayout,
    remote: RankLayout,
    sources: Callable[[PlaneGeometry], list[ReadSource]],
) -> dict[int, tuple[PlaneClass, ...]]:
    """Bucket the group's planes by (remote rank, strides, head slice size), keeping plane order.

    The first head of each slice is folded into the plane offsets, so planes reading different
    head slices with equal strides share a class. Packed layers count as one fused plane.
    """
    lg, rg = local.groups[group], remote.groups[group]
    buckets: dict[_ClassKey, list[tuple[PlaneGeometry, PlaneGeometry, ReadSource]]] = {}
    for lp, rp in fuse_packed_planes(lg.planes, rg.planes):
        for source in sources(lp):
            key = _ClassKey(
                source.remote_rank,
                _strides(lp),
                _strides(rp),
                lp.head_bytes,
                len(source.local_heads),
            )
            buckets.setdefault(key, []).append((lp, rp, source))
    ssm = lg.kind is GroupKind.SSM
    atom_major = local.memory_layout is MemoryLayout.BLOCK_OUTERMOST
    classes: dict[int, list[PlaneClass]] = {}
    for key, members in buckets.items():
        classes.setdefault(key.remote_rank, []).append(_plane_class(key, members, ssm, atom_major))
    return {rank: tuple(found) for rank, found in classes.items()}


def pair_groups(local: RankLayout, remote: RankLayout) -> tuple[GroupPairing, ...]:
    """Every group's plane classes per remote rank, for a pairing that passed
    worker/pairing_checks.py ``validate_pair`` (worker/plan.py ``peer_plan`` calls both)."""

    def sources(plane: PlaneGeometry) -> list[ReadSource]:
        return read_sources(
            local.tp_rank,
            local.tp_size,
            remote.tp_size,
            plane.model_heads,
            replicated=plane.replicated,
        )

    return tuple(
        GroupPairing(
            index=index,
            kind=lg.kind,
            window=lg.window,
            local=SideBlocks(lg.block_size, lg.kernel_block_size, lg.num_blocks),
            remote=SideBlocks(rg.block_size, rg.kernel_block_size, rg.num_blocks),
            classes=_plane_classes(index, local, remote, sources),
            whole_blocks=not lg.block_format.token_addressable,
        )
        for index, (lg, rg) in enumerate(zip(local.groups, remote.groups, strict=True))
    )
