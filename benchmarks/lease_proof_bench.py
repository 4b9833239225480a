"""What a lease proof adds to a load: one LeaseCheck round trip to prefill's side channel.

A decode rank asks, after its last READ landed, whether the lease still holds; the load is
reported only after the answer. This measures that exchange on loopback (the same client
call the worker makes, against a real SideChannelServer holding real leases), with and
without a shared secret, and prints medians and p99 in microseconds.

    .venv/bin/python -m benchmarks.lease_proof_bench [--calls 500]
"""

from __future__ import annotations

import argparse
import statistics
import time

from connector.net.side_channel_client import check_leases, fetch_boot_id
from scheduler.leases import LeaseTable
from scheduler.side_channel import SideChannelServer
from tests.test_protocol import make_handshake

HOST = "127.0.0.1"
ENGINE = "prefill-bench"


def measure(calls: int, secret: str | None) -> list[float]:
    leases = LeaseTable(duration_s=3600.0)
    leases.lease("req", time.monotonic(), "lease0")
    server = SideChannelServer(
        HOST,
        0,
        {0: make_handshake(0)},
        engine_id=ENGINE,
        on_heartbeat=lambda ids: 0,
        on_release=lambda ids: 0,
        on_lease_check=lambda refs: leases.check(refs, time.monotonic()),
        secret=secret,
    )
    server.start()
    try:
        boot_id = fetch_boot_id(HOST, server.port, engine_id=ENGINE, secret=secret, timeout_s=2)
        samples = []
        for _ in range(calls):
            start = time.perf_counter()
            (held,) = check_leases(
                HOST, server.port, [("req", "lease0")], engine_id=ENGINE, boot_id=boot_id,
                secret=secret, timeout_s=2.0,
            )  # fmt: skip
            samples.append((time.perf_counter() - start) * 1e6)
            if not held:
                raise SystemExit("the lease should be held")
        return samples
    finally:
        server.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=500)
    args = parser.parse_args()
    for label, secret in (("no secret", None), ("with secret (HMAC)", "s3cret")):
        samples = sorted(measure(args.calls, secret))
        p99 = samples[int(0.99 * (len(samples) - 1))]
        print(
            f"LeaseCheck round trip, {label}: median {statistics.median(samples):.0f} us, "
            f"p99 {p99:.0f} us ({len(samples)} calls)"
        )


if __name__ == "__main__":
    main()
