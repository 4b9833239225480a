"""A lone warm load on one decode rank: from start_load_kv to get_finished reporting it.

In process, no engine: tests/test_lease_proof.py's pair of ranks (FakeNixl, whose READ copies
inside post(); prefill's lease answers come at once from a check thread). What is left is the
rank's own machinery: the transfer thread's passes and the hand-offs between it, the check
threads and the engine thread (here polling get_finished every 0.1 ms). Compare two trees:

    .venv/bin/python -m benchmarks.lone_load --loads 200
    PYTHONPATH=/tmp/old-tree .venv/bin/python -m benchmarks.lone_load   # an export of an older commit
"""

from __future__ import annotations

import argparse
import statistics
import time

from tests.test_lease_proof import Pair, ScriptedCheck, remote_of

ENGINE_POLL_S = 0.0001


def measure(num_loads: int) -> list[float]:
    """Milliseconds per load, the first (which also handshakes) left out."""
    pair = Pair(ScriptedCheck(*([True] * (2 * num_loads + 2))))
    times_ms = []
    try:
        for index in range(num_loads + 1):
            started = time.perf_counter()
            pair.start(remote_of(f"p-{index}", lease_id=f"L{index}"), request_id=f"d-{index}")
            while not (report := pair.decode.get_finished()).finished_recving:
                if report.failed_recving:
                    raise RuntimeError(f"load {index} failed: {report.failed_recving}")
                time.sleep(ENGINE_POLL_S)
            if index:
                times_ms.append((time.perf_counter() - started) * 1e3)
            pair.prefill.flush()
            pair.prefill.get_finished()  # prefill's side of the lease ends too
    finally:
        pair.close()
    return times_ms


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--loads", type=int, default=200)
    times_ms = sorted(measure(parser.parse_args().loads))
    p90 = times_ms[int(0.9 * (len(times_ms) - 1))]
    print(f"{len(times_ms)} loads: median {statistics.median(times_ms):.2f} ms, p90 {p90:.2f} ms")


if __name__ == "__main__":
    main()
