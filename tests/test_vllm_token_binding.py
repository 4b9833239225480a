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

from vllm.lora.request import LoRARequest  # noqa: E402
from vllm.multimodal.inputs import MultiModalFeatureSpec, PlaceholderRange  # noqa: E402

from connector.observability.metrics import LOADS_FAILED, PULLED_TOKENS, default_recorder  # noqa: E402
from connector.vllm.scheduler import kv_salt  # noqa: E402
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
    engines = h.build_pair(
        model, monkeypatch, failure_policy="recompute", extra_config=MODE, block_size=BLOCK_SIZE
    )
    yield engines
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


# ---- KV that depends on more than the ids: cache salt, LoRA, multimodal inputs -----------

LORA_X = LoRARequest("adapter-x", 1, "/adapters/x")
LORA_X_ELSEWHERE = LoRARequest("adapter-x", 7, "/mnt/other/x")  # one adapter, another path
LORA_Y = LoRARequest("adapter-y", 2, "/adapters/y")
SALTED = {
    "same-cache-salt-loads": ({"cache_salt": "a"}, {"cache_salt": "a"}, True),
    "another-cache-salt-fails": ({"cache_salt": "a"}, {"cache_salt": "b"}, False),
    "a-salt-only-on-decode-fails": ({}, {"cache_salt": "b"}, False),
    "same-lora-loads": ({"lora_request": LORA_X}, {"lora_request": LORA_X_ELSEWHERE}, True),
    "another-lora-fails": ({"lora_request": LORA_X}, {"lora_request": LORA_Y}, False),
    "a-lora-only-on-prefill-fails": ({"lora_request": LORA_X}, {}, False),
}


@pytest.mark.parametrize(("on_prefill", "on_decode", "loads"), SALTED.values(), ids=SALTED)
def test_decode_loads_only_kv_made_with_its_own_salt_and_adapter(
    pair: tuple[h.Engine, h.Engine],
    on_prefill: dict[str, Any],
    on_decode: dict[str, Any],
    loads: bool,
) -> None:
    """The same ids under another cache salt or LoRA adapter have other KV: both sides bind
    them into the lease's token digest, and a mismatch fails the load before any READ."""
    prefill, decode = pair
    prefill.add(h.make_request("p", len(PROMPT), block_size=BLOCK_SIZE, max_tokens=1,
                               kv_transfer_params={"do_remote_decode": True}, **on_prefill))  # fmt: skip
    prefill.run_until(lambda e: e.finished("p") is not None)
    params = dict(prefill.finished("p").kv_transfer_params)
    before = _failed_tokens_mismatch()
    decode.add(h.make_request("d", len(PROMPT), block_size=BLOCK_SIZE, max_tokens=2,
                              kv_transfer_params=params, **on_decode))  # fmt: skip
    _both_until(decode, prefill, lambda: decode.finished("d") is not None)
    if loads:
        assert decode.stats.get("loads_finished") == 1 and not decode.stats.get("loads_failed")
        assert sum(agent.num_posted for agent in decode.agents) > 0
    else:
        assert decode.stats.get("loads_failed") == 1 and not decode.stats.get("loads_finished")
        assert _failed_tokens_mismatch() - before == 1
        assert sum(agent.num_posted for agent in decode.agents) == 0


def test_a_next_turn_under_another_cache_salt_does_not_pull_the_held_turn(
    pair: tuple[h.Engine, h.Engine],
) -> None:
    """D->P: decode's hold is bound to its request's salt like prefill's lease."""
    prefill, decode = pair
    prefill.add(h.make_request("t1", len(PROMPT), block_size=BLOCK_SIZE, max_tokens=1,
                               kv_transfer_params={"do_remote_decode": True}, cache_salt="a"))  # fmt: skip
    prefill.run_until(lambda e: e.finished("t1") is not None)
    decode.add(h.make_request("t1", len(PROMPT), block_size=BLOCK_SIZE, max_tokens=ANSWER_TOKENS,
                              kv_transfer_params=dict(prefill.finished("t1").kv_transfer_params),
                              cache_salt="a"))  # fmt: skip
    _both_until(decode, prefill, lambda: decode.finished("t1") is not None)
    held = decode.finished("t1").kv_transfer_params
    assert held is not None
    prompt = PROMPT + [h.SAMPLED_TOKEN] * ANSWER_TOKENS + list(range(100, 100 + BLOCK_SIZE))
    before = _failed_tokens_mismatch()
    prefill.add(h.make_request("t2", len(prompt), block_size=BLOCK_SIZE, max_tokens=1,
                               kv_transfer_params=dict(held), token_ids=prompt, cache_salt="b"))  # fmt: skip
    _both_until(prefill, decode, lambda: prefill.finished("t2") is not None)
    assert prefill.stats.get("loads_failed") == 1
    assert _failed_tokens_mismatch() - before == 1


def test_each_multimodal_item_is_named_from_its_placeholder_on() -> None:
    """Images are not in the ids (their placeholders are): each item's hash and length bind
    the KV from its offset on, so only a reader whose prefix reaches an item digests it."""
    image = MultiModalFeatureSpec(
        data=None, modality="image", identifier="img-hash", mm_position=PlaceholderRange(5, 4)
    )
    request = h.make_request("mm", 12, block_size=BLOCK_SIZE, mm_features=[image],
                             cache_salt="s", lora_request=LORA_X)  # fmt: skip
    assert kv_salt(request) == (
        (0, b"lora\0adapter-x"),
        (0, b"cache_salt\0s"),
        (5, b"mm\0img-hash\x004"),
    )
    assert kv_salt(h.make_request("plain", 12, block_size=BLOCK_SIZE)) == ()
