"""Host staging's per-step copy: one batched gather/scatter per layer vs a Python loop per block.

    .venv/bin/python benchmarks/staging_copy.py [--layers 32] [--blocks 512] [--repeats 5]

A Llama-8B-like rank (per layer: blocks of 16 tokens x 8 KV heads x 128 x K|V, bf16 = 64 KiB
per block) with a host mirror, as connector/vllm/staging.HostBuffer builds it. It copies a
request's blocks device->host with HostBuffer's own op (the one used when vLLM gives none:
slice copies of contiguous runs, or one gather and one scatter per layer for fragmented ids)
and with a per-block loop, for contiguous and fragmented ids, and prints the best time of
each and their ratio. Here "device" is CPU memory (no GPU on this machine): this measures the
per-call overhead the batching removes, not PCIe bandwidth.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from connector.layout import GroupKind, GroupSpec, KVCacheSpec, LayerSpec  # noqa: E402
from connector.vllm.staging import HostBuffer  # noqa: E402

BLOCK_TOKENS, HEADS, HEAD_DIM = 16, 8, 128


def build(num_layers: int, num_blocks: int) -> tuple[HostBuffer, dict[str, torch.Tensor]]:
    names = [f"layers.{i}" for i in range(num_layers)]
    caches = {
        name: torch.randn(num_blocks, HEADS, BLOCK_TOKENS, 2 * HEAD_DIM).to(torch.bfloat16)
        for name in names
    }
    layers = tuple(LayerSpec(name, HEADS, HEAD_DIM, 2) for name in names)
    group = GroupSpec(GroupKind.FULL, BLOCK_TOKENS, BLOCK_TOKENS, num_blocks, layers)
    spec = KVCacheSpec("bench", "bfloat16", "bfloat16", (group,))
    return HostBuffer(caches, spec, pin=False), caches


def per_block(buffer: HostBuffer, block_ids: list[int]) -> None:
    for name, tensor in buffer.device.items():
        target = buffer.host[name]
        for block in block_ids:
            target[block].copy_(tensor[block])


def best_s(run: object, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        run()  # type: ignore[operator]
        times.append(time.perf_counter() - started)
    return min(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--blocks", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(1)
    buffer, _ = build(args.layers, args.blocks)
    results = []
    for num_blocks in (8, 64, 256):
        stride = args.blocks // num_blocks
        for shape, block_ids in (
            ("contiguous", list(range(1, 1 + num_blocks))),
            ("fragmented", list(range(1, args.blocks, stride))[:num_blocks]),
        ):
            entries = [(tuple(block_ids),)]
            batched = best_s(lambda entries=entries: buffer.to_host(entries), args.repeats)
            looped = best_s(lambda ids=block_ids: per_block(buffer, ids), args.repeats)
            num_bytes = num_blocks * args.layers * HEADS * BLOCK_TOKENS * 2 * HEAD_DIM * 2
            results.append(
                {
                    "blocks": num_blocks,
                    "ids": shape,
                    "MiB": num_bytes // 2**20,
                    "host_buffer_ms": round(batched * 1e3, 3),
                    "per_block_loop_ms": round(looped * 1e3, 3),
                    "loop_over_host_buffer": round(looped / batched, 2),
                }
            )
    print(json.dumps({"layers": args.layers, "results": results}, indent=1))


if __name__ == "__main__":
    main()
