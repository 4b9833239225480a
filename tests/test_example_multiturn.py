"""Multi-turn on the example engine (FakeNixl, in process): turn N+1's prefill pulls from decode.

Each turn goes through the toy router; from turn 2 on, prefill gets the params decode returned
for the previous turn and pulls the history it has not cached. The KV prefill ends with (a
digest of the whole prompt's KV) and every token must equal a single engine's for the same
full prompt, whatever the TP pair.
"""

from __future__ import annotations

from typing import Any

import msgspec
import pytest

from examples.engine import Engine, EngineConfig, RequestOutput
from examples.kv_cache import RankBuffers, copy_kernel_blocks
from examples.router import Completion, InProcessEngine, ToyRouter, run_local
from examples.server import connector_config
from worker.fake import FakeFabric, FakeNixl

PROMPT_LEN = 40
MAX_TOKENS = 20  # decode's tokens after prefill's first
NEW_TOKENS = 12
TURNS = 3


def _engines(
    tp_sizes: tuple[int, int], bidirectional: bool, *, staged: bool = False, verify_kv: bool = False
) -> list[Engine]:
    fabric = FakeFabric()
    config = msgspec.structs.replace(
        connector_config(),
        bidirectional_kv_xfer=bidirectional,
        kv_recompute_threshold=8,
        verify_kv=verify_kv,
    )
    return [
        Engine(
            EngineConfig(f"{role}-mt", role=role, tp_size=tp, num_blocks=128, staged=staged),
            connector_config=config,
            agent_factory=lambda name: FakeNixl(name, fabric),
        )
        for role, tp in zip(("prefill", "decode"), tp_sizes, strict=True)
    ]


def _conversation(
    engines: list[Engine], turns_run: int = TURNS, *, check_errors: bool = True
) -> list[tuple[list[int], Completion]]:
    """Turns of one conversation; each turn's full prompt and its completion."""
    router = ToyRouter(InProcessEngine(engines[0]), InProcessEngine(engines[1]))
    prompt = [(7 * t + 3) % 64 for t in range(PROMPT_LEN)]
    held: dict[str, Any] = {}
    turns = []
    for turn in range(1, turns_run + 1):
        request_id = f"c-t{turn}"
        done = router.run({request_id: prompt}, MAX_TOKENS, timeout_s=60.0, held=held)
        completion = done[request_id]
        if check_errors:
            assert completion.errors == [], completion.errors
        turns.append((prompt, completion))
        if completion.decode is None:  # a failed turn (check_errors off): the conversation ends
            break
        held = {
            f"c-t{turn + 1}": completion.decode.kv_transfer_params or {"do_remote_decode": True}
        }
        prompt = prompt + completion.token_ids + [(5 * t + turn) % 64 for t in range(NEW_TOKENS)]
    return turns


def _reference(prompts: list[list[int]]) -> dict[str, RequestOutput]:
    reference = Engine(EngineConfig("reference", num_blocks=256))
    try:
        return run_local(
            InProcessEngine(reference),
            {f"r{i}": p for i, p in enumerate(prompts)},
            MAX_TOKENS + 1,
            timeout_s=60.0,
        )
    finally:
        reference.shutdown()


@pytest.mark.parametrize("staged", [False, True], ids=["direct", "host-staged"])
@pytest.mark.parametrize(
    "tp_sizes", [(1, 1), (1, 2), (2, 1)], ids=["tp1-tp1", "prefill-tp1-decode-tp2", "tp2-tp1"]
)
def test_later_turns_pull_the_history_and_match_a_single_engine(
    tp_sizes: tuple[int, int], staged: bool
) -> None:
    """Host-staged too: decode's hold (its answer's KV, computed on the device) is copied to
    the host buffer NIXL reads before the next turn's prefill may read it (kv_match)."""
    engines = _engines(tp_sizes, bidirectional=True, staged=staged)
    try:
        turns = _conversation(engines)
    finally:
        for engine in engines:
            engine.shutdown()
    expected = _reference([prompt for prompt, _ in turns])
    for index, (_, completion) in enumerate(turns):
        reference = expected[f"r{index}"]
        assert completion.token_ids == reference.token_ids, f"turn {index + 1}"
        assert completion.prefill is not None
        assert completion.prefill.kv_digest == reference.kv_digest, f"turn {index + 1}"
    pulled = [completion.prefill.num_external_tokens for _, completion in turns]
    assert pulled[0] == 0
    # Prefill caches whole blocks of 16: it pulls the answer's tokens past its last cached one.
    assert all(tokens >= 8 for tokens in pulled[1:]), pulled


def test_without_the_mode_later_turns_compute_the_history() -> None:
    engines = _engines((1, 1), bidirectional=False)
    try:
        turns = _conversation(engines)
    finally:
        for engine in engines:
            engine.shutdown()
    assert [c.prefill.num_external_tokens for _, c in turns if c.prefill] == [0, 0, 0]


def _corrupt_copies_to_host(engine: Engine) -> None:
    """The engine's device->host block copy flips one value (a broken copy op)."""
    staging = engine.staging
    assert staging is not None
    host = staging.host

    def corrupting(source: RankBuffers, target: RankBuffers, ids: Any) -> None:
        copy_kernel_blocks(source, target, ids)
        if any(target is mirror for mirror in host) and len(ids[0]):
            target.views[0][0][0][ids[0][0]].flat[0] += 1.0

    staging.copy_op = corrupting


def test_a_staged_hold_whose_host_copy_differs_ends_and_the_next_turn_fails() -> None:
    """verify_kv covers a hold's device->host copy: a copy that differs ends the hold's lease
    (WorkerReport.unsaved), so the next turn's pull fails instead of reading the bad copy."""
    engines = _engines((1, 1), bidirectional=True, staged=True, verify_kv=True)
    _corrupt_copies_to_host(engines[1])
    try:
        turns = _conversation(engines, 2, check_errors=False)
        decode_leases = engines[1].scheduler._producer.num_leased
    finally:
        for engine in engines:
            engine.shutdown()
    assert turns[0][1].errors == []
    errors = turns[1][1].errors
    assert len(errors) == 1 and "KV load failed" in errors[0], errors
    assert "no longer held" in errors[0], errors
    assert decode_leases == 0, "the unsaved hold still holds its blocks"
