"""One side of the doctor's loopback READ, run as its own process: the target or the reader.

``python -m connector.tools.doctor_peer target --num-bytes N`` registers N bytes holding a known
pattern with a real NIXL agent (UCX, DRAM; the same RealNixlAgent the connector uses) and
prints ``READY <address> <agent metadata hex>``. Told ``idle <seconds>`` on stdin, it measures
how much CPU it uses doing nothing for that long (a spinning progress thread shows here) and
prints ``IDLE_CPU <fraction of one core>``; any other line, or stdin closing, makes it exit.

``python -m connector.tools.doctor_peer reader --num-bytes N --reads K`` creates its agent, then
reads ``<address> <metadata hex>`` from stdin, READs the target's N bytes once to warm up
(connection, page faults) and K more times timed, checks the bytes, and prints
``RESULT <bytes per READ> <timed seconds> <K> <descriptors per READ> <1 if bytes matched>``.

Either prints ``ERROR <message>`` and exits 1 on failure, and exits on its own after
``--lifetime-s`` so it never outlives a doctor that died. Every other stdout line (NIXL's own
logging) is to be ignored by the parent.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import select
import sys
import time
import uuid

import numpy as np

DESCRIPTOR_BYTES = 2**20  # one descriptor per MiB, like a run of merged KV blocks


def pattern(num_bytes: int) -> np.ndarray:
    """The bytes the target serves, reproducible in the reader."""
    return (np.arange(num_bytes, dtype=np.uint64) * 2654435761 >> 24).astype(np.uint8)


def _wait_stdin(timeout_s: float) -> str:
    """One stdin line ("" on EOF or timeout)."""
    ready, _, _ = select.select([sys.stdin], [], [], max(0.0, timeout_s))
    return sys.stdin.readline() if ready else ""


def _rows(address: int, num_bytes: int) -> np.ndarray:
    starts = np.arange(address, address + num_bytes, DESCRIPTOR_BYTES, dtype=np.int64)
    lengths = np.minimum(DESCRIPTOR_BYTES, address + num_bytes - starts)
    return np.column_stack([starts, lengths, np.zeros(len(starts), dtype=np.int64)])


def run_target(num_bytes: int, lifetime_s: float) -> None:
    from worker.nixl_real import RealNixlAgent

    buffer = pattern(num_bytes)
    agent = RealNixlAgent(f"doctor-target-{uuid.uuid4().hex[:8]}")
    registration = agent.register_regions([(buffer.ctypes.data, num_bytes)])
    print("READY", buffer.ctypes.data, agent.get_agent_metadata().hex(), flush=True)
    deadline_s = time.monotonic() + lifetime_s
    while (words := _wait_stdin(deadline_s - time.monotonic()).split())[:1] == ["idle"]:
        print("IDLE_CPU", f"{_idle_cpu_fraction(float(words[1])):.4f}", flush=True)
    agent.deregister(registration)
    agent.close()


def _idle_cpu_fraction(window_s: float) -> float:
    """The share of one core this process (NIXL's progress thread) uses while idle."""
    cpu_start_s, wall_start_s = time.process_time(), time.monotonic()
    time.sleep(min(max(window_s, 0.01), 5.0))
    return (time.process_time() - cpu_start_s) / (time.monotonic() - wall_start_s)


def run_reader(num_bytes: int, num_reads: int, lifetime_s: float) -> None:
    from worker.nixl_api import TransferState
    from worker.nixl_real import RealNixlAgent

    buffer = np.zeros(num_bytes, dtype=np.uint8)
    agent = RealNixlAgent(f"doctor-reader-{uuid.uuid4().hex[:8]}")
    registration = agent.register_regions([(buffer.ctypes.data, num_bytes)])
    words = _wait_stdin(lifetime_s).split()
    if len(words) != 2:
        raise RuntimeError(f"expected '<address> <metadata hex>' on stdin, got {words[:2]!r}")
    remote_agent = agent.add_remote_agent(bytes.fromhex(words[1]))
    local, remote = _rows(buffer.ctypes.data, num_bytes), _rows(int(words[0]), num_bytes)
    deadline_s = time.monotonic() + lifetime_s

    def read_once() -> None:
        transfer = agent.make_read(remote_agent, local, remote)
        state = agent.post(transfer)
        while state is not TransferState.DONE:
            if time.monotonic() > deadline_s:
                raise TimeoutError(f"a READ of {num_bytes} bytes did not finish in time")
            state = agent.check(transfer)
        agent.release(transfer)

    read_once()  # warm-up: connection set-up and the first touch of our pages
    start_s = time.perf_counter()
    for _ in range(num_reads):
        read_once()
    elapsed_s = time.perf_counter() - start_s
    matched = bool(np.array_equal(buffer, pattern(num_bytes)))
    # UCX writes the lanes it chose into its log through C stdio buffers, written out at a
    # clean exit: flushed now, they survive a doctor that has to kill this process (busy host).
    ctypes.CDLL(None).fflush(None)
    print("RESULT", num_bytes, f"{elapsed_s:.6f}", num_reads, len(local), int(matched), flush=True)
    agent.remove_remote_agent(remote_agent)
    agent.deregister(registration)
    agent.close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m connector.tools.doctor_peer")
    parser.add_argument("role", choices=("target", "reader"))
    parser.add_argument("--num-bytes", type=int, default=32 * 2**20)
    parser.add_argument("--reads", type=int, default=4)
    parser.add_argument("--lifetime-s", type=float, default=60.0)
    args = parser.parse_args(argv)
    os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")
    try:
        if args.role == "target":
            run_target(args.num_bytes, args.lifetime_s)
        else:
            run_reader(args.num_bytes, args.reads, args.lifetime_s)
    except Exception as exc:  # the parent reports it; one line, no traceback
        print("ERROR", f"{type(exc).__name__}: {exc}".replace("\n", " "), flush=True)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
