"""A decode request whose prefill was released never READs prefill's blocks again (#19 item 2).

Through vLLM 0.33's real Scheduler with a hybrid model (a full-attention group and a Mamba
group, prefix caching in mamba_cache_mode 'align' on decode), FakeNixl moving the bytes. With
Mamba, prefill stops one token short (prefill_backoff_tokens = 1): a 33-token prompt is
prefilled to 32 tokens, and decode's own prefix cache (the same prompt run locally first)
covers all 32. vLLM then asks again about the request after:

1. a preemption (vLLM's own _preempt_request, as its schedule() does when a running request
   cannot grow), its cached prefix evicted while it waits;
2. a prefix-cache reset (Scheduler.reset_prefix_cache with reset_running_requests);
3. an allocation that failed for want of blocks and is retried after a running request's
   growth evicted the cached prefix.

Each time the local hit is now smaller (none). Whatever the connector answers, no load may
READ prefill's blocks after prefill was told to free them (prefill may have reused them), and
no load may be reported as received from them. In 1 and 2 prefill was released at
allocation, so vLLM computes the prompt locally; in 3 nothing was allocated yet, so prefill
still holds the KV and the load is legitimate (its bytes are prefill's).
"""

from __future__ import annotations

import importlib.util
import os
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest

if importlib.util.find_spec("vllm") is None and not os.environ.get("NIXL_PD_REQUIRE_VLLM"):
    pytest.skip(
        "vllm is not installed (scripts/install_vllm.sh); CI sets NIXL_PD_REQUIRE_VLLM",
        allow_module_level=True,
    )

import torch  # noqa: E402
from vllm.v1.core.sched.interface import PauseState  # noqa: E402
from vllm.v1.kv_cache_interface import (  # noqa: E402
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    MambaSpec,
)
from vllm.v1.request import RequestStatus  # noqa: E402

from connector.layout import TOKEN_ADDRESSABLE, BlockFormat  # noqa: E402
from tests import vllm_harness as h  # noqa: E402

pytestmark = pytest.mark.vllm

BLOCK_SIZE = 16
MAMBA_STATE = BlockFormat("MAMBA_STATE", token_addressable=False)
FORMATS = [TOKEN_ADDRESSABLE, MAMBA_STATE]  # attention group, Mamba group
NUM_TOKENS = 2 * BLOCK_SIZE + 1  # prefill computes 32; decode's prefix cache hit caps at 32
FULL_HIT = NUM_TOKENS - 1  # everything a load would bring
MAX_TOKENS = 24  # still running when prefill has freed its blocks
# in a roomy pool: still running while the release settles, even on a loaded machine
ROOMY_MAX_TOKENS = 200
ROOMY = 32  # blocks (block 0 is vLLM's null block)
# Tight: after the hog's first chunk (4 attention + 1 state block) only the three blocks of
# the cached prefix are free, too few for the remote request (3 touched + 2 new).
TIGHT = 9
HOG_TOKENS = 4 * BLOCK_SIZE + 1
RELEASE_GRACE_S = 3.0  # a release and its ack take well under a second on FakeNixl


def hybrid_cache(num_blocks: int, *, caching: bool) -> KVCacheConfig:
    full = FullAttentionSpec(
        block_size=BLOCK_SIZE, num_kv_heads=h.MODEL_KV_HEADS, head_size=h.HEAD_SIZE,
        dtype=torch.float32,
    )  # fmt: skip
    mamba = MambaSpec(
        block_size=BLOCK_SIZE,
        shapes=((3, 4), (5,)),
        dtypes=(torch.float32, torch.float32),
        mamba_cache_mode="align" if caching else "none",  # vLLM's Mamba prefix caching
    )
    groups = [KVCacheGroupSpec(["layers.0"], full), KVCacheGroupSpec(["layers.1"], mamba)]
    return KVCacheConfig(
        num_blocks=num_blocks, kv_cache_tensors=[], kv_cache_groups=groups, kv_cache_layout="LBNHC"
    )


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Any:
    return h.model_config(h.write_tiny_model(tmp_path_factory.mktemp("model")))


@pytest.fixture
def engines(model: Any, monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    built: list[h.Engine] = []

    def make(decode_blocks: int) -> tuple[h.Engine, h.Engine]:
        for role, caching, num_blocks in (
            ("kv_producer", False, ROOMY),
            ("kv_consumer", True, decode_blocks),
        ):
            config = h.vllm_config(model, kv_role=role, block_size=BLOCK_SIZE)
            config.scheduler_config.disable_hybrid_kv_cache_manager = False
            config.cache_config.enable_prefix_caching = caching
            config.cache_config.mamba_cache_mode = "align" if caching else "none"
            cache = hybrid_cache(num_blocks, caching=caching)
            built.append(
                h.build_engine(role, config, cache, port=h.free_port(), env=monkeypatch, block_format=FORMATS)
            )  # fmt: skip
        prefill, decode = built[-2:]
        return prefill, decode

    yield make
    for engine in built:
        engine.shutdown()


class Watch:
    """One ordered log of what matters for request ``r`` on decode:

    ``release``: decode's connector tells prefill to free (a ReleaseSpec in the step's
    metadata; the side-channel release goes out in the same scheduler call);
    ``read``: a decode rank posts a READ; ``received``/``failed``: what vLLM hears of the
    load; ``prefill-freed``: prefill's scheduler dropped the prefill request (blocks freed).
    ``asks``: the locally computed tokens of each get_num_new_matched_tokens call for ``r``.
    """

    def __init__(self, prefill: h.Engine, decode: h.Engine, prefill_id: str) -> None:
        self.log: list[str] = []
        self.loaded: tuple[list[int], ...] = ()
        self.asks: list[int] = []
        self._prefill, self._prefill_id = prefill, prefill_id
        connector = decode.connector
        build_meta = connector.build_connector_meta

        def build_connector_meta(scheduler_output: Any) -> Any:
            meta = build_meta(scheduler_output)
            if any(spec.request_id == "r" for spec in meta.step.releases):
                self.log.append("release")
            return meta

        connector.build_connector_meta = build_connector_meta  # type: ignore[method-assign]
        ask = connector.get_num_new_matched_tokens

        def asked(request: Any, num_computed_tokens: int) -> Any:
            if request.request_id == "r":
                self.asks.append(num_computed_tokens)
            return ask(request, num_computed_tokens)

        connector.get_num_new_matched_tokens = asked  # type: ignore[method-assign]
        for agent in decode.agents:
            post = agent.post

            def counted_post(transfer: Any, post: Any = post) -> Any:
                self.log.append("read")
                return post(transfer)

            agent.post = counted_post  # type: ignore[method-assign]
        aggregate = decode.aggregator.aggregate

        def aggregated(outputs: Any, *args: Any, **kwargs: Any) -> Any:
            merged = aggregate(outputs, *args, **kwargs)
            kv = merged.kv_connector_output if merged is not None else None
            if kv is not None and "r" in (kv.failed_recving or ()):
                self.log.append("failed")
            elif kv is not None and "r" in (kv.finished_recving or ()):
                self.log.append("received")
                # The blocks the load wrote, before decode computes on.
                self.loaded = decode.scheduler.kv_cache_manager.get_block_ids("r")
            return merged

        decode.aggregator.aggregate = aggregated  # type: ignore[method-assign]

    def note_prefill(self) -> None:
        if (
            self._prefill_id not in self._prefill.scheduler.requests
            and "prefill-freed" not in self.log
        ):
            self.log.append("prefill-freed")

    def check(self) -> None:
        """No READ, and no load received, once prefill was told to free or freed."""
        for marker in ("release", "prefill-freed"):
            if marker in self.log:
                after = self.log[self.log.index(marker) :]
                assert "read" not in after, f"a READ of prefill's blocks after {marker}: {self.log}"
                assert "received" not in after, (
                    f"a load reported received after {marker}: {self.log}"
                )


def step_both(prefill: h.Engine, decode: h.Engine, watch: Watch) -> None:
    decode.step()
    watch.check()
    prefill.step()
    watch.note_prefill()
    watch.check()


def run_both(
    prefill: h.Engine,
    decode: h.Engine,
    watch: Watch,
    done: Callable[[], bool],
    timeout_s: float = 30,
) -> None:
    deadline_s = time.monotonic() + timeout_s
    while not done():
        assert time.monotonic() < deadline_s, f"not done within {timeout_s} s: {watch.log}"
        step_both(prefill, decode, watch)
        time.sleep(0.001)  # let the side-channel threads run


def release_settled(decode: h.Engine, watch: Watch) -> bool:
    """Prefill freed its blocks and decode's ranks acked the release: nothing in flight."""
    return (
        "prefill-freed" in watch.log
        and not decode.connector._scheduler.connector.has_pending_work()
    )


def cache_the_prompt_on_decode(decode: h.Engine) -> None:
    decode.add(h.make_request("warm", NUM_TOKENS, block_size=BLOCK_SIZE, max_tokens=1))
    decode.run_until(lambda e: e.finished("warm") is not None)


def prefill_remotely(prefill: h.Engine) -> tuple[dict[str, Any], list[bytes]]:
    """Prefill's params for the prompt, its blocks filled with known bytes (and those bytes)."""
    params = h.prefill_for_decode(prefill, "p", NUM_TOKENS, block_size=BLOCK_SIZE)
    assert params["remote_num_tokens"] == NUM_TOKENS - 1, "prefill did not stop one token short"
    h.fill_blocks(prefill, params["remote_block_ids"], seed=3)
    attention_blocks, _ = params["remote_block_ids"]
    return params, h.block_bytes(prefill, 0, 0, attention_blocks)


def remote_request(params: dict[str, Any], max_tokens: int = MAX_TOKENS) -> Any:
    return h.make_request(
        "r", NUM_TOKENS, block_size=BLOCK_SIZE, kv_transfer_params=params, max_tokens=max_tokens
    )


def finish_and_check_nothing_leaks(
    prefill: h.Engine, decode: h.Engine, watch: Watch, free: tuple[int, int]
) -> None:
    run_both(prefill, decode, watch, lambda: decode.finished("r") is not None)
    assert str(decode.finished("r").finish_reason) == "length"
    assert decode.stats.get("loads_failed", 0) == 0, "a full local hit counted as a failed load"
    sides = [engine.connector._scheduler for engine in (prefill, decode)]
    run_both(
        prefill, decode, watch,
        lambda: (prefill.num_free_blocks(), decode.num_free_blocks()) == free
        and "p" not in prefill.scheduler.requests
        and not any(side.connector.has_pending_work() for side in sides),
    )  # fmt: skip
    # No record of either request is left on either side (the no-reload memo included).
    assert [side.connector.num_tracked_loads for side in sides] == [0, 0]


def test_preempted_after_a_full_local_hit_then_evicted_computes_locally(engines: Any) -> None:
    prefill, decode = engines(ROOMY)
    free = (prefill.num_free_blocks(), decode.num_free_blocks())
    cache_the_prompt_on_decode(decode)
    params, _ = prefill_remotely(prefill)
    watch = Watch(prefill, decode, "p")
    request = remote_request(params, ROOMY_MAX_TOKENS)
    decode.add(request)
    step_both(prefill, decode, watch)
    assert request.status == RequestStatus.RUNNING and request.num_computed_tokens == NUM_TOKENS
    assert watch.asks == [FULL_HIT], "decode's prefix cache was meant to cover the whole load"
    # Before d48954c the load record ended once the ranks acked the release, and only then
    # did a later ask start a fresh load: let the release settle first.
    run_both(prefill, decode, watch, lambda: release_settled(decode, watch))
    assert watch.log == ["release", "prefill-freed"]
    assert request.status == RequestStatus.RUNNING

    # As vLLM's schedule() preempts a running request that cannot grow; while it waits,
    # other requests' allocations evict its cached prefix.
    held = decode.scheduler.kv_cache_manager.get_block_ids("r")
    decode.scheduler.running.remove(request)
    decode.scheduler._preempt_request(request, time.monotonic())
    decode.scheduler.kv_cache_manager.block_pool.evict_blocks({b for g in held for b in g if b})

    finish_and_check_nothing_leaks(prefill, decode, watch, free)
    assert watch.log == ["release", "prefill-freed"], "a load after the release"
    assert watch.asks == [FULL_HIT, 0], "asked again with the prefix evicted"
    assert request.num_preemptions == 1


def test_a_prefix_cache_reset_after_a_full_local_hit_computes_locally(engines: Any) -> None:
    prefill, decode = engines(ROOMY)
    free = (prefill.num_free_blocks(), decode.num_free_blocks())
    cache_the_prompt_on_decode(decode)
    params, _ = prefill_remotely(prefill)
    watch = Watch(prefill, decode, "p")
    request = remote_request(params, ROOMY_MAX_TOKENS)
    decode.add(request)
    step_both(prefill, decode, watch)
    assert request.status == RequestStatus.RUNNING and request.num_computed_tokens == NUM_TOKENS
    assert watch.asks == [FULL_HIT], "decode's prefix cache was meant to cover the whole load"
    # Before d48954c the load record ended once the ranks acked the release, and only then
    # did a later ask start a fresh load: let the release settle first.
    run_both(prefill, decode, watch, lambda: release_settled(decode, watch))
    assert watch.log == ["release", "prefill-freed"]
    assert request.status == RequestStatus.RUNNING

    assert decode.scheduler.reset_prefix_cache(reset_running_requests=True)
    assert request.status == RequestStatus.PREEMPTED

    finish_and_check_nothing_leaks(prefill, decode, watch, free)
    assert watch.log == ["release", "prefill-freed"], "a load after the release"
    assert watch.asks == [FULL_HIT, 0], "asked again with the prefix evicted"


def test_a_failed_allocation_retried_after_eviction_loads_only_held_blocks(engines: Any) -> None:
    prefill, decode = engines(TIGHT)
    free = (prefill.num_free_blocks(), decode.num_free_blocks())
    cache_the_prompt_on_decode(decode)
    params, expected = prefill_remotely(prefill)
    watch = Watch(prefill, decode, "p")
    # The hog's first chunk takes every never-used block; "r" is asked with the whole prompt
    # cached, and its allocation fails. The hog's next token needs a block: it evicts the
    # cached prefix. The hog finishes; "r" is asked again with nothing cached.
    decode.add(h.make_request("hog", HOG_TOKENS, block_size=BLOCK_SIZE, max_tokens=2, first_token=100))  # fmt: skip
    request = remote_request(params)
    decode.add(request)
    step_both(prefill, decode, watch)
    assert watch.asks == [FULL_HIT], f"'r' was meant to be asked once, all cached: {watch.asks}"
    assert request.status == RequestStatus.WAITING, "the first allocation was meant to fail"
    assert request.num_computed_tokens == 0

    # vLLM stops admitting (PAUSED_NEW) for a while: the hog runs on, evicts the prefix and
    # finishes, and a release given at the first ask would be acked and obeyed by prefill.
    decode.scheduler.set_pause_state(PauseState.PAUSED_NEW)
    pause_ends_s = time.monotonic() + RELEASE_GRACE_S
    run_both(
        prefill, decode, watch,
        lambda: decode.finished("hog") is not None
        and (release_settled(decode, watch) or time.monotonic() > pause_ends_s),
    )  # fmt: skip
    assert decode.finished("hog") is not None and request.status == RequestStatus.WAITING
    decode.scheduler.set_pause_state(PauseState.UNPAUSED)

    run_both(prefill, decode, watch, lambda: decode.finished("r") is not None)
    assert watch.asks[0] == FULL_HIT and set(watch.asks[1:]) == {0}, (
        f"the cached prefix was meant to be evicted before the retry: {watch.asks}"
    )
    finish_and_check_nothing_leaks(prefill, decode, watch, free)
    # Prefill was never told to free before the load: it READ prefill's own, held bytes,
    # and prefill freed them once decode's READ notification came.
    assert [event for event in watch.log if event != "read"] == ["received", "prefill-freed"]
    assert watch.log[0] == "read" and decode.stats["loads_finished"] == 1
    assert h.block_bytes(decode, 0, 0, watch.loaded[0][:2]) == expected
