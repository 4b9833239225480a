"""Wire GB/s side by side: our READs and vLLM's prepped path against the same-run ceiling.

Two processes over UCX on loopback (benchmarks/transfer_bench.py's set-up: the child holds
"prefill" KV regions, this process is "decode"; 8 KV heads, head_dim 128, bf16, 16-token
blocks, NHD, one region per layer: 32 layers and a 576-block pool per side for 2k and 8k
tokens, 8 layers and a 2112-block pool for 32k, so that 32k fits in about 1 GiB per side with
the same 32 KiB per layer plane and block). For each request:
- ours: worker/plan/recipe.py's merged descriptors through RealNixlAgent.make_read, the calls
  our transfer thread makes;
- vLLM: one descriptor per (layer plane, block) from dlists prepared once at handshake, posted
  by index with make_prepped_xfer (what vLLM's worker does; NIXL merges adjacent ones);
- ceiling: the same number of bytes in the biggest descriptors the regions allow, timed two
  ways, one descriptor per region and the same bytes cut into 1 MiB descriptors (which the
  agent's backend threads can share); the faster of the two in each run is the ceiling;
- pieces: the same bytes at the same contiguous addresses, cut into descriptors of one layer
  plane and block (32 KiB), as many as a fragmented request has: what the descriptor count
  alone costs, without the scattered addresses.
The decode agent has ``num_threads`` UCX backend threads (4: our default and vLLM's). Decode
checks busily (``--check-every-ms``: every so often, leaving the core to the backend
threads); GB/s = bytes / (post -> DONE). The strategies are interleaved, ``repeats`` READs
each per run; every strategy's landed bytes are checked once per case.
"""

from __future__ import annotations

import os
import statistics
from collections.abc import Callable

import numpy as np

from benchmarks.transfer_bench import (
    BLOCK_SIZE,
    Decode,
    Timing,
    _block_ids,
    _layout,
    per_block_reads,
    split_reads,
)
from benchmarks.transfer_peer import PeerChild
from connector.config import DEFAULT_NIXL_THREADS
from connector.layout import RankLayout
from worker.plan.exact_runs import ByteRuns
from worker.plan.recipe import TransferRequest, peer_plan, plan_request

Case = tuple[int, bool]  # (num_tokens, fragmented)
# (layers, pool blocks) -> the requests read in that shape
SHAPES: dict[tuple[int, int], tuple[Case, ...]] = {
    (32, 576): ((2048, False), (2048, True), (8192, False), (8192, True)),
    (8, 2112): ((32768, False), (32768, True)),
}
STRATEGIES = ("ceiling", "ceiling 1 MiB", "pieces", "ours", "vLLM")
CEILING_PIECE_BYTES = 1 << 20


def ceiling_reads(layout: RankLayout, num_bytes: int) -> ByteRuns:
    """``num_bytes`` as one descriptor per region from its start, regions filled in order."""
    region_bytes = min(layout.region_bytes)
    num_full, rest = divmod(num_bytes, region_bytes)
    lengths = [region_bytes] * num_full + ([rest] if rest else [])
    if len(lengths) > len(layout.region_bytes):
        raise ValueError(f"{num_bytes} bytes do not fit one pass over the regions")
    regions = np.arange(len(lengths), dtype=np.int64)
    zeros = np.zeros(len(lengths), dtype=np.int64)
    return ByteRuns(regions, zeros, regions, zeros, np.array(lengths, dtype=np.int64))


def _strategies(
    decode: Decode, layout: RankLayout, dlists: tuple[object, object], case: Case
) -> tuple[dict[str, Callable[[float], Timing]], dict[str, ByteRuns], int]:
    num_tokens, fragmented = case
    pool_blocks = layout.groups[0].num_blocks
    local_ids, remote_ids = (
        _block_ids(num_tokens // BLOCK_SIZE, fragmented, seed, pool_blocks) for seed in (1, 2)
    )
    peer = peer_plan(layout, layout)

    def ours() -> ByteRuns:
        request = TransferRequest((local_ids,), (remote_ids,), num_tokens, 0)
        runs = plan_request(peer, request).reads[0].ranges
        assert runs is not None  # no prepared rows: byte ranges only
        return runs

    blocks = per_block_reads(layout, local_ids, remote_ids)
    num_bytes = int(blocks.lengths.sum())
    ceiling = ceiling_reads(layout, num_bytes)
    pieces = split_reads(ceiling, CEILING_PIECE_BYTES)
    block_pieces = split_reads(ceiling, int(blocks.lengths.max()))
    runs: dict[str, Callable[[float], Timing]] = {
        "ceiling": lambda step_s: decode.read(ceiling, step_s),
        "ceiling 1 MiB": lambda step_s: decode.read(pieces, step_s),
        "pieces": lambda step_s: decode.read(block_pieces, step_s),
        "ours": lambda step_s: decode.read(ours, step_s),
        "vLLM": lambda step_s: decode.prepped_read(dlists, local_ids, remote_ids, step_s),
    }
    checked = {
        "ceiling": ceiling,
        "ceiling 1 MiB": pieces,
        "pieces": block_pieces,
        "ours": ours(),
        "vLLM": blocks,
    }
    return runs, checked, num_bytes


def wire_rows(
    runs: int, repeats: int = 3, num_threads: int = DEFAULT_NIXL_THREADS, step_s: float = 0.0
) -> list[str]:
    """The table; decode checks each READ every ``step_s`` (0: busily)."""
    os.environ.setdefault("UCX_NET_DEVICES", "lo")
    gbps: dict[Case, dict[str, list[float]]] = {}
    for (num_layers, pool_blocks), cases in SHAPES.items():
        layout = _layout(num_layers=num_layers, pool_blocks=pool_blocks)
        gbps.update(_shape_gbps(layout, cases, runs, repeats, num_threads, step_s))
    return _table(gbps)


def _shape_gbps(
    layout: RankLayout,
    cases: tuple[Case, ...],
    runs: int,
    repeats: int,
    num_threads: int,
    step_s: float,
) -> dict[Case, dict[str, list[float]]]:
    """GB/s per case and strategy, one entry per run, over one child holding ``layout``."""
    gbps: dict[Case, dict[str, list[float]]] = {}
    pool_blocks = layout.groups[0].num_blocks
    with PeerChild(layout.region_bytes, lifetime_s=600.0) as child:
        metadata, remote_addresses = child.wait_ready(timeout_s=120.0)
        decode = Decode(layout, metadata, remote_addresses, num_threads)
        try:
            pool = per_block_reads(layout, range(pool_blocks), range(pool_blocks))
            local_pool, remote_pool = decode.descriptors(pool)
            dlists = (
                decode.raw.prep_xfer_dlist("NIXL_INIT_AGENT", local_pool, "DRAM"),
                decode.raw.prep_xfer_dlist(decode.remote, remote_pool, "DRAM"),
            )
            by_case = {case: _strategies(decode, layout, dlists, case) for case in cases}
            for case, (strategies, checked, _) in by_case.items():
                gbps[case] = {name: [] for name in STRATEGIES}
                for name, run in strategies.items():
                    decode.verify(checked[name], run, f"{case} {name}")
            for _ in range(runs):
                for case, (strategies, _, num_bytes) in by_case.items():
                    samples: dict[str, list[float]] = {name: [] for name in STRATEGIES}
                    for _ in range(repeats):  # interleaved: load changes hit all alike
                        for name, run in strategies.items():
                            samples[name].append(run(step_s).done_s)
                    for name, done in samples.items():
                        gbps[case][name].append(num_bytes / statistics.median(done) / 1e9)
        finally:
            decode.agent.close()
    return gbps


def _table(gbps: dict[Case, dict[str, list[float]]]) -> list[str]:
    lines = [
        "| request | ceiling GB/s | ours GB/s | vLLM GB/s | ours / ceiling [range] "
        "| vLLM / ceiling [range] | ours / vLLM [range] | 32 KiB pieces / ceiling [range] |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for (num_tokens, fragmented), by_name in gbps.items():
        # per run, the faster way of moving the bytes in big descriptors
        ceiling = [
            max(pair) for pair in zip(by_name["ceiling"], by_name["ceiling 1 MiB"], strict=True)
        ]
        ours, vllm = by_name["ours"], by_name["vLLM"]
        case = f"{num_tokens // 1024}k {'fragmented' if fragmented else 'contiguous'}"
        lines.append(
            f"| {case} | {statistics.median(ceiling):.1f} | {statistics.median(ours):.1f} | "
            f"{statistics.median(vllm):.1f} | {_ratio(ours, ceiling)} | {_ratio(vllm, ceiling)} "
            f"| {_ratio(ours, vllm)} | {_ratio(by_name['pieces'], ceiling)} |"
        )
    return lines


def _ratio(top: list[float], bottom: list[float]) -> str:
    ratios = [t / b for t, b in zip(top, bottom, strict=True)]
    return f"{statistics.median(ratios):.2f} [{min(ratios):.2f}-{max(ratios):.2f}]"
