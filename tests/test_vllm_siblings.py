"""Requests that carry the same kv_transfer_params inside vLLM 0.33's real Scheduler (FakeNixl).

vLLM fans an ``n > 1`` request out into children with the parent's params, and clients or
routers may resend params. One load reads a lease; the others wait for it, then compute
locally what decode's prefix cache does not hold (scheduler/requests.py SiblingLoads). Before, each
child loaded the same lease, and whichever proof came after the first load's free
notification failed ``lease``: a good request answered with an error (CI, ``n=2``). Params
resent after their load are not waited for: they load, and their proof decides.
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
NUM_TOKENS = 3 * BLOCK_SIZE + 5  # three full blocks and a partial one
CHILDREN = ("0_req", "1_req")  # vLLM's ids for an n=2 request's children


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Any:
    return h.model_config(h.write_tiny_model(Path(tmp_path_factory.mktemp("tiny-llama"))))


@pytest.fixture
def pair(model: Any, monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[h.Engine, h.Engine]]:
    engines = h.build_pair(model, monkeypatch, failure_policy="fail", extra_config={})
    yield engines
    for engine in engines:
        engine.shutdown()


def _child(request_id: str, params: dict[str, Any]) -> Any:
    return h.make_request(
        request_id, NUM_TOKENS, block_size=BLOCK_SIZE, kv_transfer_params=dict(params)
    )


def _both_until(decode: h.Engine, prefill: h.Engine, done: Any) -> None:
    def stepped(engine: h.Engine) -> bool:
        prefill.step()
        return bool(done())

    decode.run_until(stepped)


def _all_finished(decode: h.Engine, request_ids: tuple[str, ...]) -> bool:
    return all(decode.finished(request_id) is not None for request_id in request_ids)


def _assert_answered(decode: h.Engine, request_ids: tuple[str, ...]) -> None:
    reasons = {rid: str(decode.finished(rid).finish_reason) for rid in request_ids}
    assert reasons == dict.fromkeys(request_ids, "length"), reasons
    assert decode.stats.get("loads_failed", 0) == 0


def _second_child_during_the_first_read(prefill: h.Engine, decode: h.Engine) -> Any:
    """Prefill a prompt; decode's first child posts its READ (held in flight for 5 polls),
    then the second child arrives. Returns decode's agent."""
    params = h.prefill_for_decode(prefill, "req", NUM_TOKENS, block_size=BLOCK_SIZE)
    (agent,) = decode.agents
    agent.faults.stall_polls = 5
    decode.add(_child("0_req", params))
    decode.run_until(lambda e: agent.num_posted == 1)
    decode.add(_child("1_req", params))
    return agent


def _local_hit(decode: h.Engine, request_id: str) -> int:
    """The tokens vLLM found in decode's own prefix cache for the request."""
    stats = [o.prefill_stats for o in decode.outputs if o.request_id == request_id]
    return max(s.num_local_cached_tokens for s in stats if s is not None)


def _freed_on_both_sides(
    decode: h.Engine, prefill: h.Engine, free_decode: int, free_prefill: int
) -> None:
    _both_until(
        decode,
        prefill,
        lambda: (
            decode.num_free_blocks() == free_decode and prefill.num_free_blocks() == free_prefill
        ),
    )


def test_children_added_together_load_once_and_all_answer(
    pair: tuple[h.Engine, h.Engine],
) -> None:
    prefill, decode = pair
    free_prefill, free_decode = prefill.num_free_blocks(), decode.num_free_blocks()
    params = h.prefill_for_decode(prefill, "req", NUM_TOKENS, block_size=BLOCK_SIZE)
    for request_id in CHILDREN:
        decode.add(_child(request_id, params))
    _both_until(decode, prefill, lambda: _all_finished(decode, CHILDREN))
    _assert_answered(decode, CHILDREN)
    assert decode.stats.get("loads_finished") == 1  # one READ of the lease
    # The second child found the first one's loaded blocks in decode's prefix cache.
    assert _local_hit(decode, "1_req") == 3 * BLOCK_SIZE
    _freed_on_both_sides(decode, prefill, free_decode, free_prefill)


def test_a_child_arriving_during_the_first_read_waits_instead_of_failing(
    pair: tuple[h.Engine, h.Engine],
) -> None:
    prefill, decode = pair
    free_prefill, free_decode = prefill.num_free_blocks(), decode.num_free_blocks()
    agent = _second_child_during_the_first_read(prefill, decode)
    _both_until(decode, prefill, lambda: _all_finished(decode, CHILDREN))
    _assert_answered(decode, CHILDREN)
    assert agent.num_posted == 1  # the second child read nothing
    _freed_on_both_sides(decode, prefill, free_decode, free_prefill)


def test_params_resent_after_their_load_fail_through_the_policy(
    pair: tuple[h.Engine, h.Engine],
) -> None:
    """Waiting is for requests that arrive while the lease is read (n > 1 children); params
    resent once their lease is gone load, fail their proof and vLLM's policy decides."""
    prefill, decode = pair
    free_prefill = prefill.num_free_blocks()
    params = h.prefill_for_decode(prefill, "req", NUM_TOKENS, block_size=BLOCK_SIZE)
    decode.add(_child("first", params))
    _both_until(
        decode,
        prefill,
        lambda: decode.finished("first") is not None and prefill.num_free_blocks() == free_prefill,
    )
    decode.add(_child("resent", params))
    _both_until(decode, prefill, lambda: decode.finished("resent") is not None)
    assert str(decode.finished("resent").finish_reason) == "error"  # failure_policy "fail"
    assert decode.stats.get("loads_failed") == 1


def test_aborting_a_waiting_child_leaves_the_first_ones_lease_alone(
    pair: tuple[h.Engine, h.Engine],
) -> None:
    prefill, decode = pair
    free_prefill, free_decode = prefill.num_free_blocks(), decode.num_free_blocks()
    _second_child_during_the_first_read(prefill, decode)
    decode.step()  # the second child is asked, and waits
    decode.scheduler.finish_requests("1_req", RequestStatus.FINISHED_ABORTED)
    _both_until(decode, prefill, lambda: decode.finished("0_req") is not None)
    _assert_answered(decode, ("0_req",))
    _freed_on_both_sides(decode, prefill, free_decode, free_prefill)
