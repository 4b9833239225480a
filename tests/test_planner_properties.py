"""Property tests: random pairings of block sizes, kernel splits, layouts, TP and prefix hits.

Each example builds both engines' specs, plans every decode rank, executes the plans with the
byte-level oracle against every prefill rank and demands exact decode memory, fully merged
descriptors and consistent notification counts.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from connector.geometry import build_rank_layout
from connector.layout import (
    TOKEN_ADDRESSABLE,
    BlockFormat,
    GroupKind,
    GroupSpec,
    KVCacheSpec,
    LayerSpec,
    MemoryLayout,
)
from tests import oracle

TP_PAIRS = [(1, 1), (1, 2), (2, 1), (2, 4), (4, 2), (1, 4), (4, 1)]  # (prefill, decode)
KINDS = [GroupKind.FULL, GroupKind.SLIDING_WINDOW, GroupKind.MLA, GroupKind.SSM]
PLACEHOLDER = 0  # the null block: never a real block on either side
ALL_LAYOUTS = list(MemoryLayout)  # includes the packed layouts
PACKED = [MemoryLayout.NHD_PACKED, MemoryLayout.HND_PACKED]  # K and V share a (token, head) cell
HEAD_MAJOR = (MemoryLayout.HND, MemoryLayout.HND_PACKED)


@dataclass(frozen=True)
class Side:
    memory_layout: MemoryLayout
    blocks: tuple[tuple[int, int], ...]  # per group: (block_size, kernel_block_size)
    block_format: BlockFormat = TOKEN_ADDRESSABLE


@st.composite
def _block_sizes(draw: st.DrawFn, kind: GroupKind) -> tuple[int, int]:
    block = draw(st.sampled_from([2, 4, 6, 8, 16]))
    if kind is GroupKind.SSM:
        return block, block
    kernel = draw(st.sampled_from([k for k in (1, 2, 3, 4, 8, 16) if block % k == 0]))
    return block, kernel


FP8_KINDS = [GroupKind.FULL, GroupKind.SLIDING_WINDOW, GroupKind.MLA]  # attention caches only
FP8_SCALES = (0.5, 1.0)  # (k_scale, v_scale): the planner must never need them


@st.composite
def _layers(draw: st.DrawFn, kind: GroupKind, fp8: bool = False) -> tuple[LayerSpec, ...]:
    if fp8:  # one byte per element: heads of 1 to 3 bytes start at odd offsets
        return tuple(
            msgspec.structs.replace(layer, dtype_bytes=1, kv_scales=FP8_SCALES)
            for layer in draw(_layers(kind))
        )
    count = draw(st.integers(1, 2))
    heads = (
        [1] * count
        if kind is GroupKind.MLA
        else draw(st.lists(st.sampled_from([1, 2, 4, 8]), min_size=count, max_size=count))
    )
    planes = 1 if kind in (GroupKind.MLA, GroupKind.SSM) else 2
    return tuple(
        LayerSpec(name=f"l{i}", num_kv_heads=h, head_dim=draw(st.integers(1, 3)), dtype_bytes=draw(st.sampled_from([1, 2])), num_planes=planes)
        for i, h in enumerate(heads)
    )  # fmt: skip


def _ids(draw: st.DrawFn, count: int, pool: int) -> list[int]:
    """``count`` distinct real block ids out of [1, pool): contiguous or shuffled."""
    if draw(st.booleans()):
        first = draw(st.integers(1, pool - count))
        return list(range(first, first + count))
    return draw(st.permutations(range(1, pool)))[:count]


@dataclass(frozen=True)
class Case:
    prefill: KVCacheSpec
    decode: KVCacheSpec
    prefill_tp: int
    decode_tp: int
    request: oracle.Request


def _spec(side: Side, kinds, layers, windows, pools, cache_dtype: str = "bf16") -> KVCacheSpec:
    groups = tuple(
        GroupSpec(kind=kind, block_size=block, kernel_block_size=kernel, num_blocks=pool, layers=layer, window=window, block_format=side.block_format)
        for kind, (block, kernel), layer, window, pool in zip(kinds, side.blocks, layers, windows, pools, strict=True)
    )  # fmt: skip
    return KVCacheSpec(
        model="m",
        dtype="bf16",
        cache_dtype=cache_dtype,
        groups=groups,
        memory_layout=side.memory_layout,
    )


def _group_ids(draw, kind, block_size, window, num_tokens, first_token, pool) -> list[int]:
    """Block ids covering [first_token, num_tokens); SWA blocks before the window are placeholders."""
    first_logical = first_token // block_size
    count = math.ceil(num_tokens / block_size) - first_logical
    if kind is GroupKind.SSM:
        return (
            []
            if first_token >= num_tokens
            else [PLACEHOLDER] * draw(st.integers(0, 2)) + _ids(draw, 1, pool)
        )
    ids = _ids(draw, count, pool)
    if kind is GroupKind.SLIDING_WINDOW:
        window_start = oracle.vllm_window_start(num_tokens, window)  # vLLM frees before it
        ids = [
            PLACEHOLDER if (first_logical + i + 1) * block_size <= window_start else b
            for i, b in enumerate(ids)
        ]
    return ids


@st.composite
def _memory_layouts(draw: st.DrawFn, packed: str) -> tuple[MemoryLayout, MemoryLayout]:
    """(prefill, decode) layouts; ``packed`` names the side(s) forced to a packed layout."""
    prefill = draw(st.sampled_from(PACKED if packed in ("prefill", "both") else ALL_LAYOUTS))
    decode = draw(st.sampled_from(PACKED if packed in ("decode", "both") else ALL_LAYOUTS))
    return prefill, decode


@st.composite
def _opaque_sides(draw: st.DrawFn, kinds: list[GroupKind]) -> tuple[Side, Side, int, int]:
    """Equal sides with an opaque block format; TP may differ only where heads are chunks."""
    block_format = BlockFormat(
        "kernel-private", token_addressable=False, head_chunks=draw(st.booleans())
    )
    side = Side(
        draw(st.sampled_from(ALL_LAYOUTS)),
        tuple(draw(_block_sizes(k)) for k in kinds),
        block_format,
    )
    head_slices = block_format.head_chunks and side.memory_layout in HEAD_MAJOR
    prefill_tp, decode_tp = draw(st.sampled_from(TP_PAIRS if head_slices else [(1, 1), (2, 2)]))
    return side, side, prefill_tp, decode_tp  # fmt: skip


@st.composite
def cases(draw: st.DrawFn, packed: str = "any", opaque: bool = False, fp8: bool = False) -> Case:
    kinds = draw(st.lists(st.sampled_from(FP8_KINDS if fp8 else KINDS), min_size=1, max_size=3))
    layers = [draw(_layers(kind, fp8)) for kind in kinds]
    windows = [draw(st.integers(1, 24)) if k is GroupKind.SLIDING_WINDOW else None for k in kinds]
    if opaque:
        prefill, decode, prefill_tp, decode_tp = draw(_opaque_sides(kinds))
    else:
        prefill_tp, decode_tp = draw(st.sampled_from(TP_PAIRS))
        prefill_layout, decode_layout = draw(_memory_layouts(packed))
        prefill = Side(prefill_layout, tuple(draw(_block_sizes(k)) for k in kinds))
        decode = Side(decode_layout, tuple(draw(_block_sizes(k)) for k in kinds))
    aligned = math.lcm(
        *[b for (b, _), k in zip(decode.blocks, kinds, strict=True) if k is not GroupKind.SSM]
        or [1]
    )
    hit = draw(st.sampled_from(["none", "partial", "full"]))
    num_tokens = draw(st.integers(1, 40))
    if hit == "full":
        num_tokens = aligned * max(1, num_tokens // aligned)
    cached = {
        "none": 0,
        "partial": aligned * draw(st.integers(0, num_tokens // aligned)),
        "full": num_tokens,
    }[hit]
    pools = [
        math.ceil(num_tokens / min(p[0], d[0])) + 4
        for p, d in zip(prefill.blocks, decode.blocks, strict=True)
    ]
    local_ids = [
        _group_ids(draw, k, d[0], w, num_tokens, cached, pool)
        for k, d, w, pool in zip(kinds, decode.blocks, windows, pools, strict=True)
    ]
    remote_block_ids = [
        _group_ids(draw, k, p[0], w, num_tokens, 0, pool)
        for k, p, w, pool in zip(kinds, prefill.blocks, windows, pools, strict=True)
    ]
    request = oracle.Request(
        num_tokens, cached, tuple(map(tuple, local_ids)), tuple(map(tuple, remote_block_ids))
    )
    cache_dtype = "fp8_e4m3" if fp8 else "bf16"
    return Case(_spec(prefill, kinds, layers, windows, pools, cache_dtype), _spec(decode, kinds, layers, windows, pools, cache_dtype), prefill_tp, decode_tp, request)  # fmt: skip


@settings(max_examples=250)
@given(cases())
def test_plans_are_byte_exact_merged_and_notify_every_prefill_rank(case: Case) -> None:
    oracle.run_all_ranks(case.prefill, case.decode, case.prefill_tp, case.decode_tp, case.request)


@settings(max_examples=200)
@given(data=st.data())
def test_fp8_caches_are_byte_exact_at_one_byte_per_element(data: st.DataObject) -> None:
    """FP8 with per-tensor scales: every element one byte, so heads of 1-3 bytes sit at odd
    offsets. TP pairs, block and kernel sizes, layouts (packed or not, either side), partial
    last blocks and prefix hits (a multi-turn pull reads a cached prefix's suffix the same
    way) vary; the reader must hold exactly the oracle's bytes, merged as always."""
    case = data.draw(cases(packed=data.draw(st.sampled_from(["any", "both"])), fp8=True))
    for spec in (case.prefill, case.decode):
        assert {layer.dtype_bytes for group in spec.groups for layer in group.layers} == {1}
    oracle.run_all_ranks(case.prefill, case.decode, case.prefill_tp, case.decode_tp, case.request)


@pytest.mark.parametrize("packed", ["prefill", "decode", "both"], ids=lambda side: f"{side}-packed")
@settings(max_examples=100)
@given(data=st.data())
def test_packed_layouts_are_byte_exact_and_merged(packed: str, data: st.DataObject) -> None:
    """Packed K|V cells on one side (planned plane by plane) or both (fused per layer)."""
    case = data.draw(cases(packed))
    oracle.run_all_ranks(case.prefill, case.decode, case.prefill_tp, case.decode_tp, case.request)


@settings(max_examples=150)
@given(cases(opaque=True))
def test_opaque_block_formats_move_whole_kernel_blocks(case: Case) -> None:
    """A kernel-private block format: decode gets every byte of every block it needs, the
    partial last block and the block holding the window start included, and nothing else."""
    oracle.run_all_ranks(case.prefill, case.decode, case.prefill_tp, case.decode_tp, case.request)


@settings(max_examples=300)
@given(data=st.data())
def test_same_block_sizes_cut_tokens_as_the_general_cutter_does(data: st.DataObject) -> None:
    """segments.same_blocks_segments (the hot path when both sides cut tokens alike) equals
    segments.token_segments on every range and set of ids."""
    import numpy as np

    from worker.plan.pairing import SideBlocks
    from worker.plan.segments import same_blocks_segments, token_segments

    kernel = data.draw(st.sampled_from([1, 2, 3, 4, 8]))
    ratio = data.draw(st.sampled_from([1, 2, 4]))
    block = kernel * ratio
    end = data.draw(st.integers(1, 60))
    start = data.draw(st.integers(0, end - 1))
    first_logical, last_logical = start // block, (end - 1) // block
    count = last_logical + 1 - first_logical
    pool = count + 5
    side = SideBlocks(block, kernel, pool)
    local = np.array(data.draw(st.permutations(range(pool)))[:count], dtype=np.int64)
    remote = np.array(data.draw(st.permutations(range(pool)))[:count], dtype=np.int64)
    fast = same_blocks_segments(start, end, side, local, remote, first_logical)
    general = token_segments(start, end, side, side, local, first_logical, remote, first_logical)
    for name in ("local_blocks", "local_slots", "remote_blocks", "remote_slots", "num_tokens"):
        assert getattr(fast, name).tolist() == getattr(general, name).tolist(), name
    # The hint the index path trusts instead of comparing: exactly the short segments.
    assert fast.partial_at == tuple(np.flatnonzero(general.num_tokens < kernel).tolist())


def _page_content_bytes(spec: KVCacheSpec, group_index: int, tp: int) -> int:
    """The largest content of one layer's kernel block in a group on one rank of ``tp``."""
    group = build_rank_layout(spec, 0, tp).groups[group_index]
    slots = 1 if group.kind is GroupKind.SSM else group.kernel_block_size
    pages: dict[int, int] = {}
    for plane in group.planes:
        pages[plane.layer] = pages.get(plane.layer, 0) + slots * plane.num_heads * plane.head_bytes
    return max(pages.values())


def _can_pad(spec: KVCacheSpec, group: GroupSpec) -> bool:
    """Padding needs a layer's planes side by side (connector/geometry.py)."""
    layout = spec.memory_layout
    return (
        layout.packed
        or layout.block_outermost
        or all(layer.num_planes == 1 for layer in group.layers)
    )


@st.composite
def padded(draw: st.DrawFn, spec: KVCacheSpec, tp: int) -> KVCacheSpec:
    """``spec`` with some groups' pages padded by a few bytes to a few pages (vLLM pads state
    pages up to its attention pages, by 91% for a tiny Qwen3-Next)."""
    groups = []
    for index, group in enumerate(spec.groups):
        if _can_pad(spec, group) and draw(st.booleans()):
            content = _page_content_bytes(spec, index, tp)
            padding = draw(st.sampled_from([1, 7, 8, content, 3 * content + 5]))
            group = msgspec.structs.replace(group, page_stride_bytes=content + padding)
        groups.append(group)
    return msgspec.structs.replace(spec, groups=tuple(groups))


@settings(max_examples=250)
@given(data=st.data())
def test_padded_pages_move_their_content_only(data: st.DataObject) -> None:
    """Pages padded past their content, differently on each side (or on one side only):
    decode gets exactly the content bytes it needs and no padding byte is written. The
    oracle's whole-region comparison catches a copied pad, a shifted block and a lost byte."""
    case = data.draw(cases(packed=data.draw(st.sampled_from(["any", "both"]))))
    prefill = data.draw(padded(case.prefill, case.prefill_tp))
    decode = data.draw(padded(case.decode, case.decode_tp))
    oracle.run_all_ranks(prefill, decode, case.prefill_tp, case.decode_tp, case.request)


@settings(max_examples=100)
@given(data=st.data())
def test_padded_opaque_pages_move_whole_content(data: st.DataObject) -> None:
    """Opaque blocks (a hybrid's state, a kernel-private attention block) with padded pages,
    padded differently on each side: whole content of each needed block, no padding."""
    case = data.draw(cases(opaque=True))
    prefill = data.draw(padded(case.prefill, case.prefill_tp))
    decode = data.draw(padded(case.decode, case.decode_tp))
    oracle.run_all_ranks(prefill, decode, case.prefill_tp, case.decode_tp, case.request)
