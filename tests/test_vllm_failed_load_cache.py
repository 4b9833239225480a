"""A failed load leaves nothing in vLLM 0.33's prefix cache (issue 30 item 6).

Through the real Scheduler (FakeNixl on the CPU): a load whose READs may have written decode's
blocks and which then fails, its READ failing or its lease proof refusing it after the READs
landed, is reported by request (failed_recving) and by block (get_block_ids_with_load_errors:
exactly the load's local blocks). Under ``fail`` and under ``recompute`` none of those blocks is
cached when the failure is reported, and a later plain request with the same prompt hits
nothing (``fail``) or only the blocks the recompute itself filled (``recompute``). The other
direction too: a prefill whose pull from a decode hold fails. A cache of several groups gets no
block ids (vLLM's scheduler refuses them there) and keeps serving.
"""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

if importlib.util.find_spec("vllm") is None and not os.environ.get("NIXL_PD_REQUIRE_VLLM"):
    pytest.skip(
        "vllm is not installed (scripts/install_vllm.sh); CI sets NIXL_PD_REQUIRE_VLLM",
        allow_module_level=True,
    )

from connector.vllm.worker import load_error_block_ids  # noqa: E402
from tests import vllm_harness as h  # noqa: E402

pytestmark = pytest.mark.vllm

BLOCK_SIZE = 16
NUM_TOKENS = 3 * BLOCK_SIZE
PROMPT = list(range(1, NUM_TOKENS + 1))  # what prefill_for_decode sends
EDITED = [*PROMPT[:5], 999, *PROMPT[6:]]  # the same length, one token differs
MULTI_TURN = {"bidirectional_kv_xfer": True, "kv_recompute_threshold": 0}
POLICIES = ("fail", "recompute")
EXPECTED_FINISH = {"fail": "error", "recompute": "length"}

Make = Callable[..., tuple[h.Engine, h.Engine]]


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Any:
    return h.model_config(h.write_tiny_model(Path(tmp_path_factory.mktemp("tiny-llama"))))


@pytest.fixture
def make_pair(model: Any, monkeypatch: pytest.MonkeyPatch) -> Iterator[Make]:
    built: list[h.Engine] = []

    def make(
        policy: str,
        *,
        extra: dict[str, Any] | None = None,
        window: int | None = None,
        decode_tp_size: int = 1,
    ) -> tuple[h.Engine, h.Engine]:
        roles = (("prefill", "kv_producer", 1), ("decode", "kv_consumer", decode_tp_size))
        for name, role, tp_size in roles:
            config = h.vllm_config(
                model, kv_role=role, failure_policy=policy, extra_config=extra, tp_size=tp_size
            )
            cache = h.kv_cache_config(
                block_size=BLOCK_SIZE, num_blocks=64, window=window, tp_size=tp_size
            )
            built.append(h.build_engine(name, config, cache, port=h.free_port(), env=monkeypatch))
        return built[-2], built[-1]

    yield make
    for engine in built:
        engine.shutdown()


def _run_together(first: h.Engine, second: h.Engine, done: Callable[[], bool]) -> None:
    def stepped(engine: h.Engine) -> bool:
        second.step()
        return done()

    first.run_until(stepped)


def _read(
    reader: h.Engine, holder: h.Engine, request_id: str, params: dict[str, Any], prompt: list[int]
) -> Any:
    reader.add(
        h.make_request(
            request_id,
            len(prompt),
            block_size=BLOCK_SIZE,
            kv_transfer_params=params,
            max_tokens=2,
            token_ids=prompt,
        )
    )
    _run_together(reader, holder, lambda: reader.finished(request_id) is not None)
    return reader.finished(request_id)


def _load_of(engine: h.Engine, request_id: str) -> set[int]:
    """The local blocks of the one LoadSpec ``request_id`` got on ``engine``."""
    (load,) = [spec for spec in engine.load_specs if spec.request_id == request_id]
    return {block for group in load.local_block_ids for block in group}


def _cached(engine: h.Engine, block_ids: set[int]) -> set[int]:
    """Which of ``block_ids`` vLLM's block pool holds under a prefix-cache hash now."""
    pool = engine.scheduler.kv_cache_manager.block_pool
    return {block for block in block_ids if pool.blocks[block].block_hash is not None}


def _prefix_hit_tokens(engine: h.Engine, prompt: list[int]) -> int:
    """The tokens a new plain request with ``prompt`` would take from the prefix cache."""
    probe = h.make_request("probe", len(prompt), block_size=BLOCK_SIZE, token_ids=prompt)
    _, num_hit_tokens, *_ = engine.scheduler.kv_cache_manager.get_computed_blocks(probe)
    return int(num_hit_tokens)


def _assert_nothing_of_it_cached(
    reader: h.Engine,
    holder: h.Engine,
    request_id: str,
    prompt: list[int],
    policy: str,
    num_hit_before: int = 0,
) -> None:
    """The failed load's blocks were reported invalid, exactly; a later plain request hits
    what the reader had cached before the load (``num_hit_before`` tokens) and no more
    (``fail``), or what a recompute filled itself (``recompute``)."""
    loaded = _load_of(reader, request_id)
    assert loaded, "the load had no local blocks: nothing to check"
    assert set().union(*reader.invalid_block_ids) == loaded
    if policy == "fail":
        assert not _cached(reader, loaded)
        assert _prefix_hit_tokens(reader, prompt) == num_hit_before
    else:  # recompute: vLLM computed the prompt itself and cached what it computed (a hit
        # stops short of the last prompt token, so whole blocks of the first len - 1)
        assert _prefix_hit_tokens(reader, prompt) == (len(prompt) - 1) // BLOCK_SIZE * BLOCK_SIZE
    plain = f"{request_id}-plain"
    reader.add(h.make_request(plain, len(prompt), block_size=BLOCK_SIZE, token_ids=prompt))
    _run_together(reader, holder, lambda: reader.finished(plain) is not None)
    assert str(reader.finished(plain).finish_reason) == "length"


def _invalid_when_reported(engine: h.Engine) -> Callable[[], None]:
    """Wrap ``engine.step`` so that, in the step whose output reports invalid blocks, no such
    block is cached once vLLM took that output (the moment a hit could first happen)."""
    plain_step = engine.step
    seen: list[set[int]] = []

    def step() -> list[Any]:
        before = len(engine.invalid_block_ids)
        outputs = plain_step()
        for reported in engine.invalid_block_ids[before:]:
            seen.append(_cached(engine, reported))
        return outputs

    engine.step = step  # type: ignore[method-assign]

    def check() -> None:
        assert seen, "no step reported invalid blocks"
        assert all(not cached for cached in seen), f"cached when reported: {seen}"

    return check


@pytest.mark.parametrize("policy", POLICIES)
def test_a_read_that_fails_leaves_its_blocks_invalid_and_uncached(
    make_pair: Make, policy: str
) -> None:
    prefill, decode = make_pair(policy)
    params = h.prefill_for_decode(prefill, "p", NUM_TOKENS, block_size=BLOCK_SIZE)
    for agent in decode.agents:
        agent.faults.fail_transfers = 1
    check_when_reported = _invalid_when_reported(decode)
    output = _read(decode, prefill, "d", params, PROMPT)
    assert str(output.finish_reason) == EXPECTED_FINISH[policy]
    assert decode.stats["loads_failed"] == 1
    check_when_reported()
    _assert_nothing_of_it_cached(decode, prefill, "d", PROMPT, policy)


@pytest.mark.parametrize("policy", POLICIES)
def test_a_proof_that_fails_after_the_reads_leaves_nothing_cached(
    make_pair: Make, policy: str
) -> None:
    """Prefill's side channel answered a check moments ago (the good load), so the next load
    posts its READs at once; the check after them finds the lease held for other tokens."""
    prefill, decode = make_pair(policy)
    good = h.prefill_for_decode(prefill, "p-good", NUM_TOKENS, block_size=BLOCK_SIZE)
    assert str(_read(decode, prefill, "d-good", good, PROMPT).finish_reason) == "length"
    params = h.prefill_for_decode(prefill, "p", NUM_TOKENS, block_size=BLOCK_SIZE)
    posted = sum(agent.num_posted for agent in decode.agents)
    check_when_reported = _invalid_when_reported(decode)
    output = _read(decode, prefill, "d", params, EDITED)
    assert sum(agent.num_posted for agent in decode.agents) > posted, "no READ was posted"
    assert str(output.finish_reason) == EXPECTED_FINISH[policy]
    assert decode.stats["loads_failed"] == 1
    check_when_reported()
    _assert_nothing_of_it_cached(decode, prefill, "d", EDITED, policy)


@pytest.mark.parametrize("policy", POLICIES)
def test_a_pull_from_a_decode_hold_that_fails_leaves_nothing_cached_on_prefill(
    make_pair: Make, policy: str
) -> None:
    """Multi-turn: turn 2's prefill pulls turn 1's history from decode with an edited history;
    prefill must not cache (and then lease to decode) what its pull read."""
    prefill, decode = make_pair(policy, extra=MULTI_TURN)
    params = h.prefill_for_decode(prefill, "t1", NUM_TOKENS, block_size=BLOCK_SIZE)
    output = _read(decode, prefill, "t1", params, PROMPT)
    held = output.kv_transfer_params
    assert held is not None and held["remote_num_tokens"] > NUM_TOKENS
    history = PROMPT + [h.SAMPLED_TOKEN] * 2
    edited = [*history[:NUM_TOKENS], 999, *history[NUM_TOKENS + 1 :]]  # the answer edited
    prompt = [*edited, *range(100, 100 + BLOCK_SIZE)]
    for agent in prefill.agents:  # the pull's READ fails if the proof did not fail it first
        agent.faults.fail_transfers = 1
    num_hit_before = _prefix_hit_tokens(prefill, prompt)  # turn 1's prompt, prefill's own
    check_when_reported = _invalid_when_reported(prefill)
    turn = _read(prefill, decode, "t2", dict(held), prompt)
    assert str(turn.finish_reason) == EXPECTED_FINISH[policy]
    assert prefill.stats["loads_failed"] == 1
    check_when_reported()
    _assert_nothing_of_it_cached(prefill, decode, "t2", prompt, policy, num_hit_before)


@pytest.mark.parametrize("policy", POLICIES)
def test_one_rank_failing_before_the_other_finishes(make_pair: Make, policy: str) -> None:
    """TP 2: rank 0's READ fails at once while rank 1's still reads, so vLLM hears of the
    invalid blocks steps before the request's failure (that waits for every rank): under
    ``fail`` it ends the request then, under ``recompute`` it drops its computed tokens and
    waits. Either way none of those blocks is cached, and both engines get every block back
    once rank 1's READ ended (vLLM frees nothing under a live READ)."""
    prefill, decode = make_pair(policy, decode_tp_size=2)
    free_blocks = decode.num_free_blocks()
    prefill_free_blocks = prefill.num_free_blocks()
    params = h.prefill_for_decode(prefill, "p", NUM_TOKENS, block_size=BLOCK_SIZE)
    decode.agents[0].faults.fail_transfers = 1
    decode.agents[1].faults.stall_polls = 200
    check_when_reported = _invalid_when_reported(decode)
    output = _read(decode, prefill, "d", params, PROMPT)
    assert str(output.finish_reason) == EXPECTED_FINISH[policy]
    check_when_reported()
    _assert_nothing_of_it_cached(decode, prefill, "d", PROMPT, policy)
    decode.agents[1].faults.stall_polls = 0
    _run_together(
        decode,
        prefill,
        lambda: (
            decode.num_free_blocks() == free_blocks
            and prefill.num_free_blocks() == prefill_free_blocks
        ),
    )


def test_a_cache_of_several_groups_reports_no_block_ids_and_keeps_serving(
    make_pair: Make,
) -> None:
    """vLLM's scheduler raises on invalid block ids in a cache of several groups: there the
    request alone is reported, and the engine serves the next request."""
    prefill, decode = make_pair("fail", window=BLOCK_SIZE)
    params = h.prefill_for_decode(prefill, "p", NUM_TOKENS, block_size=BLOCK_SIZE)
    for agent in decode.agents:
        agent.faults.fail_transfers = 1
    assert str(_read(decode, prefill, "d", params, PROMPT).finish_reason) == "error"
    assert decode.invalid_block_ids == []
    params = h.prefill_for_decode(prefill, "p2", NUM_TOKENS, block_size=BLOCK_SIZE)
    assert str(_read(decode, prefill, "d2", params, PROMPT).finish_reason) == "length"


@pytest.mark.parametrize(
    ("failed", "num_cache_groups", "expected"),
    [
        (["a"], 1, {3, 4}),
        (["a", "b"], 1, {3, 4, 9}),
        (["gone"], 1, set()),
        (["a"], 2, set()),
    ],
    ids=[
        "one-failed-load-its-blocks",
        "two-failed-loads-all-their-blocks",
        "a-load-this-rank-never-ran-names-none",
        "several-cache-groups-name-none",
    ],
)
def test_load_error_block_ids(failed: list[str], num_cache_groups: int, expected: set[int]) -> None:
    loads = {"a": ((3, 4),), "b": ((9,),), "c": ((11,),)}
    assert load_error_block_ids(loads, failed, num_cache_groups) == expected
