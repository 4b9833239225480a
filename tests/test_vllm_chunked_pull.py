"""Chunked pulls inside vLLM 0.33's real Scheduler (FakeNixl, which moves the bytes).

With ``chunked_pull`` on both engines and a transfer key (docs/overlap.md, "Pulling chunks as
prefill computes them"), prefill announces each chunk's whole blocks as soon as every rank
finished the step that wrote them, and decode READs them while later chunks compute; the
final announcement's LoadSpec reads the rest and proves the whole load. The drills: a load
across three chunks, prefill preempted after decode read a chunk (both failure policies),
prefill aborting mid-prefill, and decode aborting with a chunk READ in flight.

The harness runs no model: a step "computes" a chunk by writing seeded bytes into the
blocks it covers (``_write_chunks``), before the ranks echo the step.
"""

from __future__ import annotations

import importlib.util
import os
import time
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

from connector.observability.metrics import (  # noqa: E402
    CHUNK_READS,
    LOADS_FAILED,
    default_recorder,
)
from tests import vllm_harness as h  # noqa: E402

pytestmark = pytest.mark.vllm

BLOCK_SIZE = 16
CHUNKED = {"chunked_pull": True}


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Any:
    return h.model_config(h.write_tiny_model(Path(tmp_path_factory.mktemp("tiny-llama"))))


@pytest.fixture
def make_pair(model: Any, monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    engines: list[h.Engine] = []

    def make(
        *,
        failure_policy: str = "fail",
        chunk_tokens: int = 256,
        num_blocks: int = 64,
        verify_kv: bool = False,
        wait_s: float = 30.0,
        tp_sizes: tuple[int, int] = (1, 1),
    ) -> tuple[h.Engine, h.Engine]:
        extra = {**CHUNKED, "verify_kv": verify_kv, "overlap_wait_timeout": wait_s}
        roles = (("prefill", "kv_producer"), ("decode", "kv_consumer"))
        for (name, role), tp_size in zip(roles, tp_sizes, strict=True):
            config = h.vllm_config(
                model, kv_role=role, block_size=BLOCK_SIZE, failure_policy=failure_policy,
                extra_config=extra, tp_size=tp_size,
            )  # fmt: skip
            cache = h.kv_cache_config(block_size=BLOCK_SIZE, num_blocks=num_blocks, tp_size=tp_size)
            engines.append(h.build_engine(name, config, cache, port=h.free_port(), env=monkeypatch))
        prefill, decode = engines[-2:]
        prefill.scheduler.max_num_scheduled_tokens = chunk_tokens  # chunks of this many
        h.sample_nothing_for_chunks(prefill)
        _write_chunks(prefill)
        return prefill, decode

    yield make
    for engine in engines:
        engine.shutdown()


def _write_chunks(engine: h.Engine) -> None:
    """Each step writes seeded bytes into the blocks its prompt chunks cover, before the
    ranks run (as a forward writes KV before the step's results are taken)."""
    run_rank = engine._run_rank
    written: set[tuple[str, int]] = set()

    def run(worker: Any, scheduled: Any) -> Any:
        manager = engine.scheduler.kv_cache_manager
        for request_id, num_scheduled in scheduled.num_scheduled_tokens.items():
            request = engine.scheduler.requests[request_id]
            start = request.num_computed_tokens - num_scheduled  # already advanced
            if start >= request.num_prompt_tokens or (request_id, start) in written:
                continue
            written.add((request_id, start))
            (table,) = manager.get_block_ids(request_id)
            end = min(start + num_scheduled, request.num_prompt_tokens)
            blocks = table[start // BLOCK_SIZE : -(-end // BLOCK_SIZE)]
            h.fill_blocks(engine, [blocks], seed=hash((request_id, start)) % 2**31)
        return run_rank(worker, scheduled)

    engine._run_rank = run  # type: ignore[method-assign]


def _decode_params(prefill: h.Engine, key: str) -> dict[str, Any]:
    return {
        "do_remote_prefill": True,
        "transfer_key": key,
        "remote_engine_id": prefill.scheduler.vllm_config.kv_transfer_config.engine_id,
        "remote_host": "127.0.0.1",
        "remote_port": prefill.connector.side_channel_port,
    }


def _request(request_id: str, num_tokens: int, params: dict[str, Any], **options: Any) -> Any:
    return h.make_request(
        request_id, num_tokens, block_size=BLOCK_SIZE, kv_transfer_params=params, **options
    )


def _parked(engine: h.Engine, request_id: str) -> bool:
    request = engine.scheduler.requests.get(request_id)
    return request is not None and request.status == RequestStatus.WAITING_FOR_REMOTE_KVS


# Bounds, not expectations: a run returns as soon as the condition holds; the generous bound
# keeps a loaded two-core machine (another suite beside this one) from failing a good run.
WAIT_S = 60.0


def _specs_reach(decode: h.Engine, count: int, timeout_s: float = WAIT_S) -> None:
    """Step decode until its ranks got ``count`` LoadSpecs and posted every READ of them."""
    decode.run_until(
        lambda e: len(e.load_specs) >= count and sum(a.num_posted for a in e.agents) > 0,
        timeout_s=timeout_s,
    )


def _step_both(prefill: h.Engine, decode: h.Engine, done: Any, timeout_s: float = WAIT_S) -> None:
    """Step both engines until ``done()``: prefill answers decode's checks, and with verify_kv
    its ranks digest a lease in the step after request_finished."""
    deadline = time.monotonic() + timeout_s
    while not done():
        assert time.monotonic() < deadline, "condition not met in time"
        prefill.step()
        decode.step()
        time.sleep(0.001)


@pytest.fixture
def failed_loads() -> Any:
    before = default_recorder().snapshot().counters.get(LOADS_FAILED.name, {})

    def delta() -> dict[str, int]:
        after = default_recorder().snapshot().counters.get(LOADS_FAILED.name, {})
        counts = {kind: n - before.get(kind, 0) for kind, n in after.items()}
        return {kind: n for kind, n in counts.items() if n}

    return delta


def chunk_reads_counted() -> int:
    """nixl_pd_chunk_reads_total so far in this process (decode counts it)."""
    return default_recorder().snapshot().counters.get(CHUNK_READS.name, {}).get("", 0)


def _start(prefill: h.Engine, decode: h.Engine, key: str, num_tokens: int, **options: Any) -> None:
    """Decode parks ``d-<key>``; prefill takes ``p-<key>`` in (not stepped yet)."""
    decode.add(_request(f"d-{key}", num_tokens, _decode_params(prefill, key), **options))
    decode.run_until(lambda e: _parked(e, f"d-{key}"))
    params = {"do_remote_decode": True, "transfer_key": key}
    prefill.add(_request(f"p-{key}", num_tokens, params, max_tokens=1, **options))


@pytest.mark.parametrize(
    ("verify_kv", "tp_sizes"),
    [(False, (1, 1)), (True, (1, 1)), (True, (2, 1)), (False, (1, 2))],
    ids=["lease-check", "verify-kv", "prefill-tp2", "decode-tp2"],
)
def test_a_load_across_three_chunks_reads_each_while_prefill_computes_the_next(
    make_pair: Any, verify_kv: bool, tp_sizes: tuple[int, int]
) -> None:
    """Prefill TP 2: a chunk is announced only once both ranks echoed its step."""
    prefill, decode = make_pair(verify_kv=verify_kv, tp_sizes=tp_sizes)
    free_prefill, free_decode = prefill.num_free_blocks(), decode.num_free_blocks()
    chunk_reads = chunk_reads_counted()
    num_tokens = 704  # chunks of 256, 256, 192: 44 whole blocks
    _start(prefill, decode, "k1", num_tokens)
    prefill.step()  # chunk 1 computed and echoed: announced
    _specs_reach(decode, 1)
    prefill.step()  # chunk 2
    _specs_reach(decode, 2)
    assert prefill.finished("p-k1") is None  # both READs went out while prefill ran
    prefill.run_until(lambda e: e.finished("p-k1") is not None)
    returned = prefill.finished("p-k1").kv_transfer_params
    _step_both(prefill, decode, lambda: not _parked(decode, "d-k1"))
    (loaded,) = decode.scheduler.kv_cache_manager.get_block_ids("d-k1")

    spans = [(s.num_read_tokens, s.num_tokens, s.chunk) for s in decode.load_specs]
    assert spans == [(0, 256, True), (256, 512, True), (512, num_tokens, False)]
    assert chunk_reads_counted() == chunk_reads + 2  # the final window is not a chunk read
    leases = {s.source.lease_id for s in decode.load_specs}
    assert leases == {returned["remote_lease_id"]}  # one lease, kept by request_finished
    final = decode.load_specs[-1]
    assert final.num_cached_tokens == 0 and final.source.remote_block_ids == (
        tuple(returned["remote_block_ids"][0]),
    )
    remote = returned["remote_block_ids"][0]
    assert len(remote) == num_tokens // BLOCK_SIZE
    assert h.heads_bytes(decode, loaded[: len(remote)]) == h.heads_bytes(prefill, remote)
    decode.run_until(lambda e: e.finished("d-k1") is not None)
    assert str(decode.finished("d-k1").finish_reason) == "length"
    # Counted by each decode rank: one load each, none failed.
    assert decode.stats["loads_finished"] == tp_sizes[1] and decode.stats["loads_failed"] == 0
    prefill.run_until(lambda e: e.num_free_blocks() == free_prefill)
    decode.run_until(lambda e: e.num_free_blocks() == free_decode)


def test_verify_kv_proves_the_chunks_read_before_the_last_one_too(
    make_pair: Any, failed_loads: Any
) -> None:
    """A chunk's bytes that changed in decode's blocks after its READ (here: overwritten)
    fail the whole load's proof: the final claims cover every chunk, not the last READ."""
    prefill, decode = make_pair(verify_kv=True)
    _start(prefill, decode, "k5", 704)
    prefill.step()
    _specs_reach(decode, 1)
    chunk = decode.load_specs[0]
    local, remote = chunk.read_block_ids[0][0], chunk.source.remote_block_ids[0][0]  # type: ignore[index]
    expected = h.block_bytes(prefill, 0, 0, [remote])
    decode.run_until(lambda e: h.block_bytes(e, 0, 0, [local]) == expected)  # it landed
    h.fill_blocks(decode, [[local]], seed=99)
    prefill.run_until(lambda e: e.finished("p-k5") is not None)
    _step_both(prefill, decode, lambda: decode.finished("d-k5") is not None)
    assert str(decode.finished("d-k5").finish_reason) == "error"
    assert decode.stats["loads_finished"] == 0 and decode.stats["loads_failed"] == 1
    assert failed_loads() == {"digest": 1}


@pytest.mark.parametrize(
    ("policy", "reason"), [("fail", "error"), ("recompute", "length")], ids=["fail", "recompute"]
)
def test_prefill_preempted_after_decode_read_a_chunk_fails_the_load(
    make_pair: Any, failed_loads: Any, policy: str, reason: str
) -> None:
    """As tests/test_vllm_chunk_tracker.py makes vLLM preempt: 38 usable blocks; step 1 runs
    "a" (32 tokens) and 480 of "p-k2"'s 600; decode READs those 480; step 2 "a" needs a third
    block and vLLM preempts p-k2, whose lease ends there. Its resumed announcements come under
    a new lease: decode's load fails (lease_expired), and never succeeds on mixed bytes."""
    prefill, decode = make_pair(failure_policy=policy, chunk_tokens=512, num_blocks=39)
    prefill.scheduler.scheduler_reserve_full_isl = False  # admit on the first chunk
    free_prefill, free_decode = prefill.num_free_blocks(), decode.num_free_blocks()
    prefill.add(h.make_request("a", 32, block_size=BLOCK_SIZE, max_tokens=60))
    _start(prefill, decode, "k2", 600, first_token=300)
    prefill.step()
    _specs_reach(decode, 1)
    (chunk,) = decode.load_specs
    assert (chunk.num_read_tokens, chunk.num_tokens, chunk.chunk) == (0, 480, True)
    deadline = time.monotonic() + 20.0
    while decode.finished("d-k2") is None and time.monotonic() < deadline:
        prefill.step()
        decode.step()
        time.sleep(0.001)
    out = decode.finished("d-k2")
    assert out is not None and str(out.finish_reason) == reason
    assert failed_loads() == {"lease_expired": 1}
    assert decode.stats["loads_finished"] == 0 and decode.stats["loads_failed"] == 1
    prefill.run_until(lambda e: e.finished("a") is not None, timeout_s=20.0)
    prefill.run_until(lambda e: e.num_free_blocks() == free_prefill)
    decode.run_until(lambda e: e.num_free_blocks() == free_decode)


def test_prefill_abort_after_decode_read_a_chunk_fails_the_load_prefill_failed(
    make_pair: Any, failed_loads: Any
) -> None:
    prefill, decode = make_pair()
    free_prefill, free_decode = prefill.num_free_blocks(), decode.num_free_blocks()
    _start(prefill, decode, "k3", 704)
    prefill.step()
    _specs_reach(decode, 1)
    prefill.scheduler.finish_requests("p-k3", RequestStatus.FINISHED_ABORTED)
    decode.run_until(lambda e: e.finished("d-k3") is not None)
    assert str(decode.finished("d-k3").finish_reason) == "error"
    assert failed_loads() == {"prefill_failed": 1}
    assert [s.chunk for s in decode.load_specs] == [True]  # no final LoadSpec went out
    prefill.run_until(lambda e: e.num_free_blocks() == free_prefill)
    decode.run_until(lambda e: e.num_free_blocks() == free_decode)


def test_decode_abort_with_a_chunk_read_in_flight_waits_for_it_then_frees_both_sides(
    make_pair: Any,
) -> None:
    prefill, decode = make_pair()
    free_prefill, free_decode = prefill.num_free_blocks(), decode.num_free_blocks()
    (agent,) = decode.agents
    posted: list[Any] = []
    post = agent.post

    def post_and_keep(transfer: Any) -> Any:
        posted.append(transfer)
        return post(transfer)

    agent.post = post_and_keep  # type: ignore[method-assign]
    agent.faults.stall_polls = 10**9  # each READ stays in flight until released below
    _start(prefill, decode, "k4", 704)
    prefill.step()
    _specs_reach(decode, 1)
    decode.scheduler.finish_requests("d-k4", RequestStatus.FINISHED_ABORTED)
    for _ in range(20):
        decode.step()
        time.sleep(0.005)
    assert decode.num_free_blocks() < free_decode, "decode freed blocks under a live READ"
    assert [s.chunk for s in decode.load_specs] == [True]
    for transfer in posted:
        transfer.polls_left = 0  # the READ lands now
    decode.run_until(lambda e: e.num_free_blocks() == free_decode)
    # Decode cancelled the transfer: prefill's chunk lease ended, and it draws none at its end.
    prefill.run_until(lambda e: e.finished("p-k4") is not None)
    assert prefill.finished("p-k4").kv_transfer_params is None
    prefill.run_until(lambda e: e.num_free_blocks() == free_prefill)
    assert len(prefill.connector._scheduler.connector._leases) == 0  # type: ignore[union-attr]


def test_no_final_announcement_within_the_wait_fails_prefill_timeout_and_ends_the_lease(
    make_pair: Any, failed_loads: Any
) -> None:
    """Prefill stalls after its first chunk (not stepped): decode's wait runs out with a
    chunk read, fails the load after the ranks ended it, and cancels the transfer, so the
    chunk lease ends and prefill, once it runs again, draws no lease at its end."""
    prefill, decode = make_pair(wait_s=1.0)
    free_prefill, free_decode = prefill.num_free_blocks(), decode.num_free_blocks()
    _start(prefill, decode, "k6", 704)
    prefill.step()
    _specs_reach(decode, 1)
    started = time.monotonic()
    decode.run_until(lambda e: e.finished("d-k6") is not None, timeout_s=5.0)
    assert time.monotonic() - started < 2.0
    assert str(decode.finished("d-k6").finish_reason) == "error"
    assert failed_loads() == {"prefill_timeout": 1}
    decode.run_until(lambda e: e.num_free_blocks() == free_decode)
    leases = prefill.connector._scheduler.connector._leases  # type: ignore[union-attr]
    deadline = time.monotonic() + 5.0
    while len(leases) and time.monotonic() < deadline:  # the cancel reaches prefill
        time.sleep(0.01)
    assert len(leases) == 0
    prefill.run_until(lambda e: e.finished("p-k6") is not None)
    assert prefill.finished("p-k6").kv_transfer_params is None
    prefill.run_until(lambda e: e.num_free_blocks() == free_prefill)
