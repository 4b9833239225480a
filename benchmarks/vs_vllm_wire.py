"""Wire GB/s side by side: our READs and vLLM's prepped path against the same-run ceiling.

Two processes over UCX on loopback (benchmarks/transfer_bench.py's set-up: the child holds
"prefill" KV regions, this process is "decode"; 32 layers, 8 KV heads, head_dim 128, bf16,
16-token blocks, NHD, one region per layer, a 576-block pool per side). For each request:
- ours: the TransferPlanner's merged descriptors through RealNixlAgent.make_read, the calls
  our transfer thread makes;
- vLLM: one descriptor per (layer plane, block) from dlists prepared once at handshake, posted
  by index with make_prepped_xfer (what vLLM's worker does; NIXL merges adjacent ones);
- ceiling: the same number of bytes in the biggest descriptors the regions allow (one per
  region, 32 MiB each), so nothing but the copy itself is timed.
Decode checks busily; GB/s = bytes / (post -> DONE). The three are interleaved, ``repeats``
READs each per run; every strategy's landed bytes are checked once per case.
"""

from __future__ import annotations

import os
import statistics
from collections.abc import Callable

import numpy as np

from benchmarks.transfer_bench import (
    BLOCK_SIZE,
    POOL_BLOCKS,
    Decode,
    Timing,
    _block_ids,
    _layout,
    per_block_reads,
)
from benchmarks.transfer_peer import PeerChild
from connector.layout import RankLayout
from worker.planner import RankReads, TransferPlanner

CASES = ((2048, False), (2048, True), (8192, False), (8192, True))  # (num_tokens, fragmented)
STRATEGIES = ("ceiling", "ours", "vLLM")


def ceiling_reads(layout: RankLayout, num_bytes: int) -> RankReads:
    """``num_bytes`` as one descriptor per region from its start, regions filled in order."""
    region_bytes = min(layout.region_bytes)
    num_full, rest = divmod(num_bytes, region_bytes)
    lengths = [region_bytes] * num_full + ([rest] if rest else [])
    if len(lengths) > len(layout.region_bytes):
        raise ValueError(f"{num_bytes} bytes do not fit one pass over the regions")
    regions = np.arange(len(lengths), dtype=np.int64)
    zeros = np.zeros(len(lengths), dtype=np.int64)
    return RankReads(0, regions, zeros, regions, zeros, np.array(lengths, dtype=np.int64))


def _strategies(
    decode: Decode, layout: RankLayout, dlists: tuple[object, object], case: tuple[int, bool]
) -> tuple[dict[str, Callable[[float], Timing]], dict[str, RankReads], int]:
    num_tokens, fragmented = case
    local_ids, remote_ids = (
        _block_ids(num_tokens // BLOCK_SIZE, fragmented, seed) for seed in (1, 2)
    )
    planner = TransferPlanner(layout, layout)

    def ours() -> RankReads:
        plan = planner.plan((local_ids,), (remote_ids,), num_tokens=num_tokens,
                            num_cached_tokens=0)  # fmt: skip
        return plan.reads[0]

    blocks = per_block_reads(layout, local_ids, remote_ids)
    num_bytes = int(blocks.lengths.sum())
    ceiling = ceiling_reads(layout, num_bytes)
    runs: dict[str, Callable[[float], Timing]] = {
        "ceiling": lambda step_s: decode.read(ceiling, step_s),
        "ours": lambda step_s: decode.read(ours, step_s),
        "vLLM": lambda step_s: decode.prepped_read(dlists, local_ids, remote_ids, step_s),
    }
    checked = {"ceiling": ceiling, "ours": ours(), "vLLM": blocks}
    return runs, checked, num_bytes


def wire_rows(runs: int, repeats: int = 3) -> list[str]:
    os.environ.setdefault("UCX_NET_DEVICES", "lo")
    layout = _layout()
    gbps: dict[tuple[int, bool], dict[str, list[float]]] = {}
    with PeerChild(layout.region_bytes, lifetime_s=600.0) as child:
        metadata, remote_addresses = child.wait_ready(timeout_s=120.0)
        decode = Decode(layout, metadata, remote_addresses)
        try:
            pool = per_block_reads(layout, range(POOL_BLOCKS), range(POOL_BLOCKS))
            local_pool, remote_pool = decode.descriptors(pool)
            dlists = (
                decode.raw.prep_xfer_dlist("NIXL_INIT_AGENT", local_pool, "DRAM"),
                decode.raw.prep_xfer_dlist(decode.remote, remote_pool, "DRAM"),
            )
            cases = {case: _strategies(decode, layout, dlists, case) for case in CASES}
            for case, (strategies, checked, _) in cases.items():
                gbps[case] = {name: [] for name in STRATEGIES}
                for name, run in strategies.items():
                    decode.verify(checked[name], run, f"{case} {name}")
            for _ in range(runs):
                for case, (strategies, _, num_bytes) in cases.items():
                    samples: dict[str, list[float]] = {name: [] for name in STRATEGIES}
                    for _ in range(repeats):  # interleaved: load changes hit all alike
                        for name, run in strategies.items():
                            samples[name].append(run(0.0).done_s)
                    for name, done in samples.items():
                        gbps[case][name].append(num_bytes / statistics.median(done) / 1e9)
        finally:
            decode.agent.close()
    return _table(gbps)


def _table(gbps: dict[tuple[int, bool], dict[str, list[float]]]) -> list[str]:
    lines = [
        "| request | ceiling GB/s | ours GB/s | vLLM GB/s | ours / ceiling [range] "
        "| vLLM / ceiling [range] | ours / vLLM [range] |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for (num_tokens, fragmented), by_name in gbps.items():
        ceiling, ours, vllm = (by_name[name] for name in STRATEGIES)
        case = f"{num_tokens // 1024}k {'fragmented' if fragmented else 'contiguous'}"
        lines.append(
            f"| {case} | {statistics.median(ceiling):.1f} | {statistics.median(ours):.1f} | "
            f"{statistics.median(vllm):.1f} | {_ratio(ours, ceiling)} | {_ratio(vllm, ceiling)} "
            f"| {_ratio(ours, vllm)} |"
        )
    return lines


def _ratio(top: list[float], bottom: list[float]) -> str:
    ratios = [t / b for t, b in zip(top, bottom, strict=True)]
    return f"{statistics.median(ratios):.2f} [{min(ratios):.2f}-{max(ratios):.2f}]"
