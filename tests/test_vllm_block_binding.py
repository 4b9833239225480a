"""Leases bound to their blocks inside vLLM 0.33's real Scheduler (FakeNixl on the CPU).

Params that keep a lease's request id, lease id, boot id and tokens but name another
request's ``remote_block_ids`` fail the load with ``blocks mismatch`` (reported through
``failed_recving``; ``kv_load_failure_policy: fail`` ends the request with an error), in both
directions: P->D, and a next turn's pull of another conversation's blocks. The controls load.
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

from vllm.v1.engine import FinishReason  # noqa: E402

from connector.observability.metrics import LOADS_FAILED, default_recorder  # noqa: E402
from tests import vllm_harness as h  # noqa: E402

pytestmark = pytest.mark.vllm

BLOCK_SIZE = 16
NUM_TOKENS = 2 * BLOCK_SIZE
ANSWER_TOKENS = BLOCK_SIZE + 1
MODE = {"bidirectional_kv_xfer": True, "kv_recompute_threshold": 0}


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Any:
    return h.model_config(h.write_tiny_model(Path(tmp_path_factory.mktemp("tiny-llama"))))


@pytest.fixture
def pair(model: Any, monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[h.Engine, h.Engine]]:
    engines = h.build_pair(
        model, monkeypatch, failure_policy="fail", extra_config=MODE, block_size=BLOCK_SIZE
    )
    yield engines
    for engine in engines:
        engine.shutdown()


def _failed_blocks_mismatch() -> int:
    counters = default_recorder().snapshot().counters
    return counters.get(LOADS_FAILED.name, {}).get("blocks_mismatch", 0)


def _prompt(first_token: int) -> list[int]:
    return list(range(first_token, first_token + NUM_TOKENS))


def _prefilled(prefill: h.Engine, request_id: str, prompt: list[int]) -> dict[str, Any]:
    """``prompt`` prefilled for a decode engine: the params prefill returns."""
    prefill.add(
        h.make_request(
            request_id,
            len(prompt),
            block_size=BLOCK_SIZE,
            kv_transfer_params={"do_remote_decode": True},
            max_tokens=1,
            token_ids=prompt,
        )
    )
    prefill.run_until(lambda engine: engine.finished(request_id) is not None)
    params = prefill.finished(request_id).kv_transfer_params
    assert params is not None
    return dict(params)


def _finish(
    engine: h.Engine, other: h.Engine, request_id: str, prompt: list[int], params: dict[str, Any],
    max_tokens: int = ANSWER_TOKENS,
) -> Any:  # fmt: skip
    engine.add(
        h.make_request(
            request_id,
            len(prompt),
            block_size=BLOCK_SIZE,
            kv_transfer_params=params,
            max_tokens=max_tokens,
            token_ids=prompt,
        )
    )

    def ended(_: h.Engine) -> bool:
        other.step()
        return engine.finished(request_id) is not None

    engine.run_until(ended, timeout_s=20.0)
    return engine.finished(request_id)


def test_decode_given_another_requests_blocks_fails_the_load(
    pair: tuple[h.Engine, h.Engine], caplog: pytest.LogCaptureFixture
) -> None:
    prefill, decode = pair
    a_prompt, b_prompt = _prompt(1), _prompt(101)
    a, b = _prefilled(prefill, "pa", a_prompt), _prefilled(prefill, "pb", b_prompt)
    assert a["remote_block_ids"] != b["remote_block_ids"]
    swapped = {**a, "remote_block_ids": b["remote_block_ids"]}
    before = _failed_blocks_mismatch()
    with caplog.at_level(logging.WARNING):
        failed = _finish(decode, prefill, "da", a_prompt, swapped)
    assert failed.finish_reason == FinishReason.ERROR
    assert decode.stats.get("loads_failed") == 1 and decode.stats.get("loads_finished", 0) == 0
    assert _failed_blocks_mismatch() - before == 1
    assert "blocks mismatch: prefill engine" in caplog.text
    # The control: B's own params load over NIXL (A's refused reader ended nothing of B's).
    good = _finish(decode, prefill, "db", b_prompt, b)
    assert good.finish_reason == FinishReason.LENGTH
    assert decode.stats.get("loads_finished") == 1


def test_a_next_turn_given_another_conversations_blocks_fails_the_pull(
    pair: tuple[h.Engine, h.Engine],
) -> None:
    prefill, decode = pair
    held: dict[str, dict[str, Any]] = {}
    histories: dict[str, list[int]] = {}
    for conversation, first_token in (("c1", 1), ("c2", 101)):
        prompt = _prompt(first_token)
        params = _prefilled(prefill, f"{conversation}-p1", prompt)
        turn1 = _finish(decode, prefill, f"{conversation}-t1", prompt, params)
        assert turn1.finish_reason == FinishReason.LENGTH and turn1.kv_transfer_params
        held[conversation] = dict(turn1.kv_transfer_params)
        histories[conversation] = prompt + [h.SAMPLED_TOKEN] * ANSWER_TOKENS
    assert held["c1"]["remote_num_tokens"] == held["c2"]["remote_num_tokens"]
    assert held["c1"]["remote_block_ids"] != held["c2"]["remote_block_ids"]
    swapped = {**held["c1"], "remote_block_ids": held["c2"]["remote_block_ids"]}
    before = _failed_blocks_mismatch()
    new_message = list(range(200, 200 + BLOCK_SIZE))
    failed = _finish(prefill, decode, "c1-t2", histories["c1"] + new_message, swapped, 1)
    assert failed.finish_reason == FinishReason.ERROR
    assert _failed_blocks_mismatch() - before == 1
    # The control: c2's next turn with its own params pulls its history.
    pulled = _finish(prefill, decode, "c2-t2", histories["c2"] + new_message, held["c2"], 1)
    assert pulled.finish_reason == FinishReason.LENGTH
    assert _failed_blocks_mismatch() - before == 1
