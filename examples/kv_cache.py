"""The example engine's paged KV cache: the spec, rank buffers and token addressing.

Bookkeeping is in logical blocks (``examples.block_manager``: one pool per cache group, block
0 of every pool is the null block used as a placeholder). Memory is in kernel blocks, laid out
per rank exactly as ``connector.geometry.build_rank_layout`` describes, so the bytes the
connector's peers address are the bytes this cache reads and writes. A token at position p of
a group with block size B and kernel block size K lives in

    kernel block = block_table[p // B] * (B // K) + (p % B) // K,   slot = p % K

(seed 003: the block table is expanded to kernel blocks, never assumed equal).
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import numpy as np
import numpy.typing as npt

from connector.geometry import build_rank_layout
from connector.layout import (
    GroupKind,
    GroupSpec,
    KVCacheSpec,
    LayerSpec,
    MemoryLayout,
    PlaneGeometry,
    RankLayout,
)
from examples.block_manager import (  # re-exported: the cache's bookkeeping half
    NULL_BLOCK,
    BlockManager,
    BlockPool,
    PoolExhausted,
    block_hashes,
)
from examples.model import CACHE_DTYPE_BYTES, ModelKind, layer_plans

__all__ = [
    "NULL_BLOCK",
    "BlockManager",
    "BlockPool",
    "PagedRequestCache",
    "PoolExhausted",
    "RankBuffers",
    "block_hashes",
    "build_spec",
    "copy_kernel_blocks",
    "layer_locations",
]

Array = npt.NDArray[np.float64]


def build_spec(
    kind: ModelKind,
    *,
    block_size: int,
    kernel_block_size: int,
    num_blocks: int,
    memory_layout: MemoryLayout,
) -> KVCacheSpec:
    """The KVCacheSpec of ``kind``: one group per layer kind, in order of first appearance.

    Every group shares the engine's logical block size; SSM groups are never split into kernel
    blocks. ``num_blocks`` is the pool size of each group, from configuration (seed 004: never
    read back from a tensor shape, since groups have different page sizes).
    """
    kinds: list[GroupKind] = []
    for plan in layer_plans(kind):
        if plan.kind not in kinds:
            kinds.append(plan.kind)
    groups = []
    for group_kind in kinds:
        plans = [p for p in layer_plans(kind) if p.kind is group_kind]
        layers = tuple(
            LayerSpec(
                f"{group_kind.value}.{i}",
                p.num_kv_heads,
                p.head_dim,
                CACHE_DTYPE_BYTES,
                p.num_planes,
            )
            for i, p in enumerate(plans)
        )
        kernel = block_size if group_kind is GroupKind.SSM else kernel_block_size
        groups.append(
            GroupSpec(group_kind, block_size, kernel, num_blocks, layers, plans[0].window)
        )
    return KVCacheSpec(f"tiny-{kind.value}", "float64", "float32", tuple(groups), memory_layout)


def layer_locations(kind: ModelKind) -> list[tuple[int, int]]:
    """(group index, layer index within the group) of every model layer."""
    order: list[GroupKind] = []
    counts: dict[GroupKind, int] = {}
    locations = []
    for plan in layer_plans(kind):
        if plan.kind not in order:
            order.append(plan.kind)
        locations.append((order.index(plan.kind), counts.get(plan.kind, 0)))
        counts[plan.kind] = counts.get(plan.kind, 0) + 1
    return locations


def _plane_view(
    region: npt.NDArray[np.uint8],
    plane: PlaneGeometry,
    kind: GroupKind,
    num_kernel_blocks: int,
    kernel_block_size: int,
) -> npt.NDArray[np.float32]:
    """A float32 view of one plane: (kernel blocks, [slots,] heads, head_dim), by the geometry."""
    base = region.view(np.float32)[plane.offset_bytes // CACHE_DTYPE_BYTES :]
    head_dim = plane.head_bytes // CACHE_DTYPE_BYTES
    if kind is GroupKind.SSM:
        shape: tuple[int, ...] = (num_kernel_blocks, plane.num_heads, head_dim)
        strides: tuple[int, ...] = (
            plane.kernel_block_stride_bytes,
            plane.head_stride_bytes,
            CACHE_DTYPE_BYTES,
        )
    else:
        shape = (num_kernel_blocks, kernel_block_size, plane.num_heads, head_dim)
        strides = (
            plane.kernel_block_stride_bytes,
            plane.token_stride_bytes,
            plane.head_stride_bytes,
            CACHE_DTYPE_BYTES,
        )
    return np.lib.stride_tricks.as_strided(base, shape, strides, writeable=True)


class RankBuffers:
    """One TP rank's registered KV memory: one numpy buffer per region of its RankLayout."""

    def __init__(self, spec: KVCacheSpec, tp_rank: int, tp_size: int) -> None:
        self.layout: RankLayout = build_rank_layout(spec, tp_rank, tp_size)
        self.regions = [
            np.zeros(num_bytes, dtype=np.uint8) for num_bytes in self.layout.region_bytes
        ]
        # views[group][layer in group][plane]
        self.views: list[list[list[npt.NDArray[np.float32]]]] = []
        for group in self.layout.groups:
            layers: list[list[npt.NDArray[np.float32]]] = []
            for plane in group.planes:
                if plane.plane == 0:
                    layers.append([])
                layers[plane.layer].append(
                    _plane_view(
                        self.regions[plane.region],
                        plane,
                        group.kind,
                        group.num_kernel_blocks,
                        group.kernel_block_size,
                    )
                )
            self.views.append(layers)

    @property
    def region_addresses(self) -> list[int]:
        return [int(region.ctypes.data) for region in self.regions]

    def heads(self, group: int, layer: int) -> range:
        """Model-wide head indices this rank holds (all of them when replicated)."""
        plane = self.layout.groups[group].planes[layer * len(self.views[group][layer])]
        if plane.replicated:
            return range(plane.num_heads)
        rank = self.layout.tp_rank
        if plane.model_heads >= self.layout.tp_size:
            return range(rank * plane.num_heads, (rank + 1) * plane.num_heads)
        first = rank // (self.layout.tp_size // plane.model_heads)
        return range(first, first + 1)


class PagedRequestCache:
    """One request's RequestCache over every rank's buffers (implements examples.model.RequestCache)."""

    def __init__(
        self,
        spec: KVCacheSpec,
        kind: ModelKind,
        ranks: Sequence[RankBuffers],
        table: Sequence[Sequence[int]],
    ) -> None:
        self.spec = spec
        self.ranks = ranks
        self.table = [np.asarray(group_table, dtype=np.int64) for group_table in table]
        self.locations = layer_locations(kind)

    @property
    def tp_size(self) -> int:
        return len(self.ranks)

    def rank_heads(self, layer: int, tp_rank: int) -> range:
        group, index = self.locations[layer]
        return self.ranks[tp_rank].heads(group, index)

    def _slots(
        self, group: int, positions: npt.NDArray[np.int64]
    ) -> tuple[npt.NDArray[np.int64], ...]:
        spec = self.spec.groups[group]
        logical = self.table[group][positions // spec.block_size]
        kernel = logical * spec.ratio + (positions % spec.block_size) // spec.kernel_block_size
        return kernel, positions % spec.kernel_block_size

    def write(self, layer: int, position: int, planes: tuple[Array, ...]) -> None:
        group, index = self.locations[layer]
        kernel, slot = self._slots(group, np.array([position]))
        for rank in self.ranks:
            heads = rank.heads(group, index)
            for view, values in zip(rank.views[group][index], planes, strict=True):
                view[kernel[0], slot[0]] = values[heads.start : heads.stop]

    def read(self, layer: int, start: int, end: int, tp_rank: int) -> tuple[Array, ...]:
        group, index = self.locations[layer]
        kernel, slot = self._slots(group, np.arange(start, end))
        views = self.ranks[tp_rank].views[group][index]
        return tuple(view[kernel, slot].astype(np.float64) for view in views)

    def _state_block(self, group: int, num_tokens: int) -> int:
        return int(self.table[group][(num_tokens - 1) // self.spec.groups[group].block_size])

    def read_state(self, layer: int, num_tokens: int) -> Array:
        group, index = self.locations[layer]
        if num_tokens == 0:
            heads = self.spec.groups[group].layers[index]
            return np.zeros((heads.num_kv_heads, heads.head_dim))
        block = self._state_block(group, num_tokens)
        parts = [rank.views[group][index][0][block] for rank in self.ranks]
        return np.concatenate(parts).astype(np.float64)

    def write_state(self, layer: int, position: int, state: Array) -> None:
        group, index = self.locations[layer]
        block = self._state_block(group, position + 1)
        for rank in self.ranks:
            heads = rank.heads(group, index)
            rank.views[group][index][0][block] = state[heads.start : heads.stop]

    def digest(self, num_tokens: int) -> str:
        """A hash of the KV a decode step at position ``num_tokens`` reads, model-wide.

        Attention: tokens [0, num_tokens) (sliding window: the last window-1 tokens); SSM: the
        state after ``num_tokens`` tokens. Rank slices are joined by head; replicated planes
        must agree on every rank, or the digest says so.
        """
        digest = hashlib.sha256()
        for group, group_spec in enumerate(self.spec.groups):
            start = 0
            if group_spec.window is not None:
                start = max(0, num_tokens + 1 - group_spec.window)
            for index in range(len(group_spec.layers)):
                for plane in range(group_spec.layers[index].num_planes):
                    digest.update(self._plane_bytes(group, index, plane, start, num_tokens))
        return digest.hexdigest()

    def _plane_bytes(self, group: int, index: int, plane: int, start: int, end: int) -> bytes:
        if self.spec.groups[group].kind is GroupKind.SSM:
            block = self._state_block(group, end)
            parts = [rank.views[group][index][plane][block] for rank in self.ranks]
            return np.concatenate(parts).tobytes()
        kernel, slot = self._slots(group, np.arange(start, end))
        parts = [rank.views[group][index][plane][kernel, slot] for rank in self.ranks]
        if self.ranks[0].heads(group, index) == self.ranks[-1].heads(group, index):
            if any(not np.array_equal(part, parts[0]) for part in parts):
                return b"replicas-differ"
            return parts[0].tobytes()
        return np.concatenate(parts, axis=1).tobytes()


def copy_kernel_blocks(
    source: RankBuffers, target: RankBuffers, kernel_ids: Sequence[npt.NDArray[np.int64]]
) -> None:
    """Copy kernel blocks ``kernel_ids[group]`` of every layer and plane from one rank's buffers
    to another laid out the same way: one gather/scatter per plane, never a loop over blocks."""
    for group, ids in enumerate(kernel_ids):
        if len(ids) == 0:
            continue
        for source_layer, target_layer in zip(
            source.views[group], target.views[group], strict=True
        ):
            for source_plane, target_plane in zip(source_layer, target_layer, strict=True):
                target_plane[ids] = source_plane[ids]
