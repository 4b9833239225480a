"""GB/s of real NIXL READs between two "hosts" (network namespaces joined by a veth) vs ceilings.

    sudo .venv/bin/python benchmarks/veth_bandwidth.py [--size-mib 64] [--trials 5] [--json]

Three placements of the same pair of processes (one serves --size-mib of memory, the other
READs all of it) in one run, each with UCX's own name for the transport that moved the bytes:

- ``two hosts, tcp/veth``: the server in one namespace, the reader in the other, UCX_TLS=tcp on
  the veth (tests/netns.py): what prefill and decode on two hosts without RDMA get.
- ``one host, tcp/lo``: both in this namespace, UCX_TLS=tcp on lo: TCP without the veth.
- ``one host, UCX's choice``: both here, UCX_NET_DEVICES=lo only: CMA, the same-host ceiling.

Per placement, READs in scattered blocks of each size (KV blocks of a few pages to a few MiB,
one descriptor each) and the ceiling of that placement (the whole buffer in 64 MiB
descriptors); trials interleave the sizes, and each figure is the median of --trials. Needs
root for the namespaces, which are always removed.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Mapping, Sequence
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.nixl_bandwidth import read_seconds, serve, stop_peer  # noqa: E402
from connector.tools.doctor_ucx import all_read_lanes, parse_proto_tables  # noqa: E402
from tests.netns import host_pair  # noqa: E402

CEILING_BYTES = 64 << 20
BLOCK_SIZES_BYTES = (CEILING_BYTES, 1 << 20, 256 << 10, 64 << 10, 16 << 10)
READY_TIMEOUT_S = 60.0


def rows(base: int, order: np.ndarray, block_bytes: int) -> np.ndarray:
    """One (address, length, device) row per block, in ``order``."""
    return np.stack([base + order * block_bytes, np.full(len(order), block_bytes), 0 * order], 1)


def read(address: int, metadata_hex: str, num_bytes: int, trials: int) -> dict[str, float]:
    """Reader child: median GB/s per block size, trials interleaved; checks the bytes."""
    from worker.nixl_real import RealNixlAgent

    agent = RealNixlAgent(f"bench-veth-{uuid.uuid4().hex[:8]}", progress_delay_us=1000)
    local = np.zeros(num_bytes // 8, dtype=np.int64)
    agent.register_regions([(local.ctypes.data, local.nbytes)])
    remote = agent.add_remote_agent(bytes.fromhex(metadata_hex))
    plans = {}
    for block_bytes in BLOCK_SIZES_BYTES:
        order = np.random.default_rng(0).permutation(num_bytes // block_bytes)
        column = np.arange(len(order), dtype=np.int64)
        plans[block_bytes] = (rows(local.ctypes.data, column, block_bytes),
                              rows(address, order, block_bytes), order)  # fmt: skip
    read_seconds(agent, remote, *plans[CEILING_BYTES][:2])  # warm-up: connection, page faults
    seconds: dict[int, list[float]] = {block_bytes: [] for block_bytes in BLOCK_SIZES_BYTES}
    for _ in range(trials):
        for block_bytes, (local_rows, remote_rows, _) in plans.items():
            seconds[block_bytes].append(read_seconds(agent, remote, local_rows, remote_rows))
    for local_rows, remote_rows, order in plans.values():
        local[:] = 0
        read_seconds(agent, remote, local_rows, remote_rows)
        expected = np.arange(num_bytes // 8, dtype=np.int64).reshape(len(order), -1)[order]
        assert np.array_equal(local.reshape(len(order), -1), expected), "bytes did not land"
    agent.close()
    return {str(b): num_bytes / statistics.median(s) / 1e9 for b, s in seconds.items()}


def run_pair(
    server_prefix: Sequence[str],
    reader_prefix: Sequence[str],
    env: Mapping[str, str],
    num_bytes: int,
    trials: int,
    ucx_log: Path,
    reader_env: Mapping[str, str] | None = None,
) -> dict[str, float]:
    """A server and a reader child (each under its prefix, e.g. `ip netns exec NS`)."""
    me = [sys.executable, __file__, "--size-mib", str(num_bytes >> 20)]
    child_env = {**os.environ, **env, "PYTHONUNBUFFERED": "1"}
    server = subprocess.Popen([*server_prefix, *me, "--serve"], env=child_env,
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)  # fmt: skip
    try:
        assert server.stdout is not None
        deadline_s = time.monotonic() + READY_TIMEOUT_S
        while not (line := server.stdout.readline()).startswith("READY"):
            assert line and time.monotonic() < deadline_s, "the serving child did not start"
        _, address, metadata_hex = line.split()
        reader = subprocess.run(
            [*reader_prefix, *me, "--read", address, metadata_hex, "--trials", str(trials)],
            env={**child_env, **(reader_env or {}), "UCX_PROTO_INFO": "y",
                 "UCX_LOG_FILE": str(ucx_log)},
            capture_output=True, text=True, timeout=600, check=True,
        )  # fmt: skip
        result_line = [ln for ln in reader.stdout.splitlines() if ln.startswith("RESULT ")]
        return dict(json.loads(result_line[-1][len("RESULT ") :]))
    finally:
        stop_peer(server)


def measure(num_bytes: int, trials: int) -> list[dict[str, object]]:
    results = []
    with tempfile.TemporaryDirectory(prefix="nixlpd-veth-bench-") as tmp, host_pair() as hosts:
        placements = {
            "two hosts, tcp/veth": (hosts.prefill.command([]), hosts.decode.command([]),
                                    hosts.prefill.env(), hosts.decode.env()),
            "one host, tcp/lo": ([], [], {"UCX_TLS": "tcp", "UCX_NET_DEVICES": "lo"}, None),
            "one host, UCX's choice": ([], [], {"UCX_NET_DEVICES": "lo"}, None),
        }  # fmt: skip
        for name, (server_prefix, reader_prefix, env, reader_env) in placements.items():
            ucx_log = Path(tmp) / f"{len(results)}.log"
            gbps = run_pair(server_prefix, reader_prefix, env, num_bytes, trials, ucx_log,
                            reader_env)  # fmt: skip
            lanes = all_read_lanes(parse_proto_tables(ucx_log.read_text(errors="replace")))
            results.append({"placement": name, "read_lanes": list(lanes), "gbps": gbps})
    return results


def table(results: list[dict[str, object]]) -> str:
    sizes = [b for b in BLOCK_SIZES_BYTES if b != CEILING_BYTES]
    same_host = results[-1]["gbps"]
    assert isinstance(same_host, dict)
    head = "| placement | UCX lanes | ceiling GB/s | of same-host ceiling |"
    head += "".join(f" {b >> 10} KiB blocks: GB/s (of ceiling) |" for b in sizes)
    lines = [head, "|" + "---|" * (4 + len(sizes))]
    for result in results:
        gbps = result["gbps"]
        assert isinstance(gbps, dict) and isinstance(result["read_lanes"], list)
        ceiling = gbps[str(CEILING_BYTES)]
        cells = [str(result["placement"]), ", ".join(result["read_lanes"]) or "?",
                 f"{ceiling:.2f}", f"{ceiling / same_host[str(CEILING_BYTES)]:.0%}"]  # fmt: skip
        cells += [f"{gbps[str(b)]:.2f} ({gbps[str(b)] / ceiling:.0%})" for b in sizes]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size-mib", type=int, default=64)
    parser.add_argument("--trials", type=int, default=5)
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--read", nargs=2, metavar=("ADDRESS", "METADATA"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    num_bytes = args.size_mib << 20
    if args.serve:
        serve(num_bytes, 1000)
    elif args.read:
        gbps = read(int(args.read[0]), args.read[1], num_bytes, args.trials)
        print("RESULT", json.dumps(gbps), flush=True)
    else:
        results = measure(num_bytes, args.trials)
        print(json.dumps(results) if args.json else table(results))


if __name__ == "__main__":
    main()
