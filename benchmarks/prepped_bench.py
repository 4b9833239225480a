"""Per-request work on the transfer thread, byte ranges against READs by index, on real NIXL.

One process, two real NIXL agents (UCX, loopback) with registered but untouched memory (mmap,
so a 32k-token pool costs no RAM). Per request: plan (``plan_request``, worker/plan/recipe.py, along one
ReadPath), then make each remote rank's READs (initialize_xfer or make_prepped_xfer) and
release them; nothing is posted, so the figures are the Python and NIXL bookkeeping a request
costs, not the copy. Paths: byte ranges from the exact planner alone, byte ranges with whole
blocks from the prepared rows (what the range path does now), and by index.
Model of benchmarks/vs_vllm.py: 32 layers, 8 KV heads, head_dim 128, bf16, 16-token blocks,
HND. "rule" is what the cost rule picks (worker/plan/whole_blocks.py choose_prepared).

Run: ``UCX_NET_DEVICES=lo .venv/bin/python -m benchmarks.prepped_bench`` (about a minute).
"""

from __future__ import annotations

import ctypes
import functools
import mmap
import os
import random
import statistics
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

os.environ.setdefault("UCX_NET_DEVICES", "lo")

from benchmarks.vs_vllm_worker import CASES as WORKER_CASES  # noqa: E402
from benchmarks.vs_vllm_worker import Case  # noqa: E402
from connector.geometry import build_rank_layout  # noqa: E402
from connector.layout import (  # noqa: E402
    GroupKind,
    GroupSpec,
    KVCacheSpec,
    LayerSpec,
    MemoryLayout,
    RankLayout,
)
from worker.nixl_real import RealNixlAgent  # noqa: E402
from worker.plan.recipe import (  # noqa: E402
    PeerPlan,
    RankPlan,
    ReadPath,
    TransferRequest,
    peer_plan,
    plan_request,
)
from worker.reads import build_descriptors, keep_plan_memory_mapped  # noqa: E402

POOL_BLOCKS = 4096
BLOCK_SIZE = 16
REPEATS = 9


# vs_vllm's worker cases (issue 10's table), plus a partial last block after the 2k ones.
CASES = (
    *WORKER_CASES[:2],
    Case("2k+5 tokens, fragmented ids", 2053, True),
    *WORKER_CASES[2:],
)


def _spec() -> KVCacheSpec:
    layer = LayerSpec(name="l", num_kv_heads=8, head_dim=128, dtype_bytes=2)
    group = GroupSpec(
        kind=GroupKind.FULL, block_size=BLOCK_SIZE, kernel_block_size=BLOCK_SIZE,
        num_blocks=POOL_BLOCKS, layers=(layer,) * 32,
    )  # fmt: skip
    return KVCacheSpec(
        model="bench", dtype="bf16", cache_dtype="bf16", groups=(group,),
        memory_layout=MemoryLayout.HND,
    )  # fmt: skip


_maps: list[mmap.mmap] = []


def _register(agent: RealNixlAgent, layout: RankLayout) -> list[int]:
    addresses = []
    for size in layout.region_bytes:
        region = mmap.mmap(-1, size)
        _maps.append(region)
        addresses.append(ctypes.addressof(ctypes.c_char.from_buffer(region)))
    agent.register_regions(list(zip(addresses, layout.region_bytes, strict=True)))
    return addresses


def _ids(case: Case, seed: int) -> list[int]:
    count = -(-case.num_tokens // BLOCK_SIZE)
    if case.fragmented:
        return random.Random(seed).sample(range(POOL_BLOCKS), count)
    return list(range(seed * 16, seed * 16 + count))


def _median_us(work: Callable[[], None]) -> float:
    samples = []
    for _ in range(REPEATS):
        start = time.perf_counter()
        work()
        samples.append(time.perf_counter() - start)
    return statistics.median(samples) * 1e6


@dataclass
class Pair:
    """A reader and the prefill ranks of one case, with their prepared lists."""

    reader: RealNixlAgent
    local_addresses: list[int]
    peer: PeerPlan
    names: list[str]
    owner_addresses: list[list[int]]
    lists: dict[int, tuple[Any, Any]]
    request: TransferRequest

    def plans(self, path: ReadPath) -> None:
        """Plan the request along ``path`` and make (then release) every rank's READs."""
        for plan in plan_request(self.peer, self.request, path).reads:
            self._reads(plan)

    def rule(self) -> str:
        plans = plan_request(self.peer, self.request).reads
        return "index" if all(p.by_index is not None for p in plans) else "ranges"

    def _reads(self, plan: RankPlan) -> None:
        rank = plan.remote_rank
        if plan.by_index is not None:
            local_list, remote_list = self.lists[rank]
            self.reader.release(self.reader.make_prepped_read(
                local_list, plan.by_index.local_indices, remote_list, plan.by_index.remote_indices,
            ))  # fmt: skip
        if plan.ranges is not None:
            reads = plan.ranges
            self.reader.release(self.reader.make_read(
                self.names[rank],
                build_descriptors(self.local_addresses, reads.local_regions, reads.local_offsets, reads.lengths),
                build_descriptors(
                    self.owner_addresses[rank], reads.remote_regions, reads.remote_offsets, reads.lengths
                ),
                b"bench:1",
            ))  # fmt: skip


PATHS: dict[str, ReadPath] = {
    "ranges (exact planner)": ReadPath.EXACT,
    "ranges (rows)": ReadPath.BY_RANGES,
    "by index": ReadPath.BY_INDEX,
}


def _pair(reader: RealNixlAgent, local: RankLayout, local_addresses: list[int], case: Case,
          owners: list[RealNixlAgent]) -> Pair:  # fmt: skip
    remotes = [build_rank_layout(_spec(), r, case.prefill_tp) for r in range(case.prefill_tp)]
    owner_addresses = [_register(o, lay) for o, lay in zip(owners, remotes, strict=True)]
    names = [reader.add_remote_agent(o.get_agent_metadata()) for o in owners]
    peer = peer_plan(
        local, remotes[0], local_addresses=local_addresses,
        remote_addresses={rank: (found, 0) for rank, found in enumerate(owner_addresses)},
    )  # fmt: skip
    assert set(peer.rows) == set(peer.read_ranks), "this model is read by whole-block index"
    lists = {
        rank: (reader.prepare_list(None, r.local_rows), reader.prepare_list(names[rank], r.remote_rows))
        for rank, r in peer.rows.items()
    }  # fmt: skip
    request = TransferRequest((_ids(case, 1),), (_ids(case, 2),), case.num_tokens, 0)
    return Pair(reader, local_addresses, peer, names, owner_addresses, lists, request)


def main() -> None:
    keep_plan_memory_mapped()  # as the worker does: no page faults on every request's arrays
    reader = RealNixlAgent(f"bench-reader-{uuid.uuid4().hex[:6]}")
    local = build_rank_layout(_spec(), 0, 1)
    local_addresses = _register(reader, local)
    print(f"µs per request, median of {REPEATS} x 3 interleaved rounds")
    print(f"| request | {' | '.join(f'{name} µs' for name in PATHS)} | rule | best / rule's |")
    print(f"|---|{'---:|' * len(PATHS)}---|---:|")
    for case in CASES:
        owners = [
            RealNixlAgent(f"bench-owner-{uuid.uuid4().hex[:6]}") for _ in range(case.prefill_tp)
        ]
        pair = _pair(reader, local, local_addresses, case, owners)
        samples: dict[str, list[float]] = {name: [] for name in PATHS}
        for _ in range(3):  # interleaved rounds
            for name, path in PATHS.items():
                samples[name].append(_median_us(functools.partial(pair.plans, path)))
        medians = {name: statistics.median(found) for name, found in samples.items()}
        rule = pair.rule()
        chosen = medians["by index"] if rule == "index" else medians["ranges (rows)"]
        cells = " | ".join(f"{us:,.0f}" for us in medians.values())
        print(f"| {case.name} | {cells} | {rule} | {min(medians.values()) / chosen:.2f} |")
        for local_list, remote_list in pair.lists.values():
            reader.release_list(remote_list)
            reader.release_list(local_list)
        for name in pair.names:
            reader.remove_remote_agent(name)
        for owner in owners:
            owner.close()
    reader.close()


if __name__ == "__main__":
    main()
