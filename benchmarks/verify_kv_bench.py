"""What verify_kv costs: digesting a request's KV on prefill (per lease) and on decode (per load).

Builds one rank's layout of a Llama-like model (bf16; layers, KV heads and head size below),
fills its memory with random bytes and times ``lease_digests`` (prefill, every leased token)
and ``read_claims`` (decode, every token read) for a few prompt lengths. Prints milliseconds
per request and seconds per GB of KV digested, both sides.

    .venv/bin/python -m benchmarks.verify_kv_bench [--layers 16] [--heads 8] [--head-dim 128]
"""

from __future__ import annotations

import argparse
import math
import time

import numpy as np

from connector.geometry import build_rank_layout
from connector.layout import GroupKind, GroupSpec, KVCacheSpec, LayerSpec
from worker.kv_digest import lease_digests, read_claims

BLOCK_SIZE = 16


def measure(layers: int, heads: int, head_dim: int, num_tokens: int, repeats: int) -> str:
    num_blocks = math.ceil(num_tokens / BLOCK_SIZE) + 1
    spec = KVCacheSpec(
        "bench",
        "bf16",
        "bf16",
        (
            GroupSpec(
                GroupKind.FULL,
                block_size=BLOCK_SIZE,
                kernel_block_size=BLOCK_SIZE,
                num_blocks=num_blocks,
                layers=tuple(LayerSpec(f"l{i}", heads, head_dim, 2) for i in range(layers)),
            ),
        ),
    )
    layout = build_rank_layout(spec, 0, 1)
    rng = np.random.default_rng(0)
    buffers = [rng.integers(0, 256, size, dtype=np.uint8) for size in layout.region_bytes]
    block_ids = (tuple(rng.permutation(np.arange(1, num_blocks))[: num_blocks - 1].tolist()),)
    kv_bytes = num_tokens * layers * 2 * heads * head_dim * 2
    prefill_s = _best(lambda: lease_digests(layout, buffers, block_ids, num_tokens), repeats)
    decode_s = _best(lambda: read_claims(layout, buffers, block_ids, 0, num_tokens), repeats)
    return (
        f"{num_tokens:>6} tokens, {kv_bytes / 2**20:7.1f} MiB: prefill {prefill_s * 1e3:8.1f} ms "
        f"({prefill_s / kv_bytes * 2**30:5.2f} s/GiB), decode {decode_s * 1e3:8.1f} ms "
        f"({decode_s / kv_bytes * 2**30:5.2f} s/GiB)"
    )


def _best(run: object, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        run()  # type: ignore[operator]
        times.append(time.perf_counter() - start)
    return min(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    print(
        f"verify_kv digests, {args.layers} layers x {args.heads} KV heads x {args.head_dim}, bf16:"
    )
    for num_tokens in (128, 1024, 4096):
        print(measure(args.layers, args.heads, args.head_dim, num_tokens, args.repeats))


if __name__ == "__main__":
    main()
