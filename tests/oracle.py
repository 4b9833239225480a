"""A deliberately naive byte-level oracle for transfer plans.

Prefill ranks' regions are filled with noise, then every (group, layer, plane, token, model
head) position prefill holds gets bytes that encode exactly that tuple. A plan is executed
with one numpy copy per descriptor. Decode's regions start as a sentinel; the expected decode
memory is built position by position from the group-kind rules, with no code shared with the
planner. Comparing whole regions proves both "every needed byte is right" and "nothing else
was written".
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from connector.geometry import build_rank_layout
from connector.layout import GroupGeometry, GroupKind, KVCacheSpec, PlaneGeometry, RankLayout
from worker.plan.exact_runs import ByteRuns
from worker.plan.recipe import RequestPlan, TransferRequest, peer_plan, plan_request

SENTINEL = 0xEE
Buffers = list[npt.NDArray[np.uint8]]


@dataclass(frozen=True)
class Request:
    num_tokens: int
    num_cached_tokens: int
    local_block_ids: tuple[tuple[int, ...], ...]  # decode: blocks covering [cached, tokens)
    remote_block_ids: tuple[tuple[int, ...], ...]  # prefill: blocks covering [0, tokens)


def _mix(values: npt.NDArray[np.uint64]) -> npt.NDArray[np.uint64]:
    """splitmix64 finaliser: a well-spread hash of each value."""
    with np.errstate(over="ignore"):
        z = values + np.uint64(0x9E3779B97F4A7C15)
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return z ^ (z >> np.uint64(31))


def _avoid_sentinel(data: npt.NDArray[np.uint8]) -> npt.NDArray[np.uint8]:
    return np.where(data == SENTINEL, np.uint8(SENTINEL ^ 1), data).astype(np.uint8)


def head_value(
    group: int, layer: int, plane: int, token: int, model_head: int, head_bytes: int
) -> npt.NDArray[np.uint8]:
    """The bytes of one head of one token (token -1: SSM state): a hash of the whole tuple."""
    key = (
        (((group * 64 + layer) * 4 + plane) * 1_000_003 + token + 1) * 4096 + model_head
    ) * 65_536
    codes = _mix(np.arange(head_bytes, dtype=np.uint64) + np.uint64(key))
    return _avoid_sentinel((codes & np.uint64(0xFF)).astype(np.uint8))


def noise(layout: RankLayout, seed: int) -> Buffers:
    rng = np.random.default_rng(seed)
    return [
        _avoid_sentinel(rng.integers(0, 256, size, dtype=np.uint8)) for size in layout.region_bytes
    ]


def sentinel(layout: RankLayout) -> Buffers:
    return [np.full(size, SENTINEL, dtype=np.uint8) for size in layout.region_bytes]


def _model_head(layout: RankLayout, plane: PlaneGeometry, head: int) -> int:
    """Model head of per-rank head ``head``: rank r holds heads from (r // replicas) * per_rank."""
    if plane.replicated:
        return head
    tp = layout.tp_size
    per_rank = plane.model_heads // tp if plane.model_heads >= tp else 1
    replicas = max(1, tp // plane.model_heads)
    return (layout.tp_rank // replicas) * per_rank + head


def _slot_address(
    group: GroupGeometry, plane: PlaneGeometry, ids: Sequence[int], first_logical: int, token: int
) -> int:
    """Byte offset (in the plane's region) of token slot ``token`` in a side's paged memory."""
    if group.kind is GroupKind.SSM:
        return plane.offset_bytes + ids[len(ids) - 1] * plane.kernel_block_stride_bytes
    logical_block = ids[token // group.block_size - first_logical]
    ratio = group.block_size // group.kernel_block_size
    kernel_block = logical_block * ratio + (token % group.block_size) // group.kernel_block_size
    slot = token % group.kernel_block_size
    return (
        plane.offset_bytes
        + kernel_block * plane.kernel_block_stride_bytes
        + slot * plane.token_stride_bytes
    )


def vllm_window_start(num_tokens: int, window: int) -> int:
    """The first token the next token (``num_tokens``) attends to in a sliding window, and the
    first vLLM keeps: ``SlidingWindowManager.get_num_skipped_tokens(n)`` is
    ``n - window + 1`` (vLLM 0.33, v1/core/single_type_kv_cache_manager.py); the blocks
    wholly before it are freed, the null block standing in their place."""
    return max(0, num_tokens - window + 1)


def needed_tokens(layout: RankLayout, g: int, request: Request) -> list[int]:
    """Tokens of group ``g`` decode attends to and lacks (-1: the SSM state, if it has a block)."""
    group = layout.groups[g]
    if group.kind is GroupKind.SSM:
        return [-1] if request.local_block_ids[g] else []
    start = request.num_cached_tokens
    if group.kind is GroupKind.SLIDING_WINDOW:  # token n's window: [n - window + 1, n]
        start = max(start, vllm_window_start(request.num_tokens, group.window or 0))
    if start >= request.num_tokens:
        return []
    return _whole_blocks_if_opaque(group, start, request.num_tokens)


def _whole_blocks_if_opaque(group: GroupGeometry, start: int, end: int) -> list[int]:
    """Token slots [start, end), or, for an opaque block format, every slot of their blocks."""
    if group.block_format.token_addressable:
        return list(range(start, end))
    kernel = group.kernel_block_size
    return list(range(start - start % kernel, -(-end // kernel) * kernel))


def _write_all(
    layout: RankLayout,
    buffers: Buffers,
    block_ids: Sequence[Sequence[int]],
    first_logical: Sequence[int],
    tokens: Sequence[list[int]],
) -> None:
    for g, group in enumerate(layout.groups):
        ids = block_ids[g]
        if not tokens[g] or (group.kind is GroupKind.SSM and not ids):
            continue
        for plane in group.planes:
            for token in tokens[g]:
                base = _slot_address(group, plane, ids, first_logical[g], token)
                for head in range(plane.num_heads):
                    value = head_value(
                        g,
                        plane.layer,
                        plane.plane,
                        token,
                        _model_head(layout, plane, head),
                        plane.head_bytes,
                    )
                    start = base + head * plane.head_stride_bytes
                    buffers[plane.region][start : start + plane.head_bytes] = value


def fill_prefill(layout: RankLayout, request: Request, seed: int) -> Buffers:
    """Prefill memory: noise, plus the true bytes of every token prefill's block ids hold
    (every slot of those blocks for an opaque block format)."""
    buffers = noise(layout, seed)
    tokens = []
    for group in layout.groups:
        if group.kind is GroupKind.SSM:
            tokens.append([-1])
            continue
        start = 0
        if group.kind is GroupKind.SLIDING_WINDOW:
            start = vllm_window_start(request.num_tokens, group.window or 0)
        # Opaque blocks: the slots past the prompt hold bytes too (whatever the kernel left).
        tokens.append(_whole_blocks_if_opaque(group, start, request.num_tokens))
    _write_all(layout, buffers, request.remote_block_ids, [0] * len(layout.groups), tokens)
    return buffers


def expected_decode(layout: RankLayout, request: Request) -> Buffers:
    """What decode's memory must hold after the transfer: sentinel except the needed heads."""
    buffers = sentinel(layout)
    first_logical = [request.num_cached_tokens // g.block_size for g in layout.groups]
    tokens = [needed_tokens(layout, g, request) for g in range(len(layout.groups))]
    _write_all(layout, buffers, request.local_block_ids, first_logical, tokens)
    return buffers


def execute(plan: RequestPlan, local: Buffers, remote_by_rank: dict[int, Buffers]) -> None:
    """Copy every byte range's bytes; a range outside any region is an error. The plan must
    read by byte ranges only (a plan without prepared rows; READs by index run on FakeNixl,
    tests/test_prepped.py)."""
    for rank_plan in plan.reads:
        reads = rank_plan.ranges
        if rank_plan.by_index is not None or reads is None:
            raise AssertionError(f"remote rank {rank_plan.remote_rank} is not read by byte ranges")
        remote = remote_by_rank[rank_plan.remote_rank]
        rows = zip(
            reads.local_regions,
            reads.local_offsets,
            reads.remote_regions,
            reads.remote_offsets,
            reads.lengths,
            strict=True,
        )
        for lr, lo, rr, ro, length in rows:
            if (
                length <= 0
                or lo < 0
                or ro < 0
                or lo + length > len(local[lr])
                or ro + length > len(remote[rr])
            ):
                raise AssertionError(
                    f"descriptor out of bounds: local ({lr}, {lo}) remote ({rr}, {ro}) length {length}"
                )
            local[lr][lo : lo + length] = remote[rr][ro : ro + length]


def first_difference(actual: Buffers, expected: Buffers) -> str | None:
    for region, (a, e) in enumerate(zip(actual, expected, strict=True)):
        diff = np.flatnonzero(a != e)
        if len(diff):
            where = int(diff[0])
            return f"region {region} byte {where}: got {int(a[where])}, expected {int(e[where])} ({len(diff)} bytes differ)"
    return None


def check_notifications(plans: Sequence[RequestPlan], remote_tp: int) -> None:
    """Every prefill rank hears from exactly ``consumers`` decode ranks, and all agree on it."""
    for remote_rank in range(remote_tp):
        senders = [
            p for p in plans if remote_rank in {r.remote_rank for r in p.reads} | set(p.notify_only)
        ]
        if not senders:
            raise AssertionError(f"prefill rank {remote_rank} is never notified")
        counts = {p.consumers[remote_rank] for p in senders}
        if counts != {len(senders)}:
            raise AssertionError(
                f"prefill rank {remote_rank}: {len(senders)} senders announce {counts}"
            )
    for p in plans:
        if set(p.consumers) != {r.remote_rank for r in p.reads} | set(p.notify_only):
            raise AssertionError("consumers must list exactly the read and notify-only ranks")


def ranges(plan: RequestPlan) -> list[ByteRuns]:
    """Each remote rank's byte ranges, in plan order; the plan must read by ranges only."""
    found = [rank_plan.ranges for rank_plan in plan.reads]
    if any(rank_plan.by_index is not None for rank_plan in plan.reads) or None in found:
        raise AssertionError("the plan reads by index; expected byte ranges only")
    return [runs for runs in found if runs is not None]


def unmerged_pairs(plan: RequestPlan) -> list[tuple[int, int]]:
    """Descriptor pairs (i, j) of one remote rank that are contiguous on both sides."""
    found: list[tuple[int, int]] = []
    for reads in ranges(plan):
        starts = {
            (int(lr), int(lo), int(rr), int(ro)): j
            for j, (lr, lo, rr, ro) in enumerate(
                zip(
                    reads.local_regions,
                    reads.local_offsets,
                    reads.remote_regions,
                    reads.remote_offsets,
                    strict=True,
                )
            )
        }
        for i in range(len(reads.lengths)):
            end = (
                int(reads.local_regions[i]),
                int(reads.local_offsets[i] + reads.lengths[i]),
                int(reads.remote_regions[i]),
                int(reads.remote_offsets[i] + reads.lengths[i]),
            )
            if end in starts:
                found.append((i, starts[end]))
    return found


def run_all_ranks(
    prefill_spec: KVCacheSpec,
    decode_spec: KVCacheSpec,
    prefill_tp: int,
    decode_tp: int,
    request: Request,
) -> list[RequestPlan]:
    """Plan every decode rank, execute against every prefill rank, and prove exactness.

    Raises AssertionError naming the first wrong byte, a mergeable descriptor pair, or a
    notification count that would leave a prefill rank waiting.
    """
    prefill = [build_rank_layout(prefill_spec, rank, prefill_tp) for rank in range(prefill_tp)]
    memory = {rank: fill_prefill(layout, request, seed=rank) for rank, layout in enumerate(prefill)}
    plans = []
    for rank in range(decode_tp):
        local = build_rank_layout(decode_spec, rank, decode_tp)
        plan = plan_request(
            peer_plan(local, prefill[0]),
            TransferRequest(
                request.local_block_ids,
                request.remote_block_ids,
                num_tokens=request.num_tokens,
                num_cached_tokens=request.num_cached_tokens,
            ),
        )
        buffers = sentinel(local)
        execute(plan, buffers, memory)
        difference = first_difference(buffers, expected_decode(local, request))
        if difference is not None:
            raise AssertionError(f"decode rank {rank}: {difference}")
        if unmerged_pairs(plan):
            raise AssertionError(
                f"decode rank {rank}: mergeable descriptors {unmerged_pairs(plan)[:4]}"
            )
        plans.append(plan)
    check_notifications(plans, prefill_tp)
    return plans
