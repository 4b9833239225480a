"""Host staging through vLLM 0.33's real Scheduler: CPU tensors stand in for the device cache.

A stand-in model runner writes each step's KV (only the token positions the step computes,
so chunked prefill half-fills blocks), then calls ``wait_for_save`` as vLLM's runner does.
With ``kv_buffer_device: "cpu"`` NIXL (FakeNixl, moving real bytes) reads host buffers only,
and decode's device blocks must end byte-identical to the direct path's.
"""

from __future__ import annotations

import importlib.util
import os
import types
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

if importlib.util.find_spec("vllm") is None and not os.environ.get("NIXL_PD_REQUIRE_VLLM"):
    pytest.skip("vllm is not installed (scripts/install_vllm.sh)", allow_module_level=True)

from vllm.v1.core.kv_cache_planning import get_kv_cache_config_from_groups  # noqa: E402
from vllm.v1.engine import FinishReason  # noqa: E402
from vllm.v1.kv_cache_interface import KVCacheConfig, KVCacheGroupSpec  # noqa: E402
from vllm.v1.kv_cache_layout import KVCacheLayout  # noqa: E402
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput  # noqa: E402
from vllm.v1.worker.utils import allocate_kv_cache  # noqa: E402

from tests import vllm_harness as h  # noqa: E402

pytestmark = pytest.mark.vllm

BLOCK_SIZE = 16
NUM_BLOCKS = 64
STAGED = {"kv_buffer_device": "cpu"}


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Any:
    return h.model_config(h.write_tiny_model(Path(tmp_path_factory.mktemp("tiny-llama"))))


def _value(request_id: str, rank: int, layer: str, position: int) -> float:
    """The KV value the stand-in model writes for one token: deterministic, per rank/layer."""
    return float(sum(map(ord, request_id)) * 1000 + rank * 100 + int(layer[-1]) * 10) + position


def _group_of(engine: h.Engine) -> dict[str, int]:
    """Each layer's vLLM cache group (the index into a request's block table)."""
    groups = engine.scheduler.kv_cache_config.kv_cache_groups
    return {name: index for index, group in enumerate(groups) for name in group.layer_names}


def _forward(engine: h.Engine, scheduled: Any, rank: int) -> None:
    """Write the KV of every prompt position scheduled this step on a prefill engine, each
    layer into its own cache group's blocks."""
    manager = engine.scheduler.kv_cache_manager
    caches = engine.kv_caches[rank]
    group_of = _group_of(engine)
    for request_id, num_tokens in scheduled.num_scheduled_tokens.items():
        request = engine.scheduler.requests[request_id]
        # vLLM's scheduler advanced num_computed_tokens when it scheduled the step.
        start = request.num_computed_tokens - num_tokens
        end = min(start + num_tokens, request.num_prompt_tokens)
        table = manager.get_block_ids(request_id)
        for position in range(start, end):
            slot = position % BLOCK_SIZE
            for name, tensor in caches.items():
                block = table[group_of[name]][position // BLOCK_SIZE]
                tensor[block, :, slot] = _value(request_id, rank, name, position)


def _partial(request: Any) -> bool:
    return bool(request.num_computed_tokens < request.num_prompt_tokens)


def _run_rank_like_the_model_runner(
    self: h.Engine, worker: Any, scheduled: Any, *, save: bool
) -> ModelRunnerOutput:
    """vLLM's order: bind, start_load_kv, forward, wait_for_save, get_transfer_results."""
    worker.bind_connector_metadata(h._across_processes(scheduled.kv_connector_metadata))
    worker.start_load_kv(None)
    if self.name == "prefill":
        _forward(self, scheduled, self.workers.index(worker))
    if save:
        worker.wait_for_save()
    results = worker.get_transfer_results(scheduled.finished_req_ids)
    kv_output = KVConnectorOutput(
        finished_sending=results.finished_sending or None,
        finished_recving=results.finished_recving or None,
        failed_recving=results.failed_recving,
        kv_connector_worker_meta=h._across_processes(worker.build_connector_worker_meta()),
    )
    worker.clear_connector_metadata()
    req_ids = list(scheduled.num_scheduled_tokens)
    requests = self.scheduler.requests
    return ModelRunnerOutput(
        req_ids=req_ids,
        req_id_to_index={rid: index for index, rid in enumerate(req_ids)},
        # A partial prefill samples nothing (vLLM's runner drops its token).
        sampled_token_ids=[
            [h.SAMPLED_TOKEN] if not _partial(requests[rid]) else [] for rid in req_ids
        ],
        kv_connector_output=kv_output,
    )


def _vllm_allocation(cache_config: Any) -> dict[str, torch.Tensor]:
    """What vLLM's model runner registers: its own allocator's views, in the config's layout."""
    return allocate_kv_cache(
        cache_config, torch.device("cpu"), KVCacheLayout[cache_config.kv_cache_layout]
    )


@pytest.fixture
def make_pair(model: Any, monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    engines: list[h.Engine] = []

    def make(
        extra: dict[str, Any] | None,
        *,
        tp_sizes: tuple[int, int] = (1, 1),
        chunk_tokens: int | None = None,
        save: bool = True,
        layout: str | None = None,
        kv_cache: Callable[[str], KVCacheConfig] | None = None,
    ) -> tuple[h.Engine, h.Engine]:
        """``kv_cache``: each engine's cache config by name ("prefill", "decode"), TP 1."""
        if layout is not None:  # vLLM's own planner and allocator lay the cache out
            monkeypatch.setattr(h, "allocate_kv_caches", _vllm_allocation)
        pair = []
        for (name, role), tp_size in zip(
            (("prefill", "kv_producer"), ("decode", "kv_consumer")), tp_sizes, strict=True
        ):
            config = h.vllm_config(model, kv_role=role, extra_config=extra, tp_size=tp_size)
            if chunk_tokens is not None and name == "prefill":
                config.scheduler_config.max_num_batched_tokens = chunk_tokens
            cache = h.kv_cache_config(block_size=BLOCK_SIZE, num_blocks=NUM_BLOCKS, tp_size=tp_size)
            if kv_cache is not None:
                cache = kv_cache(name)
            if layout is not None:
                config.cache_config.kv_cache_layout = layout
                config.cache_config.num_gpu_blocks_override = NUM_BLOCKS
                cache = get_kv_cache_config_from_groups(config, cache.kv_cache_groups, 1 << 30)
                cache.kv_cache_layout = layout
            engine = h.build_engine(name, config, cache, port=h.free_port(), env=monkeypatch)
            run = types.MethodType(_run_rank_like_the_model_runner, engine)
            engine._run_rank = lambda worker, scheduled, run=run: run(  # type: ignore[method-assign]
                worker, scheduled, save=save
            )
            engines.append(engine)
            pair.append(engine)
        return pair[0], pair[1]

    yield make
    for engine in engines:
        engine.shutdown()


def _transfer_all_groups(
    prefill: h.Engine, decode: h.Engine, request_id: str, num_tokens: int
) -> tuple[list[list[int]], list[list[int]]]:
    """Prefill then decode one request; returns (decode's block table, one list per vLLM
    cache group; prefill's leased blocks, one list per transfer group)."""
    params = h.prefill_for_decode(prefill, request_id, num_tokens, block_size=BLOCK_SIZE)
    decode.add(
        h.make_request(
            request_id, num_tokens, block_size=BLOCK_SIZE, kv_transfer_params=params, max_tokens=3
        )
    )
    table = h.run_until_loaded(decode, request_id)
    return table, [list(group) for group in params["remote_block_ids"]]


def _transfer(prefill: h.Engine, decode: h.Engine, request_id: str, num_tokens: int) -> Any:
    """Prefill then decode one request; returns (decode's loaded blocks, prefill's blocks)."""
    table, leased = _transfer_all_groups(prefill, decode, request_id, num_tokens)
    return table[0], leased[0]


def _prompt_bytes(engine: h.Engine, blocks: list[int], num_tokens: int) -> list[bytes]:
    """Every rank's every layer's KV of tokens [0, num_tokens), in token order."""
    result = []
    for caches in engine.kv_caches:
        for name in sorted(caches):
            tensor = caches[name]
            rows = [tensor[blocks[p // BLOCK_SIZE], :, p % BLOCK_SIZE] for p in range(num_tokens)]
            result.append(torch.stack(rows).numpy().tobytes())
    return result


CASES = [
    pytest.param(3 * BLOCK_SIZE, (1, 1), None, None, id="whole-blocks"),
    pytest.param(2 * BLOCK_SIZE + 5, (1, 1), None, None, id="a-partial-last-block"),
    pytest.param(100, (1, 1), 40, None, id="chunked-prefill-half-fills-blocks-between-steps"),
    pytest.param(3 * BLOCK_SIZE, (1, 2), None, None, id="prefill-tp1-to-decode-tp2"),
    pytest.param(2 * BLOCK_SIZE + 5, (1, 1), None, "BLNHC", id="block-outermost-layout"),
]


@pytest.mark.parametrize(("num_tokens", "tp_sizes", "chunk_tokens", "layout"), CASES)
def test_staged_path_gives_the_direct_paths_bytes(
    make_pair: Any,
    num_tokens: int,
    tp_sizes: tuple[int, int],
    chunk_tokens: int | None,
    layout: str | None,
) -> None:
    results = {}
    for mode, extra in (("direct", None), ("staged", STAGED)):
        prefill, decode = make_pair(
            extra, tp_sizes=tp_sizes, chunk_tokens=chunk_tokens, layout=layout
        )
        loaded, prefill_blocks = _transfer(prefill, decode, f"req-{num_tokens}", num_tokens)
        expected = _prompt_bytes(prefill, prefill_blocks, num_tokens - 1)
        got = _prompt_bytes(decode, loaded, num_tokens - 1)
        results[mode] = got
        if tp_sizes[0] == tp_sizes[1]:
            assert got == expected, f"{mode}: decode's KV differs from prefill's"
    assert results["staged"] == results["direct"]
    assert any(b != bytes(len(b)) for b in results["staged"]), "nothing was written"


def test_staging_registers_the_host_buffer_not_the_device_cache(make_pair: Any) -> None:
    prefill, decode = make_pair(STAGED)
    for engine in (prefill, decode):
        device_addresses = {t.data_ptr() for t in engine.kv_caches[0].values()}
        registered = {
            address
            for reg in engine.agents[0]._registrations.values()
            for address, _ in reg.regions
        }
        assert registered and not registered & device_addresses


def test_without_the_device_to_host_copy_decode_gets_no_kv(make_pair: Any) -> None:
    """The control: the staged path's bytes come through wait_for_save's copy, nothing else."""
    prefill, decode = make_pair(STAGED, save=False)
    num_tokens = 2 * BLOCK_SIZE
    loaded, _ = _transfer(prefill, decode, "req-unsaved", num_tokens)
    got = _prompt_bytes(decode, loaded, num_tokens - 1)
    assert all(b == bytes(len(b)) for b in got)


def test_set_host_xfer_buffer_ops_is_used_for_every_copy(make_pair: Any) -> None:
    prefill, decode = make_pair(STAGED)
    calls: list[tuple[str, int]] = []

    def copy_op(src: Any, dst: Any, src_ids: list[int], dst_ids: list[int], direction: str) -> None:
        calls.append((direction, len(src_ids)))
        for name, tensor in src.items():
            dst[name][dst_ids] = tensor[src_ids].to(dst[name].device)

    for engine in (prefill, decode):
        for worker in engine.workers:
            worker.set_host_xfer_buffer_ops(copy_op)
    num_tokens = 3 * BLOCK_SIZE
    loaded, prefill_blocks = _transfer(prefill, decode, "req-op", num_tokens)
    # One batched call per direction: 3 blocks out on prefill, 3 blocks in on decode.
    assert calls == [("d2h", 3), ("h2d", 3)]
    assert _prompt_bytes(decode, loaded, num_tokens - 1) == _prompt_bytes(
        prefill, prefill_blocks, num_tokens - 1
    )


def _finish_through_a_copy_op(make_pair: Any, side: str, broken_direction: str | None) -> Any:
    """One request prefilled and decoded with verify_kv and host staging, ``side``'s copies
    made by a copy op that changes one value of the copies in ``broken_direction`` ("d2h",
    "h2d" or None); returns decode's finish reason."""
    prefill, decode = make_pair({**STAGED, "verify_kv": True})

    def copy_op(src: Any, dst: Any, src_ids: list[int], dst_ids: list[int], direction: str) -> None:
        for name, tensor in src.items():
            dst[name][dst_ids] = tensor[src_ids].to(dst[name].device)
        if direction == broken_direction:
            first_layer = dst[sorted(dst)[0]]
            first_layer[(dst_ids[-1],) + (0,) * (first_layer.dim() - 1)] += 1.0  # one value

    for worker in (prefill if side == "prefill" else decode).workers:
        worker.set_host_xfer_buffer_ops(copy_op)
    request_id, num_tokens = f"req-{side}-{broken_direction}", 3 * BLOCK_SIZE
    params = h.prefill_for_decode(prefill, request_id, num_tokens, block_size=BLOCK_SIZE)
    decode.add(
        h.make_request(
            request_id, num_tokens, block_size=BLOCK_SIZE, kv_transfer_params=params, max_tokens=3
        )
    )

    def ended(engine: h.Engine) -> bool:
        prefill.step()  # its ranks report the lease's digests through its steps
        return engine.finished(request_id) is not None

    decode.run_until(ended, timeout_s=20.0)
    return decode.finished(request_id).finish_reason


@pytest.mark.parametrize("broken", [False, True], ids=["control-a-right-copy", "one-bit-flipped"])
def test_verify_kv_fails_a_load_whose_copy_to_the_device_differs_from_what_was_read(
    make_pair: Any, broken: bool
) -> None:
    """verify_kv proves the host bytes the READs brought; the copy to the device after them
    is compared with those bytes, and a load whose device blocks differ fails ("digest")."""
    reason = _finish_through_a_copy_op(make_pair, "decode", "h2d" if broken else None)
    assert reason == (FinishReason.ERROR if broken else FinishReason.LENGTH)


@pytest.mark.parametrize("broken", [False, True], ids=["copy-right", "copy-changes-a-value"])
def test_verify_kv_ends_the_lease_of_a_request_whose_copy_to_the_host_differs(
    make_pair: Any, broken: bool
) -> None:
    """Prefill's digests, and every READ, see the host copy of its blocks: a device->host copy
    that differs from the device blocks ends the request's lease, so decode's load fails
    (its failure policy decides) instead of succeeding on bytes prefill never computed."""
    reason = _finish_through_a_copy_op(make_pair, "prefill", "d2h" if broken else None)
    assert reason == (FinishReason.ERROR if broken else FinishReason.LENGTH)


class _OnCuda(torch.Tensor):
    """A host tensor that says it lives on cuda:1: what the adapter reads off vLLM's caches."""

    @property
    def device(self) -> torch.device:  # type: ignore[override]
        return torch.device("cuda", 1)

    @property
    def is_cuda(self) -> bool:  # type: ignore[override]
        return True


def _worker(model: Any, extra: dict[str, Any] | None, agent: Any = None) -> Any:
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    from connector.vllm import NixlPDConnector

    config = h.vllm_config(model, kv_role="kv_producer", extra_config=extra)
    cache = h.kv_cache_config(block_size=BLOCK_SIZE, num_blocks=NUM_BLOCKS)
    worker = NixlPDConnector(config, KVConnectorRole.WORKER, cache, tp_rank=0, agent=agent)
    return worker, cache


def test_a_gpu_kv_cache_is_registered_as_vram_of_its_device(
    model: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    import msgspec

    from connector.memory import Memory, MemoryKind
    from connector.protocol import WorkerHandshake
    from tests.nixl_recorder import Recorder, load_recorded_nixl_real

    recorder = Recorder()
    nixl_real = load_recorded_nixl_real(monkeypatch, recorder)
    worker, cache = _worker(model, None, nixl_real.RealNixlAgent("p", backends=("UCX",)))
    caches = {
        name: torch.Tensor._make_subclass(_OnCuda, tensor)
        for name, tensor in h.allocate_kv_caches(cache).items()
    }
    try:
        worker.register_kv_caches(caches)
        handshake = msgspec.msgpack.decode(
            worker.get_handshake_metadata().payload, type=WorkerHandshake
        )
    finally:
        worker.shutdown()
    ((rows, mem_type),) = recorder.of("register_memory")
    assert mem_type == "VRAM"
    assert sorted(address for address, _, _ in rows) == sorted(
        t.data_ptr() for t in caches.values()
    )
    assert {device for _, _, device in rows} == {1}
    assert handshake.memory == Memory(MemoryKind.GPU, 1)


def test_a_gpu_kv_cache_staged_registers_host_memory(
    model: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    from tests.nixl_recorder import Recorder, load_recorded_nixl_real

    recorder = Recorder()
    nixl_real = load_recorded_nixl_real(monkeypatch, recorder)
    worker, cache = _worker(model, STAGED, nixl_real.RealNixlAgent("p", backends=("UCX",)))
    caches = {
        name: torch.Tensor._make_subclass(_OnCuda, tensor)
        for name, tensor in h.allocate_kv_caches(cache).items()
    }
    try:
        worker.register_kv_caches(caches)
    finally:
        worker.shutdown()
    ((rows, mem_type),) = recorder.of("register_memory")
    assert mem_type == "DRAM"
    assert not {address for address, _, _ in rows} & {t.data_ptr() for t in caches.values()}


def test_the_backends_key_builds_the_agent_with_every_backend(
    model: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    from tests.nixl_recorder import Recorder, load_recorded_nixl_real

    recorder = Recorder()
    load_recorded_nixl_real(monkeypatch, recorder)
    worker, _ = _worker(model, {"backends": ["UCX", "POSIX"], "num_threads": 2})
    worker.shutdown()
    assert recorder.of("create_backend") == [("UCX", {"num_threads": "2"}), ("POSIX", {})]


def test_vllms_copy_op_is_ignored_on_its_cpu_platform(
    make_pair: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """vLLM's CPU platform has no block swap ops: a forced staging copies with torch there."""
    from connector.vllm import facade

    monkeypatch.setattr(facade, "_platform_device", lambda: "cpu")
    prefill, decode = make_pair(STAGED)

    def unusable(*args: Any) -> None:
        raise NotImplementedError("CpuPlatform has no swap_out_blocks_to_host")

    for engine in (prefill, decode):
        for worker in engine.workers:
            worker.set_host_xfer_buffer_ops(unusable)
    num_tokens = 2 * BLOCK_SIZE + 3
    loaded, prefill_blocks = _transfer(prefill, decode, "req-cpu-op", num_tokens)
    assert _prompt_bytes(decode, loaded, num_tokens - 1) == _prompt_bytes(
        prefill, prefill_blocks, num_tokens - 1
    )


def _with_a_group_outside_transfers(hidden_first: bool) -> KVCacheConfig:
    """layers.1 in the one transfer group; layers.0 in a group vLLM keeps out of transfers
    (``enable_kv_transfer=False``, as vLLM 0.33's HiSparse builds its hot and resident
    groups), placed before the transfer group or after it. The two groups take different
    blocks of the pool, so copying one group's blocks for the other's leaves the lease stale.
    """
    dense = h.kv_cache_config(block_size=BLOCK_SIZE, num_blocks=NUM_BLOCKS)
    spec = dense.kv_cache_groups[0].kv_cache_spec
    hidden = KVCacheGroupSpec(["layers.0"], spec, enable_kv_transfer=False)
    transfer = KVCacheGroupSpec(["layers.1"], spec)
    groups = [hidden, transfer] if hidden_first else [transfer, hidden]
    return KVCacheConfig(
        num_blocks=NUM_BLOCKS, kv_cache_tensors=[], kv_cache_groups=groups, kv_cache_layout="LBNHC"
    )


def _transfer_layer_bytes(engine: h.Engine, blocks: list[int], num_tokens: int) -> bytes:
    """The transfer layer's (layers.1) KV of tokens [0, num_tokens) on rank 0, in token order."""
    tensor = engine.kv_caches[0]["layers.1"]
    rows = [tensor[blocks[p // BLOCK_SIZE], :, p % BLOCK_SIZE] for p in range(num_tokens)]
    return bytes(torch.stack(rows).numpy().tobytes())


GROUP_ORDER_CASES = [
    pytest.param(True, True, id="a-non-transfer-group-before-the-transfer-group-on-both"),
    pytest.param(True, False, id="device-to-host-on-prefill-with-a-non-transfer-group-first"),
    pytest.param(False, True, id="host-to-device-on-decode-with-a-non-transfer-group-first"),
    pytest.param(False, False, id="control-the-transfer-group-first-on-both"),
]


@pytest.mark.parametrize(("prefill_hidden_first", "decode_hidden_first"), GROUP_ORDER_CASES)
def test_staging_copies_the_leased_transfer_groups_blocks(
    make_pair: Any, prefill_hidden_first: bool, decode_hidden_first: bool
) -> None:
    """Both staged copies (prefill device->host, decode host->device) take the transfer
    group's blocks, wherever vLLM puts that group among its cache groups."""
    hidden_first = {"prefill": prefill_hidden_first, "decode": decode_hidden_first}
    num_tokens = 2 * BLOCK_SIZE + 5
    for mode, extra in (("direct", None), ("staged", STAGED)):
        prefill, decode = make_pair(
            extra, kv_cache=lambda name: _with_a_group_outside_transfers(hidden_first[name])
        )
        table, (leased,) = _transfer_all_groups(prefill, decode, f"req-{mode}", num_tokens)
        (transfer_group,) = decode.scheduler.kv_cache_config.transfer_group_ids
        expected = _transfer_layer_bytes(prefill, leased, num_tokens - 1)
        got = _transfer_layer_bytes(decode, table[transfer_group], num_tokens - 1)
        assert expected != bytes(len(expected)), "prefill wrote nothing"
        assert got == expected, f"{mode}: decode's transfer-group KV differs from prefill's"


def _output(new_block_ids: tuple[list[int], ...], cached_block_ids: tuple[list[int], ...]) -> Any:
    """A vLLM SchedulerOutput with one new request "new" and one running request "running"."""
    from vllm.v1.core.sched.output import NewRequestData, SchedulerOutput

    output = SchedulerOutput.make_empty()
    output.scheduled_new_reqs = [
        NewRequestData("new", [1] * 40, [], None, None, new_block_ids, 0, None)
    ]
    cached = output.scheduled_cached_reqs
    cached.req_ids = ["running"]
    cached.new_block_ids = [cached_block_ids]
    cached.num_computed_tokens = [16]
    output.num_scheduled_tokens = {"new": 40, "running": 16}
    return output


def _groups(*transfers: bool) -> KVCacheConfig:
    spec = h.kv_cache_config(block_size=BLOCK_SIZE, num_blocks=NUM_BLOCKS).kv_cache_groups[0]
    groups = [
        KVCacheGroupSpec([f"layers.{index}"], spec.kv_cache_spec, enable_kv_transfer=transfer)
        for index, transfer in enumerate(transfers)
    ]
    return KVCacheConfig(num_blocks=NUM_BLOCKS, kv_cache_tensors=[], kv_cache_groups=groups)


ROW_CASES = [
    pytest.param((True,), ((1, 2, 3),), ((9,),), id="one-group-passes-through"),
    pytest.param((False, True), ((4, 5, 6),), ((10,),), id="a-non-transfer-group-first-is-dropped"),
    pytest.param(
        (False, True, True), ((4, 5, 6), (7, 8)), ((10,), (11,)), id="transfer-groups-in-order"
    ),
    pytest.param((True, False), ((1, 2, 3),), ((9,),), id="a-non-transfer-group-last-is-dropped"),
]


@pytest.mark.parametrize(("transfers", "new_blocks", "running_blocks"), ROW_CASES)
def test_scheduled_rows_carry_the_transfer_groups_as_the_lease_names_them(
    transfers: tuple[bool, ...], new_blocks: Any, running_blocks: Any
) -> None:
    from connector.vllm.staging import scheduled_rows

    every_group = ([1, 2, 3], [4, 5, 6], [7, 8])[: len(transfers)]
    every_new = ([9], [10], [11])[: len(transfers)]
    rows = list(scheduled_rows(_output(every_group, every_new), _groups(*transfers)))
    assert [(row.request_id, row.block_ids, row.full_table) for row in rows] == [
        ("new", new_blocks, True),
        ("running", running_blocks, False),
    ]


def test_scheduled_rows_refuse_a_row_of_other_groups_than_the_config_has() -> None:
    from connector.errors import UnsupportedConfiguration
    from connector.vllm.staging import scheduled_rows

    with pytest.raises(
        UnsupportedConfiguration,
        match="gives request 'new' block lists for 1 KV cache groups, but the KV cache config "
        "has 2",
    ):
        list(scheduled_rows(_output(([1, 2],), ([3],)), _groups(False, True)))
