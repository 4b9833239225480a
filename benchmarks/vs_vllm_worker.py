"""Worker part of benchmarks/vs_vllm: the decode worker's ``start_load_kv`` per request.

Both connectors run in this process on a stand-in NIXL agent that does no I/O (a READ is
posted, then reported DONE at the first check), with the same model shape (32 layers, 8 KV
heads, head_dim 128, bf16, 16-token blocks, K and V planes per layer, heads outermost in a
block: vLLM's LBHNC, our HND, which vLLM needs for the TP2 -> TP1 case) and the same block
ids. vLLM's worker is built as its own unit tests build it: a real ``NixlPullConnectorWorker``
with the NIXL wrapper, the TP group and the platform patched, its real ``register_kv_caches``
on (untouched, lazily allocated) host tensors, and the remote agent added through its own
``add_remote_agent`` from the metadata its own prefill worker publishes. Ours is
``WorkerConnector`` with its handshake answered in process.

Since the transfer thread (``TransferThread``, worker/connector.py), our ``start_load_kv`` only
queues the step; the table also gives the transfer thread's plan and post of the request (plan,
descriptors, post: ``LoadTable._post``), which is work vLLM does inside its
``start_load_kv``. Each request is drained to its outcome before the next one, untimed on
both sides (vLLM's ``get_finished``, our passes that check the lease and see the READ done).

Cases are interleaved (vLLM, ours, vLLM, ...) in ``runs`` rounds; each round takes the median
of ``repeats`` calls; the table gives the median round and the range of the per-round ratios.
"""

from __future__ import annotations

import dataclasses
import random
import statistics
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from typing import Any
from unittest.mock import patch

import msgspec

from benchmarks.vs_vllm_common import (
    BLOCK_SIZE,
    HEAD_DIM,
    NUM_KV_HEADS,
    NUM_LAYERS,
    POOL_BLOCKS,
    kv_cache_config,
    layer_names,
    vllm_config,
)
from connector.config import ConnectorConfig
from connector.layout import GroupKind, GroupSpec, KVCacheSpec, LayerSpec, MemoryLayout
from connector.metadata import ConnectorMetadata, LoadSpec, RemoteSource
from connector.protocol import WorkerHandshake
from worker.connector import WorkerConnector
from worker.nixl_api import Descriptors, TransferState

PREFILL_ENGINE = "prefill"


@dataclass(frozen=True)
class Case:
    name: str
    num_tokens: int
    fragmented: bool
    prefill_tp: int = 1


CASES = (
    Case("2k tokens, contiguous ids", 2048, False),
    Case("2k tokens, fragmented ids", 2048, True),
    Case("32k tokens, contiguous ids", 32768, False),
    Case("32k tokens, fragmented ids", 32768, True),
    Case("prefill TP2 -> decode TP1, 8k", 8192, False, prefill_tp=2),
)


def block_ids(case: Case, seed: int) -> list[int]:
    num_blocks = case.num_tokens // BLOCK_SIZE
    if case.fragmented:
        return random.Random(seed).sample(range(POOL_BLOCKS), num_blocks)
    return list(range(seed * 16, seed * 16 + num_blocks))


# --- ours ------------------------------------------------------------------------------------


class NullAgent:
    """A NixlAgent that moves nothing: READs are DONE at their first check. Calls whose
    arguments do not matter here take any, so the stand-in follows the Protocol as it grows."""

    def __init__(self, name: str) -> None:
        self._name = name

    @property
    def name(self) -> str:
        return self._name

    def register_regions(self, *args: Any, **kwargs: Any) -> Any:
        return object()

    def deregister(self, registration: Any) -> None:
        pass

    def get_agent_metadata(self) -> bytes:
        return self._name.encode()

    def add_remote_agent(self, metadata: bytes) -> str:
        return metadata.decode()

    def remove_remote_agent(self, agent_name: str) -> None:
        pass

    def make_read(
        self, remote_agent: str, local: Descriptors, remote: Descriptors, *args: Any, **kwargs: Any
    ) -> Any:
        return (len(local), len(remote))

    def prepare_list(self, *args: Any, **kwargs: Any) -> Any:
        return object()

    def make_prepped_read(
        self, local_list: Any, local_indices: Any, remote_list: Any, remote_indices: Any,
        *args: Any, **kwargs: Any,
    ) -> Any:  # fmt: skip
        return (len(local_indices), len(remote_indices))

    def release_list(self, prepared: Any) -> None:
        pass

    def post(self, transfer: Any) -> TransferState:
        return TransferState.IN_PROGRESS

    def check(self, transfer: Any) -> TransferState:
        return TransferState.DONE

    def release(self, transfer: Any) -> None:
        pass

    def send_notif(self, remote_agent: str, message: bytes) -> None:
        pass

    def get_new_notifs(self) -> dict[str, list[bytes]]:
        return {}

    def close(self) -> None:
        pass


def our_spec(num_kv_heads: int = NUM_KV_HEADS) -> KVCacheSpec:
    layer = LayerSpec(name="l", num_kv_heads=num_kv_heads, head_dim=HEAD_DIM, dtype_bytes=2)
    group = GroupSpec(
        kind=GroupKind.FULL,
        block_size=BLOCK_SIZE,
        kernel_block_size=BLOCK_SIZE,
        num_blocks=POOL_BLOCKS,
        layers=(layer,) * NUM_LAYERS,
    )
    return KVCacheSpec(
        model="bench", dtype="bfloat16", cache_dtype="bfloat16", groups=(group,),
        memory_layout=MemoryLayout.HND,
    )  # fmt: skip


def _our_worker(engine_id: str, tp_rank: int, tp_size: int, fetch: Any = None) -> WorkerConnector:
    spec = our_spec()
    worker = WorkerConnector(
        ConnectorConfig(),
        engine_id=engine_id,
        tp_rank=tp_rank,
        tp_size=tp_size,
        spec=spec,
        agent=NullAgent(f"{engine_id}-{tp_rank}"),
        fetch=fetch,
        lease_check=lambda remote: True,  # no prefill scheduler here: every lease holds
    )
    from connector.geometry import build_rank_layout

    num_regions = len(build_rank_layout(spec, tp_rank, tp_size).region_bytes)
    worker.register_kv_caches([0x1_0000_0000 * (i + 1) for i in range(num_regions)])
    return worker


class Ours:
    """Our decode rank 0 of TP 1, READY with a prefill engine of each TP size in CASES."""

    def __init__(self) -> None:
        self._handshakes: dict[int, dict[int, WorkerHandshake]] = {}
        for prefill_tp in sorted({case.prefill_tp for case in CASES}):
            ranks = [_our_worker(PREFILL_ENGINE, r, prefill_tp) for r in range(prefill_tp)]
            self._handshakes[prefill_tp] = {
                r: w.get_handshake_metadata() for r, w in enumerate(ranks)
            }
            for w in ranks:
                w.shutdown()
        self.worker = _our_worker("decode", 0, 1, fetch=self._fetch)
        self._serial = 0
        # The transfer thread's plan + post of each request (LoadTable._post). Since the lease
        # check before the READs, the pass that applies a step only records the load; the
        # plan and post run in a later pass, once the check answered.
        self.pass_s: list[float] = []
        loads = self.worker._loads
        assert loads is not None
        post = loads._post

        def timed_post(*args: Any) -> None:
            started = time.perf_counter()
            post(*args)
            self.pass_s.append(time.perf_counter() - started)

        loads._post = timed_post  # type: ignore[method-assign]

    def _fetch(self, host: str, port: int, tp_rank: int) -> WorkerHandshake:
        return self._handshakes[port][tp_rank]

    def metadata(self, case: Case, local: list[int], remote: list[int]) -> ConnectorMetadata:
        self._serial += 1
        source = RemoteSource(
            PREFILL_ENGINE, "127.0.0.1", case.prefill_tp, case.prefill_tp,
            f"p{self._serial}", (tuple(remote),), boot_id="bench", lease_id=f"l{self._serial}",
        )  # fmt: skip
        spec = LoadSpec(f"d{self._serial}", (tuple(local),), case.num_tokens, 0, source)
        return ConnectorMetadata(loads=(spec,))

    def start_load_kv(self, metadata: ConnectorMetadata) -> None:
        self.worker.start_load_kv(metadata)

    def drain(self) -> None:
        """Untimed: passes until the last request is reported, so its finishing pass (poll,
        release, metrics) runs here, as vLLM's finishing runs in its untimed get_finished.
        One flush left it to the next request's timed pass whenever the flush's barrier
        reached the transfer thread with the request itself (most runs)."""
        request_id = f"d{self._serial}"
        deadline = time.monotonic() + 10.0
        while time.monotonic() < deadline:
            self.worker.flush()
            report = self.worker.get_finished()
            if request_id in report.failed_recving:
                raise RuntimeError(f"{request_id} failed: {report.failed_recving[request_id]}")
            if request_id in report.finished_recving:
                return
        raise RuntimeError(f"{request_id} did not finish within 10 s")

    def warm(self, case: Case) -> None:
        """Handshake (on its thread) and wait for the first request of this prefill TP."""
        local, remote = block_ids(case, 1), block_ids(case, 2)
        metadata = self.metadata(case, local, remote)
        request_id = metadata.loads[0].request_id
        self.worker.start_load_kv(metadata)
        deadline = time.monotonic() + 10.0
        while time.monotonic() < deadline:
            report = self.worker.get_finished()
            if request_id in report.failed_recving:
                raise RuntimeError(f"warm-up failed: {report.failed_recving[request_id]}")
            if request_id in report.finished_recving:
                return
            time.sleep(0.002)
        raise RuntimeError("our warm-up request did not finish within 10 s")

    def close(self) -> None:
        self.worker.shutdown()


# --- vLLM ------------------------------------------------------------------------------------


class StandInWrapper:
    """vLLM's NixlWrapper with no I/O: descriptors pass through, READs DONE at the first check."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self._handles = 0

    def _next(self) -> int:
        self._handles += 1
        return self._handles

    def get_reg_descs(self, data: Any, *args: Any, **kwargs: Any) -> Any:
        return data

    def get_xfer_descs(self, data: Any, *args: Any, **kwargs: Any) -> Any:
        return data

    def register_memory(self, *args: Any, **kwargs: Any) -> None:
        pass

    def deregister_memory(self, *args: Any, **kwargs: Any) -> None:
        pass

    def prep_xfer_dlist(self, *args: Any, **kwargs: Any) -> int:
        return self._next()

    def make_prepped_xfer(self, *args: Any, **kwargs: Any) -> int:
        return self._next()

    def transfer(self, *args: Any, **kwargs: Any) -> str:
        return "PROC"

    def check_xfer_state(self, handle: int) -> str:
        return "DONE"

    def get_agent_metadata(self) -> bytes:
        return b"stand-in"

    def add_remote_agent(self, metadata: bytes) -> str:
        return f"remote-{self._next()}"

    def get_new_notifs(self) -> dict[str, list[bytes]]:
        return {}

    def check_remote_metadata(self, agent: str) -> bool:
        return True

    def __getattr__(self, name: str) -> Callable[..., None]:
        return lambda *args, **kwargs: None  # release_*, remove_remote_agent, send_notif


class Vllm:
    """vLLM's decode worker (TP 1), handshaken with a prefill engine of each TP size in CASES."""

    def __init__(self) -> None:
        import torch
        from vllm.distributed.kv_transfer.kv_connector.v1.nixl import base_worker
        from vllm.distributed.kv_transfer.kv_connector.v1.nixl.metadata import (
            NixlAgentMetadata,
            NixlConnectorMetadata,
        )
        from vllm.platforms.cpu import CpuPlatform
        from vllm.v1.attention.backends.flash_attn import FlashAttentionBackend

        self._torch = torch
        self._metadata_type = NixlConnectorMetadata
        self._patches = ExitStack()
        self._patches.enter_context(patch.object(base_worker, "NixlWrapper", StandInWrapper))
        self._patches.enter_context(patch.object(base_worker, "current_platform", CpuPlatform()))
        self._patches.enter_context(
            patch.object(
                base_worker, "get_current_attn_backends", lambda *a, **k: [FlashAttentionBackend]
            )
        )
        self._tensors: list[Any] = []
        self.worker = self._worker(0, 1)
        for prefill_tp in sorted({case.prefill_tp for case in CASES}):
            engine_id = f"{PREFILL_ENGINE}-tp{prefill_tp}"
            agents = {}
            for rank in range(prefill_tp):
                payload = self._worker(rank, prefill_tp).get_handshake_metadata()
                meta = msgspec.msgpack.decode(payload.agent_metadata_bytes, type=NixlAgentMetadata)
                meta = dataclasses.replace(meta, engine_id=engine_id)
                agents[(0, rank)] = self.worker.connector_worker.add_remote_agent(
                    meta, remote_tp_rank=rank, remote_tp_size=prefill_tp
                )
            # What vLLM's handshake callback records once its handshake future resolves.
            self.worker.connector_worker._remote_agents[engine_id] = agents
            self.worker.connector_worker._engine_clock_offset[engine_id] = 0.0
            self.worker.connector_worker._engine_last_active[engine_id] = time.perf_counter()
            self.worker.connector_worker._track_remote_engine_replacement(
                engine_id, "127.0.0.1", prefill_tp
            )
        self._serial = 0

    def _worker(self, tp_rank: int, tp_size: int) -> Any:
        from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
        from vllm.distributed.kv_transfer.kv_connector.v1.nixl import base_worker
        from vllm.distributed.kv_transfer.kv_connector.v1.nixl.connector import NixlPullConnector
        from vllm.v1.kv_cache_interface import KVCacheTensor, create_kv_cache_views
        from vllm.v1.kv_cache_layout import KVCacheLayout

        torch = self._torch
        cache_config = kv_cache_config(POOL_BLOCKS, NUM_KV_HEADS // tp_size)
        spec = cache_config.kv_cache_groups[0].kv_cache_spec
        names = layer_names()
        config = vllm_config("vLLM")
        config.parallel_config.tensor_parallel_size = tp_size
        with (
            patch.object(base_worker, "get_tensor_model_parallel_rank", lambda: tp_rank),
            patch.object(base_worker, "get_tensor_model_parallel_world_size", lambda: tp_size),
        ):
            connector = NixlPullConnector(config, KVConnectorRole.WORKER, cache_config)
        page_bytes = spec.page_size_bytes
        # torch.empty does not touch the pages: 4 GiB of address space, no resident memory.
        raw = torch.empty(NUM_LAYERS * page_bytes * POOL_BLOCKS, dtype=torch.int8)
        placement = KVCacheTensor(
            size=raw.numel(), layers=names, layer_stride=page_bytes * POOL_BLOCKS,
            block_stride=page_bytes,
        )  # fmt: skip
        views = create_kv_cache_views(raw, spec, POOL_BLOCKS, KVCacheLayout["LBHNC"], placement)
        connector.register_kv_caches(dict(zip(names, views, strict=True)))
        self._tensors.append(raw)
        return connector

    def metadata(self, case: Case, local: list[int], remote: list[int]) -> Any:
        self._serial += 1
        metadata = self._metadata_type()
        params = {
            "remote_block_ids": [remote], "remote_engine_id": f"{PREFILL_ENGINE}-tp{case.prefill_tp}",
            "remote_request_id": f"p{self._serial}", "remote_host": "127.0.0.1",
            "remote_port": case.prefill_tp, "tp_size": case.prefill_tp,
        }  # fmt: skip
        metadata.add_new_req_to_recv(f"d{self._serial}", [local], params, awaiting_kvs=True)
        return metadata

    def start_load_kv(self, metadata: Any) -> None:
        self.worker.connector_worker.start_load_kv(metadata)

    def drain(self) -> None:
        worker = self.worker.connector_worker
        if not worker._failed_recv_reqs.empty():  # timing a failure path would mean nothing
            raise RuntimeError("vLLM's worker failed a request; see its log above")
        worker.get_finished()

    def close(self) -> None:
        self._patches.close()


# --- the run ---------------------------------------------------------------------------------


def _median_us(side: Any, case: Case, repeats: int) -> float:
    local, remote = block_ids(case, 1), block_ids(case, 2)
    samples = []
    for _ in range(repeats):
        metadata = side.metadata(case, local, remote)
        started = time.perf_counter()
        side.start_load_kv(metadata)
        samples.append(time.perf_counter() - started)
        side.drain()
    return statistics.median(samples) * 1e6


def _pass_us(ours: Ours, repeats: int) -> float:
    """Median transfer-thread plan + post of the last ``repeats`` requests."""
    return statistics.median(ours.pass_s[len(ours.pass_s) - repeats :]) * 1e6


@contextmanager
def sides() -> Iterator[tuple[Vllm, Ours]]:
    vllm, ours = Vllm(), Ours()
    try:
        for case in CASES:
            ours.warm(case)
        yield vllm, ours
    finally:
        ours.close()
        vllm.close()


def worker_rows(vllm: Vllm, ours: Ours, runs: int, repeats: int) -> list[str]:
    rounds: dict[str, list[tuple[float, float, float]]] = {case.name: [] for case in CASES}
    for _ in range(runs):
        for case in CASES:
            vllm_us = _median_us(vllm, case, repeats)
            ours_us = _median_us(ours, case, repeats)
            rounds[case.name].append((vllm_us, ours_us, _pass_us(ours, repeats)))
    lines = [
        "| request | vLLM µs | ours µs | vLLM / ours [range] "
        "| ours: transfer thread µs (plan + post) | vLLM / that [range] |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for name, triples in rounds.items():
        ratios = [v / o for v, o, _ in triples]
        off_thread = [v / p for v, _, p in triples]
        lines.append(
            f"| {name} | {statistics.median(v for v, _, _ in triples):,.0f} | "
            f"{statistics.median(o for _, o, _ in triples):,.1f} | "
            f"{statistics.median(ratios):.0f} [{min(ratios):.0f}-{max(ratios):.0f}] | "
            f"{statistics.median(p for _, _, p in triples):,.0f} | "
            f"{statistics.median(off_thread):.2f} [{min(off_thread):.2f}-{max(off_thread):.2f}] |"
        )
    return lines
