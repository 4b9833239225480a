"""The example paged KV cache: spec per model, geometry-exact addressing, pools and prefix hits."""

from __future__ import annotations

import numpy as np
import pytest

from connector.layout import GroupKind, MemoryLayout
from examples.kv_cache import (
    NULL_BLOCK,
    BlockManager,
    BlockPool,
    PagedRequestCache,
    RankBuffers,
    block_hashes,
    build_spec,
)
from examples.model import ModelKind

GROUPS = {
    ModelKind.DENSE: [GroupKind.FULL],
    ModelKind.MLA: [GroupKind.MLA],
    ModelKind.HYBRID_SWA: [GroupKind.FULL, GroupKind.SLIDING_WINDOW],
    ModelKind.HYBRID_SSM: [GroupKind.FULL, GroupKind.SSM],
}


@pytest.mark.parametrize("kind", list(GROUPS), ids=[k.value for k in GROUPS])
def test_spec_has_one_group_per_layer_kind_with_the_configured_pool(kind: ModelKind) -> None:
    spec = build_spec(
        kind, block_size=16, kernel_block_size=8, num_blocks=40, memory_layout=MemoryLayout.NHD
    )

    assert [group.kind for group in spec.groups] == GROUPS[kind]
    assert all(group.num_blocks == 40 for group in spec.groups)  # seed 004: from config
    for group in spec.groups:
        assert group.kernel_block_size == (16 if group.kind is GroupKind.SSM else 8)


def test_hybrid_swa_groups_have_different_page_sizes() -> None:
    spec = build_spec(
        ModelKind.HYBRID_SWA,
        block_size=16,
        kernel_block_size=16,
        num_blocks=8,
        memory_layout=MemoryLayout.NHD,
    )
    full, window = RankBuffers(spec, 0, 1).layout.groups

    assert full.planes[0].head_bytes != window.planes[0].head_bytes
    assert window.window == 6


def _address(
    buffers: RankBuffers, group: int, plane_index: int, kernel_block: int, slot: int, head: int
) -> int:
    plane = buffers.layout.groups[group].planes[plane_index]
    return (
        plane.offset_bytes
        + kernel_block * plane.kernel_block_stride_bytes
        + slot * plane.token_stride_bytes
        + head * plane.head_stride_bytes
    )


@pytest.mark.parametrize("layout", [MemoryLayout.NHD, MemoryLayout.HND], ids=["nhd", "hnd"])
def test_tokens_land_where_the_geometry_says_after_kernel_block_expansion(
    layout: MemoryLayout,
) -> None:
    spec = build_spec(
        ModelKind.DENSE, block_size=16, kernel_block_size=4, num_blocks=8, memory_layout=layout
    )
    ranks = [RankBuffers(spec, rank, 2) for rank in range(2)]
    cache = PagedRequestCache(spec, ModelKind.DENSE, ranks, [[5, 2]])
    keys = np.arange(32, dtype=np.float64).reshape(4, 8)  # 4 KV heads of head_dim 8
    values = -keys

    cache.write(layer=1, position=22, planes=(keys, values))

    # position 22 -> logical block 1 (id 2), offset 6 -> kernel block 2 * 4 + 6 // 4 = 9, slot 2
    for rank, buffers in enumerate(ranks):
        for local_head in range(2):
            for plane, expected in ((2, keys), (3, values)):  # layer 1: planes 2 (K), 3 (V)
                start = _address(buffers, 0, plane, kernel_block=9, slot=2, head=local_head)
                region = buffers.regions[buffers.layout.groups[0].planes[plane].region]
                stored = region[start : start + 32].view(np.float32)
                np.testing.assert_array_equal(stored, expected[2 * rank + local_head])


def test_read_returns_what_write_stored_across_ranks() -> None:
    spec = build_spec(
        ModelKind.DENSE,
        block_size=8,
        kernel_block_size=4,
        num_blocks=8,
        memory_layout=MemoryLayout.HND,
    )
    ranks = [RankBuffers(spec, rank, 4) for rank in range(4)]
    cache = PagedRequestCache(spec, ModelKind.DENSE, ranks, [[3, 1, 6]])
    rows = np.random.default_rng(0).standard_normal((20, 4, 8)).astype(np.float32)
    for position in range(20):
        cache.write(0, position, (rows[position].astype(np.float64),) * 2)

    keys = np.concatenate([cache.read(0, 4, 20, rank)[0] for rank in range(4)], axis=1)

    np.testing.assert_array_equal(keys, rows[4:20])


def test_pool_reserves_the_null_block_and_evicts_least_recently_freed() -> None:
    pool = BlockPool(num_blocks=4)
    first, second, third = pool.allocate(), pool.allocate(), pool.allocate()
    pool.cache(first, b"h1")
    pool.release(first)
    pool.release(second)

    assert NULL_BLOCK not in (first, second, third)
    assert pool.num_used == 1
    assert pool.allocate() == first  # freed first, evicted first: its hash is gone
    assert b"h1" not in pool.by_hash


def _manager(kind: ModelKind = ModelKind.DENSE, block_size: int = 4) -> BlockManager:
    spec = build_spec(
        kind,
        block_size=block_size,
        kernel_block_size=block_size,
        num_blocks=32,
        memory_layout=MemoryLayout.NHD,
    )
    return BlockManager(spec)


HITS = {
    "same-prompt-capped-below-full": (list(range(10)), 9, 8),
    "longer-prompt-full-blocks-only": (list(range(10)) + [50, 51, 52], 12, 8),
    "cap-to-one-block": (list(range(10)), 5, 4),
    "different-first-block-no-hit": ([9] + list(range(1, 10)), 9, 0),
}


@pytest.mark.parametrize("prompt, max_hit_tokens, expected", list(HITS.values()), ids=list(HITS))
def test_prefix_hit_counts_cached_full_blocks(
    prompt: list[int], max_hit_tokens: int, expected: int
) -> None:
    blocks = _manager()
    blocks.allocate("a", list(range(10)), 0, 10)
    blocks.cache_blocks("a", list(range(10)), 10)
    blocks.free("a")

    assert blocks.find_prefix_hit(prompt, max_hit_tokens) == expected


def test_prefix_hit_blocks_are_shared_and_counted_once_freed() -> None:
    blocks = _manager()
    prompt = list(range(12))
    first = blocks.allocate("a", prompt, 0, 12)
    blocks.cache_blocks("a", prompt, 12)
    second = blocks.allocate("b", prompt, 8, 13)

    assert second[0][:2] == first[0][:2]
    assert blocks.num_used_blocks == 3 + 2  # a's 3 blocks, and b's 2 blocks beyond the hit
    blocks.free("a")
    blocks.free("b")
    assert blocks.num_used_blocks == 0


def test_ssm_state_hit_needs_the_state_at_the_boundary() -> None:
    blocks = _manager(ModelKind.HYBRID_SSM)
    prompt = list(range(12))
    blocks.allocate("a", prompt, 0, 12)
    blocks.cache_blocks("a", prompt, 12)
    blocks.free("a")
    ssm_pool = blocks.pools[1]
    del ssm_pool.by_hash[block_hashes(prompt, 4)[2]]  # no state after 12 tokens any more

    assert blocks.find_prefix_hit(prompt + [1], 12) == 8


def test_ssm_placeholders_for_hit_and_loaded_blocks_but_the_state_blocks() -> None:
    blocks = _manager(ModelKind.HYBRID_SSM)
    prompt = list(range(12))
    blocks.allocate("a", prompt, 0, 12)
    blocks.cache_blocks("a", prompt, 12)
    blocks.free("a")

    # 8 tokens hit (2 blocks), 14 more arrive remotely (tokens 8..21, blocks 2..5)
    full, ssm = blocks.allocate("b", prompt + list(range(30, 40)), 8, 22, remote_tokens=14)

    assert NULL_BLOCK not in full and len(full) == 6
    assert ssm[0] == NULL_BLOCK and ssm[1] != NULL_BLOCK  # state after the hit
    assert ssm[2:5] == (NULL_BLOCK,) * 3 and ssm[5] != NULL_BLOCK  # state after the load


def test_digest_flags_replicas_that_disagree() -> None:
    spec = build_spec(
        ModelKind.MLA,
        block_size=4,
        kernel_block_size=4,
        num_blocks=4,
        memory_layout=MemoryLayout.NHD,
    )
    ranks = [RankBuffers(spec, rank, 2) for rank in range(2)]
    cache = PagedRequestCache(spec, ModelKind.MLA, ranks, [[1, 2]])
    for position in range(6):
        for layer in range(2):
            cache.write(layer, position, (np.full((1, 16), position, dtype=np.float64),))
    agreed = cache.digest(6)

    ranks[1].regions[0][256 + 4] ^= 1  # rank 1's copy of block 1 (256 bytes a block)

    assert cache.digest(6) != agreed
