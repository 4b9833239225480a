"""Side by side with vLLM 0.33's NixlConnector: the decode worker's ``start_load_kv`` per request.

Both connectors run in this process on a stand-in NIXL agent that does no I/O (a READ is
posted, then reported DONE at the first check), with the same model shape (32 layers, 8 KV
heads, head_dim 128, bf16, 16-token blocks, K and V planes per layer, heads outermost in a block: vLLM's LBHNC, our HND, which vLLM
needs for the TP2 -> TP1 case) and the same block ids.
vLLM's worker is built as its own unit tests build it: a real ``NixlPullConnectorWorker``
with the NIXL wrapper, the TP group and the platform patched, its real ``register_kv_caches``
on (untouched, lazily allocated) host tensors, and the remote agent added through its own
``add_remote_agent`` from the metadata its own prefill worker publishes. Ours is
``WorkerConnector`` with its handshake answered in process.

Since the transfer thread (worker/transfer_thread.py), our ``start_load_kv`` only queues the
step; the table also gives the transfer thread's pass that applies it (plan, descriptors,
post), which is work vLLM does inside its ``start_load_kv``.

Cases are interleaved (vLLM, ours, vLLM, ...) in ``--runs`` rounds; each round takes the
median of ``--repeats`` calls; the table gives the median round and the range of the
per-round ratios. The machine is a shared 2-core box: rerun before quoting.

Run: ``.venv/bin/python -m benchmarks.vs_vllm`` (about a minute; vLLM is imported once).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import random
import statistics
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from unittest.mock import patch

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import msgspec  # noqa: E402
import numpy as np  # noqa: E402

from connector.config import ConnectorConfig  # noqa: E402
from connector.layout import (  # noqa: E402
    GroupKind,
    GroupSpec,
    KVCacheSpec,
    LayerSpec,
    MemoryLayout,
)
from connector.metadata import ConnectorMetadata, LoadSpec, RemoteSource  # noqa: E402
from connector.protocol import WorkerHandshake  # noqa: E402
from worker.connector import WorkerConnector  # noqa: E402
from worker.nixl_api import Descriptors, TransferState  # noqa: E402

NUM_LAYERS = 32
NUM_KV_HEADS = 8
HEAD_DIM = 128
BLOCK_SIZE = 16
POOL_BLOCKS = 4096  # per side: room for a 32k-token request, fragmented ids drawn from it
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
    """A NixlAgent that moves nothing: READs are DONE at their first check."""

    def __init__(self, name: str) -> None:
        self.name = name

    def register_regions(self, regions: Any) -> Any:
        return object()

    def deregister(self, registration: Any) -> None:
        pass

    def get_agent_metadata(self) -> bytes:
        return self.name.encode()

    def add_remote_agent(self, metadata: bytes) -> str:
        return metadata.decode()

    def remove_remote_agent(self, agent_name: str) -> None:
        pass

    def make_read(
        self, remote_agent: str, local: Descriptors, remote: Descriptors, notif: bytes = b""
    ) -> Any:
        return (len(local), len(remote))

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
        self.pass_s: list[float] = []  # transfer-thread passes that applied a step
        transfer = self.worker._transfer
        assert transfer is not None
        step = transfer._step

        def timed_step(batch: list[ConnectorMetadata]) -> None:
            started = time.perf_counter()
            step(batch)
            if batch:
                self.pass_s.append(time.perf_counter() - started)

        transfer._step = timed_step

    def _fetch(self, host: str, port: int, tp_rank: int) -> WorkerHandshake:
        return self._handshakes[port][tp_rank]

    def metadata(self, case: Case, local: list[int], remote: list[int]) -> ConnectorMetadata:
        self._serial += 1
        source = RemoteSource(
            PREFILL_ENGINE, "127.0.0.1", case.prefill_tp, case.prefill_tp,
            f"p{self._serial}", (tuple(remote),),
        )  # fmt: skip
        spec = LoadSpec(f"d{self._serial}", (tuple(local),), case.num_tokens, 0, source)
        return ConnectorMetadata(loads=(spec,))

    def start_load_kv(self, metadata: ConnectorMetadata) -> None:
        self.worker.start_load_kv(metadata)

    def drain(self) -> None:
        self.worker.flush()  # untimed: the pass that plans and posts, recorded in pass_s
        self.worker.get_finished()

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


def _model_folder() -> Path:
    folder = Path(tempfile.mkdtemp(prefix="vs-vllm-model-"))
    config = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 4096,
        "intermediate_size": 128, "num_attention_heads": 32,
        "num_key_value_heads": NUM_KV_HEADS, "head_dim": HEAD_DIM,
        "num_hidden_layers": NUM_LAYERS, "vocab_size": 256, "max_position_embeddings": 65536,
        "rms_norm_eps": 1e-6, "torch_dtype": "bfloat16",
    }  # fmt: skip
    (folder / "config.json").write_text(json.dumps(config))
    return folder


class Vllm:
    """vLLM's decode worker (TP 1), handshaken with a prefill engine of each TP size in CASES."""

    def __init__(self) -> None:
        import torch
        from vllm.config import (
            CacheConfig,
            DeviceConfig,
            KVTransferConfig,
            ModelConfig,
            SchedulerConfig,
            VllmConfig,
        )
        from vllm.distributed.kv_transfer.kv_connector.v1.nixl import base_worker
        from vllm.distributed.kv_transfer.kv_connector.v1.nixl.metadata import (
            NixlAgentMetadata,
            NixlConnectorMetadata,
        )
        from vllm.platforms.cpu import CpuPlatform
        from vllm.v1.attention.backends.flash_attn import FlashAttentionBackend

        self._torch = torch
        self._metadata_type = NixlConnectorMetadata
        model = ModelConfig(
            model=str(_model_folder()), skip_tokenizer_init=True, dtype="bfloat16", seed=0,
            max_model_len=40000,
        )  # fmt: skip

        def config() -> Any:
            made = VllmConfig(
                model_config=model,
                scheduler_config=SchedulerConfig(
                    max_num_seqs=16,
                    max_num_batched_tokens=512,
                    max_model_len=40000,
                    is_encoder_decoder=False,
                ),  # fmt: skip
                cache_config=CacheConfig(block_size=BLOCK_SIZE, enable_prefix_caching=True),
                kv_transfer_config=KVTransferConfig(
                    kv_connector="NixlConnector", kv_role="kv_both", kv_buffer_device="cpu"
                ),
                device_config=DeviceConfig("cpu"),
            )
            made.cache_config.kv_cache_layout = "LBHNC"
            return made

        self._config = config
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
        from vllm.v1.kv_cache_interface import (
            FullAttentionSpec,
            KVCacheConfig,
            KVCacheGroupSpec,
            KVCacheTensor,
            create_kv_cache_views,
        )
        from vllm.v1.kv_cache_layout import KVCacheLayout

        torch = self._torch
        heads = NUM_KV_HEADS // tp_size
        spec = FullAttentionSpec(
            block_size=BLOCK_SIZE, num_kv_heads=heads, head_size=HEAD_DIM, dtype=torch.bfloat16
        )
        names = [f"model.layers.{i}.self_attn.attn" for i in range(NUM_LAYERS)]
        cache_config = KVCacheConfig(
            num_blocks=POOL_BLOCKS, kv_cache_tensors=[],
            kv_cache_groups=[KVCacheGroupSpec(names, spec)], kv_cache_layout="LBHNC",
        )  # fmt: skip
        config = self._config()
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


# --- scheduler hooks ------------------------------------------------------------------------


class SchedulerHooks:
    """Both scheduler-side connectors (vLLM's NixlConnector, our NixlPDConnector) and fresh
    requests for them: decode's ``get_num_new_matched_tokens`` on a request carrying prefill's
    params, prefill's ``request_finished`` on a finished ``do_remote_decode`` request."""

    def __init__(self, vllm: Vllm) -> None:
        import socket

        import torch
        from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
        from vllm.distributed.kv_transfer.kv_connector.v1.nixl.connector import (
            NixlPullConnector,
        )
        from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec

        from connector.vllm import NixlPDConnector

        with socket.socket() as probe:  # our scheduler side binds its side channel
            probe.bind(("127.0.0.1", 0))
            os.environ["VLLM_NIXL_SIDE_CHANNEL_PORT"] = str(probe.getsockname()[1])
        spec = FullAttentionSpec(
            block_size=BLOCK_SIZE, num_kv_heads=NUM_KV_HEADS, head_size=HEAD_DIM,
            dtype=torch.bfloat16,
        )  # fmt: skip
        names = [f"model.layers.{i}.self_attn.attn" for i in range(NUM_LAYERS)]
        cache_config = KVCacheConfig(
            num_blocks=POOL_BLOCKS, kv_cache_tensors=[],
            kv_cache_groups=[KVCacheGroupSpec(names, spec)], kv_cache_layout="LBHNC",
        )  # fmt: skip
        ours_config = vllm._config()
        ours_config.kv_transfer_config.kv_connector = "NixlPDConnector"
        ours_config.kv_transfer_config.kv_connector_module_path = "connector.vllm"
        self.sides = {
            "vLLM": NixlPullConnector(vllm._config(), KVConnectorRole.SCHEDULER, cache_config),
            "ours": NixlPDConnector(ours_config, KVConnectorRole.SCHEDULER, cache_config),
        }
        self._serial = 0

    def _request(self, params: dict[str, Any]) -> Any:
        from vllm import SamplingParams
        from vllm.v1.request import Request

        self._serial += 1
        request = Request(
            request_id=f"s{self._serial}", prompt_token_ids=list(range(2048)),
            sampling_params=SamplingParams(max_tokens=1), pooling_params=None,
        )  # fmt: skip
        request.kv_transfer_params = params
        return request

    def matched_us(self, side: str, repeats: int) -> float:
        samples = []
        for _ in range(repeats):
            request = self._request({
                "do_remote_prefill": True, "do_remote_decode": False,
                "remote_engine_id": "prefill", "remote_request_id": f"p{self._serial}",
                "remote_block_ids": [list(range(128))], "remote_host": "127.0.0.1",
                "remote_port": 5600, "tp_size": 1,
            })  # fmt: skip
            started = time.perf_counter()
            self.sides[side].get_num_new_matched_tokens(request, 0)
            samples.append(time.perf_counter() - started)
        return statistics.median(samples) * 1e6

    def finished_us(self, side: str, repeats: int) -> float:
        from vllm.v1.request import RequestStatus

        samples = []
        for _ in range(repeats):
            request = self._request({"do_remote_decode": True})
            request.status = RequestStatus.FINISHED_LENGTH_CAPPED
            started = time.perf_counter()
            self.sides[side].request_finished(request, list(range(128)))
            samples.append(time.perf_counter() - started)
        return statistics.median(samples) * 1e6

    def close(self) -> None:
        for connector in self.sides.values():
            connector.shutdown()


def scheduler_rows(hooks: SchedulerHooks, runs: int, repeats: int) -> list[str]:
    lines = [
        "| hook, per request | vLLM µs | ours µs | vLLM / ours [range] |",
        "|---|---:|---:|---:|",
    ]
    for name, measure in (
        ("decode get_num_new_matched_tokens", hooks.matched_us),
        ("prefill request_finished", hooks.finished_us),
    ):
        pairs = [(measure("vLLM", repeats), measure("ours", repeats)) for _ in range(runs)]
        ratios = [v / o for v, o in pairs]
        lines.append(
            f"| {name} | {statistics.median(v for v, _ in pairs):,.1f} | "
            f"{statistics.median(o for _, o in pairs):,.1f} | "
            f"{statistics.median(ratios):.2f} [{min(ratios):.2f}-{max(ratios):.2f}] |"
        )
    return lines


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
    """Median transfer-thread pass (apply, plan, post) of the last ``repeats`` requests."""
    return statistics.median(ours.pass_s[len(ours.pass_s) - repeats :]) * 1e6


@contextmanager
def _sides() -> Iterator[tuple[Vllm, Ours]]:
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=15)
    args = parser.parse_args()
    np.seterr(all="ignore")
    with _sides() as (vllm, ours):
        print(f"decode start_load_kv per request ({args.runs} interleaved runs)")
        print("\n".join(worker_rows(vllm, ours, args.runs, args.repeats)))
        hooks = SchedulerHooks(vllm)
        try:
            print(f"\nscheduler hooks per request ({args.runs} interleaved runs)")
            print("\n".join(scheduler_rows(hooks, args.runs, args.repeats * 4)))
        finally:
            hooks.close()


if __name__ == "__main__":
    main()
