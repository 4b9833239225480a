"""How much READ time chunked pulls (and per-layer pulls) take off the path to decode's first step.

    UCX_NET_DEVICES=lo .venv/bin/python -m benchmarks.chunk_pull_bench [--repeats 7]

Real NIXL over UCX on loopback, two processes (the serving child is
benchmarks/nixl_bandwidth.py's). The KV is laid out as the ttft_bench model's
(benchmarks/ttft_model.py: 8 layers, 4 KV heads of 64, float32: 16 KiB per token), one
descriptor per (layer, K or V, block), blocks in order on both sides. For each prompt length
and prefill chunk size it times the READ that stays after prefill's last forward:

- today (sequential or overlapped dispatch): the whole prompt's KV;
- per-chunk pulls: the last chunk's blocks (the earlier chunks were read while it computed);
- per-layer pulls on top: the last chunk's last layer.

Each cell is the median [min] of ``--repeats`` READs, milliseconds. The landed bytes are
checked once per cell.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import uuid
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.nixl_bandwidth import read_seconds, stop_peer  # noqa: E402
from worker.nixl_real import RealNixlAgent  # noqa: E402

NUM_LAYERS = 8
TOKEN_BYTES_PER_LAYER_KV = 4 * 64 * 4  # KV heads x head size x float32, K or V of one layer
PROMPT_TOKENS = (1024, 2048, 4096)
CHUNK_TOKENS = (2048, 512)  # the ttft_bench engines' --max-num-batched-tokens, and a smaller one
MAX_PROMPT_TOKENS = max(PROMPT_TOKENS)


def rows(base: int, block_tokens: int, blocks: range, layers: range) -> np.ndarray:
    """Descriptors (address, bytes, device 0) of ``blocks`` in ``layers``, K and V each."""
    block_bytes = block_tokens * TOKEN_BYTES_PER_LAYER_KV
    num_blocks_total = MAX_PROMPT_TOKENS // block_tokens
    out = [
        (base + ((layer * 2 + kv) * num_blocks_total + block) * block_bytes, block_bytes, 0)
        for layer in layers
        for kv in (0, 1)
        for block in blocks
    ]
    return np.asarray(out, dtype=np.int64).reshape(-1, 3)


def cases(block_tokens: int) -> list[tuple[int, int, str, range, range]]:
    """(prompt, chunk, what, blocks, layers) for every cell."""
    out = []
    for prompt in PROMPT_TOKENS:
        num_blocks = prompt // block_tokens
        out.append((prompt, 0, "whole prompt (today)", range(num_blocks), range(NUM_LAYERS)))
        for chunk in CHUNK_TOKENS:
            last_chunk_tokens = prompt - ((prompt - 1) // chunk) * chunk
            first = num_blocks - last_chunk_tokens // block_tokens
            out.append((prompt, chunk, "last chunk", range(first, num_blocks), range(NUM_LAYERS)))
            out.append(
                (prompt, chunk, "last chunk, last layer", range(first, num_blocks),
                 range(NUM_LAYERS - 1, NUM_LAYERS))
            )  # fmt: skip
    return out


def measure(block_tokens: int, repeats: int) -> list[dict[str, object]]:
    num_bytes = MAX_PROMPT_TOKENS * TOKEN_BYTES_PER_LAYER_KV * 2 * NUM_LAYERS
    bench = Path(__file__).resolve().parent / "nixl_bandwidth.py"
    child = subprocess.Popen(
        [sys.executable, str(bench), "--serve", "--size-mib", str(num_bytes >> 20),
         "--progress-delays-us", "0"],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    results = []
    try:
        assert child.stdout is not None and child.stdin is not None
        agent = RealNixlAgent(f"bench-chunks-{uuid.uuid4().hex[:8]}", progress_delay_us=0)
        while not (line := child.stdout.readline()).startswith("READY"):
            assert line, "the serving child exited"
        _, address, metadata_hex = line.split()
        local = np.zeros(num_bytes // 8, dtype=np.int64)
        agent.register_regions([(local.ctypes.data, local.nbytes)])
        remote = agent.add_remote_agent(bytes.fromhex(metadata_hex))
        for prompt, chunk, what, blocks, layers in cases(block_tokens):
            local_rows = rows(local.ctypes.data, block_tokens, blocks, layers)
            remote_rows = rows(int(address), block_tokens, blocks, layers)
            local[:] = 0
            times_ms = [
                read_seconds(agent, remote, local_rows, remote_rows) * 1e3 for _ in range(repeats)
            ]
            first_row = local_rows[0]
            offset_words = (int(first_row[0]) - local.ctypes.data) // 8
            assert local[offset_words] == offset_words, "bytes did not land"  # served: arange
            results.append(
                {
                    "block_tokens": block_tokens,
                    "prompt_tokens": prompt,
                    "chunk_tokens": chunk,
                    "read": what,
                    "mib": round(int(local_rows[:, 1].sum()) / 2**20, 1),
                    "descriptors": len(local_rows),
                    "median_ms": round(statistics.median(times_ms), 2),
                    "min_ms": round(min(times_ms), 2),
                }
            )
            print(json.dumps(results[-1]), flush=True)
        agent.close()
    finally:
        stop_peer(child)
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--block-tokens", default="16,128", help="KV block sizes to lay out")
    args = parser.parse_args()
    os.environ.setdefault("UCX_NET_DEVICES", "lo")
    for block_tokens in (int(text) for text in args.block_tokens.split(",")):
        measure(block_tokens, args.repeats)


if __name__ == "__main__":
    main()
