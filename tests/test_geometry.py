"""build_rank_layout: every plane's address formula against the tensor shape it describes."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from connector.errors import UnsupportedConfiguration
from connector.geometry import build_rank_layout
from connector.layout import (
    GroupKind,
    GroupSpec,
    KVCacheSpec,
    LayerSpec,
    MemoryLayout,
    PlaneGeometry,
)


def _spec(
    kind=GroupKind.FULL,
    memory_layout=MemoryLayout.NHD,
    heads=(4, 2),
    head_dim=3,
    planes=2,
    block_stride_bytes=None,
    **group,
):
    layers = tuple(
        LayerSpec(name=f"l{i}", num_kv_heads=h, head_dim=head_dim, dtype_bytes=2, num_planes=planes)
        for i, h in enumerate(heads)
    )
    fields = {"block_size": 8, "kernel_block_size": 4, "num_blocks": 3, "window": None} | group
    return KVCacheSpec(
        model="m", dtype="bf16", cache_dtype="bf16", memory_layout=memory_layout,
        groups=(GroupSpec(kind=kind, layers=layers, **fields),), block_stride_bytes=block_stride_bytes,
    )  # fmt: skip


def _address(plane: PlaneGeometry, kernel_block: int, slot: int, head: int) -> int:
    return (
        plane.offset_bytes
        + kernel_block * plane.kernel_block_stride_bytes
        + slot * plane.token_stride_bytes
        + head * plane.head_stride_bytes
    )


def _check_per_layer(layout, order: str, slots: int) -> None:
    """Each layer is one region shaped (planes, kernel blocks, tokens, heads) or (.., heads, tokens)."""
    group = layout.groups[0]
    for plane in group.planes:
        shape = {"nhd": (2, group.num_kernel_blocks, slots, plane.num_heads),
                 "hnd": (2, group.num_kernel_blocks, plane.num_heads, slots)}[order]  # fmt: skip
        assert layout.region_bytes[plane.region] == int(np.prod(shape)) * plane.head_bytes
        for kb, t, h in itertools.product(
            range(group.num_kernel_blocks), range(slots), range(plane.num_heads)
        ):
            index = (plane.plane, kb, t, h) if order == "nhd" else (plane.plane, kb, h, t)
            assert (
                _address(plane, kb, t, h)
                == int(np.ravel_multi_index(index, shape)) * plane.head_bytes
            )


def test_nhd_per_layer_regions():
    layout = build_rank_layout(_spec(), 0, 1)
    assert len(layout.region_bytes) == 2
    _check_per_layer(layout, "nhd", 4)


def test_hnd_per_layer_regions():
    layout = build_rank_layout(_spec(memory_layout=MemoryLayout.HND), 0, 1)
    _check_per_layer(layout, "hnd", 4)


def test_block_outermost_puts_all_layers_of_a_block_together():
    layout = build_rank_layout(_spec(memory_layout=MemoryLayout.BLOCK_OUTERMOST), 0, 1)
    group = layout.groups[0]
    # Per kernel block: layer 0 (K, V) of 4 tokens x 4 heads, then layer 1 (K, V) of 4 x 2.
    per_block_heads = [4, 4, 2, 2]
    block_bytes = sum(h * 4 * 6 for h in per_block_heads)
    assert layout.region_bytes == (block_bytes * group.num_kernel_blocks,)
    starts = np.cumsum([0] + [h * 4 * 6 for h in per_block_heads])
    for index, plane in enumerate(group.planes):
        assert plane.kernel_block_stride_bytes == block_bytes
        for kb, t, h in itertools.product(range(6), range(4), range(plane.num_heads)):
            expected = kb * block_bytes + int(starts[index]) + (t * plane.num_heads + h) * 6
            assert _address(plane, kb, t, h) == expected


@pytest.mark.parametrize(
    ("memory_layout", "order"),
    [(MemoryLayout.BLOCK_NHD_PACKED, "nhd"), (MemoryLayout.BLOCK_HND_PACKED, "hnd")],
    ids=["blnhc", "blhnc"],
)
@pytest.mark.parametrize("pad_bytes", [0, 40], ids=["dense-rows", "padded-rows"])
def test_packed_block_outermost_rows_hold_every_layers_packed_page(memory_layout, order, pad_bytes):
    """vLLM's BLNHC / BLHNC: per kernel block, layer 0's page then layer 1's, each page
    (tokens, heads, K|V) or (heads, tokens, K|V); rows may be padded to the engine's stride."""
    unpadded = build_rank_layout(_spec(memory_layout=memory_layout), 0, 1)
    row_bytes = unpadded.groups[0].planes[0].kernel_block_stride_bytes
    spec = _spec(memory_layout=memory_layout, block_stride_bytes=2 * (row_bytes + pad_bytes))
    layout = build_rank_layout(spec, 0, 1)
    group = layout.groups[0]
    stride = row_bytes + pad_bytes  # two kernel blocks per logical block
    assert row_bytes == 4 * 2 * (4 + 2) * 6  # 4 tokens, K and V, 4 + 2 heads, 6 bytes a head
    assert layout.region_bytes == (stride * group.num_kernel_blocks,)
    layer_starts = [0, 4 * 4 * 2 * 6]
    for plane in group.planes:
        assert plane.kernel_block_stride_bytes == stride
        for kb, t, h in itertools.product(range(6), range(4), range(plane.num_heads)):
            cell = (t * plane.num_heads + h) if order == "nhd" else (h * 4 + t)
            expected = kb * stride + layer_starts[plane.layer] + cell * 12 + plane.plane * 6
            assert _address(plane, kb, t, h) == expected


def test_block_stride_too_small_for_the_rows_is_refused():
    spec = _spec(memory_layout=MemoryLayout.BLOCK_NHD_PACKED, block_stride_bytes=100)
    with pytest.raises(UnsupportedConfiguration, match="block rows of 100 bytes cannot hold 2"):
        build_rank_layout(spec, 0, 1)


@pytest.mark.parametrize(
    ("heads", "tp_size", "tp_rank", "expected_heads"),
    [((4, 2), 2, 1, [2, 1]), ((4, 2), 4, 3, [1, 1]), ((8, 8), 8, 5, [1, 1])],
    ids=["even-shard", "tp-over-heads-replicates", "one-head-each"],
)
def test_heads_per_rank(heads, tp_size, tp_rank, expected_heads):
    layout = build_rank_layout(_spec(heads=heads), tp_rank, tp_size)
    assert [p.num_heads for p in layout.groups[0].planes[::2]] == expected_heads
    assert [p.model_heads for p in layout.groups[0].planes[::2]] == list(heads)


def test_mla_latent_is_replicated_on_every_rank():
    spec = _spec(kind=GroupKind.MLA, heads=(1,), head_dim=5, planes=1)
    for rank in range(4):
        (plane,) = build_rank_layout(spec, rank, 4).groups[0].planes
        assert (plane.num_heads, plane.replicated, plane.head_bytes) == (1, True, 10)


def test_ssm_state_has_no_token_axis():
    spec = _spec(kind=GroupKind.SSM, heads=(4,), planes=1, block_size=8, kernel_block_size=8)
    layout = build_rank_layout(spec, 1, 2)
    (plane,) = layout.groups[0].planes
    assert plane.token_stride_bytes == 0
    assert plane.num_heads == 2
    assert plane.kernel_block_stride_bytes == 2 * 6
    assert layout.region_bytes == (3 * 2 * 6,)


@pytest.mark.parametrize(
    ("spec", "rank", "tp", "message"),
    [
        (_spec(), 2, 2, "tp_rank=2 is not a rank of tp_size=2"),
        (_spec(kernel_block_size=3), 0, 1, "kernel block size 3 does not divide the logical block size 8"),
        (_spec(kind=GroupKind.SSM, planes=1), 0, 1, r"kernel_block_size \(4\) must equal block_size \(8\)"),
        (_spec(kind=GroupKind.SLIDING_WINDOW), 0, 1, "sliding-window but its window is None"),
        (_spec(heads=(6, 2)), 0, 4, "6 KV heads cannot be split over tensor-parallel size 4"),
        (_spec(num_blocks=0), 0, 1, "num_blocks=0 must all be positive"),
        (KVCacheSpec(model="m", dtype="bf16", cache_dtype="bf16", groups=()), 0, 1, "has no cache groups"),
        (_spec(page_stride_bytes=512), 0, 1, "keeps K and V in separate halves of a layer"),
        (_spec(memory_layout=MemoryLayout.NHD_PACKED, page_stride_bytes=100), 0, 1,
         "'l0' holds 192 bytes per kernel block on this rank but its padded page is 100 bytes"),
    ],
    ids=["rank-out-of-range", "kernel-not-dividing", "ssm-split", "swa-without-window",
         "heads-not-divisible", "empty-pool", "no-groups", "padding-between-split-planes",
         "padded-page-smaller-than-content"],
)  # fmt: skip
def test_build_rank_layout_rejects(spec, rank, tp, message):
    with pytest.raises(UnsupportedConfiguration, match=message):
        build_rank_layout(spec, rank, tp)


def test_engine_rows_put_every_group_in_one_region():
    """Given the engine's row length, groups share one region (vLLM's one buffer): a
    one-layer group's rows are as long as the three-layer group's, from the same byte 0."""
    layers = [
        tuple(LayerSpec(f"g{g}.l{i}", 2, 4, 2) for i in range(count))
        for g, count in enumerate((3, 1))
    ]
    groups = tuple(
        GroupSpec(kind=GroupKind.FULL, block_size=4, kernel_block_size=4, num_blocks=5, layers=ls)
        for ls in layers
    )
    row_bytes = 3 * 2 * 4 * 2 * 8  # 3 layers x K|V x 4 tokens x 2 heads x 8 bytes
    spec = KVCacheSpec("m", "bf16", "bf16", groups, MemoryLayout.BLOCK_HND_PACKED, row_bytes)
    layout = build_rank_layout(spec, 0, 1)
    assert layout.region_bytes == (5 * row_bytes,)
    for group in layout.groups:
        assert {(p.region, p.kernel_block_stride_bytes) for p in group.planes} == {(0, row_bytes)}
    assert [p.offset_bytes for p in layout.groups[1].planes] == [0, 8]


@pytest.mark.parametrize(
    "memory_layout", [MemoryLayout.NHD_PACKED, MemoryLayout.HND_PACKED], ids=["nhd", "hnd"]
)
def test_padded_pages_stride_a_page_and_keep_the_cells_inside_it(memory_layout):
    """Pages of 192 bytes of content (4 tokens x 4 heads x K|V of 6 bytes) padded to 256:
    kernel block k starts at k * 256, every cell stays in [k * 256, k * 256 + 192), and the
    region holds every page, the last one's padding too."""
    spec = _spec(memory_layout=memory_layout, heads=(4,), page_stride_bytes=256)
    layout = build_rank_layout(spec, 0, 1)
    group = layout.groups[0]
    assert layout.region_bytes == (group.num_kernel_blocks * 256,)
    for plane in group.planes:
        assert plane.kernel_block_stride_bytes == 256
        for kb, t, h in itertools.product(range(group.num_kernel_blocks), range(4), range(4)):
            start = _address(plane, kb, t, h)
            assert kb * 256 <= start and start + plane.head_bytes <= kb * 256 + 192


def test_padded_state_pages_one_per_block():
    spec = _spec(kind=GroupKind.SSM, planes=1, heads=(2, 2), head_dim=10, kernel_block_size=8,
                 page_stride_bytes=64)  # fmt: skip
    layout = build_rank_layout(spec, 1, 2)  # one 20-byte state head per rank
    assert layout.region_bytes == (3 * 64, 3 * 64)
    assert {
        (p.kernel_block_stride_bytes, p.head_bytes, p.num_heads) for p in layout.groups[0].planes
    } == {(64, 20, 1)}
