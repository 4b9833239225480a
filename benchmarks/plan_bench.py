"""Transfer planning cost: microseconds and descriptors per request, against one per (layer, block).

"plan µs" is ``plan_request`` (worker/plan/recipe.py) without prepared rows: every segment through
the exact planner. The "by index" columns: ``plan_request`` along ReadPath.BY_INDEX, with
prepared rows (segments, then indices of whole blocks and the partial block's ranges), its
index count, and what the cost rule (worker/plan/whole_blocks.py choose_prepared) picks ("-":
the pairing cannot be read by whole-block index). Real NIXL's make_read / make_prepped_xfer costs on top are measured
in benchmarks/README.md ("prepared lists").

Model: 32 layers, 8 KV heads, head_dim 128, bf16, 16-token blocks (K and V planes per layer).
Run: ``.venv/bin/python -m benchmarks.plan_bench`` or ``python benchmarks/plan_bench.py``.
"""

from __future__ import annotations

import random
import statistics
import time
from dataclasses import dataclass

from connector.geometry import build_rank_layout
from connector.layout import GroupKind, GroupSpec, KVCacheSpec, LayerSpec, MemoryLayout, RankLayout
from worker.plan.recipe import PeerPlan, ReadPath, TransferRequest, peer_plan, plan_request
from worker.reads import keep_plan_memory_mapped

NUM_LAYERS = 32
NUM_KV_HEADS = 8
HEAD_DIM = 128
DTYPE_BYTES = 2
BLOCK_SIZE = 16
POOL_BLOCKS = 8192
REPEATS = 30


def _spec(memory_layout: MemoryLayout, block_size: int = BLOCK_SIZE) -> KVCacheSpec:
    layers = tuple(
        LayerSpec(
            name=f"layer{i}", num_kv_heads=NUM_KV_HEADS, head_dim=HEAD_DIM, dtype_bytes=DTYPE_BYTES
        )
        for i in range(NUM_LAYERS)
    )
    group = GroupSpec(
        kind=GroupKind.FULL,
        block_size=block_size,
        kernel_block_size=block_size,
        num_blocks=POOL_BLOCKS * BLOCK_SIZE // block_size,
        layers=layers,
    )
    return KVCacheSpec(
        model="bench",
        dtype="bfloat16",
        cache_dtype="bfloat16",
        groups=(group,),
        memory_layout=memory_layout,
    )


@dataclass(frozen=True)
class Case:
    name: str
    num_tokens: int
    fragmented: bool
    memory_layout: MemoryLayout = MemoryLayout.NHD
    decode_tp: int = 1  # decode TP 2 from prefill TP 1 reads a head slice
    prefill_layout: MemoryLayout | None = None  # None: the same as decode's


def _block_ids(num_blocks: int, fragmented: bool, seed: int) -> tuple[int, ...]:
    if not fragmented:
        return tuple(range(100, 100 + num_blocks))
    return tuple(random.Random(seed).sample(range(POOL_BLOCKS), num_blocks))


def _median_us(peer: PeerPlan, request: TransferRequest) -> float:
    samples = []
    for _ in range(REPEATS):
        start = time.perf_counter()
        plan_request(peer, request)
        samples.append(time.perf_counter() - start)
    return statistics.median(samples) * 1e6


def _index_us(
    local: RankLayout, remote: RankLayout, request: TransferRequest
) -> tuple[str, str, str]:
    """(median µs of the per-request work by index, indices, the rule's choice), or dashes."""
    peer = peer_plan(
        local, remote, local_addresses=[1 << 30] * 64, remote_addresses={0: ([1 << 40] * 64, 0)}
    )
    (chosen,) = plan_request(peer, request).reads
    choice = "index" if chosen.by_index is not None else "ranges"
    if not peer.rows:
        return "-", "-", choice
    samples = []
    for _ in range(REPEATS):
        start = time.perf_counter()
        (indexed,) = plan_request(peer, request, ReadPath.BY_INDEX).reads
        samples.append(time.perf_counter() - start)
    assert indexed.by_index is not None
    num_indices = len(indexed.by_index.local_indices)
    return f"{statistics.median(samples) * 1e6:.0f}", str(num_indices), choice


def run(case: Case) -> tuple[float, int, int, tuple[str, str, str]]:
    """(median plan time in µs, descriptors, descriptors of one per (layer plane, block),
    the by-index columns)."""
    decode_spec = _spec(case.memory_layout)
    prefill_spec = _spec(case.prefill_layout or case.memory_layout)
    local_layout = build_rank_layout(decode_spec, 0, case.decode_tp)
    remote_layout = build_rank_layout(prefill_spec, 0, 1)
    peer = peer_plan(local_layout, remote_layout)
    num_blocks = -(-case.num_tokens // BLOCK_SIZE)
    local = _block_ids(num_blocks, case.fragmented, seed=1)
    remote = _block_ids(num_blocks, case.fragmented, seed=2)
    request = TransferRequest((local,), (remote,), case.num_tokens, 0)
    plan = plan_request(peer, request)
    descriptors = sum(len(r.ranges) for r in plan.reads if r.ranges is not None)
    per_block = NUM_LAYERS * 2 * num_blocks
    by_index = _index_us(local_layout, remote_layout, request)
    return _median_us(peer, request), descriptors, per_block, by_index


CASES = [
    Case("2k contiguous", 2048, False),
    Case("2k fragmented", 2048, True),
    Case("32k contiguous", 32768, False),
    Case("32k fragmented", 32768, True),
    Case("32k contiguous, block-outermost", 32768, False, MemoryLayout.BLOCK_OUTERMOST),
    Case("32k contiguous, NHD packed (vLLM)", 32768, False, MemoryLayout.NHD_PACKED),
    Case("32k fragmented, NHD packed (vLLM)", 32768, True, MemoryLayout.NHD_PACKED),
    Case("32k contiguous, HND packed (vLLM)", 32768, False, MemoryLayout.HND_PACKED),
    Case("32k contiguous, HND decode TP2<-TP1", 32768, False, MemoryLayout.HND, decode_tp=2),
    Case("32k contig., HND packed TP2<-TP1", 32768, False, MemoryLayout.HND_PACKED, decode_tp=2),
    # Only one side packed: K and V heads interleave on one side only, one run per
    # (token, head, plane) is unavoidable; planned plane by plane (exact, slow).
    Case(
        "2k contig., NHD packed <- NHD",
        2048,
        False,
        MemoryLayout.NHD_PACKED,
        prefill_layout=MemoryLayout.NHD,
    ),
]


def main() -> None:
    # As the worker does: without it, glibc maps and unmaps every large per-request array,
    # and the figures depend on the heap's history (2-3x on the 32k cases).
    keep_plan_memory_mapped()
    header = (
        f"{'case':<38} {'plan µs':>9} {'descriptors':>12} {'per (layer,block)':>18} "
        f"{'by index µs':>12} {'indices':>8} {'rule':>7}"
    )
    print(header)
    print("-" * len(header))
    for case in CASES:
        micros, descriptors, per_block, (index_us, indices, rule) = run(case)
        print(
            f"{case.name:<38} {micros:>9.0f} {descriptors:>12} {per_block:>18} "
            f"{index_us:>12} {indices:>8} {rule:>7}"
        )


if __name__ == "__main__":
    main()
