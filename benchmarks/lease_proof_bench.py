"""What a lease proof adds to a load: one LeaseCheck round trip to prefill's side channel.

A decode rank asks, after its last READ landed, whether the lease still holds; the load is
reported only after the answer. This measures that exchange on loopback (the same client
call the worker makes, against a real SideChannelServer holding real leases), with and
without a shared secret, and prints medians and p99 in microseconds.

``bound``: each call checks a fresh lease bound as Producer binds one (a 2,048-token prompt
in 128 blocks of 16) with the ref a reader's rank sends (its token and block digests), so the
holder packs the ids, digests both and compares inside the round trip, as for a load's first
check; ``unbound``: the lease id alone.

    .venv/bin/python -m benchmarks.lease_proof_bench [--calls 500]
"""

from __future__ import annotations

import argparse
import statistics
import time

from connector.lease_binding import HeldBlocks, HeldTokens, block_digest, token_digest
from connector.net.side_channel_client import check_leases_status, fetch_boot_id
from connector.protocol import LeaseRef
from scheduler.leases import LeaseTable
from scheduler.side_channel import SideChannelServer
from tests.test_protocol import make_handshake

HOST = "127.0.0.1"
ENGINE = "prefill-bench"
PROMPT = list(range(1000, 3048))  # 2,048 token ids
BLOCKS = (tuple(range(128)),)  # 16 tokens a block


def measure(calls: int, secret: str | None, bound: bool = False) -> list[float]:
    leases = LeaseTable(duration_s=3600.0)
    refs: list[tuple[str, str] | LeaseRef] = []
    for call in range(calls if bound else 1):
        request_id = f"req{call}"
        if bound:
            tokens = HeldTokens(list(PROMPT), len(PROMPT))
            held = HeldBlocks(BLOCKS, len(PROMPT), exact=False)
            leases.lease(request_id, time.monotonic(), "lease0", tokens=tokens, blocks=held)
            expects = token_digest(PROMPT, len(PROMPT))
            reads = block_digest(BLOCKS, len(PROMPT))
            refs.append(LeaseRef(request_id, "lease0", (), expects, reads))
        else:
            leases.lease(request_id, time.monotonic(), "lease0")
            refs.append((request_id, "lease0"))
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
        for call in range(calls):
            start = time.perf_counter()
            (held,) = check_leases_status(
                HOST, server.port, [refs[call if bound else 0]], engine_id=ENGINE,
                boot_id=boot_id, secret=secret, timeout_s=2.0,
            ).held  # fmt: skip
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
    for label, secret, bound in (
        ("no secret, unbound", None, False),
        ("no secret, bound", None, True),
        ("with secret (HMAC), bound", "s3cret", True),
    ):
        samples = sorted(measure(args.calls, secret, bound))
        p99 = samples[int(0.99 * (len(samples) - 1))]
        print(
            f"LeaseCheck round trip, {label}: median {statistics.median(samples):.0f} us, "
            f"p99 {p99:.0f} us ({len(samples)} calls)"
        )


if __name__ == "__main__":
    main()
