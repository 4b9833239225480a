"""What our design buys on the wire: descriptor and free-notification strategies over real NIXL.

Two processes on loopback: a child (benchmarks/transfer_peer.py) holds the "prefill" KV regions
and serves its agent; this process is "decode" and READs from it. Both agents are RealNixlAgent
with our settings (UCX, progress thread delay 1000 us).

1. Descriptor strategy per request, same bytes and memory: OURS (worker/plan/recipe.py's merged
   descriptors through RealNixlAgent.make_read, i.e. initialize_xfer), one descriptor per
   (layer plane, block) the same way, one per (layer plane, block) through prepped dlists +
   make_prepped_xfer (vLLM's path; NIXL merges adjacent descriptors there), and OURS cut into
   descriptors of at most 256 KiB. "prepare" = plan or indices + descriptors + NIXL request;
   post -> DONE with decode checking busily, and with decode checking once per 1 ms (then also
   the decode thread's time inside post() and check()). Every strategy's bytes are verified.
2. Free notification: the READ carrying it (worker/loads.py today) vs a plain READ then
   send_notif on DONE, 64 KiB and 8 MiB, decode checking busily or once per 10 ms engine step:
   time from post until decode sees DONE and until the prefill agent's get_new_notifs returns
   the notification (the child polls every 0.1 ms; a real prefill adds its own poll period).

3. Block-outermost rows against the ceiling (issue 10 item 3): the same model laid out as
   vLLM's BLNHC (MemoryLayout.BLOCK_NHD_PACKED: one 2 MiB row per block holding every layer's
   K|V page), 2k/8k requests with contiguous and fragmented ids, OURS (the planner's merged
   rows) interleaved with the ceiling: the same number of bytes in the fewest, biggest
   descriptors the regions allow (one, here), in the same run, with a fresh child.

Sections 1 and 3 also time the ceiling; each strategy's "of ceiling" is its GB/s over the
ceiling's in the same case.

Model: 32 layers, 8 KV heads, head_dim 128, bf16, 16-token blocks (2 MiB per block, 32 KiB per
layer plane), NHD, a 576-block pool per side: 1.125 GiB per process, 2.25 GiB in all (the 8k
prompt is 1 GiB). About 30 s on the 2-core machine, plus about as much for section 3.
Run: ``.venv/bin/python -m benchmarks.transfer_bench [--sections descriptors,notif,block-major]``
(sets UCX_NET_DEVICES=lo if unset).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import itertools
import os
import random
import statistics
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from benchmarks.transfer_peer import PeerChild, expected_words
from connector.config import DEFAULT_NIXL_THREADS
from connector.geometry import build_rank_layout
from connector.layout import (
    GroupKind,
    GroupSpec,
    KVCacheSpec,
    LayerSpec,
    MemoryLayout,
    RankLayout,
)
from worker.nixl_api import Descriptors, TransferState
from worker.nixl_real import RealNixlAgent
from worker.plan.exact_runs import ByteRuns
from worker.plan.recipe import TransferRequest, peer_plan, plan_request
from worker.reads import build_descriptors

NUM_LAYERS = 32
NUM_KV_HEADS = 8
HEAD_DIM = 128
DTYPE_BYTES = 2
BLOCK_SIZE = 16
POOL_BLOCKS = 576
WAIT_S = 30.0  # bound on any single wait (a READ, a notification, the child starting)
CASES = ((2048, False), (2048, True), (8192, False), (8192, True))  # (num_tokens, fragmented)
NOTIF_SIZES_BYTES = (64 << 10, 8 << 20)


def _layout(
    memory_layout: MemoryLayout = MemoryLayout.NHD,
    num_layers: int = NUM_LAYERS,
    pool_blocks: int = POOL_BLOCKS,
) -> RankLayout:
    layer = LayerSpec(
        name="l", num_kv_heads=NUM_KV_HEADS, head_dim=HEAD_DIM, dtype_bytes=DTYPE_BYTES
    )
    group = GroupSpec(
        kind=GroupKind.FULL,
        block_size=BLOCK_SIZE,
        kernel_block_size=BLOCK_SIZE,
        num_blocks=pool_blocks,
        layers=(layer,) * num_layers,
    )
    spec = KVCacheSpec(
        model="bench",
        dtype="bfloat16",
        cache_dtype="bfloat16",
        groups=(group,),
        memory_layout=memory_layout,
    )
    return build_rank_layout(spec, 0, 1)


def _plane_offsets(layout: RankLayout, block_ids: Sequence[int]) -> tuple[Any, Any, int]:
    """(regions, offsets) of every (layer plane, block), plane-major, and one block's bytes."""
    planes = layout.groups[0].planes
    ids = np.asarray(block_ids, dtype=np.int64)
    starts = np.array([p.offset_bytes for p in planes], dtype=np.int64)
    strides = np.array([p.kernel_block_stride_bytes for p in planes], dtype=np.int64)
    regions = np.repeat(np.array([p.region for p in planes], dtype=np.int64), len(ids))
    offsets = (starts[:, None] + ids[None, :] * strides[:, None]).ravel()
    block_bytes = BLOCK_SIZE * planes[0].num_heads * planes[0].head_bytes
    return regions, offsets, block_bytes


def per_block_reads(
    layout: RankLayout, local_ids: Sequence[int], remote_ids: Sequence[int]
) -> ByteRuns:
    """One descriptor per (layer plane, block), in vLLM's order (plane-major)."""
    local_regions, local_offsets, block_bytes = _plane_offsets(layout, local_ids)
    remote_regions, remote_offsets, _ = _plane_offsets(layout, remote_ids)
    lengths = np.full(len(local_offsets), block_bytes, dtype=np.int64)
    return ByteRuns(local_regions, local_offsets, remote_regions, remote_offsets, lengths)


def ceiling_reads(layout: RankLayout, num_bytes: int) -> ByteRuns:
    """``num_bytes`` in the fewest, biggest descriptors: each region read from its start, in
    order, until the bytes are covered (one descriptor when a region holds them all)."""
    sizes = np.array(layout.region_bytes, dtype=np.int64)
    starts = np.cumsum(sizes) - sizes
    lengths = np.clip(num_bytes - starts, 0, sizes)
    regions = np.flatnonzero(lengths).astype(np.int64)
    zeros = np.zeros(len(regions), dtype=np.int64)
    return ByteRuns(regions, zeros, regions, zeros, lengths[regions])


def split_reads(reads: ByteRuns, max_bytes: int) -> ByteRuns:
    """The same byte ranges cut into descriptors of at most max_bytes each."""
    pieces = -(-reads.lengths // max_bytes)
    row = np.repeat(np.arange(len(pieces)), pieces)
    first_piece = np.repeat(np.cumsum(pieces) - pieces, pieces)
    offsets = (np.arange(pieces.sum()) - first_piece) * max_bytes
    lengths = np.minimum(reads.lengths[row] - offsets, max_bytes)
    return ByteRuns(
        reads.local_regions[row],
        reads.local_offsets[row] + offsets,
        reads.remote_regions[row],
        reads.remote_offsets[row] + offsets,
        lengths,
    )


@dataclass(frozen=True)
class Timing:
    """One READ as the decode thread lives it (seconds)."""

    prepare_s: float  # plan or indices, descriptors, NIXL request creation
    in_post_s: float  # inside post(): UCX copies over CMA inline for a short list
    in_calls_s: float  # inside post() and every check(): the decode thread's share
    done_s: float  # post until decode sees DONE
    checks: int  # check() calls after post (0: post itself returned DONE)


def _drive(post: Callable[[], bool], check: Callable[[], bool], step_s: float) -> Timing:
    """Post, then check every step_s (0: busily) until DONE; prepare_s left 0."""
    started = time.perf_counter()
    done = post()
    in_post_s = in_calls_s = time.perf_counter() - started
    deadline = time.monotonic() + WAIT_S
    checks = 0
    while not done:
        if time.monotonic() > deadline:
            raise TimeoutError(f"READ not DONE within {WAIT_S} s")
        if step_s:
            time.sleep(step_s)
        call = time.perf_counter()
        done = check()
        in_calls_s += time.perf_counter() - call
        checks += 1
    return Timing(0.0, in_post_s, in_calls_s, time.perf_counter() - started, checks)


def _raw_done(state: str) -> bool:
    if state == "ERR":
        raise RuntimeError("prepped READ ended in state 'ERR'")
    return state == "DONE"


class Decode:
    """This process's agent, its regions and the loaded child agent."""

    def __init__(
        self,
        layout: RankLayout,
        metadata: bytes,
        remote_addresses: tuple[int, ...],
        num_threads: int = DEFAULT_NIXL_THREADS,
    ):
        self.agent = RealNixlAgent(f"bench-decode-{uuid.uuid4().hex[:8]}", num_threads=num_threads)
        group = layout.groups[0]
        self.num_layers, self.pool_blocks = len(group.planes) // 2, group.num_blocks
        self.regions = [np.full(n // 8, -1, dtype=np.int64) for n in layout.region_bytes]
        self.addresses = tuple(r.ctypes.data for r in self.regions)
        self.agent.register_regions(
            [(a, r.nbytes) for a, r in zip(self.addresses, self.regions, strict=True)]
        )
        self.remote = self.agent.add_remote_agent(metadata)
        self.remote_addresses = remote_addresses
        # vLLM's path needs the agent behind RealNixlAgent, which has no prepped-dlist API.
        self.raw = self.agent._live()

    def descriptors(self, reads: ByteRuns) -> tuple[Descriptors, Descriptors]:
        local = build_descriptors(
            self.addresses, reads.local_regions, reads.local_offsets, reads.lengths
        )
        remote = build_descriptors(
            self.remote_addresses, reads.remote_regions, reads.remote_offsets, reads.lengths
        )
        return local, remote

    def read(self, reads: ByteRuns | Callable[[], ByteRuns], step_s: float) -> Timing:
        """One READ through RealNixlAgent.make_read (initialize_xfer); reads may be a plan."""
        started = time.perf_counter()
        rows = reads() if callable(reads) else reads
        transfer = self.agent.make_read(self.remote, *self.descriptors(rows))
        prepare_s = time.perf_counter() - started
        timing = _drive(
            lambda: self.agent.post(transfer) is TransferState.DONE,
            lambda: self.agent.check(transfer) is TransferState.DONE,
            step_s,
        )
        self.agent.release(transfer)
        return dataclasses.replace(timing, prepare_s=prepare_s)

    def prepped_read(
        self, dlists: tuple[Any, Any], local_ids: list[int], remote_ids: list[int], step_s: float
    ) -> Timing:
        """One READ through make_prepped_xfer on dlists prepared at handshake."""
        started = time.perf_counter()
        local_idx, remote_idx = (
            _pool_indices(ids, self.num_layers, self.pool_blocks) for ids in (local_ids, remote_ids)
        )
        handle = self.raw.make_prepped_xfer("READ", dlists[0], local_idx, dlists[1], remote_idx)
        prepare_s = time.perf_counter() - started
        timing = _drive(
            lambda: _raw_done(self.raw.transfer(handle)),
            lambda: _raw_done(self.raw.check_xfer_state(handle)),
            step_s,
        )
        handle.release()
        return dataclasses.replace(timing, prepare_s=prepare_s)

    def verify(self, reads: ByteRuns, run: Callable[[float], object], name: str) -> None:
        """Zero a sample of destinations, run the READ, check the bytes that landed."""
        sample = np.random.default_rng(0).choice(len(reads.lengths), 16)
        sample = np.concatenate([sample, [0, len(reads.lengths) - 1]])
        for i in sample:
            start = reads.local_offsets[i] // 8
            self.regions[reads.local_regions[i]][start : start + reads.lengths[i] // 8] = 0
        run(0.0)
        for i in sample:
            start = reads.local_offsets[i] // 8
            got = self.regions[reads.local_regions[i]][start : start + reads.lengths[i] // 8]
            want = expected_words(
                int(reads.remote_regions[i]), int(reads.remote_offsets[i]), int(reads.lengths[i])
            )
            if not np.array_equal(got, want):
                raise RuntimeError(f"{name}: descriptor {i} did not land the expected bytes")


def _block_ids(
    num_blocks: int, fragmented: bool, seed: int, pool_blocks: int = POOL_BLOCKS
) -> list[int]:
    if fragmented:
        return random.Random(seed).sample(range(pool_blocks), num_blocks)
    return list(range(seed * 8, seed * 8 + num_blocks))


def _pool_indices(
    block_ids: list[int], num_layers: int = NUM_LAYERS, pool_blocks: int = POOL_BLOCKS
) -> npt.NDArray[np.int32]:
    """Indices into the prepped pool dlist (plane-major) of every (layer plane, block)."""
    planes = np.arange(2 * num_layers, dtype=np.int32)[:, None] * pool_blocks
    return (planes + np.asarray(block_ids, dtype=np.int32)).ravel()


@dataclass(frozen=True)
class Row:
    case: str
    strategy: str
    poll: str  # how decode checks: "busy" or "1 ms"
    descriptors: int
    num_bytes: int
    timings: list[Timing]

    def median_s(self, field: str) -> float:
        return statistics.median(getattr(t, field) for t in self.timings)


SPLIT_BYTES = 256 << 10
CEILING = "ceiling (fewest descriptors)"
STRATEGIES = ("OURS (merged, initialize_xfer)", "per block, initialize_xfer",
              "per block, prepped (vLLM)", "OURS split at 256 KiB", CEILING)  # fmt: skip
DECODE_POLLS_S = {"busy": 0.0, "1 ms": 0.001}


def descriptor_rows(decode: Decode, layout: RankLayout, repeats: int) -> list[Row]:
    peer = peer_plan(layout, layout)
    pool = per_block_reads(layout, range(POOL_BLOCKS), range(POOL_BLOCKS))
    started = time.perf_counter()
    local_pool, remote_pool = decode.descriptors(pool)
    dlists = (
        decode.raw.prep_xfer_dlist("NIXL_INIT_AGENT", local_pool, "DRAM"),
        decode.raw.prep_xfer_dlist(decode.remote, remote_pool, "DRAM"),
    )
    print(f"prepped dlists of {len(local_pool):,} descriptors per side (once, at handshake): "
          f"{(time.perf_counter() - started) * 1e3:.1f} ms")  # fmt: skip
    rows: list[Row] = []
    for num_tokens, fragmented in CASES:
        local_ids, remote_ids = (
            _block_ids(num_tokens // BLOCK_SIZE, fragmented, seed) for seed in (1, 2)
        )
        case = f"{num_tokens // 1024}k {'fragmented' if fragmented else 'contiguous'}"

        def ours(
            local_ids: list[int] = local_ids,
            remote_ids: list[int] = remote_ids,
            num_tokens: int = num_tokens,
        ) -> ByteRuns:
            request = TransferRequest((local_ids,), (remote_ids,), num_tokens, 0)
            runs = plan_request(peer, request).reads[0].ranges
            assert runs is not None  # no prepared rows: byte ranges only
            return runs

        blocks = per_block_reads(layout, local_ids, remote_ids)
        ceiling = ceiling_reads(layout, int(blocks.lengths.sum()))
        runs: dict[str, Callable[[float], Timing]] = {
            STRATEGIES[0]: functools.partial(decode.read, ours),
            STRATEGIES[1]: functools.partial(decode.read, blocks),
            STRATEGIES[2]: functools.partial(decode.prepped_read, dlists, local_ids, remote_ids),
            STRATEGIES[3]: functools.partial(decode.read, functools.partial(_split, ours)),
            CEILING: functools.partial(decode.read, ceiling),
        }
        checked = (ours(), blocks, blocks, split_reads(ours(), SPLIT_BYTES), ceiling)
        counts = tuple(len(reads.lengths) for reads in checked)
        for (name, run), reads in zip(runs.items(), checked, strict=True):
            decode.verify(reads, run, f"{case} {name}")
        for poll, step_s in DECODE_POLLS_S.items():
            samples: dict[str, list[Timing]] = {name: [] for name in runs}
            for _ in range(repeats):  # interleaved: load changes hit every strategy alike
                for name, run in runs.items():
                    samples[name].append(run(step_s))
            for (name, timings), count in zip(samples.items(), counts, strict=True):
                rows.append(Row(case, name, poll, count, int(blocks.lengths.sum()), timings))
    return rows


BLOCK_MAJOR = "OURS (block rows, initialize_xfer)"


def block_major_rows(decode: Decode, layout: RankLayout, repeats: int) -> list[Row]:
    """OURS on block-outermost rows and the ceiling, interleaved, decode checking busily."""
    peer = peer_plan(layout, layout)
    rows: list[Row] = []
    for num_tokens, fragmented in CASES:
        local_ids, remote_ids = (
            _block_ids(num_tokens // BLOCK_SIZE, fragmented, seed) for seed in (1, 2)
        )
        case = f"{num_tokens // 1024}k {'fragmented' if fragmented else 'contiguous'}"

        def ours(
            local_ids: list[int] = local_ids,
            remote_ids: list[int] = remote_ids,
            num_tokens: int = num_tokens,
        ) -> ByteRuns:
            request = TransferRequest((local_ids,), (remote_ids,), num_tokens, 0)
            runs = plan_request(peer, request).reads[0].ranges
            assert runs is not None  # no prepared rows: byte ranges only
            return runs

        planned = ours()
        ceiling = ceiling_reads(layout, int(planned.lengths.sum()))
        runs: dict[str, Callable[[float], Timing]] = {
            BLOCK_MAJOR: functools.partial(decode.read, ours),
            CEILING: functools.partial(decode.read, ceiling),
        }
        for (name, run), reads in zip(runs.items(), (planned, ceiling), strict=True):
            decode.verify(reads, run, f"{case} {name}")
        samples: dict[str, list[Timing]] = {name: [] for name in runs}
        for _ in range(repeats):  # interleaved: load changes hit both alike
            for name, run in runs.items():
                samples[name].append(run(0.0))
        for (name, timings), reads in zip(samples.items(), (planned, ceiling), strict=True):
            num_bytes = int(reads.lengths.sum())
            rows.append(Row(case, name, "busy", len(reads.lengths), num_bytes, timings))
    return rows


def _split(plan: Callable[[], ByteRuns]) -> ByteRuns:
    return split_reads(plan(), SPLIT_BYTES)


def _notif_reads(layout: RankLayout, num_bytes: int) -> ByteRuns:
    """64 KiB: one descriptor. 8 MiB: a contiguous 4-block request as the planner reads it."""
    if num_bytes == 8 << 20:
        ids = list(range(4))
        plan = plan_request(peer_plan(layout, layout), TransferRequest((ids,), (ids,), 64, 0))
        runs = plan.reads[0].ranges
        assert runs is not None  # no prepared rows: byte ranges only
        return runs
    zero = np.zeros(1, dtype=np.int64)
    return ByteRuns(zero, zero, zero, zero, np.array([num_bytes], dtype=np.int64))


@dataclass(frozen=True)
class NotifTrial:
    done_s: float  # post until decode sees DONE
    notif_s: float  # post until prefill's get_new_notifs returned the notification
    done_at_post: bool  # post() itself returned DONE


def notif_trial(
    decode: Decode, child: PeerChild, reads: ByteRuns, attached: bool, step_s: float, tag: str
) -> NotifTrial:
    message = tag.encode()
    local, remote = decode.descriptors(reads)
    transfer = decode.agent.make_read(decode.remote, local, remote, message if attached else b"")
    posted_ns = time.monotonic_ns()  # CLOCK_MONOTONIC: the child's clock too
    timing = _drive(
        lambda: decode.agent.post(transfer) is TransferState.DONE,
        lambda: decode.agent.check(transfer) is TransferState.DONE,
        step_s,
    )
    done_ns = time.monotonic_ns()
    if not attached:
        decode.agent.send_notif(decode.remote, message)
    decode.agent.release(transfer)
    got, seen_ns = child.wait_notif(WAIT_S)
    if got != message:
        raise RuntimeError(f"expected notification {message!r}, the child got {got!r}")
    return NotifTrial((done_ns - posted_ns) / 1e9, (seen_ns - posted_ns) / 1e9, not timing.checks)


NotifRow = tuple[str, str, str, list[NotifTrial]]  # size, decode checks, strategy, trials
NOTIF_STRATEGIES = {"READ carries notif (today)": True, "READ, then send_notif": False}
NOTIF_DECODE_POLLS_S = {"busy": 0.0, "10 ms": 0.01}  # 10 ms: a check per engine step
PREFILL_POLL_US = 100  # ~arrival time at the prefill agent


def notif_rows(
    decode: Decode, child: PeerChild, layout: RankLayout, repeats: int
) -> list[NotifRow]:
    child.set_poll_us(PREFILL_POLL_US)
    rows: list[NotifRow] = []
    for num_bytes, (decode_poll, step_s) in itertools.product(
        NOTIF_SIZES_BYTES, NOTIF_DECODE_POLLS_S.items()
    ):
        reads = _notif_reads(layout, num_bytes)
        samples: dict[str, list[NotifTrial]] = {name: [] for name in NOTIF_STRATEGIES}
        for i in range(repeats + 1):  # the first round warms up and is dropped
            for name, attached in NOTIF_STRATEGIES.items():
                tag = f"n{i}{'a' if attached else 's'}"
                trial = notif_trial(decode, child, reads, attached, step_s, tag)
                if i:
                    samples[name].append(trial)
        size = f"{num_bytes >> 20} MiB" if num_bytes >= 1 << 20 else f"{num_bytes >> 10} KiB"
        for name, trials in samples.items():
            rows.append((size, decode_poll, name, trials))
    child.set_poll_us(1000)
    return rows


def print_busy_table(rows: list[Row], title: str) -> None:
    """post -> DONE per strategy; "vs OURS" is the time over the first strategy's, "of
    ceiling" the GB/s over the ceiling's in the same case (both medians)."""
    first = {r.case: r for r in reversed(rows)}
    ceiling = {r.case: r for r in rows if r.strategy == CEILING}
    print(f"\n{title}")
    print("| case | strategy | descriptors | prepare ms | post->DONE ms [min-max] | GB/s "
          "| vs OURS | of ceiling [min-max] |")  # fmt: skip
    print("|---|---|---:|---:|---:|---:|---:|---:|")
    for row in rows:
        done_s = row.median_s("done_s")
        values = [t.done_s * 1e3 for t in row.timings]
        print(f"| {row.case} | {row.strategy} | {row.descriptors:,} "
              f"| {row.median_s('prepare_s') * 1e3:.2f} "
              f"| {done_s * 1e3:.1f} [{min(values):.0f}-{max(values):.0f}] "
              f"| {row.num_bytes / done_s / 1e9:.1f} "
              f"| {done_s / first[row.case].median_s('done_s'):.2f}x "
              f"| {_of_ceiling(row, ceiling.get(row.case))} |")  # fmt: skip


def _of_ceiling(row: Row, ceiling: Row | None) -> str:
    """Median GB/s over the ceiling's median, and the range over paired (interleaved) trials."""
    if ceiling is None:
        return "-"
    ratios = [c.done_s / t.done_s for t, c in zip(row.timings, ceiling.timings, strict=True)]
    median = ceiling.median_s("done_s") / row.median_s("done_s")
    return f"{median:.0%} [{min(ratios):.0%}-{max(ratios):.0%}]"


def print_descriptor_tables(rows: list[Row]) -> None:
    print_busy_table(
        [r for r in rows if r.poll == "busy"],
        "Decode checks busily (post -> DONE as fast as it can be seen):",
    )
    print("\nDecode checks once per 1 ms (an engine step); the thread's time inside NIXL calls:")
    print("| case | strategy | post->DONE ms | inside post() ms | inside post()+check() ms |")
    print("|---|---|---:|---:|---:|")
    for row in (r for r in rows if r.poll == "1 ms"):
        print(f"| {row.case} | {row.strategy} | {row.median_s('done_s') * 1e3:.1f} "
              f"| {row.median_s('in_post_s') * 1e3:.1f} "
              f"| {row.median_s('in_calls_s') * 1e3:.1f} |")  # fmt: skip


def print_notif_table(rows: list[NotifRow]) -> None:
    print("\nms from post until decode sees DONE / until prefill's get_new_notifs has the "
          "notification, medians, split by whether post() itself returned DONE:")  # fmt: skip
    print("| size | decode checks | strategy | post() returned DONE | DONE / notif, then "
          "| DONE / notif, otherwise | DONE / notif, all trials (p90) |")  # fmt: skip
    print("|---|---|---|---:|---:|---:|---:|")
    for size, decode_poll, name, trials in rows:
        at_post = [t for t in trials if t.done_at_post]
        later = [t for t in trials if not t.done_at_post]
        print(f"| {size} | {decode_poll} | {name} | {len(at_post) / len(trials):.0%} "
              f"| {_pair_ms(at_post)} | {_pair_ms(later)} "
              f"| {_pair_ms(trials, p90=True)} |")  # fmt: skip


def _pair_ms(trials: list[NotifTrial], p90: bool = False) -> str:
    """ "DONE / notif" medians in ms (with p90s), or "-" for no trials."""
    if not trials:
        return "-"
    return f"{_ms([t.done_s for t in trials], p90)} / {_ms([t.notif_s for t in trials], p90)}"


def _ms(values: list[float], p90: bool) -> str:
    text = f"{statistics.median(values) * 1e3:.2f}"
    if p90 and len(values) > 1:
        text += f" ({statistics.quantiles(values, n=10)[-1] * 1e3:.2f})"
    return text


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--repeats", type=int, default=7, help="READs per descriptor cell")
    parser.add_argument("--notif-repeats", type=int, default=60, help="trials per notif cell")
    parser.add_argument(
        "--sections",
        default="descriptors,notif,block-major",
        help="comma-separated: descriptors, notif, block-major",
    )
    args = parser.parse_args()
    sections = set(args.sections.split(","))
    os.environ.setdefault("UCX_NET_DEVICES", "lo")
    started = time.monotonic()
    if sections & {"descriptors", "notif"}:
        layout = _layout()
        with _session(layout) as (decode, child):
            if "descriptors" in sections:
                print_descriptor_tables(descriptor_rows(decode, layout, args.repeats))
            if "notif" in sections:
                print_notif_table(notif_rows(decode, child, layout, args.notif_repeats))
    if "block-major" in sections:
        layout = _layout(MemoryLayout.BLOCK_NHD_PACKED)
        with _session(layout) as (decode, _):
            rows = block_major_rows(decode, layout, args.repeats)
        print_busy_table(rows, "Block-outermost rows (vLLM's BLNHC) against the ceiling, "
                         "decode checking busily:")  # fmt: skip
    print(f"\nwall time {time.monotonic() - started:.0f} s")


@contextlib.contextmanager
def _session(layout: RankLayout) -> Iterator[tuple[Decode, PeerChild]]:
    """A child serving ``layout``'s regions and this process's agent reading them."""
    total_gib = 2 * sum(layout.region_bytes) / (1 << 30)
    print(f"\n{layout.memory_layout.value}: {len(layout.region_bytes)} KV regions per side, "
          f"{total_gib:.2f} GiB in both processes")  # fmt: skip
    with PeerChild(layout.region_bytes, lifetime_s=600.0) as child:
        metadata, remote_addresses = child.wait_ready(timeout_s=120.0)
        decode = Decode(layout, metadata, remote_addresses)
        try:
            yield decode, child
        finally:
            decode.agent.close()


if __name__ == "__main__":
    main()
