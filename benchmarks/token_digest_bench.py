"""What binding a lease to its tokens costs: the reader's digest and the holder's compare.

The reader packs its prompt's first N ids (a Python list, as vLLM keeps them) as int32 and
digests them once per load; the holder packs its ids once per lease (at its first check,
on the side-channel thread: HeldTokens) and, per lease check, digests the first N of those
bytes. Prints median microseconds per call and per 1k tokens.

    .venv/bin/python -m benchmarks.token_digest_bench [--calls 2000]
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from collections.abc import Callable

from connector.lease_binding import pack_tokens, token_digest, tokens_verdict

SIZES = (1_024, 8_192, 32_768)


def median_us(call: Callable[[], object], calls: int) -> float:
    samples = []
    for _ in range(calls):
        started = time.perf_counter()
        call()
        samples.append(time.perf_counter() - started)
    return statistics.median(samples) * 1e6


def row(num_tokens: int, calls: int) -> list[float]:
    """Median µs of the reader's digest, the holder's pack and its compare, at ``num_tokens``."""
    ids = [random.randrange(150_000) for _ in range(num_tokens)]
    packed = pack_tokens(ids, num_tokens)
    expected = token_digest(ids, num_tokens)
    assert packed is not None and expected is not None
    return [
        median_us(lambda: token_digest(ids, num_tokens), calls),
        median_us(lambda: pack_tokens(ids, num_tokens), calls),
        median_us(lambda: tokens_verdict(packed, expected), calls),
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--calls", type=int, default=2000)
    args = parser.parse_args()
    print("| tokens | reader: pack + digest | holder: pack at lease | holder: compare per check |")
    print("|---:|---:|---:|---:|")
    for num_tokens in SIZES:
        cells = row(num_tokens, max(50, args.calls * 1_024 // num_tokens))
        text = " | ".join(f"{cell:.0f} µs ({cell * 1_024 / num_tokens:.1f}/1k)" for cell in cells)
        print(f"| {num_tokens:,} | {text} |")


if __name__ == "__main__":
    main()
