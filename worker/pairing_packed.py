"""Handshake-time fusion of packed planes: a layer's K and V cells read as one wider plane.

In a packed layout (MemoryLayout.NHD_PACKED / HND_PACKED, vLLM >= 0.33) one (token, head) cell
holds every plane of a layer side by side, e.g. with head_bytes 256::

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

import itertools
from collections.abc import Sequence

import msgspec

from connector.layout import PlaneGeometry


def _shape(plane: PlaneGeometry) -> tuple[int | bool, ...]:
    """Everything but the offset that fused planes must share."""
    return (
        plane.region,
        plane.kernel_block_stride_bytes,
        plane.token_stride_bytes,
        plane.head_stride_bytes,
        plane.head_bytes,
        plane.num_heads,
        plane.model_heads,
        plane.replicated,
    )


def _interleaved(planes: Sequence[PlaneGeometry]) -> bool:
    """True if the planes (of one layer) interleave per cell: plane i at offset + i * head_bytes."""
    if len(planes) < 2:
        return False
    first = planes[0]
    return all(
        _shape(plane) == _shape(first)
        and plane.offset_bytes == first.offset_bytes + index * first.head_bytes
        for index, plane in enumerate(planes)
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
