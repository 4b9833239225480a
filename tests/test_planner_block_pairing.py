"""The planner's block pairing agrees with worker/blocks.py, used here as an independent oracle.

The planner never looks at block ids as pairs: it turns token ranges into byte ranges through
each side's geometry. worker/blocks.py pairs kernel block ids directly (end-trim for equal
ratios, by token position for different ones, the tail for SSM state). Where both apply (equal
kernel block sizes, TP 1:1, token-addressable blocks, no sliding window), copying the bytes of
every token slot of each blocks.py pair must leave decode's memory exactly as the planner's
READs do: every byte written, and nothing else.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from hypothesis import given, settings
from hypothesis import strategies as st

from connector.geometry import build_rank_layout
from connector.layout import (
    GroupGeometry,
    GroupKind,
    GroupSpec,
    KVCacheSpec,
    LayerSpec,
    MemoryLayout,
    RankLayout,
)
from tests import oracle
from worker.blocks import apply_prefix_caching, logical_to_kernel_block_ids
from worker.plan.recipe import TransferRequest, peer_plan, plan_request

PLACEHOLDER = 0  # the null block: SSM groups list it before the real state block


@dataclass(frozen=True)
class Pairing:
    decode: KVCacheSpec
    prefill: KVCacheSpec
    request: oracle.Request


def _layers(draw: st.DrawFn, kind: GroupKind) -> tuple[LayerSpec, ...]:
    planes, heads = (2, draw(st.sampled_from([1, 2]))) if kind is GroupKind.FULL else (1, 1)
    return tuple(
        LayerSpec(f"l{i}", num_kv_heads=heads, head_dim=draw(st.integers(1, 3)),
                  dtype_bytes=draw(st.sampled_from([1, 2])), num_planes=planes)
        for i in range(draw(st.integers(1, 2)))
    )  # fmt: skip


def _distinct_ids(draw: st.DrawFn, count: int, pool: int) -> list[int]:
    return list(draw(st.permutations(range(1, pool))))[:count]


@st.composite
def pairings(draw: st.DrawFn) -> Pairing:
    kernel = draw(st.sampled_from([1, 2, 4]))
    kinds = draw(st.lists(st.sampled_from([GroupKind.FULL, GroupKind.MLA, GroupKind.SSM]), min_size=1, max_size=3))  # fmt: skip
    layers = [_layers(draw, kind) for kind in kinds]
    # SSM state blocks are never split, so their block is one kernel block of equal size.
    decode_sizes = [kernel if k is GroupKind.SSM else kernel * draw(st.integers(1, 4)) for k in kinds]  # fmt: skip
    prefill_sizes = [kernel if k is GroupKind.SSM else kernel * draw(st.integers(1, 4)) for k in kinds]  # fmt: skip
    num_tokens = draw(st.integers(1, 40))
    aligned = math.lcm(*[s for s, k in zip(decode_sizes, kinds, strict=True) if k is not GroupKind.SSM] or [1])  # fmt: skip
    cached = draw(st.sampled_from(sorted({0, num_tokens, *range(0, num_tokens + 1, aligned)})))
    if cached == num_tokens and num_tokens % aligned:
        cached = aligned * (num_tokens // aligned)  # a full hit ends on a block boundary
    pools = [math.ceil(num_tokens / min(d, p)) + 4 for d, p in zip(decode_sizes, prefill_sizes, strict=True)]  # fmt: skip
    local, remote = [], []
    for kind, d, p, pool in zip(kinds, decode_sizes, prefill_sizes, pools, strict=True):
        if kind is GroupKind.SSM:
            placeholders = [PLACEHOLDER] * draw(st.integers(0, 2))
            local.append(
                [] if cached >= num_tokens else placeholders + _distinct_ids(draw, 1, pool)
            )
            remote.append(placeholders + _distinct_ids(draw, 1, pool))
            continue
        local.append(_distinct_ids(draw, math.ceil(num_tokens / d) - cached // d, pool))
        remote.append(_distinct_ids(draw, math.ceil(num_tokens / p), pool))

    def spec(sizes: list[int]) -> KVCacheSpec:
        groups = tuple(
            GroupSpec(kind=k, block_size=s, kernel_block_size=kernel, num_blocks=pool, layers=layer)
            for k, s, layer, pool in zip(kinds, sizes, layers, pools, strict=True)
        )
        layout = draw(st.sampled_from(list(MemoryLayout)))
        return KVCacheSpec(model="m", dtype="bf16", cache_dtype="bf16", groups=groups, memory_layout=layout)  # fmt: skip

    request = oracle.Request(
        num_tokens, cached, tuple(map(tuple, local)), tuple(map(tuple, remote))
    )
    return Pairing(spec(decode_sizes), spec(prefill_sizes), request)


def _blocks_pairs(
    local: GroupGeometry, remote: GroupGeometry, g: int, request: oracle.Request
) -> list[tuple[int, int, int]]:
    """(decode kernel block, prefill kernel block, kernel position) from worker/blocks.py."""
    ssm = (0,) if local.kind is GroupKind.SSM else ()
    local_ids, remote_ids = (
        logical_to_kernel_block_ids([ids], ratio, ssm)
        for ids, ratio in (
            (request.local_block_ids[g], local.ratio),
            (request.remote_block_ids[g], remote.ratio),
        )
    )
    paired_local, paired_remote = apply_prefix_caching(
        local_ids, remote_ids, ssm_groups=ssm,
        local_ratio=local.ratio, remote_ratio=remote.ratio,
        num_tokens=request.num_tokens, kernel_block_size=local.kernel_block_size,
    )  # fmt: skip
    first = 0 if ssm else request.num_cached_tokens // local.kernel_block_size
    return [(lb, rb, first + i) for i, (lb, rb) in enumerate(zip(paired_local[0], paired_remote[0], strict=True))]  # fmt: skip


def expected_by_block_pairs(
    local: RankLayout, remote: RankLayout, prefill: oracle.Buffers, request: oracle.Request
) -> oracle.Buffers:
    """Decode memory after copying every token slot of every blocks.py pair (SSM: its state)."""
    decode = oracle.sentinel(local)
    for g, (lg, rg) in enumerate(zip(local.groups, remote.groups, strict=True)):
        kernel = lg.kernel_block_size
        for local_block, remote_block, position in _blocks_pairs(lg, rg, g, request):
            slots = [0] if lg.kind is GroupKind.SSM else [
                s for s in range(kernel) if position * kernel + s < request.num_tokens
            ]  # fmt: skip
            for lp, rp in zip(lg.planes, rg.planes, strict=True):
                for slot in slots:
                    for head in range(lp.num_heads):
                        dst = lp.offset_bytes + local_block * lp.kernel_block_stride_bytes + slot * lp.token_stride_bytes + head * lp.head_stride_bytes  # fmt: skip
                        src = rp.offset_bytes + remote_block * rp.kernel_block_stride_bytes + slot * rp.token_stride_bytes + head * rp.head_stride_bytes  # fmt: skip
                        decode[lp.region][dst : dst + lp.head_bytes] = prefill[rp.region][src : src + rp.head_bytes]  # fmt: skip
    return decode


@settings(max_examples=200)
@given(pairings())
def test_planner_reads_exactly_the_block_pairs_of_worker_blocks(case: Pairing) -> None:
    local = build_rank_layout(case.decode, 0, 1)
    remote = build_rank_layout(case.prefill, 0, 1)
    prefill = oracle.noise(remote, seed=7)
    request = case.request
    plan = plan_request(
        peer_plan(local, remote),
        TransferRequest(
            request.local_block_ids,
            request.remote_block_ids,
            num_tokens=request.num_tokens,
            num_cached_tokens=request.num_cached_tokens,
        ),
    )
    by_planner = oracle.sentinel(local)
    oracle.execute(plan, by_planner, {0: prefill})
    difference = oracle.first_difference(
        by_planner, expected_by_block_pairs(local, remote, prefill, request)
    )
    assert difference is None, difference


def test_the_oracle_sees_a_wrong_pairing() -> None:
    """Pairing decode's block with the wrong prefill block changes the expected bytes."""
    group = GroupSpec(kind=GroupKind.FULL, block_size=2, kernel_block_size=2, num_blocks=4,
                      layers=(LayerSpec("l0", num_kv_heads=1, head_dim=1, dtype_bytes=1),))  # fmt: skip
    spec = KVCacheSpec(model="m", dtype="bf16", cache_dtype="bf16", groups=(group,))
    layout = build_rank_layout(spec, 0, 1)
    prefill = oracle.noise(layout, seed=3)
    right = oracle.Request(4, 2, ((3,),), ((1, 2),))  # tokens [2, 4): prefill block 2 -> 3
    wrong = oracle.Request(4, 2, ((3,),), ((2, 1),))  # the same ids, prefill's order swapped
    plan = plan_request(peer_plan(layout, layout), TransferRequest(((3,),), ((1, 2),), num_tokens=4, num_cached_tokens=2))  # fmt: skip
    by_planner = oracle.sentinel(layout)
    oracle.execute(plan, by_planner, {0: prefill})
    assert oracle.first_difference(by_planner, expected_by_block_pairs(layout, layout, prefill, right)) is None  # fmt: skip
    assert oracle.first_difference(by_planner, expected_by_block_pairs(layout, layout, prefill, wrong)) is not None  # fmt: skip
