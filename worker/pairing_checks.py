"""Handshake-time checks that a decode rank's layout can be paired exactly with a prefill engine's.

Every rejection raises UnsupportedConfiguration naming the group, layer or plane, both
values, and what must match. A peer's layout is untrusted input: planes must fit their regions.
"""

from __future__ import annotations

from connector.errors import UnsupportedConfiguration
from connector.geometry import heads_per_rank
from connector.layout import GroupGeometry, GroupKind, MemoryLayout, PlaneGeometry, RankLayout
from worker.topology import tp_ratio


def _reject(message: str) -> UnsupportedConfiguration:
    return UnsupportedConfiguration(message)


def _check_same(group: int, what: str, local: object, remote: object) -> None:
    if local != remote:
        raise _reject(
            f"cache group {group}: decode has {what} {local!r} but prefill has {remote!r}; "
            "both engines must serve the same model with the same cache configuration"
        )


def _check_group_blocks(side: str, index: int, group: GroupGeometry) -> None:
    if group.block_size <= 0 or group.kernel_block_size <= 0 or group.num_blocks <= 0:
        raise _reject(f"{side} cache group {index}: block sizes and num_blocks must be positive")
    if group.block_size % group.kernel_block_size != 0:
        raise _reject(
            f"{side} cache group {index}: kernel block size {group.kernel_block_size} does not "
            f"divide the logical block size {group.block_size}"
        )
    if group.kind is GroupKind.SSM and group.ratio != 1:
        raise _reject(
            f"{side} cache group {index}: SSM state blocks cannot be split into kernel blocks"
        )


def _check_plane_fits(
    side: str, layout: RankLayout, group: GroupGeometry, plane: PlaneGeometry
) -> None:
    slots = 1 if group.kind is GroupKind.SSM else group.kernel_block_size
    strides = (plane.kernel_block_stride_bytes, plane.token_stride_bytes, plane.head_stride_bytes)
    if (
        not 0 <= plane.region < len(layout.region_bytes)
        or min(strides) < 0
        or plane.offset_bytes < 0
    ):
        raise _reject(
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
        raise _reject(
            f"{side} layout: layer {plane.layer} plane {plane.plane} ends at byte {end_bytes}, past "
            f"its region of {layout.region_bytes[plane.region]} bytes; the layout is inconsistent"
        )


def _check_heads(side: str, layout: RankLayout, plane: PlaneGeometry) -> None:
    expected = (
        plane.model_heads if plane.replicated else heads_per_rank(plane.model_heads, layout.tp_size)
    )
    if plane.num_heads != expected:
        raise _reject(
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
        raise _reject(
            f"cache group {index}: decode's attention kernel stores blocks as "
            f"{local_format.name!r} but prefill's as {remote_format.name!r}; run both engines "
            "with the same attention backend (and, on CPUs, the same instruction set)"
        )
    if local_format.token_addressable:
        return
    if lg.kind is GroupKind.SSM:
        if local.tp_size != remote.tp_size and not local_format.head_chunks:
            raise _reject(
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
            raise _reject(
                f"cache group {index}: blocks in format {local_format.name!r} are opaque (the "
                f"kernel orders bytes inside a block its own way) and move whole only between "
                f"equal engines, but decode's {what} is {ours!r} and prefill's {theirs!r}; "
                f"use the same {what} on both sides"
            )
    slices_heads = local.tp_size != remote.tp_size
    if slices_heads and not (local_format.head_chunks and local.memory_layout in _HEAD_MAJOR):
        raise _reject(
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
        raise _reject(f"decode rank {local.tp_rank} is not a rank of TP size {local.tp_size}")
    if len(local.groups) != len(remote.groups):
        raise _reject(
            f"decode has {len(local.groups)} cache groups but prefill has {len(remote.groups)}; "
            "both engines must serve the same model"
        )
    for index, (lg, rg) in enumerate(zip(local.groups, remote.groups, strict=True)):
        _check_same(index, "kind", lg.kind.value, rg.kind.value)
        _check_same(index, "sliding window", lg.window, rg.window)
        if lg.kind is GroupKind.SLIDING_WINDOW and (lg.window is None or lg.window <= 0):
            raise _reject(
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
