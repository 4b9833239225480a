"""The planning recipe (worker/plan/recipe.py): named scenarios proven byte-exact by the oracle, and every rejection."""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import msgspec
import numpy as np
import pytest

from connector.errors import TransferPlanError, UnsupportedConfiguration
from connector.geometry import build_rank_layout
from connector.layout import (
    BlockFormat,
    GroupKind,
    GroupSpec,
    KVCacheSpec,
    LayerSpec,
    MemoryLayout,
)
from tests import oracle
from worker.plan.pairing import CopyMode, pair_groups
from worker.plan.recipe import (
    PeerPlan,
    RankPlan,
    RequestPlan,
    TransferRequest,
    peer_plan,
    plan_request,
)

FULL, SWA, MLA, SSM = GroupKind.FULL, GroupKind.SLIDING_WINDOW, GroupKind.MLA, GroupKind.SSM
NHD_PACKED, HND_PACKED = MemoryLayout.NHD_PACKED, MemoryLayout.HND_PACKED


def _layers(heads=(4, 4), head_dim=2, kind=FULL):
    planes = 1 if kind in (MLA, SSM) else 2
    return tuple(
        LayerSpec(
            name=f"l{i}",
            num_kv_heads=h,
            head_dim=head_dim + i % 2,
            dtype_bytes=2,
            num_planes=planes,
        )
        for i, h in enumerate(heads)
    )


def _group(kind=FULL, block=16, kernel=None, blocks=16, heads=(4, 4), head_dim=2, window=None):
    if kind is SWA and window is None:
        window = 20
    return GroupSpec(
        kind=kind, block_size=block, kernel_block_size=kernel or block, num_blocks=blocks,
        layers=_layers(heads, head_dim, kind), window=window,
    )  # fmt: skip


def _spec(*groups, memory_layout=MemoryLayout.NHD):
    return KVCacheSpec(
        model="m", dtype="bf16", cache_dtype="bf16", groups=groups, memory_layout=memory_layout
    )


@dataclass(frozen=True)
class Scenario:
    prefill: KVCacheSpec
    decode: KVCacheSpec
    request: oracle.Request
    prefill_tp: int = 1
    decode_tp: int = 1
    descriptors: list[int] | None = None  # per decode rank, when the count is the point
    notify_only: list[tuple[int, ...]] = field(default_factory=list)  # per decode rank


def _req(tokens, cached, local, remote):
    return oracle.Request(tokens, cached, tuple(map(tuple, local)), tuple(map(tuple, remote)))


SCENARIOS = {
    # One contiguous run of blocks per layer plane: 2 layers x (K, V) = 4 descriptors.
    "same-geometry-contiguous-one-descriptor-per-plane": Scenario(
        _spec(_group()), _spec(_group()), _req(64, 0, [[4, 5, 6, 7]], [[8, 9, 10, 11]]), descriptors=[4]
    ),
    "same-geometry-shuffled-ids": Scenario(
        _spec(_group()), _spec(_group()), _req(60, 0, [[7, 2, 3, 9]], [[1, 5, 6, 0]]), descriptors=[12]
    ),
    # Tokens [0, 16) and [32, 48) are neighbours on both sides although not in token order.
    "out-of-order-neighbours-merge": Scenario(
        _spec(_group()), _spec(_group()), _req(48, 0, [[3, 9, 4]], [[5, 0, 6]]), descriptors=[8]
    ),
    # vLLM weakness 2 + 3: decode block 32, prefill 16, decode has [0, 32) cached.
    "decode-block-larger-with-partial-hit": Scenario(
        _spec(_group(block=16)), _spec(_group(block=32)), _req(70, 32, [[3, 1]], [[0, 1, 2, 3, 4]])
    ),
    # vLLM weakness 4: reader block smaller than writer block.
    "decode-block-smaller-with-partial-hit": Scenario(
        _spec(_group(block=64)), _spec(_group(block=16)), _req(70, 16, [[2, 9, 4, 5]], [[6, 3]])
    ),
    # seed 003: logical 128 split into kernel 64 on decode, 16 on prefill.
    "kernel-splits-differ": Scenario(
        _spec(_group(block=32, kernel=8)), _spec(_group(block=32, kernel=16)), _req(90, 32, [[1, 0]], [[5, 3, 1]])
    ),
    # seed 004: per-layer page sizes differ (heads and head_dim differ per layer).
    "per-layer-page-sizes": Scenario(
        _spec(_group(heads=(4, 2, 1))), _spec(_group(heads=(4, 2, 1))), _req(40, 16, [[3, 4]], [[0, 1, 2]])
    ),
    "hybrid-swa-window-only": Scenario(
        _spec(_group(), _group(SWA, window=20)), _spec(_group(block=8), _group(SWA, block=8, window=20)),
        _req(50, 8, [[1, 2, 3, 4, 5, 6], [0, 0, 3, 4, 5, 6]], [[1, 2, 3, 4], [0, 0, 7, 8]]),
    ),
    # seed 001's open risk: full hit with an SSM group; nothing is read, every rank notified.
    "hybrid-ssm-full-hit-reads-nothing": Scenario(
        _spec(_group(), _group(SSM)), _spec(_group(), _group(SSM)), _req(32, 32, [[], []], [[1, 2], [3, 4]]),
        prefill_tp=2, decode_tp=2, descriptors=[0, 0], notify_only=[(0,), (1,)],
    ),
    "hybrid-ssm-partial-hit-copies-last-state": Scenario(
        _spec(_group(), _group(SSM, heads=(4,))), _spec(_group(block=8), _group(SSM, block=8, heads=(4,))),
        _req(40, 16, [[1, 2, 3], [7, 9]], [[1, 2, 3], [5, 6, 8]]), prefill_tp=2, decode_tp=4,
    ),
    # seed 002: MLA, prefill TP 4 > decode TP 1: read rank 0, notification-only to 1..3.
    "mla-decode-1-prefill-4": Scenario(
        _spec(_group(MLA, heads=(1, 1))), _spec(_group(MLA, heads=(1, 1))), _req(40, 0, [[1, 2, 3]], [[4, 5, 6]]),
        prefill_tp=4, decode_tp=1, notify_only=[(1, 2, 3)],
    ),
    "mla-decode-4-prefill-2": Scenario(
        _spec(_group(MLA, heads=(1,))), _spec(_group(MLA, heads=(1,))), _req(20, 0, [[1, 2]], [[4, 5]]),
        prefill_tp=2, decode_tp=4, notify_only=[(), (), (), ()],
    ),
    "decode-tp-larger-reads-head-slice": Scenario(
        _spec(_group(heads=(8, 8))), _spec(_group(heads=(8, 8))), _req(40, 0, [[1, 2, 3]], [[4, 5, 6]]),
        prefill_tp=2, decode_tp=4,
    ),
    "prefill-tp-larger-reads-several-ranks": Scenario(
        _spec(_group(heads=(8, 8))), _spec(_group(heads=(8, 8))), _req(40, 0, [[1, 2, 3]], [[4, 5, 6]]),
        prefill_tp=4, decode_tp=2,
    ),
    "tp-over-heads-replicated-heads": Scenario(
        _spec(_group(heads=(2, 1))), _spec(_group(heads=(2, 1))), _req(30, 0, [[1, 2]], [[4, 5]]),
        prefill_tp=4, decode_tp=1, notify_only=[(1, 3)],
    ),
    # HND with a head slice: one descriptor per (plane, kernel block), heads contiguous.
    "hnd-hetero-tp-one-descriptor-per-plane-block": Scenario(
        _spec(_group(heads=(8, 8)), memory_layout=MemoryLayout.HND),
        _spec(_group(heads=(8, 8)), memory_layout=MemoryLayout.HND),
        _req(64, 0, [[1, 2, 3, 4]], [[4, 5, 6, 7]]), prefill_tp=1, decode_tp=2, descriptors=[16, 16],
    ),
    # Block-outermost on both sides, contiguous ids: one descriptor for the whole request.
    "block-outermost-contiguous-one-descriptor": Scenario(
        _spec(_group(), memory_layout=MemoryLayout.BLOCK_OUTERMOST),
        _spec(_group(), memory_layout=MemoryLayout.BLOCK_OUTERMOST),
        _req(64, 0, [[4, 5, 6, 7]], [[8, 9, 10, 11]]), descriptors=[1],
    ),
    # Packed (vLLM >= 0.33) on both sides: a layer's K and V cells are one fused plane, so a
    # contiguous run of blocks is one descriptor per layer: 2 layers = 2 descriptors.
    "nhd-packed-contiguous-one-descriptor-per-layer": Scenario(
        _spec(_group(), memory_layout=NHD_PACKED), _spec(_group(), memory_layout=NHD_PACKED),
        _req(64, 0, [[4, 5, 6, 7]], [[8, 9, 10, 11]]), descriptors=[2],
    ),
    "hnd-packed-contiguous-one-descriptor-per-layer": Scenario(
        _spec(_group(), memory_layout=HND_PACKED), _spec(_group(), memory_layout=HND_PACKED),
        _req(64, 0, [[4, 5, 6, 7]], [[8, 9, 10, 11]]), descriptors=[2],
    ),
    # Two contiguous runs of blocks on both sides ([4, 5] <- [8, 9], [9, 10] <- [12, 13]).
    "nhd-packed-two-contiguous-runs-two-descriptors-per-layer": Scenario(
        _spec(_group(), memory_layout=NHD_PACKED), _spec(_group(), memory_layout=NHD_PACKED),
        _req(64, 0, [[4, 5, 9, 10]], [[8, 9, 12, 13]]), descriptors=[4],
    ),
    "packed-hetero-blocks-kernels-and-partial-hit": Scenario(
        _spec(_group(block=32, kernel=8), memory_layout=NHD_PACKED),
        _spec(_group(block=16), memory_layout=HND_PACKED),
        _req(70, 16, [[3, 1, 9, 4]], [[5, 0, 1]]),
    ),
    # A head slice of a packed layer: one fused (K|V) run per token (NHD) or per block (HND).
    "nhd-packed-decode-tp-larger-one-descriptor-per-token": Scenario(
        _spec(_group(heads=(8, 8)), memory_layout=NHD_PACKED),
        _spec(_group(heads=(8, 8)), memory_layout=NHD_PACKED),
        _req(40, 0, [[1, 2, 3]], [[4, 5, 6]]), prefill_tp=1, decode_tp=2, descriptors=[80, 80],
    ),
    "hnd-packed-decode-tp-larger-one-descriptor-per-block": Scenario(
        _spec(_group(heads=(8, 8)), memory_layout=HND_PACKED),
        _spec(_group(heads=(8, 8)), memory_layout=HND_PACKED),
        _req(64, 0, [[1, 2, 3, 4]], [[4, 5, 6, 7]]), prefill_tp=1, decode_tp=2, descriptors=[8, 8],
    ),
    "packed-prefill-tp-larger-reads-several-ranks": Scenario(
        _spec(_group(heads=(8, 8)), memory_layout=HND_PACKED),
        _spec(_group(heads=(8, 8)), memory_layout=NHD_PACKED),
        _req(40, 16, [[1, 2]], [[4, 5, 6]]), prefill_tp=4, decode_tp=2,
    ),
    # Only one side packed: exact, but one descriptor per (token, head, plane): 20 x 4 x 4.
    "packed-decode-reads-unpacked-nhd-per-head": Scenario(
        _spec(_group()), _spec(_group(), memory_layout=NHD_PACKED),
        _req(20, 0, [[1, 2]], [[4, 5]]), descriptors=[320],
    ),
    "unpacked-decode-reads-packed-hnd": Scenario(
        _spec(_group(block=8), memory_layout=HND_PACKED),
        _spec(_group(block=16), memory_layout=MemoryLayout.HND),
        _req(40, 16, [[3, 2]], [[7, 1, 0, 4, 5]]), prefill_tp=2, decode_tp=1,
    ),
    "block-outermost-reads-packed": Scenario(
        _spec(_group(), memory_layout=NHD_PACKED),
        _spec(_group(), memory_layout=MemoryLayout.BLOCK_OUTERMOST),
        _req(20, 0, [[1, 2]], [[4, 5]]),
    ),
    "mixed-layouts-nhd-reads-hnd": Scenario(
        _spec(_group(block=16, kernel=8), memory_layout=MemoryLayout.HND), _spec(_group(block=32)),
        _req(45, 32, [[3]], [[2, 0, 1]]), prefill_tp=2, decode_tp=1,
    ),
}  # fmt: skip


@pytest.mark.parametrize("scenario", list(SCENARIOS.values()), ids=list(SCENARIOS))
def test_scenario_is_byte_exact(scenario: Scenario):
    plans = oracle.run_all_ranks(
        scenario.prefill, scenario.decode, scenario.prefill_tp, scenario.decode_tp, scenario.request
    )
    if scenario.descriptors is not None:
        assert [sum(len(r) for r in oracle.ranges(p)) for p in plans] == scenario.descriptors
    if scenario.notify_only:
        assert [p.notify_only for p in plans] == scenario.notify_only


def test_mla_consumers_match_seed002():
    spec = _spec(_group(MLA, heads=(1,)))
    plan = plan_request(
        peer_plan(build_rank_layout(spec, 0, 1), build_rank_layout(spec, 0, 4)),
        TransferRequest(((1,),), ((2,),), num_tokens=10, num_cached_tokens=0),
    )
    assert [r.remote_rank for r in plan.reads] == [0]
    assert plan.notify_only == (1, 2, 3)
    assert plan.consumers == {0: 1, 1: 1, 2: 1, 3: 1}


def test_oracle_catches_a_plan_shifted_by_one_token():
    scenario = SCENARIOS["decode-block-larger-with-partial-hit"]
    local = build_rank_layout(scenario.decode, 0, 1)
    remote = build_rank_layout(scenario.prefill, 0, 1)
    request = scenario.request
    plan = plan_request(peer_plan(local, remote), TransferRequest(
        request.local_block_ids, request.remote_block_ids,
        num_tokens=request.num_tokens, num_cached_tokens=request.num_cached_tokens,
    ))  # fmt: skip
    reads = oracle.ranges(plan)[0]
    token_bytes = local.groups[0].planes[0].token_stride_bytes
    shifted = msgspec.structs.replace(reads, remote_offsets=reads.remote_offsets + token_bytes)
    bad = RequestPlan((RankPlan(0, None, shifted),), plan.notify_only, plan.consumers)
    buffers = oracle.sentinel(local)
    oracle.execute(bad, buffers, {0: oracle.fill_prefill(remote, request, seed=0)})
    assert oracle.first_difference(buffers, oracle.expected_decode(local, request)) is not None


def _plan(
    peer: PeerPlan, local_ids, remote_ids, *, num_tokens: int, num_cached_tokens: int
) -> RequestPlan:
    return plan_request(peer, TransferRequest(local_ids, remote_ids, num_tokens, num_cached_tokens))


def _planner(decode: KVCacheSpec, prefill: KVCacheSpec, decode_tp=1, prefill_tp=1, rank=0):
    return peer_plan(
        build_rank_layout(decode, rank, decode_tp), build_rank_layout(prefill, 0, prefill_tp)
    )


@pytest.mark.parametrize(
    ("decode", "prefill", "tps", "message"),
    [
        (_spec(_group()), _spec(_group(), _group()), (1, 1), "decode has 1 cache groups but prefill has 2"),
        (_spec(_group()), _spec(_group(SWA)), (1, 1), "cache group 0: decode has kind 'full' but prefill has 'sliding_window'"),
        (_spec(_group(SWA, window=20)), _spec(_group(SWA, window=32)), (1, 1), "sliding window 20 but prefill has 32"),
        (_spec(_group(heads=(4,))), _spec(_group(heads=(4, 4))), (1, 1), "decode has planes 2 but prefill has 4"),
        (_spec(_group(head_dim=2)), _spec(_group(head_dim=4)), (1, 1), "layer 0 plane 0 head bytes 4 but prefill has 8"),
        (_spec(_group(heads=(4, 4))), _spec(_group(heads=(4, 8))), (1, 1), "layer 1 plane 0 model KV heads 4 but prefill has 8"),
        (_spec(_group(heads=(12, 12))), _spec(_group(heads=(12, 12))), (4, 6), "decode TP 4 and prefill TP 6 do not divide"),
    ],
    ids=["group-count", "group-kind", "window", "layer-count", "head-dim", "model-heads", "tp-not-divisible"],
)  # fmt: skip
def test_pairing_rejects(decode, prefill, tps, message):
    with pytest.raises(UnsupportedConfiguration, match=message):
        _planner(decode, prefill, *tps)


CPU_VEC = BlockFormat("CPU_ATTN:vec", token_addressable=False, head_chunks=True)
CPU_AMX = BlockFormat("CPU_ATTN:amx", token_addressable=False, head_chunks=True)
UNKNOWN = BlockFormat("SOME_BACKEND", token_addressable=False)
HND = MemoryLayout.HND


def _opaque(block_format=CPU_VEC, block=16, kernel=None, layout=HND_PACKED):
    group = msgspec.structs.replace(_group(block=block, kernel=kernel), block_format=block_format)
    return _spec(group, memory_layout=layout)


@pytest.mark.parametrize(
    ("decode", "prefill", "tps", "message"),
    [
        (_opaque(CPU_VEC), _opaque(CPU_AMX), (1, 1), "decode's attention kernel stores blocks as 'CPU_ATTN:vec' but prefill's as 'CPU_ATTN:amx'; run both engines with the same attention backend"),
        (_spec(_group()), _opaque(CPU_VEC, layout=MemoryLayout.NHD), (1, 1), "blocks as 'tokens' but prefill's as 'CPU_ATTN:vec'"),
        (_opaque(block=16), _opaque(block=32), (1, 1), "are opaque .* decode's block size is 16 and prefill's 32; use the same block size"),
        (_opaque(block=16, kernel=8), _opaque(block=16), (1, 1), "decode's kernel block size is 8 and prefill's 16"),
        (_opaque(layout=HND_PACKED), _opaque(layout=HND), (1, 1), "decode's memory layout is 'hnd_packed' and prefill's 'hnd'"),
        (_opaque(UNKNOWN, layout=HND), _opaque(UNKNOWN, layout=HND), (1, 2), "cannot be split by head, so decode TP 1 cannot read from prefill TP 2"),
        (_opaque(CPU_VEC, layout=NHD_PACKED), _opaque(CPU_VEC, layout=NHD_PACKED), (2, 1), "cannot be split by head, so decode TP 2"),
    ],
    ids=["other-cpu-isa", "addressable-vs-opaque", "block-size", "kernel-block-size", "memory-layout", "unknown-format-other-tp", "token-major-chunks-other-tp"],
)  # fmt: skip
def test_pairing_refuses_opaque_blocks_between_unequal_engines(decode, prefill, tps, message):
    with pytest.raises(UnsupportedConfiguration, match=message):
        _planner(decode, prefill, *tps)


@pytest.mark.parametrize(
    ("tokens", "cached", "expected_blocks"),
    [(5, 0, [0]), (16, 0, [0]), (17, 0, [0, 1]), (40, 16, [1, 2])],
    ids=["one-partial-block", "one-full-block", "full-plus-one-token", "prefix-hit-then-partial"],
)  # fmt: skip
def test_opaque_blocks_are_read_whole(tokens, cached, expected_blocks):
    """Every needed kernel block moves whole: one descriptor per (layer, head chunk run)."""
    spec = _opaque(CPU_VEC, block=16, layout=HND_PACKED)
    first = cached // 16
    local = [list(range(first, -(-tokens // 16)))]
    remote = [list(range(-(-tokens // 16)))]
    plan = _plan(_planner(spec, spec), local, remote, num_tokens=tokens, num_cached_tokens=cached)
    (reads,) = oracle.ranges(plan)
    planes = build_rank_layout(spec, 0, 1).groups[0].planes
    block_bytes = {plane.region: plane.kernel_block_stride_bytes for plane in planes}
    assert int(reads.lengths.sum()) == len(expected_blocks) * sum(block_bytes.values())
    rows = zip(reads.remote_regions, reads.remote_offsets, reads.lengths, strict=True)
    for region, offset, length in rows:
        stride = block_bytes[int(region)]
        assert offset % stride == 0 and length % stride == 0
        assert list(range(offset // stride, (offset + length) // stride)) == expected_blocks


def _with_plane(layout, **changes):
    group = layout.groups[0]
    planes = (msgspec.structs.replace(group.planes[0], **changes),) + group.planes[1:]
    return msgspec.structs.replace(layout, groups=(msgspec.structs.replace(group, planes=planes),))


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        (
            {"num_heads": 3},
            "prefill layout: layer 0 holds 3 heads per rank, but 4 heads over TP 1 give 4",
        ),
        ({"offset_bytes": 10**9}, "prefill layout: layer 0 plane 0 ends at byte"),
        ({"region": 7}, "prefill layout: layer 0 plane 0 has a bad region or stride"),
    ],
    ids=["wrong-head-count", "plane-past-region", "unknown-region"],
)
def test_pairing_rejects_inconsistent_peer_layout(changes, message):
    spec = _spec(_group())
    remote = _with_plane(build_rank_layout(spec, 0, 1), **changes)
    with pytest.raises(UnsupportedConfiguration, match=message):
        peer_plan(build_rank_layout(spec, 0, 1), remote)


@pytest.mark.parametrize(
    ("local", "remote", "tokens", "cached", "message"),
    [
        ([[1, 2]], [[1, 2, 3]], 40, 8, "num_cached_tokens=8 is not a multiple of decode's block size 16"),
        ([[1]], [[1, 2, 3]], 40, 16, "decode needs 2 blocks of 16 tokens and got 1"),
        ([[1, 2]], [[1, 2]], 40, 16, "prefill needs 3 blocks of 16 tokens for \\[0, 40\\) and got 2"),
        ([[1, 99]], [[1, 2, 3]], 40, 16, "decode block id 99 is outside the pool \\[0, 16\\)"),
        ([[1, 2]], [[1, -2, 3]], 40, 16, "prefill block id -2 is outside the pool"),
        ([[5, 5]], [[1, 2, 3]], 40, 16, "decode block ids repeat block 5; each block of a request must be distinct"),
        ([[1, 2]], [[1, 2**63, 3]], 40, 16, "group 0: prefill block ids must be integers within int64"),
        ([[1, 2]], [[1, 2, 3]], 0, 0, "num_tokens=0 and num_cached_tokens=0"),
        ([[1, 2]], [[1, 2, 3]], 40, 48, "num_cached_tokens=48"),
        ([[1, 2], []], [[1, 2, 3]], 40, 16, "decode block ids have 2 groups, the layout has 1"),
    ],
    ids=["cached-not-block-aligned", "decode-count", "prefill-count", "decode-id-out-of-pool",
         "prefill-negative-id", "duplicate-decode-id", "prefill-id-beyond-int64", "zero-tokens", "cached-beyond-tokens", "group-count"],
)  # fmt: skip
def test_plan_rejects_impossible_requests(local, remote, tokens, cached, message):
    planner = _planner(_spec(_group()), _spec(_group()))
    with pytest.raises(TransferPlanError, match=message):
        _plan(planner, local, remote, num_tokens=tokens, num_cached_tokens=cached)


def _scattered(num_ids: int, pool: int, *, repeat: int | None = None, bad: int | None = None):
    """``num_ids`` distinct ids spread over [0, pool), shuffled; optionally the last one
    replaced by a repeat of ``repeat`` or by the out-of-pool ``bad``."""
    ids = random.Random(num_ids).sample(range(pool), num_ids)
    if repeat is not None:
        ids[ids.index(repeat) if repeat in ids else 0] = repeat
        ids[-1] = repeat
    if bad is not None:
        ids[-1] = bad
    return ids


LONG_POOL = 40_000
LONG_IDS = {  # (decode ids of 400 blocks, message): dense lists are counted, sparse ones sorted
    "dense repeat": (_scattered(400, 800, repeat=7), "decode block ids repeat block 7"),
    "sparse repeat": (_scattered(400, LONG_POOL, repeat=7), "decode block ids repeat block 7"),
    "out of the pool": (_scattered(400, 800, bad=LONG_POOL), f"block id {LONG_POOL} is outside"),
    "negative": (_scattered(400, LONG_POOL, bad=-3), "decode block id -3 is outside"),
}  # fmt: skip


@pytest.mark.parametrize(("local", "message"), LONG_IDS.values(), ids=LONG_IDS.keys())
def test_long_id_lists_are_checked_like_short_ones(local, message):
    spec = _spec(_group(blocks=LONG_POOL))
    with pytest.raises(TransferPlanError, match=message):
        _plan(
            _planner(spec, spec),
            [local],
            [list(range(400))],
            num_tokens=400 * 16,
            num_cached_tokens=0,
        )


def test_long_scattered_distinct_ids_plan():
    spec = _spec(_group(blocks=LONG_POOL))
    for pool in (800, LONG_POOL):
        plan = _plan(
            _planner(spec, spec),
            [_scattered(400, pool)],
            [list(range(400))],
            num_tokens=400 * 16,
            num_cached_tokens=0,
        )
        assert sum(len(r) for r in oracle.ranges(plan)) > 0


def test_ssm_state_without_a_prefill_block_is_rejected():
    spec = _spec(_group(), _group(SSM))
    with pytest.raises(
        TransferPlanError, match=r"group 1 \(SSM\): decode has a state block but prefill sent none"
    ):
        _plan(_planner(spec, spec), [[1], [2]], [[1], []], num_tokens=10, num_cached_tokens=0)


def test_swa_placeholders_outside_the_window_are_not_validated():
    spec = _spec(_group(SWA, window=16))
    plan = _plan(
        _planner(spec, spec), [[-1, -1, 3]], [[-1, -1, 4]], num_tokens=48, num_cached_tokens=0
    )
    (reads,) = oracle.ranges(plan)
    assert int(np.sum(reads.lengths)) > 0


@pytest.mark.parametrize("block", [1, 4, 16])
@pytest.mark.parametrize("window", [1, 2, 5, 16, 17])
@pytest.mark.parametrize("num_tokens", [1, 15, 16, 17, 31, 32, 33, 46, 47, 48])
def test_swa_reads_the_next_tokens_window_and_no_block_vllm_freed(num_tokens, window, block):
    """With n tokens loaded, decode's next token n attends to [n - window + 1, n]; vLLM frees
    (null block 0 in both lists) every block wholly before n - window + 1. The plan fills
    exactly those window - 1 tokens (the oracle), so it never reads block 0 nor writes it.
    Reading from n - window (one token more) touched a freed block whenever
    n - window + 1 is a multiple of the block size (47 tokens, window 16, block 16)."""
    spec = _spec(_group(SWA, block=block, blocks=64, window=window))
    num_blocks = -(-num_tokens // block)
    freed = oracle.vllm_window_start(num_tokens, window) // block
    local = [0] * freed + list(range(1, 1 + num_blocks - freed))
    remote = [0] * freed + list(range(63, 63 - (num_blocks - freed), -1))
    oracle.run_all_ranks(spec, spec, 1, 1, _req(num_tokens, 0, [local], [remote]))


@pytest.mark.parametrize(
    ("memory_layout", "descriptors"),
    [
        (MemoryLayout.NHD, 8),
        (MemoryLayout.HND, 8),
        (MemoryLayout.BLOCK_OUTERMOST, 1),
        (NHD_PACKED, 4),
        (HND_PACKED, 4),
    ],
    ids=["nhd-per-plane", "hnd-per-plane", "block-outermost-one", "nhd-packed-per-layer",
         "hnd-packed-per-layer"],
)  # fmt: skip
def test_contiguous_32k_request_descriptors(memory_layout, descriptors):
    spec = _spec(_group(block=16, blocks=2100, heads=(8,) * 4), memory_layout=memory_layout)
    ids = tuple(range(1, 2049))
    plan = _plan(_planner(spec, spec), (ids,), (ids,), num_tokens=32768, num_cached_tokens=0)
    assert [len(r) for r in oracle.ranges(plan)] == [descriptors]


@pytest.mark.parametrize(
    ("decode_layout", "prefill_layout", "mode", "head_bytes", "num_planes"),
    [
        (NHD_PACKED, NHD_PACKED, CopyMode.SEGMENT, (8, 12), 2),
        (HND_PACKED, HND_PACKED, CopyMode.PER_HEAD, (8, 12), 2),
        (NHD_PACKED, HND_PACKED, CopyMode.PER_ELEMENT, (8, 12), 2),
        (NHD_PACKED, MemoryLayout.NHD, CopyMode.PER_ELEMENT, (4, 6), 4),
        (MemoryLayout.HND, HND_PACKED, CopyMode.PER_ELEMENT, (4, 6), 4),
    ],
    ids=["nhd-packed-both", "hnd-packed-both", "packed-differently", "decode-only-packed",
         "prefill-only-packed"],
)  # fmt: skip
def test_packed_layers_fuse_only_when_both_sides_pack_them(
    decode_layout, prefill_layout, mode, head_bytes, num_planes
):
    """Layers of 4- and 6-byte heads: fused into one plane of K|V cells only if both sides pack."""
    decode = build_rank_layout(_spec(_group(), memory_layout=decode_layout), 0, 1)
    prefill = build_rank_layout(_spec(_group(), memory_layout=prefill_layout), 0, 1)
    (pairing,) = pair_groups(decode, prefill)
    classes = pairing.classes[0]
    assert [(c.mode, c.head_bytes) for c in classes] == [(mode, size) for size in head_bytes]
    assert sum(len(c.local_offsets) for c in classes) == num_planes


@pytest.mark.parametrize(
    ("spec", "group_changes", "layout_changes", "message"),
    [
        (_spec(_group()), {"kernel_block_size": 3}, {},
         "prefill cache group 0: kernel block size 3 does not divide the logical block size 16"),
        (_spec(_group(SSM, heads=(4,))), {"kernel_block_size": 8}, {},
         "prefill cache group 0: SSM state blocks cannot be split into kernel blocks"),
        (_spec(_group()), {"num_blocks": 0}, {}, "prefill cache group 0: block sizes and num_blocks must be positive"),
        (_spec(_group()), {}, {"tp_rank": 5}, "decode rank 5 is not a rank of TP size 1"),
    ],
    ids=["kernel-not-dividing", "ssm-split", "empty-pool", "decode-rank-out-of-range"],
)  # fmt: skip
def test_pairing_rejects_inconsistent_group_geometry(spec, group_changes, layout_changes, message):
    local = msgspec.structs.replace(build_rank_layout(spec, 0, 1), **layout_changes)
    remote = build_rank_layout(spec, 0, 1)
    group = msgspec.structs.replace(remote.groups[0], **group_changes)
    with pytest.raises(UnsupportedConfiguration, match=message):
        peer_plan(local, msgspec.structs.replace(remote, groups=(group,)))


def test_pairing_rejects_a_non_positive_window_on_both_sides():
    layout = build_rank_layout(_spec(_group(SWA, window=20)), 0, 1)
    broken = msgspec.structs.replace(
        layout, groups=(msgspec.structs.replace(layout.groups[0], window=0),)
    )
    with pytest.raises(
        UnsupportedConfiguration, match="sliding-window with window 0; it must be positive"
    ):
        peer_plan(broken, broken)
