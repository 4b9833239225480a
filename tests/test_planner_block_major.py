"""Block-outermost packed layouts (vLLM's BLNHC / BLHNC) through the planner.

Property tests: hypothesis draws engines where one or both sides keep every layer's page of a
block in one row (packed K|V cells, rows possibly padded to the engine's block stride), with
TP pairs, kernel splits, prefix hits and mixed peers (a block-outermost side against any other
layout, in either direction); the byte oracle (tests/oracle.py) demands exact decode memory,
fully merged descriptors and consistent notifications. Table tests pin the descriptor counts
that make block-outermost worth it: one per block row when TP matches.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from connector.geometry import build_rank_layout
from connector.layout import GroupKind, GroupSpec, KVCacheSpec, LayerSpec, MemoryLayout
from tests import oracle

BLOCK_MAJOR = [MemoryLayout.BLOCK_NHD_PACKED, MemoryLayout.BLOCK_HND_PACKED]
EVERY_LAYOUT = list(MemoryLayout)
TP_PAIRS = [(1, 1), (2, 2), (1, 2), (2, 1), (2, 4), (4, 2), (1, 4), (4, 1)]  # (prefill, decode)
KINDS = [GroupKind.FULL, GroupKind.SLIDING_WINDOW, GroupKind.MLA, GroupKind.SSM]
PLACEHOLDER = 0  # the null block: never a real block on either side


@dataclass(frozen=True)
class Engine:
    layout: MemoryLayout
    tp: int
    blocks: tuple[tuple[int, int], ...]  # per group: (block_size, kernel_block_size)
    pad_bytes: int | None  # None: rows hold exactly the pages; else extra bytes per row


def _layers(draw: st.DrawFn, kind: GroupKind) -> tuple[LayerSpec, ...]:
    count = draw(st.integers(1, 3))
    planes = 1 if kind in (GroupKind.MLA, GroupKind.SSM) else 2
    heads = 1 if kind is GroupKind.MLA else draw(st.sampled_from([1, 2, 4]))
    head_dim, dtype_bytes = draw(st.integers(1, 3)), draw(st.sampled_from([1, 2]))
    # vLLM groups share one spec: every layer of a group has the same shape.
    return tuple(LayerSpec(f"l{i}", heads, head_dim, dtype_bytes, planes) for i in range(count))


def _block_sizes(draw: st.DrawFn, kind: GroupKind) -> tuple[int, int]:
    block = draw(st.sampled_from([2, 4, 8, 16]))
    if kind is GroupKind.SSM:
        return block, block
    return block, draw(st.sampled_from([k for k in (1, 2, 4, 8, 16) if block % k == 0]))


def _block_stride(spec: KVCacheSpec, tp: int, pad_bytes: int | None) -> int | None:
    """An engine-wide row that fits every group's kernel blocks, padded by ``pad_bytes``."""
    if pad_bytes is None or not spec.memory_layout.block_outermost:
        return None
    layout = build_rank_layout(spec, 0, tp)
    needs = [group.planes[0].kernel_block_stride_bytes * group.ratio for group in layout.groups]
    ratios = math.lcm(*[group.ratio for group in layout.groups])
    return -(-max(needs) // ratios) * ratios + pad_bytes * ratios


def _spec(engine: Engine, kinds, layers, windows, pools) -> KVCacheSpec:
    groups = tuple(
        GroupSpec(kind=kind, block_size=block, kernel_block_size=kernel, num_blocks=pool, layers=layer, window=window)
        for kind, (block, kernel), layer, window, pool in zip(kinds, engine.blocks, layers, windows, pools, strict=True)
    )  # fmt: skip
    spec = KVCacheSpec("m", "bf16", "bf16", groups, engine.layout)
    stride = _block_stride(spec, engine.tp, engine.pad_bytes)
    return KVCacheSpec("m", "bf16", "bf16", groups, engine.layout, block_stride_bytes=stride)


def _ids(draw: st.DrawFn, count: int, first: int, end: int) -> list[int]:
    """``count`` distinct block ids out of [first, end): contiguous or shuffled."""
    if draw(st.booleans()):
        start = draw(st.integers(first, end - count))
        return list(range(start, start + count))
    return draw(st.permutations(range(first, end)))[:count]


def _group_ids(draw, kind, block_size, window, num_tokens, first_token, id_range) -> list[int]:
    """Block ids covering [first_token, num_tokens) out of the group's ``id_range``; SWA blocks
    before the window are placeholders. Groups draw from disjoint ranges of one pool, as in
    vLLM, where groups share block rows but never a block id at once."""
    first_logical = first_token // block_size
    count = math.ceil(num_tokens / block_size) - first_logical
    if kind is GroupKind.SSM:
        return [] if first_token >= num_tokens else [PLACEHOLDER] + _ids(draw, 1, *id_range)
    ids = _ids(draw, count, *id_range)
    if kind is GroupKind.SLIDING_WINDOW:
        window_start = oracle.vllm_window_start(num_tokens, window)  # vLLM frees before it
        ids = [
            PLACEHOLDER if (first_logical + i + 1) * block_size <= window_start else b
            for i, b in enumerate(ids)
        ]
    return ids


@st.composite
def _engine(draw: st.DrawFn, layouts: list[MemoryLayout], tp: int, kinds) -> Engine:
    return Engine(
        draw(st.sampled_from(layouts)),
        tp,
        tuple(_block_sizes(draw, kind) for kind in kinds),
        draw(st.sampled_from([None, 0, 3])),
    )


@st.composite
def cases(
    draw: st.DrawFn, block_major: str
) -> tuple[KVCacheSpec, KVCacheSpec, int, int, oracle.Request]:
    """(prefill spec, decode spec, prefill TP, decode TP, request); ``block_major`` names the
    side(s) forced to a block-outermost packed layout."""
    kinds = draw(st.lists(st.sampled_from(KINDS), min_size=1, max_size=2))
    layers = [_layers(draw, kind) for kind in kinds]
    windows = [draw(st.integers(1, 24)) if k is GroupKind.SLIDING_WINDOW else None for k in kinds]
    prefill_tp, decode_tp = draw(st.sampled_from(TP_PAIRS))
    on = {
        "prefill": block_major in ("prefill", "both"),
        "decode": block_major in ("decode", "both"),
    }
    prefill = draw(_engine(BLOCK_MAJOR if on["prefill"] else EVERY_LAYOUT, prefill_tp, kinds))
    decode = draw(_engine(BLOCK_MAJOR if on["decode"] else EVERY_LAYOUT, decode_tp, kinds))
    aligned = math.lcm(*[b for (b, _), k in zip(decode.blocks, kinds, strict=True) if k is not GroupKind.SSM] or [1])  # fmt: skip
    num_tokens = draw(st.integers(1, 48))
    hit = draw(st.sampled_from(["none", "partial", "full"]))
    if hit == "full":
        num_tokens = aligned * max(1, num_tokens // aligned)
    cached = {"none": 0, "partial": aligned * draw(st.integers(0, num_tokens // aligned)), "full": num_tokens}[hit]  # fmt: skip
    sizes = [math.ceil(num_tokens / min(p[0], d[0])) + 3 for p, d in zip(prefill.blocks, decode.blocks, strict=True)]  # fmt: skip
    ends = [1 + sum(sizes[: i + 1]) for i in range(len(sizes))]  # block 0 is the null block
    ranges = [(end - size, end) for size, end in zip(sizes, ends, strict=True)]
    pools = [ends[-1]] * len(kinds)  # one pool shared by every group
    local_ids = [_group_ids(draw, k, d[0], w, num_tokens, cached, r) for k, d, w, r in zip(kinds, decode.blocks, windows, ranges, strict=True)]  # fmt: skip
    remote_ids = [_group_ids(draw, k, p[0], w, num_tokens, 0, r) for k, p, w, r in zip(kinds, prefill.blocks, windows, ranges, strict=True)]  # fmt: skip
    request = oracle.Request(
        num_tokens, cached, tuple(map(tuple, local_ids)), tuple(map(tuple, remote_ids))
    )
    return (
        _spec(prefill, kinds, layers, windows, pools),
        _spec(decode, kinds, layers, windows, pools),
        prefill_tp,
        decode_tp,
        request,
    )


@pytest.mark.parametrize(
    "block_major",
    ["both", "decode", "prefill"],
    ids=["both-block-major", "block-major-decode-reads-any", "any-decode-reads-block-major"],
)
@settings(max_examples=120, deadline=None)
@given(data=st.data())
def test_block_major_plans_are_byte_exact_and_merged(block_major: str, data: st.DataObject) -> None:
    prefill, decode, prefill_tp, decode_tp, request = data.draw(cases(block_major))
    oracle.run_all_ranks(prefill, decode, prefill_tp, decode_tp, request)


# ---- descriptor counts ----------------------------------------------------------------------

LAYERS = 3
HEADS = 4
BLOCK = 16
FRAGMENTED = (1, 3, 5, 7)  # every other block: no two neighbours on either side
SHUFFLED_REMOTE = (9, 2, 6, 4)


def _dense(layout: MemoryLayout, *, pad_bytes: int = 0) -> KVCacheSpec:
    layers = tuple(LayerSpec(f"l{i}", HEADS, 8, 2) for i in range(LAYERS))
    group = GroupSpec(GroupKind.FULL, BLOCK, BLOCK, 16, layers)
    row_bytes = LAYERS * 2 * BLOCK * HEADS * 16  # every layer's K|V page of one block, TP 1
    stride = row_bytes + pad_bytes if layout.block_outermost and pad_bytes else None
    return KVCacheSpec("m", "bf16", "bf16", (group,), layout, block_stride_bytes=stride)


@pytest.mark.parametrize(
    ("decode", "prefill", "num_tokens", "expected_per_rank"),
    [
        (MemoryLayout.BLOCK_NHD_PACKED, MemoryLayout.BLOCK_NHD_PACKED, 64, 4),
        (MemoryLayout.BLOCK_HND_PACKED, MemoryLayout.BLOCK_HND_PACKED, 64, 4),
        (MemoryLayout.BLOCK_NHD_PACKED, MemoryLayout.BLOCK_NHD_PACKED, 60, 3 + LAYERS),
        (MemoryLayout.BLOCK_HND_PACKED, MemoryLayout.BLOCK_HND_PACKED, 60, 3 + LAYERS * HEADS),
        (MemoryLayout.BLOCK_NHD_PACKED, MemoryLayout.NHD_PACKED, 64, 4 * LAYERS),
        (MemoryLayout.HND_PACKED, MemoryLayout.BLOCK_HND_PACKED, 64, 4 * LAYERS),
        (MemoryLayout.NHD_PACKED, MemoryLayout.NHD_PACKED, 64, 4 * LAYERS),
    ],
    ids=[
        "blnhc-one-per-block-row",
        "blhnc-one-per-block-row",
        "blnhc-partial-last-block-one-per-layer",
        "blhnc-partial-last-block-one-per-layer-head",
        "blnhc-decode-from-lbnhc-prefill-one-per-layer-block",
        "lbhnc-decode-from-blhnc-prefill-one-per-layer-block",
        "layer-outermost-baseline-one-per-layer-block",
    ],
)
@pytest.mark.parametrize("pad_bytes", [0, 256], ids=["dense-rows", "padded-rows"])
def test_fragmented_request_posts_one_descriptor_per_block_row(
    decode: MemoryLayout,
    prefill: MemoryLayout,
    num_tokens: int,
    expected_per_rank: int,
    pad_bytes: int,
) -> None:
    request = oracle.Request(num_tokens, 0, (FRAGMENTED,), (SHUFFLED_REMOTE,))
    (plan,) = oracle.run_all_ranks(
        _dense(prefill, pad_bytes=pad_bytes), _dense(decode, pad_bytes=pad_bytes), 1, 1, request
    )
    (reads,) = oracle.ranges(plan)
    assert len(reads.lengths) == expected_per_rank


def test_contiguous_ids_on_both_sides_read_as_one_descriptor() -> None:
    request = oracle.Request(64, 0, ((2, 3, 4, 5),), ((6, 7, 8, 9),))
    spec = _dense(MemoryLayout.BLOCK_NHD_PACKED)
    (plan,) = oracle.run_all_ranks(spec, spec, 1, 1, request)
    assert [len(reads.lengths) for reads in oracle.ranges(plan)] == [1]


@pytest.mark.parametrize(
    ("layout", "per_block"),
    [(MemoryLayout.BLOCK_HND_PACKED, LAYERS), (MemoryLayout.BLOCK_NHD_PACKED, LAYERS * BLOCK)],
    ids=["blhnc-head-slice-one-per-layer", "blnhc-head-slice-one-per-layer-token"],
)
def test_tp_head_slices_per_block(layout: MemoryLayout, per_block: int) -> None:
    """Decode TP 2 reads half of prefill TP 1's heads: in BLHNC a layer's head slice is one
    span; in BLNHC heads interleave per token, so the slice is one span per token."""
    request = oracle.Request(64, 0, (FRAGMENTED,), (SHUFFLED_REMOTE,))
    plans = oracle.run_all_ranks(_dense(layout), _dense(layout), 1, 2, request)
    assert [len(reads.lengths) for plan in plans for reads in oracle.ranges(plan)] == [
        4 * per_block
    ] * 2
