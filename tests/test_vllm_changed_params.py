"""Params that change between vLLM's first ask and allocation fail the request, never park it.

The adapter claims a decode request's tokens at vLLM's first ask, on the word of a dict saying
``do_remote_prefill: true``, and reads the params at allocation. If something edits the dict
in between (another connector in a MultiConnector, a plugin), vLLM has parked the request
waiting for remote KV that no load will bring: it must fail, through vLLM's
kv_load_failure_policy, instead of waiting forever (issue 19). Driven through vLLM 0.33's real
Scheduler: the first allocation fails for want of blocks, the params change, the retry
allocates.
"""

from __future__ import annotations

import importlib.util
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

from vllm.v1.request import RequestStatus  # noqa: E402

from tests import vllm_harness as h  # noqa: E402

pytestmark = pytest.mark.vllm

BLOCK_SIZE = 16
NUM_BLOCKS = 9  # block 0 is vLLM's null block: 8 usable
HOG_TOKENS = 7 * BLOCK_SIZE - 4  # 7 blocks: too few left for the decode request's 3
NUM_TOKENS = 3 * BLOCK_SIZE
CLAIMING_PARAMS: dict[str, Any] = {
    "do_remote_prefill": True,
    "remote_engine_id": "prefill-x",
    "remote_request_id": "cmpl-1",
    "remote_block_ids": [[1, 2, 3]],
    "remote_host": "127.0.0.1",
    "remote_port": 9,
}


@pytest.fixture
def make_decode(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    model = h.model_config(h.write_tiny_model(tmp_path))
    engines: list[h.Engine] = []

    def make(policy: str) -> h.Engine:
        config = h.vllm_config(model, kv_role="kv_consumer", failure_policy=policy)
        cache = h.kv_cache_config(block_size=BLOCK_SIZE, num_blocks=NUM_BLOCKS)
        engine = h.build_engine("decode", config, cache, port=h.free_port(), env=monkeypatch)
        engines.append(engine)
        return engine

    yield make
    for engine in engines:
        engine.shutdown()


@pytest.mark.parametrize(
    "changed_to",
    [{"do_remote_prefill": False}, {**CLAIMING_PARAMS, "do_remote_prefill": False}],
    ids=["flag-cleared", "flag-false-keys-kept"],
)
@pytest.mark.parametrize(
    ("policy", "finish_reason"),
    [("fail", "error"), ("recompute", "length")],
    ids=["fail-policy-errors-it", "recompute-policy-computes-it-locally"],
)
def test_params_changed_after_the_claim_fail_the_request_instead_of_parking_it(
    make_decode: Any, changed_to: Any, policy: str, finish_reason: str
) -> None:
    decode = make_decode(policy)
    free_blocks = decode.num_free_blocks()
    decode.add(h.make_request("hog", HOG_TOKENS, block_size=BLOCK_SIZE, max_tokens=64))
    request = h.make_request(
        "r", NUM_TOKENS, block_size=BLOCK_SIZE, kv_transfer_params=dict(CLAIMING_PARAMS),
        first_token=200,
    )  # fmt: skip
    decode.add(request)
    decode.step()  # the hog runs; "r" is asked about (claimed), its allocation fails
    assert request.status == RequestStatus.WAITING, "the first allocation was meant to fail"

    request.kv_transfer_params = changed_to
    decode.scheduler.finish_requests("hog", RequestStatus.FINISHED_ABORTED)
    decode.run_until(lambda e: e.finished("r") is not None, timeout_s=10)

    assert str(decode.finished("r").finish_reason) == finish_reason
    decode.run_until(lambda e: e.num_free_blocks() == free_blocks)


@pytest.mark.parametrize("policy", ["fail", "recompute"])
def test_params_removed_after_the_claim_are_computed_locally(make_decode: Any, policy: str) -> None:
    """No params at the retry's ask: vLLM is told there is nothing to load, so it never
    parks the request, and computes it (the stale claim must not fail it)."""
    decode = make_decode(policy)
    decode.add(h.make_request("hog", HOG_TOKENS, block_size=BLOCK_SIZE, max_tokens=64))
    request = h.make_request(
        "r", NUM_TOKENS, block_size=BLOCK_SIZE, kv_transfer_params=dict(CLAIMING_PARAMS),
        first_token=200,
    )  # fmt: skip
    decode.add(request)
    decode.step()
    request.kv_transfer_params = None
    decode.scheduler.finish_requests("hog", RequestStatus.FINISHED_ABORTED)
    decode.run_until(lambda e: e.finished("r") is not None, timeout_s=10)
    assert str(decode.finished("r").finish_reason) == "length"
