"""Overlapped dispatch inside vLLM 0.33's real Scheduler (FakeNixl on the CPU).

The router sends one transfer key to prefill and decode at once (docs/overlap.md): decode
claims the prompt, vLLM allocates and parks the request, and its load waits (off the engine
thread) until prefill's side channel announces the lease; then it READs and proves as a
sequential load does. The failure drills: prefill aborts before its lease, prefill never
answers, decode aborts first (before and after prefill's lease), malformed params.
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

from connector.metadata import LoadFailure  # noqa: E402
from connector.observability.metrics import LOADS_FAILED, default_recorder  # noqa: E402
from scheduler.connector import SchedulerConnector  # noqa: E402
from tests import vllm_harness as h  # noqa: E402

pytestmark = pytest.mark.vllm

BLOCK_SIZE = 16
NUM_TOKENS = 3 * BLOCK_SIZE


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Any:
    return h.model_config(h.write_tiny_model(Path(tmp_path_factory.mktemp("tiny-llama"))))


@pytest.fixture
def make_pair(model: Any, monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    engines: list[h.Engine] = []

    def make(
        *, failure_policy: str = "fail", extra: dict | None = None
    ) -> tuple[h.Engine, h.Engine]:
        pair = h.build_pair(
            model,
            monkeypatch,
            failure_policy=failure_policy,
            extra_config=extra or {},
            block_size=BLOCK_SIZE,
        )
        engines.extend(pair)
        return pair

    yield make
    for engine in engines:
        engine.shutdown()


def _decode_params(prefill: h.Engine, key: str, **overrides: Any) -> dict[str, Any]:
    """What a router sends decode: the key and prefill's side channel, no lease."""
    params = {
        "do_remote_prefill": True,
        "transfer_key": key,
        "remote_engine_id": prefill.scheduler.vllm_config.kv_transfer_config.engine_id,
        "remote_host": "127.0.0.1",
        "remote_port": prefill.connector.side_channel_port,
    }
    return {**params, **overrides}


def _request(request_id: str, params: dict[str, Any], *, max_tokens: int = 3) -> Any:
    return h.make_request(
        request_id, NUM_TOKENS, block_size=BLOCK_SIZE, kv_transfer_params=params,
        max_tokens=max_tokens,
    )  # fmt: skip


def _parked(engine: h.Engine, request_id: str) -> bool:
    """vLLM allocated the request's blocks and waits for its remote KV."""
    request = engine.scheduler.requests.get(request_id)
    return request is not None and request.status == RequestStatus.WAITING_FOR_REMOTE_KVS


@pytest.fixture
def refusals(monkeypatch: pytest.MonkeyPatch) -> dict[str, LoadFailure]:
    """Every load the scheduler side failed before a LoadSpec went out: request id -> why."""
    seen: dict[str, LoadFailure] = {}
    take_refused = SchedulerConnector.take_refused

    def recording(self: SchedulerConnector) -> dict[str, LoadFailure]:
        refused = take_refused(self)
        seen.update(refused)
        return refused

    monkeypatch.setattr(SchedulerConnector, "take_refused", recording)
    return seen


@pytest.fixture
def failed_loads() -> Any:
    """nixl_pd_loads_failed_total since the test started, by kind (this process's recorder:
    the engines' schedulers and ranks all record there)."""
    before = default_recorder().snapshot().counters.get(LOADS_FAILED.name, {})

    def delta() -> dict[str, int]:
        after = default_recorder().snapshot().counters.get(LOADS_FAILED.name, {})
        counts = {kind: n - before.get(kind, 0) for kind, n in after.items()}
        return {kind: n for kind, n in counts.items() if n}

    return delta


@pytest.mark.parametrize("engine_id", [True, False], ids=["engine-id-named", "engine-id-learned"])
def test_decode_parks_before_prefill_starts_then_reads_prefills_bytes(
    make_pair: Any, engine_id: bool
) -> None:
    prefill, decode = make_pair()
    free_prefill, free_decode = prefill.num_free_blocks(), decode.num_free_blocks()
    params = _decode_params(prefill, "key-1")
    if not engine_id:
        del params["remote_engine_id"]
    decode.add(_request("d-1", params))
    decode.run_until(lambda e: _parked(e, "d-1"))
    assert decode.num_free_blocks() == free_decode - NUM_TOKENS // BLOCK_SIZE
    for _ in range(5):  # waiting costs the engine nothing but its usual steps
        decode.step()
    assert _parked(decode, "d-1") and decode.load_specs == []

    prefill_params = {"do_remote_decode": True, "transfer_key": "key-1"}
    prefill.add(_request("p-1", prefill_params, max_tokens=1))
    prefill.run_until(lambda e: e.finished("p-1") is not None)
    returned = prefill.finished("p-1").kv_transfer_params
    h.fill_blocks(prefill, returned["remote_block_ids"], seed=5)
    expected = h.block_bytes(prefill, 0, 0, returned["remote_block_ids"][0])

    loaded = h.run_until_loaded(decode, "d-1")
    assert h.block_bytes(decode, 0, 0, loaded[0][: NUM_TOKENS // BLOCK_SIZE]) == expected
    (spec,) = decode.load_specs  # prefill's lease, exactly as the sequential params name it
    assert spec.source.lease_id == returned["remote_lease_id"]
    assert spec.source.remote_request_id == "p-1"
    decode.run_until(lambda e: e.finished("d-1") is not None)
    assert decode.finished("d-1").new_token_ids == [h.SAMPLED_TOKEN]
    assert str(decode.finished("d-1").finish_reason) == "length"
    assert decode.stats["loads_finished"] == 1 and decode.stats["loads_failed"] == 0
    prefill.run_until(lambda e: e.num_free_blocks() == free_prefill)
    decode.run_until(lambda e: e.num_free_blocks() == free_decode)


def test_a_lease_announced_before_decode_asks_loads_too(make_pair: Any) -> None:
    prefill, decode = make_pair()
    prefill.add(_request("p-2", {"do_remote_decode": True, "transfer_key": "key-2"}, max_tokens=1))
    prefill.run_until(lambda e: e.finished("p-2") is not None)
    decode.add(_request("d-2", _decode_params(prefill, "key-2")))
    decode.run_until(lambda e: e.finished("d-2") is not None)
    assert decode.stats["loads_finished"] == 1 and decode.stats["loads_failed"] == 0


@pytest.mark.parametrize(
    ("policy", "reason"), [("fail", "error"), ("recompute", "length")], ids=["fail", "recompute"]
)
def test_prefill_abort_before_its_lease_fails_decodes_load_with_its_own_kind(
    make_pair: Any, refusals: dict[str, LoadFailure], failed_loads: Any, policy: str, reason: str
) -> None:
    prefill, decode = make_pair(failure_policy=policy)
    free_prefill, free_decode = prefill.num_free_blocks(), decode.num_free_blocks()
    decode.add(_request("d-3", _decode_params(prefill, "key-3")))
    decode.run_until(lambda e: _parked(e, "d-3"))
    prefill.add(_request("p-3", {"do_remote_decode": True, "transfer_key": "key-3"}))
    prefill.scheduler.finish_requests("p-3", RequestStatus.FINISHED_ABORTED)
    decode.run_until(lambda e: e.finished("d-3") is not None)
    assert str(decode.finished("d-3").finish_reason) == reason
    assert refusals["d-3"].kind == "prefill_failed"
    assert "prefill aborted the request" in refusals["d-3"].message
    assert failed_loads() == {"prefill_failed": 1}  # counted once, by its kind
    assert decode.load_specs == [] and sum(a.num_posted for a in decode.agents) == 0
    prefill.run_until(lambda e: e.num_free_blocks() == free_prefill)
    decode.run_until(lambda e: e.num_free_blocks() == free_decode)


@pytest.mark.parametrize("prefill_listens", [True, False], ids=["never-got-it", "nothing-listens"])
def test_a_prefill_that_never_announces_fails_the_load_within_the_wait(
    make_pair: Any, refusals: dict[str, LoadFailure], failed_loads: Any, prefill_listens: bool
) -> None:
    wait_s = 0.5
    prefill, decode = make_pair(extra={"overlap_wait_timeout": wait_s, "handshake_timeout": 0.2})
    free_decode = decode.num_free_blocks()
    port = prefill.connector.side_channel_port if prefill_listens else h.free_port()
    started = time.monotonic()
    decode.add(_request("d-4", _decode_params(prefill, "key-4", remote_port=port)))
    decode.run_until(lambda e: e.finished("d-4") is not None, timeout_s=5.0)
    waited_s = time.monotonic() - started
    assert wait_s <= waited_s < wait_s + 1.5, waited_s
    assert str(decode.finished("d-4").finish_reason) == "error"
    assert refusals["d-4"].kind == "prefill_timeout"
    assert failed_loads() == {"prefill_timeout": 1}
    decode.run_until(lambda e: e.num_free_blocks() == free_decode)
    if prefill_listens:  # decode cancelled the key: a request reaching prefill late leases nothing
        _wait_cancelled(prefill, "key-4")
        free_prefill = prefill.num_free_blocks()
        prefill.add(
            _request("p-4", {"do_remote_decode": True, "transfer_key": "key-4"}, max_tokens=1)
        )
        prefill.run_until(lambda e: e.finished("p-4") is not None)
        assert prefill.finished("p-4").kv_transfer_params is None
        prefill.run_until(lambda e: e.num_free_blocks() == free_prefill, timeout_s=2.0)


def _wait_cancelled(prefill: h.Engine, key: str) -> None:
    """Until prefill's board has decode's cancel of ``key`` (it travels on decode's sender
    thread)."""
    board = prefill.connector._require_scheduler().connector._transfers
    deadline = time.monotonic() + 5.0
    while not board.is_cancelled(key):
        assert time.monotonic() < deadline, f"prefill never got decode's cancel of {key}"
        time.sleep(0.01)


def test_decode_abort_while_waiting_frees_a_late_lease_at_once(make_pair: Any) -> None:
    prefill, decode = make_pair()  # leases last 30 s: only the cancel frees them sooner
    free_prefill, free_decode = prefill.num_free_blocks(), decode.num_free_blocks()
    decode.add(_request("d-5", _decode_params(prefill, "key-5")))
    decode.run_until(lambda e: _parked(e, "d-5"))
    decode.scheduler.finish_requests("d-5", RequestStatus.FINISHED_ABORTED)
    decode.run_until(lambda e: e.num_free_blocks() == free_decode)
    _wait_cancelled(prefill, "key-5")
    prefill.add(_request("p-5", {"do_remote_decode": True, "transfer_key": "key-5"}, max_tokens=1))
    prefill.run_until(lambda e: e.finished("p-5") is not None)
    assert prefill.finished("p-5").kv_transfer_params is None  # no lease drawn
    prefill.run_until(lambda e: e.num_free_blocks() == free_prefill, timeout_s=2.0)


def test_decode_abort_after_the_announcement_ends_prefills_lease_at_once(make_pair: Any) -> None:
    prefill, decode = make_pair()
    free_prefill, free_decode = prefill.num_free_blocks(), decode.num_free_blocks()
    decode.add(_request("d-6", _decode_params(prefill, "key-6")))
    decode.run_until(lambda e: _parked(e, "d-6"))
    prefill.add(_request("p-6", {"do_remote_decode": True, "transfer_key": "key-6"}, max_tokens=1))
    prefill.run_until(lambda e: e.finished("p-6") is not None)
    assert prefill.num_free_blocks() < free_prefill  # leased for decode
    decode.scheduler.finish_requests("d-6", RequestStatus.FINISHED_ABORTED)
    decode.run_until(lambda e: e.num_free_blocks() == free_decode)
    prefill.run_until(lambda e: e.num_free_blocks() == free_prefill, timeout_s=2.0)
    assert decode.load_specs == [] and sum(a.num_posted for a in decode.agents) == 0


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"transfer_key": "has spaces"}, "kv_transfer_params['transfer_key']: value 'has spaces'"),
        ({"remote_host": None}, "with transfer_key but remote_host missing"),
        (
            {"remote_request_id": "p-1", "remote_block_ids": [[0, 1]]},
            "transfer_key with remote_request_id, remote_block_ids",
        ),
        ({"transfer_key": 7}, "kv_transfer_params['transfer_key']: value 7"),
    ],
    ids=["key-with-spaces", "no-side-channel-host", "key-and-a-lease-both", "key-not-a-string"],
)
def test_malformed_overlapped_params_fail_one_request_not_the_engine(
    make_pair: Any,
    refusals: dict[str, LoadFailure],
    failed_loads: Any,
    overrides: dict[str, Any],
    message: str,
) -> None:
    prefill, decode = make_pair()
    free_decode = decode.num_free_blocks()
    decode.add(_request("bad", _decode_params(prefill, "key-7", **overrides)))
    decode.add(h.make_request("good", 20, block_size=BLOCK_SIZE, first_token=50))
    decode.run_until(lambda e: e.finished("bad") is not None and e.finished("good") is not None)
    assert str(decode.finished("good").finish_reason) == "length"
    assert str(decode.finished("bad").finish_reason) == "error"
    assert refusals["bad"].kind == "params" and message in refusals["bad"].message
    assert failed_loads() == {"params": 1}
    decode.run_until(lambda e: e.num_free_blocks() == free_decode)
