"""Run inside .venv-vllm: vLLM's real CPU cache-write op is the oracle for one transfer.

The op writes a prompt's K/V (a length that is not a block multiple) into a prefill cache and,
separately, straight into a reference decode cache; our planner moves the prefill blocks into
a second decode cache; the two decode caches must be byte-identical. The same transfer planned
as token-addressable (what the shape alone suggests) is run as a control and must differ, so
the check can fail. Prints one JSON object per case on stdout.
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass

import numpy as np
import torch
from vllm import _custom_ops as ops

from connector.geometry import build_rank_layout
from connector.layout import (
    TOKEN_ADDRESSABLE,
    BlockFormat,
    GroupKind,
    GroupSpec,
    KVCacheSpec,
    LayerSpec,
    MemoryLayout,
)
from connector.vllm.backends import block_format_for
from worker.plan.recipe import TransferRequest, peer_plan, plan_request

NUM_LAYERS, NUM_HEADS, HEAD_SIZE, BLOCK_SIZE, NUM_BLOCKS = 2, 2, 64, 32, 8
DTYPE = torch.bfloat16


@dataclass(frozen=True)
class Case:
    name: str
    num_tokens: int
    num_cached_tokens: int
    prefill_blocks: tuple[int, ...]
    decode_blocks: tuple[int, ...]  # every block of the prompt, cached ones first


CASES = (
    Case("one-token", 1, 0, (5,), (2,)),
    Case("block-minus-one", BLOCK_SIZE - 1, 0, (5,), (2,)),
    Case("two-blocks-and-a-bit", 2 * BLOCK_SIZE + 7, 0, (3, 6, 1), (4, 0, 7)),
    Case("prefix-hit-then-partial", 2 * BLOCK_SIZE + 7, BLOCK_SIZE, (3, 6, 1), (4, 0, 7)),
)


def isa() -> str:
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    return str(_get_attn_isa(DTYPE, BLOCK_SIZE, HEAD_SIZE))


def spec(block_format: BlockFormat) -> KVCacheSpec:
    dtype_bytes = torch.empty((), dtype=DTYPE).element_size()
    layers = tuple(
        LayerSpec(f"layers.{i}", NUM_HEADS, HEAD_SIZE, dtype_bytes) for i in range(NUM_LAYERS)
    )
    group = GroupSpec(
        kind=GroupKind.FULL,
        block_size=BLOCK_SIZE,
        kernel_block_size=BLOCK_SIZE,
        num_blocks=NUM_BLOCKS,
        layers=layers,
        block_format=block_format,
    )
    # vLLM's CPU backend asks for LBHNC: per layer [blocks, heads, tokens, K|V].
    return KVCacheSpec("tiny", "bfloat16", "bfloat16", (group,), MemoryLayout.HND_PACKED)


def caches() -> list[torch.Tensor]:
    shape = (NUM_BLOCKS, NUM_HEADS, BLOCK_SIZE, 2 * HEAD_SIZE)
    return [torch.zeros(shape, dtype=DTYPE) for _ in range(NUM_LAYERS)]


def write(cache: list[torch.Tensor], kv: list[tuple[torch.Tensor, torch.Tensor]],
          blocks: tuple[int, ...], tokens: range, kernel_isa: str) -> None:  # fmt: skip
    """The real op, as vLLM's CPU backend calls it: slot = block * block_size + offset."""
    slots = torch.tensor(
        [blocks[t // BLOCK_SIZE] * BLOCK_SIZE + t % BLOCK_SIZE for t in tokens], dtype=torch.int64
    )
    for layer, (key, value) in zip(cache, kv, strict=True):
        view = layer.view(NUM_BLOCKS, NUM_HEADS, 2 * BLOCK_SIZE, HEAD_SIZE)
        key_cache, value_cache = view.chunk(2, dim=2)
        ops.cpu_attn_reshape_and_cache(
            key[tokens.start : tokens.stop], value[tokens.start : tokens.stop],
            key_cache, value_cache, slots, kernel_isa,
        )  # fmt: skip


def transfer(case: Case, block_format: BlockFormat, prefill: list[torch.Tensor],
             decode: list[torch.Tensor]) -> None:  # fmt: skip
    layout = build_rank_layout(spec(block_format), 0, 1)
    first = case.num_cached_tokens // BLOCK_SIZE
    plan = plan_request(
        peer_plan(layout, layout),
        TransferRequest(
            [list(case.decode_blocks[first:])],
            [list(case.prefill_blocks)],
            num_tokens=case.num_tokens,
            num_cached_tokens=case.num_cached_tokens,
        ),
    )
    local = [t.view(torch.uint8).numpy().reshape(-1) for t in decode]
    remote = [t.view(torch.uint8).numpy().reshape(-1) for t in prefill]
    for reads in (rank_plan.ranges for rank_plan in plan.reads):
        rows = zip(reads.local_regions, reads.local_offsets, reads.remote_regions,
                   reads.remote_offsets, reads.lengths, strict=True)  # fmt: skip
        for lr, lo, rr, ro, length in rows:
            local[lr][lo : lo + length] = remote[rr][ro : ro + length]


def run(case: Case, kernel_isa: str) -> dict[str, object]:
    generator = torch.Generator().manual_seed(case.num_tokens)
    kv = [
        tuple(torch.randn(case.num_tokens, NUM_HEADS, HEAD_SIZE, generator=generator).to(DTYPE)
              for _ in range(2))
        for _ in range(NUM_LAYERS)
    ]  # fmt: skip
    prompt = range(case.num_tokens)
    prefill, reference = caches(), caches()
    write(prefill, kv, case.prefill_blocks, prompt, kernel_isa)  # type: ignore[arg-type]
    write(reference, kv, case.decode_blocks, prompt, kernel_isa)  # type: ignore[arg-type]
    result: dict[str, object] = {"case": case.name, "isa": kernel_isa}
    for label, block_format in (("opaque", block_format_for("CPU_ATTN", kernel_isa)),
                                ("as_tokens", TOKEN_ADDRESSABLE)):  # fmt: skip
        decode = caches()
        cached = range(case.num_cached_tokens)  # decode's own prefix hit, written by decode
        write(decode, kv, case.decode_blocks, cached, kernel_isa)  # type: ignore[arg-type]
        transfer(case, block_format, prefill, decode)
        result[f"{label}_identical"] = all(
            bool(np.array_equal(d.view(torch.uint8).numpy(), r.view(torch.uint8).numpy()))
            for d, r in zip(decode, reference, strict=True)
        )
    return result


def main() -> int:
    kernel_isa = isa()
    for case in CASES:
        print(json.dumps(run(case, kernel_isa)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
