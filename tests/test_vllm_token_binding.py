"""Leases bound to tokens inside vLLM 0.33's real Scheduler (FakeNixl on the CPU).

The adapter hands the connector vLLM's token ids: prefill's lease is bound to the prompt it
leased, decode's hold to prompt + answer. A reader whose prompt is not what those blocks hold
fails its load before any READ with ``tokens mismatch``, and vLLM's kv_load_failure_policy
(``recompute`` here) computes the request itself: both directions, P->D and D->P.
"""

from __future__ import annotations

import importlib.util
import logging
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

if importlib.util.find_spec("vllm") is None and not os.environ.get("NIXL_PD_REQUIRE_VLLM"):
    pytest.skip(
        "vllm is not installed (scripts/install_vllm.sh); CI sets NIXL_PD_REQUIRE_VLLM",
        allow_module_level=True,
    )

from connector.observability.metrics import LOADS_FAILED, PULLED_TOKENS, default_recorder  # noqa: E402
from tests import vllm_harness as h  # noqa: E402

pytestmark = pytest.mark.vllm

BLOCK_SIZE = 16
PROMPT = list(range(1, 2 * BLOCK_SIZE + 1))  # what prefill_for_decode sends: 1..32
ANSWER_TOKENS = BLOCK_SIZE + 1
MODE = {"bidirectional_kv_xfer": True, "kv_recompute_threshold": 0}


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Any:
    return h.model_config(h.write_tiny_model(Path(tmp_path_factory.mktemp("tiny-llama"))))


@pytest.fixture
def pair(model: Any, monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[h.Engine, h.Engine]]:
    engines = []
    for name, role in (("prefill", "kv_producer"), ("decode", "kv_consumer")):
        config = h.vllm_config(model, kv_role=role, failure_policy="recompute", extra_config=MODE)
        cache = h.kv_cache_config(block_size=BLOCK_SIZE, num_blocks=64)
        engines.append(h.build_engine(name, config, cache, port=h.free_port(), env=monkeypatch))
    yield engines[0], engines[1]
    for engine in engines:
        engine.shutdown()


def _failed_tokens_mismatch() -> int:
    counters = default_recorder().snapshot().counters
    return counters.get(LOADS_FAILED.name, {}).get("tokens_mismatch", 0)


def _pulled_tokens() -> int:
    return default_recorder().snapshot().counters.get(PULLED_TOKENS.name, {}).get("", 0)


def _decode(decode: h.Engine, request_id: str, params: dict[str, Any], prompt: list[int]) -> None:
    request = h.make_request(
        request_id,
        len(prompt),
        block_size=BLOCK_SIZE,
        kv_transfer_params=params,
        max_tokens=ANSWER_TOKENS,
        token_ids=prompt,
    )
    decode.add(request)


def _both_until(first: h.Engine, second: h.Engine, done: Any) -> None:
    def stepped(engine: h.Engine) -> bool:
        second.step()
        return bool(done())

    first.run_until(stepped)


def test_decode_with_params_of_another_prompt_recomputes_without_reading(
    pair: tuple[h.Engine, h.Engine], caplog: pytest.LogCaptureFixture
) -> None:
    prefill, decode = pair
    params = h.prefill_for_decode(prefill, "p", len(PROMPT), block_size=BLOCK_SIZE)
    edited = [*PROMPT[:5], 999, *PROMPT[6:]]  # the same length; one token differs
    before = _failed_tokens_mismatch()
    with caplog.at_level(logging.WARNING):
        _decode(decode, "d", params, edited)
        _both_until(decode, prefill, lambda: decode.finished("d") is not None)
    assert decode.stats.get("loads_failed") == 1 and decode.stats.get("loads_finished", 0) == 0
    assert _failed_tokens_mismatch() - before == 1
    assert "tokens mismatch: prefill engine" in caplog.text
    assert sum(agent.num_posted for agent in decode.agents) == 0
    # The same params with the prompt they were made for load over NIXL.
    params = h.prefill_for_decode(prefill, "p2", len(PROMPT), block_size=BLOCK_SIZE)
    _decode(decode, "d2", params, PROMPT)
    _both_until(decode, prefill, lambda: decode.finished("d2") is not None)
    assert decode.stats.get("loads_finished") == 1
    assert sum(agent.num_posted for agent in decode.agents) > 0


def test_a_next_turn_with_an_edited_history_does_not_pull_it(
    pair: tuple[h.Engine, h.Engine],
) -> None:
    prefill, decode = pair
    params = h.prefill_for_decode(prefill, "t1", len(PROMPT), block_size=BLOCK_SIZE)
    _decode(decode, "t1", params, PROMPT)
    _both_until(decode, prefill, lambda: decode.finished("t1") is not None)
    held = decode.finished("t1").kv_transfer_params
    assert held is not None and held["remote_num_tokens"] == len(PROMPT) + ANSWER_TOKENS - 1
    history = PROMPT + [h.SAMPLED_TOKEN] * ANSWER_TOKENS
    edited = [*history[: len(PROMPT) + 3], 999, *history[len(PROMPT) + 4 :]]  # the answer
    prompt = edited + list(range(100, 100 + BLOCK_SIZE))
    pulled, before = _pulled_tokens(), _failed_tokens_mismatch()
    posted = sum(agent.num_posted for agent in prefill.agents)
    request = h.make_request(
        "t2",
        len(prompt),
        block_size=BLOCK_SIZE,
        kv_transfer_params=dict(held),
        max_tokens=1,
        token_ids=prompt,
    )
    prefill.add(request)
    _both_until(prefill, decode, lambda: prefill.finished("t2") is not None)
    assert prefill.finished("t2").new_token_ids == [h.SAMPLED_TOKEN]  # computed: recompute
    assert prefill.stats.get("loads_failed") == 1
    assert _failed_tokens_mismatch() - before == 1 and _pulled_tokens() == pulled
    assert sum(agent.num_posted for agent in prefill.agents) == posted
