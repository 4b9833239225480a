"""Derive one TP rank's byte geometry (RankLayout) from the model-wide KVCacheSpec."""

from __future__ import annotations

import msgspec

from connector.errors import UnsupportedConfiguration
from connector.layout import (
    GroupGeometry,
    GroupKind,
    GroupSpec,
    KVCacheSpec,
    LayerSpec,
    MemoryLayout,
    PlaneGeometry,
    RankLayout,
)


def heads_per_rank(model_heads: int, tp_size: int) -> int:
    """Heads one rank holds: an even shard, or one replicated head when TP exceeds the heads."""
    if model_heads % tp_size == 0:
        return model_heads // tp_size
    if tp_size % model_heads == 0:
        return 1
    raise UnsupportedConfiguration(
        f"{model_heads} KV heads cannot be split over tensor-parallel size {tp_size}: "
        "one must divide the other; choose a TP size that divides the head count or a multiple of it"
    )


def _layer_heads(layer: LayerSpec, kind: GroupKind, tp_size: int) -> tuple[int, bool]:
    if kind is GroupKind.MLA:
        return layer.num_kv_heads, True
    return heads_per_rank(layer.num_kv_heads, tp_size), False


def _validate_group(group: GroupSpec, index: int, memory_layout: MemoryLayout) -> None:
    if group.block_size <= 0 or group.kernel_block_size <= 0 or group.num_blocks <= 0:
        raise UnsupportedConfiguration(
            f"cache group {index}: block_size={group.block_size}, "
            f"kernel_block_size={group.kernel_block_size} and num_blocks={group.num_blocks} "
            "must all be positive"
        )
    if group.block_size % group.kernel_block_size != 0:
        raise UnsupportedConfiguration(
            f"cache group {index}: kernel block size {group.kernel_block_size} does not divide "
            f"the logical block size {group.block_size}; use a block size that is a multiple "
            f"of {group.kernel_block_size}"
        )
    if group.kind is GroupKind.SSM and group.kernel_block_size != group.block_size:
        raise UnsupportedConfiguration(
            f"cache group {index} holds SSM state, which is never split into kernel blocks: "
            f"kernel_block_size ({group.kernel_block_size}) must equal block_size ({group.block_size})"
        )
    if group.page_stride_bytes is not None:
        _validate_padding(group, index, memory_layout)
    if group.kind is GroupKind.SLIDING_WINDOW and (group.window is None or group.window <= 0):
        raise UnsupportedConfiguration(
            f"cache group {index} is sliding-window but its window is {group.window!r}; "
            "give the window size in tokens"
        )


def _validate_padding(group: GroupSpec, index: int, memory_layout: MemoryLayout) -> None:
    """A padded page must hold the layer's kernel block, all planes side by side."""
    split_planes = not (memory_layout.packed or memory_layout.block_outermost)
    if split_planes and any(layer.num_planes > 1 for layer in group.layers):
        raise UnsupportedConfiguration(
            f"cache group {index} has padded pages ({group.page_stride_bytes} bytes) in the "
            f"{memory_layout.value} layout, which keeps K and V in separate halves of a layer: "
            "a padded page needs them side by side; use a packed or block-outermost layout"
        )


def _page_stride(group: GroupSpec, index: int, layer: LayerSpec, page_bytes: int) -> int:
    """Bytes one layer's kernel block occupies on this rank: its padded page, or its content."""
    stride = group.page_stride_bytes
    if stride is None:
        return page_bytes
    if stride < page_bytes:
        raise UnsupportedConfiguration(
            f"cache group {index}: layer {layer.name!r} holds {page_bytes} bytes per kernel "
            f"block on this rank but its padded page is {stride} bytes; the engine's page "
            "size does not match its cache spec"
        )
    return stride


def _plane_bytes_per_kernel_block(group: GroupSpec, num_heads: int, head_bytes: int) -> int:
    slots = 1 if group.kind is GroupKind.SSM else group.kernel_block_size
    return slots * num_heads * head_bytes


def _strides(
    group: GroupSpec, num_heads: int, cell_bytes: int, memory_layout: MemoryLayout
) -> tuple[int, int]:
    """(token_stride_bytes, head_stride_bytes) inside one kernel block of one plane.

    ``cell_bytes`` is one (token, head) cell: one head's bytes, or every plane's in a packed
    layout.
    """
    if group.kind is GroupKind.SSM:
        return 0, cell_bytes
    if memory_layout.head_major:
        return cell_bytes, group.kernel_block_size * cell_bytes
    return num_heads * cell_bytes, cell_bytes


def _per_layer_group(
    group: GroupSpec, index: int, tp_size: int, memory_layout: MemoryLayout, first_region: int
) -> tuple[list[PlaneGeometry], list[int]]:
    """One region per layer, shaped (planes, kernel blocks, ...); with padded pages, kernel
    block k of a layer starts k * page_stride_bytes into its region. Example, a state page of
    68608 bytes padded to 131072: block 1's state is bytes [131072, 199680)."""
    planes: list[PlaneGeometry] = []
    regions: list[int] = []
    num_kernel_blocks = group.num_blocks * group.ratio
    for layer_index, layer in enumerate(group.layers):
        num_heads, replicated = _layer_heads(layer, group.kind, tp_size)
        head_bytes = layer.head_dim * layer.dtype_bytes
        block_bytes = _plane_bytes_per_kernel_block(group, num_heads, head_bytes)
        # Packed: K and V of one (token, head) are neighbours, e.g. NHD_PACKED with 2 heads:
        # [t0h0 K|V][t0h1 K|V][t1h0 K|V]...; V's plane starts head_bytes into the block.
        packed = memory_layout.packed
        cell_bytes = head_bytes * layer.num_planes if packed else head_bytes
        page_bytes = block_bytes * (layer.num_planes if packed else 1)
        stride = _page_stride(group, index, layer, page_bytes)
        plane_offset_bytes = head_bytes if packed else num_kernel_blocks * stride
        token_stride, head_stride = _strides(group, num_heads, cell_bytes, memory_layout)
        region = first_region + len(regions)
        for plane in range(layer.num_planes):
            planes.append(
                PlaneGeometry(
                    layer=layer_index,
                    plane=plane,
                    region=region,
                    offset_bytes=plane * plane_offset_bytes,
                    kernel_block_stride_bytes=stride,
                    token_stride_bytes=token_stride,
                    head_stride_bytes=head_stride,
                    head_bytes=head_bytes,
                    num_heads=num_heads,
                    model_heads=layer.num_kv_heads,
                    replicated=replicated,
                )
            )
        regions.append((1 if packed else layer.num_planes) * num_kernel_blocks * stride)
    return planes, regions


def _kernel_row_stride(group: GroupSpec, index: int, row_bytes: int, spec: KVCacheSpec) -> int:
    """Bytes from one kernel block's row to the next: the group's own pages, or the engine's
    padded logical row (``spec.block_stride_bytes``) split evenly into kernel blocks."""
    if spec.block_stride_bytes is None:
        return row_bytes
    stride, remainder = divmod(spec.block_stride_bytes, group.ratio)
    if remainder or stride < row_bytes:
        raise UnsupportedConfiguration(
            f"cache group {index}: block rows of {spec.block_stride_bytes} bytes cannot hold "
            f"{group.ratio} kernel block(s) of {row_bytes} bytes (every layer's page); the "
            "engine's block stride does not match its cache spec"
        )
    return stride


def _block_outermost_group(
    group: GroupSpec, index: int, spec: KVCacheSpec, tp_size: int, first_region: int
) -> tuple[list[PlaneGeometry], list[int]]:
    """One row per kernel block holding every layer's page in order: the group's own region,
    or, when the engine gave its row length (``spec.block_stride_bytes``), region 0 shared by
    every group, as vLLM aliases all groups' rows in one buffer (its groups never hold the
    same block id at once).

    Unpacked (BLOCK_OUTERMOST), a page is (planes, tokens, heads, head_dim); packed
    (BLOCK_NHD_PACKED / BLOCK_HND_PACKED), a page is (tokens, heads, C) or (heads, tokens, C)
    with the cell C = K then V, so plane V starts head_bytes after plane K. Example, 2 layers
    of 1 head, 2 tokens, packed NHD, head_bytes 4: row = [l0 t0 K|V][l0 t1 K|V][l1 t0 K|V]...,
    layer 1 at byte 16, its V at byte 20.
    """
    memory_layout = spec.memory_layout
    packed = memory_layout.packed
    inner = memory_layout if packed else MemoryLayout.NHD
    planes: list[PlaneGeometry] = []
    offset = 0
    for layer_index, layer in enumerate(group.layers):
        num_heads, replicated = _layer_heads(layer, group.kind, tp_size)
        head_bytes = layer.head_dim * layer.dtype_bytes
        plane_bytes = _plane_bytes_per_kernel_block(group, num_heads, head_bytes)
        cell_bytes = head_bytes * layer.num_planes if packed else head_bytes
        token_stride, head_stride = _strides(group, num_heads, cell_bytes, inner)
        for plane in range(layer.num_planes):
            planes.append(
                PlaneGeometry(
                    layer=layer_index,
                    plane=plane,
                    region=first_region,
                    offset_bytes=offset + plane * (head_bytes if packed else plane_bytes),
                    kernel_block_stride_bytes=0,  # set below, once the row is known
                    token_stride_bytes=token_stride,
                    head_stride_bytes=head_stride,
                    head_bytes=head_bytes,
                    num_heads=num_heads,
                    model_heads=layer.num_kv_heads,
                    replicated=replicated,
                )
            )
        offset += _page_stride(group, index, layer, layer.num_planes * plane_bytes)
    stride = _kernel_row_stride(group, index, offset, spec)
    planes = [msgspec.structs.replace(p, kernel_block_stride_bytes=stride) for p in planes]
    return planes, [stride * group.num_blocks * group.ratio]


def build_rank_layout(spec: KVCacheSpec, tp_rank: int, tp_size: int) -> RankLayout:
    """The geometry of rank ``tp_rank`` of ``tp_size``; raises UnsupportedConfiguration."""
    if tp_size <= 0 or not 0 <= tp_rank < tp_size:
        raise UnsupportedConfiguration(
            f"tp_rank={tp_rank} is not a rank of tp_size={tp_size}; ranks are 0..tp_size-1"
        )
    if not spec.groups:
        raise UnsupportedConfiguration(
            "the KV cache spec has no cache groups; describe at least one"
        )
    groups: list[GroupGeometry] = []
    region_bytes: list[int] = []
    shared_rows = spec.memory_layout.block_outermost and spec.block_stride_bytes is not None
    for index, group in enumerate(spec.groups):
        _validate_group(group, index, spec.memory_layout)
        if spec.memory_layout.block_outermost:
            first_region = 0 if shared_rows else len(region_bytes)
            planes, regions = _block_outermost_group(group, index, spec, tp_size, first_region)
        else:
            planes, regions = _per_layer_group(
                group, index, tp_size, spec.memory_layout, len(region_bytes)
            )
        if shared_rows:  # one buffer for every group: as long as the longest group's rows
            region_bytes = [max(region_bytes + regions)]
        else:
            region_bytes.extend(regions)
        groups.append(
            GroupGeometry(
                kind=group.kind,
                block_size=group.block_size,
                kernel_block_size=group.kernel_block_size,
                num_blocks=group.num_blocks,
                window=group.window,
                planes=tuple(planes),
                block_format=group.block_format,
            )
        )
    return RankLayout(
        tp_rank=tp_rank,
        tp_size=tp_size,
        memory_layout=spec.memory_layout,
        groups=tuple(groups),
        region_bytes=tuple(region_bytes),
    )
