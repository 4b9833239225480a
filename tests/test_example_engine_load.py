"""The example engine under more load than its KV pool holds (issue 11, finding 1).

`nixl-pd route --requests 32 --prompt-len 100 --max-tokens 100` against default servers ended
decode with ``KeyError: 'dictionary is empty'``: admission reserved blocks for the prompt only,
decoding grew past the pool and nothing caught it. Admission now reserves what a request can
grow to (the rest wait their turn), and an exhausted pool fails one request, never the engine.
"""

from __future__ import annotations

import re

import pytest

from connector.layout import MemoryLayout
from examples.engine import Engine, EngineConfig, EngineRequest
from examples.kv_cache import BlockManager, PoolExhausted, build_spec
from examples.model import ModelKind
from examples.router import InProcessEngine, ToyRouter, run_local
from examples.server import connector_config
from worker.fake import FakeFabric, FakeNixl


def manager(kind: ModelKind = ModelKind.DENSE, num_blocks: int = 9) -> BlockManager:
    spec = build_spec(
        kind, block_size=4, kernel_block_size=4, num_blocks=num_blocks,
        memory_layout=MemoryLayout.NHD,
    )  # fmt: skip
    return BlockManager(spec)


@pytest.mark.parametrize("kind", [ModelKind.DENSE, ModelKind.HYBRID_SSM], ids=["dense", "ssm"])
def test_admission_counts_the_growth_other_requests_reserved(kind: ModelKind) -> None:
    blocks = manager(kind)  # 8 usable blocks per group
    prompt = list(range(6))
    assert blocks.can_admit(prompt, 0, max_num_tokens=16)  # 4 blocks: 2 now, 2 reserved
    blocks.allocate("a", prompt, 0, len(prompt), max_num_tokens=16)
    assert blocks.can_admit(list(range(10, 16)), 0, max_num_tokens=16)
    blocks.allocate("b", list(range(10, 16)), 0, 6, max_num_tokens=16)
    # 4 blocks are free, but a and b may still take all 4: a third request must wait.
    assert not blocks.can_admit(list(range(20, 24)), 0, max_num_tokens=4)
    blocks.grow("a", 16)
    blocks.grow("b", 16)  # reserved growth always succeeds
    blocks.free("a")
    assert blocks.can_admit(list(range(20, 24)), 0, max_num_tokens=16)


def test_growth_beyond_the_reservation_is_a_typed_error_not_a_key_error() -> None:
    blocks = manager(num_blocks=4)  # 3 usable blocks
    blocks.allocate("a", list(range(4)), 0, 4, max_num_tokens=8)
    blocks.allocate("b", list(range(10, 14)), 0, 4, max_num_tokens=4)
    blocks.grow("a", 8)
    with pytest.raises(PoolExhausted, match=r"request a needs a block of group 0 for 12 tokens"):
        blocks.grow("a", 12)


def run_pair(num_requests: int, prompt_len: int, max_tokens: int, num_blocks: int) -> dict:
    fabric = FakeFabric()
    engines = [
        Engine(
            EngineConfig(f"{role}-load", role=role, num_blocks=num_blocks),
            connector_config=connector_config(),
            agent_factory=lambda name: FakeNixl(name, fabric),
        )
        for role in ("prefill", "decode")
    ]
    try:
        prompts = {
            f"r{i}": [(i * 7 + t) % 64 for t in range(prompt_len)] for i in range(num_requests)
        }
        router = ToyRouter(InProcessEngine(engines[0]), InProcessEngine(engines[1]))
        completions = router.run(prompts, max_tokens, timeout_s=120.0)
        for _ in range(10_000):
            if not any(engine.has_work() for engine in engines):
                break
            for engine in engines:
                engine.step()
        return {
            "errors": [e for c in completions.values() for e in c.errors],
            "tokens": {rid: c.token_ids for rid, c in completions.items()},
            "leaked": [engine.num_leaked_blocks for engine in engines],
            "prompts": prompts,
        }
    finally:
        for engine in engines:
            engine.shutdown()


def test_decode_holds_a_batch_larger_than_its_pool() -> None:
    """The issue's load, scaled down: 12 requests that need 3x decode's pool, all complete."""
    result = run_pair(num_requests=12, prompt_len=40, max_tokens=40, num_blocks=24)
    assert result["errors"] == []
    assert result["leaked"] == [0, 0]
    reference = Engine(EngineConfig("reference", num_blocks=256))
    expected = run_local(InProcessEngine(reference), result["prompts"], 41, timeout_s=60.0)
    assert result["tokens"] == {rid: out.token_ids for rid, out in expected.items()}


def test_a_request_the_pool_can_never_hold_fails_alone() -> None:
    engine = Engine(EngineConfig("local", num_blocks=8))
    handle = InProcessEngine(engine)
    handle.submit(EngineRequest("huge", list(range(100)), 100))
    handle.submit(EngineRequest("small", list(range(8)), 4))
    outputs = {o.request_id: o for _ in range(50) for o in handle.poll(0.0)}
    assert re.search(r"needs 13 blocks for 200 tokens; the pool has 7", outputs["huge"].error)
    assert outputs["small"].error is None and len(outputs["small"].token_ids) == 4
    assert engine.num_leaked_blocks == 0
