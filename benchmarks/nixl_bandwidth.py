"""Measure RealNixlAgent across two processes: agent creation, READ bandwidth and latency, idle CPU.

    UCX_NET_DEVICES=lo .venv/bin/python benchmarks/nixl_bandwidth.py \
        [--size-mib 64] [--progress-delays-us 1000,0,none] [--latency-reads 200]

For each progress setting (a delay in us for NIXL's progress thread, or "none" for no thread
with the served side polling get_new_notifs every 1 ms), a child process serves --size-mib
of memory and this process READs all of it, in scattered blocks of each size, reporting the
best of --repeats runs. "0" is what nixl_agent() does by default. Latency: --latency-reads
READs of one 4 KiB block each, one at a time, from posting to DONE (this side polls without
pause; the serving side has only its progress thread), their median and 90th percentile.
Run it with UCX_TLS=tcp too: there the serving side's progress thread serves the READ.
"""

from __future__ import annotations

import argparse
import json
import os
import select
import subprocess
import sys
import time
import uuid
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from worker.nixl_api import TransferState  # noqa: E402
from worker.nixl_real import RealNixlAgent  # noqa: E402

BLOCK_SIZES_BYTES = (64 << 20, 1 << 20, 256 << 10, 64 << 10, 16 << 10, 4 << 10)


def _parse_delay(text: str) -> int | None:
    return None if text == "none" else int(text)


def serve(num_bytes: int, progress_delay_us: int | None) -> None:
    """Child: register num_bytes, print address and metadata, drive the agent until stdin closes."""
    agent = RealNixlAgent(
        f"bench-serve-{uuid.uuid4().hex[:8]}", progress_delay_us=progress_delay_us
    )
    buffer = np.arange(num_bytes // 8, dtype=np.int64)
    agent.register_regions([(buffer.ctypes.data, buffer.nbytes)])
    print("READY", buffer.ctypes.data, agent.get_agent_metadata().hex(), flush=True)
    while not select.select([sys.stdin], [], [], 0.001)[0]:
        if progress_delay_us is None:
            agent.get_new_notifs()
    agent.close()


def read_seconds(
    agent: RealNixlAgent, remote: str, local_rows: np.ndarray, remote_rows: np.ndarray
) -> float:
    started = time.perf_counter()
    transfer = agent.make_read(remote, local_rows, remote_rows)
    state = agent.post(transfer)
    while state is TransferState.IN_PROGRESS:
        state = agent.check(transfer)
    elapsed_s = time.perf_counter() - started
    agent.release(transfer)
    return elapsed_s


LATENCY_BLOCK_BYTES = 4 << 10


def read_latencies_us(
    agent: RealNixlAgent, remote: str, local_address: int, remote_address: int, count: int
) -> dict[str, float]:
    """Median and 90th percentile of ``count`` one-block READs, each alone, in microseconds."""
    local_rows = np.array([[local_address, LATENCY_BLOCK_BYTES, 0]], dtype=np.int64)
    remote_rows = np.array([[remote_address, LATENCY_BLOCK_BYTES, 0]], dtype=np.int64)
    samples = sorted(
        read_seconds(agent, remote, local_rows, remote_rows) * 1e6 for _ in range(count)
    )
    return {
        "read_4KiB_us_p50": round(samples[len(samples) // 2], 1),
        "read_4KiB_us_p90": round(samples[len(samples) * 9 // 10], 1),
    }


def stop_peer(child: subprocess.Popen[str]) -> None:
    """End a `serve` child: close its stdin (it exits), kill it if it has not after 10 s."""
    if child.stdin is not None:
        child.stdin.close()
    try:
        child.wait(timeout=10)
    except subprocess.TimeoutExpired:
        child.kill()
        child.wait()


def measure(
    num_bytes: int, progress_delay_us: int | None, repeats: int, latency_reads: int
) -> dict[str, object]:
    child = subprocess.Popen(
        [sys.executable, __file__, "--serve", "--size-mib", str(num_bytes >> 20),
         "--progress-delays-us", "none" if progress_delay_us is None else str(progress_delay_us)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert child.stdout is not None and child.stdin is not None
        started = time.perf_counter()
        agent = RealNixlAgent(
            f"bench-read-{uuid.uuid4().hex[:8]}", progress_delay_us=progress_delay_us
        )
        create_s = time.perf_counter() - started
        while not (line := child.stdout.readline()).startswith("READY"):
            assert line, "the serving child exited"
        _, address, metadata_hex = line.split()
        local = np.zeros(num_bytes // 8, dtype=np.int64)
        agent.register_regions([(local.ctypes.data, local.nbytes)])
        remote = agent.add_remote_agent(bytes.fromhex(metadata_hex))
        results: dict[str, object] = {
            "progress_delay_us": progress_delay_us,
            "agent_create_s": round(create_s, 3),
        }
        for block_bytes in BLOCK_SIZES_BYTES:
            num_blocks = num_bytes // block_bytes
            order = np.random.default_rng(0).permutation(num_blocks)
            column = np.arange(num_blocks, dtype=np.int64)
            local_rows = np.stack(
                [
                    local.ctypes.data + column * block_bytes,
                    np.full(num_blocks, block_bytes),
                    0 * column,
                ],
                1,
            )
            remote_rows = np.stack(
                [int(address) + order * block_bytes, np.full(num_blocks, block_bytes), 0 * column],
                1,
            )
            best_s = min(
                read_seconds(agent, remote, local_rows, remote_rows) for _ in range(repeats)
            )
            expected = np.arange(num_bytes // 8, dtype=np.int64).reshape(num_blocks, -1)[order]
            assert np.array_equal(local.reshape(num_blocks, -1), expected), "bytes did not land"
            results[f"gbps_{block_bytes >> 10}KiB"] = round(num_bytes / best_s / 1e9, 2)
        if latency_reads:
            results |= read_latencies_us(
                agent, remote, local.ctypes.data, int(address), latency_reads
            )
        before = os.times()
        time.sleep(1.0)
        after = os.times()
        results["idle_cpu_s_per_s"] = round(
            after.user + after.system - before.user - before.system, 2
        )
        agent.close()
        return results
    finally:
        stop_peer(child)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--size-mib", type=int, default=64)
    parser.add_argument("--progress-delays-us", default="1000,0,none")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--latency-reads", type=int, default=0, help="one-block READs to time")
    parser.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    delays = [_parse_delay(text) for text in args.progress_delays_us.split(",")]
    if args.serve:
        serve(args.size_mib << 20, delays[0])
        return
    os.environ.setdefault("UCX_NET_DEVICES", "lo")
    for delay in delays:
        print(
            json.dumps(measure(args.size_mib << 20, delay, args.repeats, args.latency_reads)),
            flush=True,
        )


if __name__ == "__main__":
    main()
