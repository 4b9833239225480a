"""ChunkTracker fed by vLLM 0.33's real Scheduler: what the chunked-pull design assumes of vLLM.

Chunked pulls are designed (docs/overlap.md, "Pulling chunks as prefill computes them") on
three facts about vLLM's scheduler, checked here on the real one with chunked prefill:

1. a running request's block table only grows between steps, so each announced whole-block
   prefix stays the request's until it finishes, and is a prefix of the blocks prefill's
   final params name;
2. a preemption frees the request's blocks inside ``schedule()`` and names the request in
   that same step's ``scheduler_output.preempted_req_ids``, which ``build_connector_meta``
   sees before the step's forward (the first that can write the freed blocks);
3. a resumed request's row carries its whole new table.

This test feeds its own tracker from the hooks vLLM calls (the scheduler output at
build_connector_meta, the step's end at update_connector_output), as the wiring
(scheduler/chunk_leases.py) does; tests/test_vllm_chunked_pull.py runs the wired one.
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path
from typing import Any

import pytest

if importlib.util.find_spec("vllm") is None and not os.environ.get("NIXL_PD_REQUIRE_VLLM"):
    pytest.skip(
        "vllm is not installed (scripts/install_vllm.sh); CI sets NIXL_PD_REQUIRE_VLLM",
        allow_module_level=True,
    )

from vllm.v1.request import RequestStatus  # noqa: E402

from connector.vllm import NixlPDConnector  # noqa: E402
from connector.vllm.staging import scheduled_rows  # noqa: E402
from scheduler.chunk_tracker import ChunkAnnouncement, ChunkTracker  # noqa: E402
from tests import vllm_harness as h  # noqa: E402

pytestmark = pytest.mark.vllm

BLOCK_SIZE = 16
CHUNK_TOKENS = 512  # the harness's max_num_batched_tokens


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Any:
    return h.model_config(h.write_tiny_model(Path(tmp_path_factory.mktemp("tiny-llama"))))


class Fed:
    """A ChunkTracker fed from one engine's connector hooks, with what each hook saw."""

    def __init__(self, engine: h.Engine, monkeypatch: pytest.MonkeyPatch) -> None:
        self.tracker = ChunkTracker((BLOCK_SIZE,))
        self.engine = engine
        self.step_seq = 0
        self.announced: list[ChunkAnnouncement] = []
        self.ended: list[str] = []
        self.free_when_ended: list[bool] = []  # the preempted request's blocks were free then
        build, update = (
            NixlPDConnector.build_connector_meta,
            NixlPDConnector.update_connector_output,
        )

        def build_connector_meta(connector: NixlPDConnector, scheduler_output: Any) -> Any:
            self.step_seq += 1
            rows = scheduled_rows(scheduler_output, connector._kv_cache_config)
            preempted = scheduler_output.preempted_req_ids or ()
            ended = self.tracker.step(self.step_seq, rows, preempted)
            self.ended.extend(ended)
            manager = engine.scheduler.kv_cache_manager
            self.free_when_ended.extend(
                not any(manager.get_block_ids(request_id)) for request_id in ended
            )
            return build(connector, scheduler_output)

        def update_connector_output(connector: NixlPDConnector, output: Any) -> None:
            update(connector, output)
            for announcement in self.tracker.saved(self.step_seq):
                self.announced.append(announcement)
                self._check_owned(announcement)

        monkeypatch.setattr(NixlPDConnector, "build_connector_meta", build_connector_meta)
        monkeypatch.setattr(NixlPDConnector, "update_connector_output", update_connector_output)

    def _check_owned(self, announcement: ChunkAnnouncement) -> None:
        """At announcement, every announced block is the request's, in the same place."""
        table = self.engine.scheduler.kv_cache_manager.get_block_ids(announcement.request_id)
        (blocks,) = announcement.block_ids
        assert list(table[0][: len(blocks)]) == list(blocks), (announcement, table)
        computed = self.engine.scheduler.requests[announcement.request_id].num_computed_tokens
        assert announcement.num_tokens <= computed


def _prefill_request(request_id: str, num_tokens: int, first_token: int, max_tokens: int) -> Any:
    return h.make_request(
        request_id, num_tokens, block_size=BLOCK_SIZE, first_token=first_token,
        max_tokens=max_tokens, kv_transfer_params={"do_remote_decode": True},
    )  # fmt: skip


def _engine(model: Any, monkeypatch: pytest.MonkeyPatch, num_blocks: int) -> h.Engine:
    config = h.vllm_config(model, kv_role="kv_producer", block_size=BLOCK_SIZE)
    cache = h.kv_cache_config(block_size=BLOCK_SIZE, num_blocks=num_blocks)
    engine = h.build_engine("prefill", config, cache, port=h.free_port(), env=monkeypatch)
    h.sample_nothing_for_chunks(engine)
    return engine


def test_chunks_announce_growing_prefixes_of_the_blocks_the_final_params_name(
    model: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    engine = _engine(model, monkeypatch, num_blocks=64)
    fed = Fed(engine, monkeypatch)
    try:
        num_tokens = CHUNK_TOKENS + 388  # two chunks (max_model_len is 1024): 512, 388
        assert fed.tracker.track("p", num_tokens)
        engine.add(_prefill_request("p", num_tokens, first_token=1, max_tokens=1))
        engine.run_until(lambda e: e.finished("p") is not None)
        final = engine.finished("p").kv_transfer_params["remote_block_ids"][0]
        tokens = [a.num_tokens for a in fed.announced]
        assert tokens == [CHUNK_TOKENS, 896], tokens  # 900 tokens: 56 whole blocks
        for announcement in fed.announced:  # each a prefix of what decode finally reads
            (blocks,) = announcement.block_ids
            assert final[: len(blocks)] == list(blocks)
        assert [a.generation for a in fed.announced] == [1, 2]
    finally:
        engine.shutdown()


def test_a_preemption_mid_prefill_is_seen_in_the_step_that_freed_the_blocks(
    model: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A decoding request needs a block the pool no longer has: vLLM preempts the request
    still prefilling. The tracker ends its lease in that very step's build_connector_meta,
    when its blocks are already free and before any forward can write them; after resuming,
    its announcements restart on its new table (here its own blocks again, through the prefix
    cache: the same ids under a lease that must be new)."""
    # 38 usable blocks. Step 1: "a" 32 tokens (2 blocks), "b" 480 of its 600 (30 blocks).
    # Step 2: "a" decodes into a third block; "b" needs 8 more, 5 are free: b is preempted.
    engine = _engine(model, monkeypatch, num_blocks=39)
    # Admit "b" on its first chunk (vLLM's scheduler_reserve_full_isl=False): with the
    # default, admission wants the whole prompt to fit, which makes this rarer, not impossible.
    engine.scheduler.scheduler_reserve_full_isl = False
    fed = Fed(engine, monkeypatch)
    try:
        engine.add(h.make_request("a", 32, block_size=BLOCK_SIZE, max_tokens=60))
        fed.tracker.track("b", 600)
        engine.add(_prefill_request("b", 600, first_token=300, max_tokens=1))
        engine.run_until(lambda e: bool(fed.ended), timeout_s=10.0)
        assert fed.ended == ["b"] and fed.free_when_ended == [True]
        assert [(a.request_id, a.num_tokens, a.generation) for a in fed.announced] == [
            ("b", 480, 1)
        ]
        assert engine.scheduler.requests["b"].status == RequestStatus.PREEMPTED
        engine.run_until(lambda e: e.finished("b") is not None, timeout_s=20.0)
        after = fed.announced[1:]
        assert [(a.num_tokens, a.generation) for a in after] == [(592, 2)]
        final = engine.finished("b").kv_transfer_params["remote_block_ids"][0]
        (blocks,) = after[-1].block_ids
        assert final[: len(blocks)] == list(blocks)
    finally:
        engine.shutdown()
