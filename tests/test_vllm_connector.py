"""NixlPDConnector inside vLLM 0.33's real Scheduler: P/D lifecycles with FakeNixl on the CPU."""

from __future__ import annotations

import importlib.util
import itertools
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

if importlib.util.find_spec("vllm") is None and not os.environ.get("NIXL_PD_REQUIRE_VLLM"):
    pytest.skip(
        "vllm is not installed (scripts/install_vllm.sh); CI sets NIXL_PD_REQUIRE_VLLM",
        allow_module_level=True,
    )

from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.v1.base import (  # noqa: E402
    KVConnectorRole,
    supports_hma,
)
from vllm.v1.request import RequestStatus  # noqa: E402

from connector.errors import UnsupportedConfiguration  # noqa: E402
from connector.layout import GroupKind, MemoryLayout  # noqa: E402
from connector.vllm import NixlPDConnector  # noqa: E402
from tests import vllm_harness as h  # noqa: E402

pytestmark = pytest.mark.vllm

BLOCK_SIZE = 16
NUM_BLOCKS = 64


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Any:
    return h.model_config(h.write_tiny_model(Path(tmp_path_factory.mktemp("tiny-llama"))))


@pytest.fixture
def make_pair(model: Any, monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    engines: list[h.Engine] = []

    def make(
        *,
        failure_policy: str = "fail",
        window: int | None = None,
        extra: dict | None = None,
        tp_sizes: tuple[int, int] = (1, 1),
    ) -> tuple[h.Engine, h.Engine]:
        pair = []
        roles = (("prefill", "kv_producer"), ("decode", "kv_consumer"))
        for (name, role), tp_size in zip(roles, tp_sizes, strict=True):
            config = h.vllm_config(
                model,
                kv_role=role,
                failure_policy=failure_policy,
                extra_config=extra,
                tp_size=tp_size,
            )
            cache = h.kv_cache_config(
                block_size=BLOCK_SIZE, num_blocks=NUM_BLOCKS, window=window, tp_size=tp_size
            )
            engine = h.build_engine(name, config, cache, port=h.free_port(), env=monkeypatch)
            engines.append(engine)
            pair.append(engine)
        return pair[0], pair[1]

    yield make
    for engine in engines:
        engine.shutdown()


def _prefill(prefill: h.Engine, request_id: str, num_tokens: int) -> dict[str, Any]:
    return h.prefill_for_decode(prefill, request_id, num_tokens, block_size=BLOCK_SIZE)


# Well-formed decode params for a prefill engine that is never reached (the tests using them
# must fail before any handshake).
PREFILL_PARAMS: dict[str, Any] = {
    "do_remote_prefill": True,
    "remote_engine_id": "prefill-x",
    "remote_request_id": "cmpl-1",
    "remote_block_ids": [[0, 1]],
    "remote_host": "127.0.0.1",
    "remote_port": 9,
}


def _nested(depth: int) -> list[Any]:
    value: list[Any] = []
    for _ in range(depth):
        value = [value]
    return value


def _decode_request(request_id: str, num_tokens: int, params: dict[str, Any]) -> Any:
    return h.make_request(
        request_id, num_tokens, block_size=BLOCK_SIZE, kv_transfer_params=params, max_tokens=3
    )


def test_factory_loads_connector_by_module_path(make_pair: Any) -> None:
    prefill, decode = make_pair()
    for engine in (prefill, decode):
        connector = KVConnectorFactory.create_connector(
            engine.scheduler.vllm_config,
            KVConnectorRole.SCHEDULER,
            engine.scheduler.kv_cache_config,
        )
        assert type(connector).__name__ == "NixlPDConnector"
        assert supports_hma(connector)
        connector.shutdown()
    assert isinstance(prefill.scheduler.connector, NixlPDConnector)
    assert not NixlPDConnector.supports_sleep_mode(prefill.scheduler.vllm_config.kv_transfer_config)


def test_prefill_to_decode_moves_bytes_and_frees_blocks(make_pair: Any) -> None:
    prefill, decode = make_pair()
    num_tokens = 3 * BLOCK_SIZE
    free_prefill, free_decode = prefill.num_free_blocks(), decode.num_free_blocks()
    params = _prefill(prefill, "req-1", num_tokens)
    assert params["do_remote_prefill"] is True
    assert params["remote_request_id"] == "req-1"
    prefill_blocks = params["remote_block_ids"]
    assert prefill.num_free_blocks() < free_prefill, "prefill freed blocks decode must read"
    h.fill_blocks(prefill, prefill_blocks, seed=1)

    decode.add(_decode_request("req-1", num_tokens, params))
    decode.run_until(lambda e: e.finished("req-1") is not None)
    prefill.run_until(lambda e: e.num_free_blocks() == free_prefill)

    assert decode.num_free_blocks() == free_decode
    assert decode.finished("req-1").new_token_ids == [h.SAMPLED_TOKEN]
    assert decode.stats == {
        "loads_finished": 1,
        "loads_failed": 0,
        "loads_aborted": 0,
        "sends_finished": 0,
    }
    assert prefill.stats == {
        "loads_finished": 0,
        "loads_failed": 0,
        "loads_aborted": 0,
        "sends_finished": 1,
    }


@pytest.mark.parametrize("tp_sizes", [(1, 1), (1, 2)], ids=["decode-tp1", "decode-tp2"])
def test_a_finished_load_reaches_vllm_in_the_step_it_finished(
    make_pair: Any, tp_sizes: tuple[int, int], monkeypatch: pytest.MonkeyPatch
) -> None:
    # As with vLLM's own connector, every decode rank reports its finished READ to vLLM in the
    # step it ends; vLLM's aggregator passes it on once all ranks did. No echo step between.
    prefill, decode = make_pair(tp_sizes=tp_sizes)
    params = _prefill(prefill, "req-t", 2 * BLOCK_SIZE)
    reported_at: dict[int, int] = {}  # tp_rank -> the step its report listed the load
    reached_vllm: list[int] = []  # steps whose aggregated output listed it
    aggregate = decode.aggregator.aggregate
    step_numbers = itertools.count()

    def recording(outputs: list[Any], output_rank: int = 0) -> Any:
        step = next(step_numbers)
        for output in outputs:
            meta = output.kv_connector_output.kv_connector_worker_meta
            for report in meta.reports if meta else ():
                if "req-t" in report.finished_recving:
                    reported_at.setdefault(report.tp_rank, step)
        merged = aggregate(outputs, output_rank)
        if "req-t" in (merged.kv_connector_output.finished_recving or ()):
            reached_vllm.append(step)
        return merged

    monkeypatch.setattr(decode.aggregator, "aggregate", recording)
    decode.add(_decode_request("req-t", 2 * BLOCK_SIZE, params))
    decode.run_until(lambda e: e.finished("req-t") is not None)
    assert sorted(reported_at) == list(range(tp_sizes[1]))
    assert reached_vllm == [max(reported_at.values())]


def test_steps_that_skip_start_load_kv_lose_nothing(make_pair: Any) -> None:
    prefill, decode = make_pair()
    free_prefill, free_decode = prefill.num_free_blocks(), decode.num_free_blocks()
    params = _prefill(prefill, "req-s", 2 * BLOCK_SIZE)
    prefill.call_start_load_kv = decode.call_start_load_kv = False
    decode.add(_decode_request("req-s", 2 * BLOCK_SIZE, params))
    decode.run_until(lambda e: e.finished("req-s") is not None)
    prefill.run_until(lambda e: e.num_free_blocks() == free_prefill)
    decode.run_until(lambda e: e.num_free_blocks() == free_decode)


def test_decode_reads_the_prefill_bytes(make_pair: Any) -> None:
    prefill, decode = make_pair()
    num_tokens = 2 * BLOCK_SIZE
    params = _prefill(prefill, "req-b", num_tokens)
    prefill_blocks = params["remote_block_ids"]
    h.fill_blocks(prefill, prefill_blocks, seed=7)
    expected = h.block_bytes(prefill, 0, 0, prefill_blocks[0][:2])

    decode.add(_decode_request("req-b", num_tokens, params))
    loaded = h.run_until_loaded(decode, "req-b")
    assert h.block_bytes(decode, 0, 0, loaded[0][:2]) == expected


def _loads_the_bytes(reader: h.Engine, writer: h.Engine, request_id: str, params: Any) -> None:
    """``reader`` loads ``request_id`` with ``params`` and holds ``writer``'s bytes."""
    writer_blocks = params["remote_block_ids"]
    h.fill_blocks(writer, writer_blocks, seed=11)
    expected = h.block_bytes(writer, 0, 0, writer_blocks[0][:2])
    reader.add(_decode_request(request_id, 2 * BLOCK_SIZE, params))
    loaded = h.run_until_loaded(reader, request_id)
    assert h.block_bytes(reader, 0, 0, loaded[0][:2]) == expected
    reader.run_until(lambda e: e.finished(request_id) is not None)
    assert str(reader.finished(request_id).finish_reason) == "length"
    assert reader.stats["loads_finished"] == 1 and reader.stats["loads_failed"] == 0


def test_params_as_vllm_accepts_them_load(make_pair: Any) -> None:
    # vLLM's connector defaults a missing tp_size to 1 and takes the port as a string too.
    prefill, decode = make_pair()
    params = _prefill(prefill, "req-v", 2 * BLOCK_SIZE)
    assert params["transfer_mode"] == "pull" and params["remote_num_tokens"] == 2 * BLOCK_SIZE
    del params["tp_size"]
    params["remote_port"] = str(params["remote_port"])
    _loads_the_bytes(decode, prefill, "req-v", params)


def test_roles_are_advisory(make_pair: Any) -> None:
    # A kv_consumer engine handed do_remote_decode serves as the prefill, and a kv_producer
    # handed the params it returns loads them: as vLLM's NixlConnector does.
    producer, consumer = make_pair()
    params = _prefill(consumer, "req-r", 2 * BLOCK_SIZE)
    _loads_the_bytes(producer, consumer, "req-r", params)


def test_decode_prefix_hit_reads_only_the_uncached_suffix(make_pair: Any) -> None:
    prefill, decode = make_pair()
    num_tokens = 3 * BLOCK_SIZE
    first = _prefill(prefill, "first", num_tokens)
    h.fill_blocks(prefill, first["remote_block_ids"], seed=11)
    decode.add(_decode_request("first", num_tokens, first))
    decode.run_until(lambda e: e.finished("first") is not None)

    second = _prefill(prefill, "second", num_tokens)  # the same prompt
    h.fill_blocks(prefill, second["remote_block_ids"], seed=12)  # new bytes everywhere
    prefill_bytes = h.block_bytes(prefill, 0, 0, second["remote_block_ids"][0])
    decode.add(_decode_request("second", num_tokens, second))
    loaded = h.run_until_loaded(decode, "second")[0][:3]
    decode_bytes = h.block_bytes(decode, 0, 0, loaded)
    assert decode_bytes[2] == prefill_bytes[2], "the uncached last block was not loaded"
    assert decode_bytes[:2] != prefill_bytes[:2], "cached blocks were overwritten by a READ"


@pytest.mark.parametrize(
    "tp_sizes",
    [(2, 2), (2, 1), (1, 2)],
    ids=["prefill-tp2-decode-tp2", "prefill-tp2-decode-tp1", "prefill-tp1-decode-tp2"],
)
def test_tensor_parallel_pairs_move_every_head(make_pair: Any, tp_sizes: tuple[int, int]) -> None:
    prefill, decode = make_pair(tp_sizes=tp_sizes)
    num_tokens = 2 * BLOCK_SIZE
    free_prefill, free_decode = prefill.num_free_blocks(), decode.num_free_blocks()
    params = _prefill(prefill, "req-tp", num_tokens)
    assert params["tp_size"] == tp_sizes[0]
    blocks = params["remote_block_ids"][0][:2]
    h.fill_blocks(prefill, [blocks], seed=3)
    expected = h.heads_bytes(prefill, blocks)
    decode.add(_decode_request("req-tp", num_tokens, params))
    loaded = h.run_until_loaded(decode, "req-tp")[0][:2]
    assert h.heads_bytes(decode, loaded) == expected
    decode.run_until(lambda e: e.finished("req-tp") is not None)
    prefill.run_until(lambda e: e.num_free_blocks() == free_prefill)
    decode.run_until(lambda e: e.num_free_blocks() == free_decode)


@pytest.mark.parametrize(
    ("policy", "expect_error"),
    [("fail", True), ("recompute", False)],
    ids=["fail-policy-errors-the-request", "recompute-policy-computes-locally"],
)
def test_failed_load_follows_policy(make_pair: Any, policy: str, expect_error: bool) -> None:
    prefill, decode = make_pair(failure_policy=policy)
    num_tokens = 2 * BLOCK_SIZE
    free_decode = decode.num_free_blocks()
    params = _prefill(prefill, "req-f", num_tokens)
    for agent in decode.agents:
        agent.faults.fail_transfers = 1
    decode.add(_decode_request("req-f", num_tokens, params))
    decode.run_until(lambda e: e.finished("req-f") is not None)
    reason = decode.finished("req-f").finish_reason
    assert (str(reason) == "error") is expect_error, reason
    assert decode.stats["loads_failed"] == 1
    decode.run_until(lambda e: e.num_free_blocks() == free_decode)


@pytest.mark.parametrize(
    "params",
    [
        {"do_remote_prefill": True, "remote_block_ids": "not-a-list"},
        {"do_remote_prefill": True, "remote_engine_id": 5, "remote_request_id": "x"},
        # json.loads('"\\ud800"') gives a lone surrogate; no encoder downstream takes it.
        {**PREFILL_PARAMS, "remote_request_id": "cmpl-\ud800"},
        {**PREFILL_PARAMS, "x_router_hint": {"trace": "\udfff"}},
        {**PREFILL_PARAMS, "x_router_hint": _nested(5000)},
    ],
    ids=[
        "block-ids-not-a-list",
        "missing-keys-and-wrong-types",
        "lone-surrogate-in-remote-request-id",
        "lone-surrogate-in-an-unknown-key",
        "unknown-key-nested-5000-deep",
    ],
)
@pytest.mark.parametrize("policy", ["fail", "recompute"])
def test_malformed_params_fail_one_request_not_the_engine(
    make_pair: Any, params: dict[str, Any], policy: str
) -> None:
    _, decode = make_pair(failure_policy=policy)
    free_decode = decode.num_free_blocks()
    decode.add(h.make_request("bad", 20, block_size=BLOCK_SIZE, kv_transfer_params=params))
    decode.add(h.make_request("good", 20, block_size=BLOCK_SIZE, first_token=50))
    decode.run_until(lambda e: e.finished("bad") is not None and e.finished("good") is not None)
    assert str(decode.finished("good").finish_reason) == "length"
    expected = "error" if policy == "fail" else "length"
    assert str(decode.finished("bad").finish_reason) == expected
    decode.run_until(lambda e: e.num_free_blocks() == free_decode)


def test_decode_abort_with_a_read_in_flight_frees_both_sides(make_pair: Any) -> None:
    prefill, decode = make_pair()
    num_tokens = 2 * BLOCK_SIZE
    free_prefill, free_decode = prefill.num_free_blocks(), decode.num_free_blocks()
    params = _prefill(prefill, "req-a", num_tokens)
    (agent,) = decode.agents
    agent.faults.stall_polls = 5  # the READ stays in flight for 5 polls
    decode.add(_decode_request("req-a", num_tokens, params))
    decode.run_until(lambda e: agent.num_posted == 1)
    decode.scheduler.finish_requests("req-a", RequestStatus.FINISHED_ABORTED)
    assert decode.num_free_blocks() < free_decode, "decode freed blocks under a live READ"
    decode.run_until(lambda e: e.num_free_blocks() == free_decode)
    prefill.run_until(lambda e: e.num_free_blocks() == free_prefill)


def test_several_requests_in_flight_finish_independently(make_pair: Any) -> None:
    prefill, decode = make_pair()
    free_prefill, free_decode = prefill.num_free_blocks(), decode.num_free_blocks()
    lengths = {"r-a": 20, "r-b": 2 * BLOCK_SIZE, "r-c": 45}
    all_params = {rid: _prefill(prefill, rid, n) for rid, n in lengths.items()}
    for rid, n in lengths.items():
        decode.add(_decode_request(rid, n, all_params[rid]))
    decode.run_until(lambda e: all(e.finished(rid) is not None for rid in lengths))
    assert {str(decode.finished(rid).finish_reason) for rid in lengths} == {"length"}
    prefill.run_until(lambda e: e.num_free_blocks() == free_prefill)
    decode.run_until(lambda e: e.num_free_blocks() == free_decode)


def test_unread_prefill_blocks_are_freed_when_the_lease_expires(make_pair: Any) -> None:
    prefill, _ = make_pair(extra={"kv_lease_duration": 0.3, "heartbeat_interval": 0.1})
    free_prefill = prefill.num_free_blocks()
    _prefill(prefill, "req-l", 2 * BLOCK_SIZE)
    assert prefill.num_free_blocks() < free_prefill
    prefill.run_until(lambda e: e.num_free_blocks() == free_prefill, timeout_s=5.0)


def test_prefill_abort_offers_nothing(make_pair: Any) -> None:
    prefill, _ = make_pair()
    free_prefill = prefill.num_free_blocks()
    prefill.add(
        h.make_request(
            "req-p", 40, block_size=BLOCK_SIZE, kv_transfer_params={"do_remote_decode": True}
        )
    )
    prefill.step()
    prefill.scheduler.finish_requests("req-p", RequestStatus.FINISHED_ABORTED)
    prefill.step()
    assert prefill.num_free_blocks() == free_prefill


def test_hybrid_sliding_window_and_full_attention(make_pair: Any) -> None:
    """HMA: the full group moves every transferred token, the sliding group only the window
    of the first token decode computes. Backed off by one (a sliding window), prefill computes
    63 of the 64 tokens and frees the blocks before token 63's window [48, 63]; decode loads
    63 and reads [48, 63) of the sliding group."""
    prefill, decode = make_pair(window=BLOCK_SIZE)
    spec = prefill.connector.kv_cache_spec()
    assert [group.kind for group in spec.groups] == [GroupKind.FULL, GroupKind.SLIDING_WINDOW]
    num_tokens = 4 * BLOCK_SIZE
    loaded_tokens, window = range(num_tokens - 1), range(num_tokens - BLOCK_SIZE, num_tokens - 1)
    free_prefill, free_decode = prefill.num_free_blocks(), decode.num_free_blocks()
    params = _prefill(prefill, "req-h", num_tokens)
    full, sliding = params["remote_block_ids"]
    assert len(full) == 4 and sliding[:3] == [0, 0, 0], "out-of-window blocks are vLLM's null"
    h.fill_blocks(prefill, [full, sliding[3:]], seed=5)
    expected = [
        h.token_bytes(prefill, 0, full, loaded_tokens),
        h.token_bytes(prefill, 1, sliding, window),
    ]
    decode.add(_decode_request("req-h", num_tokens, params))
    loaded = h.run_until_loaded(decode, "req-h")
    got = [
        h.token_bytes(decode, 0, loaded[0], loaded_tokens),
        h.token_bytes(decode, 1, loaded[1], window),
    ]
    assert got == expected
    decode.run_until(lambda e: e.finished("req-h") is not None)
    assert str(decode.finished("req-h").finish_reason) == "length"
    prefill.run_until(lambda e: e.num_free_blocks() == free_prefill)
    decode.run_until(lambda e: e.num_free_blocks() == free_decode)


def test_translation_of_vllm_cache_config(make_pair: Any) -> None:
    prefill, _ = make_pair()
    spec = prefill.connector.kv_cache_spec()
    assert spec.memory_layout is MemoryLayout.NHD_PACKED
    (group,) = spec.groups
    assert (group.block_size, group.num_blocks) == (BLOCK_SIZE, NUM_BLOCKS)
    assert [(layer.num_kv_heads, layer.head_dim, layer.dtype_bytes) for layer in group.layers] == [
        (h.MODEL_KV_HEADS, h.HEAD_SIZE, 4)
    ] * h.NUM_LAYERS


def test_importing_our_packages_never_imports_vllm() -> None:
    code = (
        "import sys, connector, connector.config, connector.params, connector.layout, "
        "scheduler.connector, worker.connector, worker.fake; "
        "assert 'vllm' not in sys.modules, 'vllm was imported'"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=Path(__file__).parent.parent)


def test_unknown_extra_config_key_is_rejected(model: Any) -> None:
    config = h.vllm_config(model, kv_role="kv_producer", extra_config={"lease": 3})
    cache = h.kv_cache_config(block_size=BLOCK_SIZE, num_blocks=NUM_BLOCKS)
    with pytest.raises(UnsupportedConfiguration, match="unknown key 'lease'"):
        NixlPDConnector(config, KVConnectorRole.SCHEDULER, cache)
