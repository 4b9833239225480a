"""The vLLM 0.33 adapter: NixlPDConnector maps vLLM's connector calls onto our connectors.

Load it with ``--kv-transfer-config '{"kv_connector": "NixlPDConnector",
"kv_connector_module_path": "connector.vllm", "kv_role": "kv_producer", ...}'``. Only this
package imports vllm; importing ``connector`` never does.
The scheduler half lives in connector.vllm.scheduler, the worker half in connector.vllm.worker.

Who decides what (one request's journey through vLLM):
- Scheduler process: our SchedulerConnector owns request state. Each step it builds our
  ConnectorMetadata, and after the step it reads every rank's WorkerReport (carried back in
  vLLM's worker metadata) and decides which requests finished or failed.
- A load a rank ran (a LoadSpec) is reported to vLLM by that rank from
  ``get_transfer_results`` in the step it ends, as vLLM's own connector does; vLLM's output
  aggregator passes it on once every rank did, and applies its ``kv_load_failure_policy``
  to failures. vLLM's aggregate also reaches our SchedulerConnector, which counts it as the
  ranks' word. Decisions only the scheduler makes (invalid params, unplannable loads,
  prefill frees) reach vLLM through the next step: every rank echoes them. Either way a
  failure never crashes the engine.
- Host staging (kv_buffer_device "cpu", connector/vllm/staging.py): the scheduler adds to
  each step's metadata the requests whose prefill completes in it (their transfer groups'
  blocks, as the lease names them) and, multi-turn, the holds leased since the last step
  (``stage_out``: not readable until every rank reports its copy); ranks copy those blocks
  device->host in wait_for_save, and loaded blocks host->device before reporting a load.
- Malformed kv_transfer_params fail only their request: SchedulerConnector (its params bind
  at allocation, as vLLM binds a request) answers "tokens will
  arrive", and the adapter announces the request as a failed load in the same step; vLLM then
  fails it ("fail") or recomputes it locally ("recompute").
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import msgspec
import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorHandshakeMetadata,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
    KVConnectorWorkerMetadata,
    SupportsHMA,
)
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
    PromMetric,
    PromMetricT,
)

from connector.config import ConnectorConfig
from connector.errors import UnsupportedConfiguration
from connector.layout import BlockFormat, KVCacheSpec
from connector.observability.freeze_watch import start_freeze_watch
from connector.observability.metrics import default_recorder
from connector.params import raw_flag
from connector.staging import SaveTracker
from connector.vllm.backends import block_formats_of
from connector.vllm.layout import (
    dtype_name,
    kv_cache_spec_from_vllm,
    memory_layout_of,
)
from connector.vllm.metrics import NixlPDPromMetrics, NixlPDStats
from connector.vllm.scales import kv_scales_of
from connector.vllm.scheduler import (
    NixlPDMetadata,
    SchedulerSide,
    prefill_backoff_tokens,
    truncate_for_prefill,
)
from connector.vllm.staging import CopyBlocksOp, scheduled_rows, staging_enabled
from connector.vllm.worker import WorkerSide
from scheduler.connector import SchedulerConnector
from scheduler.requests import Role
from worker.nixl_api import NixlAgent

if TYPE_CHECKING:
    from vllm.config import KVTransferConfig, VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

_ROLES = {"kv_producer": Role.PRODUCER, "kv_consumer": Role.CONSUMER, "kv_both": Role.BOTH}


class NixlPDConnector(KVConnectorBase_V1, SupportsHMA):
    """vLLM's entry point; one per process role (scheduler, or one per worker rank).

    Keyword-only seams for tests and embedders: ``connector_config`` replaces the config read
    from kv_connector_extra_config + env, ``tp_rank`` the rank read from vLLM's parallel
    state, ``agent`` the NIXL agent this worker rank would create, ``block_formats`` (one per
    transfer group) what this worker would read off its attention layers.
    """

    def __init__(
        self,
        vllm_config: VllmConfig,
        role: KVConnectorRole,
        kv_cache_config: KVCacheConfig,
        *,
        connector_config: ConnectorConfig | None = None,
        tp_rank: int | None = None,
        agent: NixlAgent | None = None,
        block_formats: Sequence[BlockFormat] | None = None,
    ) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        transfer = self._kv_transfer_config
        parallel = vllm_config.parallel_config
        if parallel.pipeline_parallel_size != 1:
            raise UnsupportedConfiguration(
                f"pipeline_parallel_size={parallel.pipeline_parallel_size}: NixlPDConnector "
                "supports tensor parallelism only; use pipeline_parallel_size 1"
            )
        dcp_size = int(getattr(parallel, "decode_context_parallel_size", 1) or 1)
        if dcp_size > 1:
            raise UnsupportedConfiguration(
                f"decode_context_parallel_size={dcp_size}: NixlPDConnector does not split a "
                "request's KV across context-parallel ranks; use decode_context_parallel_size 1"
            )
        if transfer.kv_role not in _ROLES:
            raise UnsupportedConfiguration(
                f"kv_role {transfer.kv_role!r} is not accepted; expected one of {sorted(_ROLES)}"
            )
        config = connector_config or ConnectorConfig.from_sources(
            transfer.kv_connector_extra_config
        )
        if connector_config is None and parallel.data_parallel_index:
            # One side channel per data-parallel engine, as vLLM's NixlConnector does.
            port = config.side_channel_port + parallel.data_parallel_index
            config = msgspec.structs.replace(config, side_channel_port=port)
        self._config = config
        self._engine_id = str(transfer.engine_id)
        self._tp_size = parallel.tensor_parallel_size
        self._backoff = prefill_backoff_tokens(vllm_config, kv_cache_config)
        self._scheduler: SchedulerSide | None = None
        self._worker: WorkerSide | None = None
        staging = staging_enabled(config, transfer.kv_buffer_device, _platform_device())
        # Prefill with host staging: requests whose blocks go device->host when prefill ends.
        self._saves: SaveTracker | None = SaveTracker() if staging else None
        if role is KVConnectorRole.SCHEDULER:
            connector = SchedulerConnector(
                config,
                engine_id=self._engine_id,
                role=_ROLES[transfer.kv_role],
                spec=self.kv_cache_spec(),
                tp_size=self._tp_size,
                host_staging=staging,
            )
            self._scheduler = SchedulerSide(
                connector, kv_cache_config, backoff_tokens=self._backoff
            )
        else:
            rank = _tp_rank(self._tp_size) if tp_rank is None else tp_rank
            self._worker = WorkerSide(
                config,
                engine_id=self._engine_id,
                tp_rank=rank,
                tp_size=self._tp_size,
                agent=agent or self._create_agent(rank),
                kv_cache_config=kv_cache_config,
                spec_for=lambda kernels: self.kv_cache_spec(
                    kernels,
                    block_formats or block_formats_of(vllm_config, kv_cache_config),
                    kv_scales_of(vllm_config, kv_cache_config),
                ),
                staging=staging,
            )
        # Engine processes can stop whole for seconds on a loaded host; say why when one does.
        start_freeze_watch(f"{role.name.lower()} of engine {self._engine_id} (pid {os.getpid()}): ")

    # ---- configuration shared by both roles --------------------------------------------

    @classmethod
    def supports_sleep_mode(cls, kv_transfer_config: KVTransferConfig) -> bool:
        """No: sleep remaps KV memory, and registered regions and peers' handshakes would go
        stale (vLLM then refuses --enable-sleep-mode at start instead of corrupting KV)."""
        return False

    @property
    def supports_divergent_local_hybrid_hits(self) -> bool:
        """Yes: a hybrid's local full-attention hit may run deeper than its local SSM state,
        and a load always brings the state for the prompt's end (an SSM group's last block)
        with the uncached attention suffix, so the load completes such a hit. vLLM then keeps
        the deeper attention hit as local (without this, a hybrid's decode reuses no
        prefix: a load never brings the block-boundary states vLLM's own hits need)."""
        return True

    @classmethod
    def get_required_kvcache_layout(cls, vllm_config: VllmConfig) -> str | None:
        """No requirement: LBNHC, LBHNC, BLNHC and BLHNC all translate, and the attention
        backend may support only some. Block-outermost layouts read one descriptor per block
        row (opt in with VLLM_KV_CACHE_LAYOUT=BLHNC); BHLNC and LHBNC are refused at start."""
        return None

    def kv_cache_spec(
        self,
        kernel_block_sizes: tuple[int, ...] | None = None,
        block_formats: Sequence[BlockFormat] | None = None,
        kv_scales: Mapping[str, tuple[float, float]] | None = None,
    ) -> KVCacheSpec:
        """Our KVCacheSpec for this engine (kernel block sizes, formats, scales: workers only)."""
        model = self._vllm_config.model_config
        cache = self._vllm_config.cache_config
        dtype = dtype_name(model.dtype)
        return kv_cache_spec_from_vllm(
            self._kv_cache_config,
            model=str(model.model),
            dtype=dtype,
            cache_dtype=dtype if cache.cache_dtype == "auto" else str(cache.cache_dtype),
            model_kv_heads=model.get_total_num_kv_heads(),
            tp_size=self._tp_size,
            memory_layout=memory_layout_of(self._kv_cache_config.kv_cache_layout),
            kernel_block_sizes=kernel_block_sizes,
            block_formats=block_formats,
            kv_scales=kv_scales,
        )

    def _create_agent(self, tp_rank: int) -> NixlAgent:
        from worker.nixl_real import RealNixlAgent  # imports nixl: only real worker ranks

        # A fresh name per start: a restarted peer under an old name is refused by NIXL.
        name = f"{self._engine_id}-tp{tp_rank}-{uuid.uuid4().hex[:8]}"
        return RealNixlAgent(
            name, backends=self._config.backends, num_threads=self._config.num_threads
        )

    def _require_scheduler(self) -> SchedulerSide:
        if self._scheduler is None:
            raise UnsupportedConfiguration("a scheduler-side method was called on a worker")
        return self._scheduler

    def _require_worker(self) -> WorkerSide:
        if self._worker is None:
            raise UnsupportedConfiguration("a worker-side method was called on the scheduler")
        return self._worker

    # ---- scheduler side ----------------------------------------------------------------

    # The hooks vLLM calls per request read self._scheduler directly (a call less each):
    # on a worker it is None, and _require_scheduler raises the clear error.

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        scheduler = self._scheduler or self._require_scheduler()
        return scheduler.get_num_new_matched_tokens(request, num_computed_tokens)

    def on_new_request(self, request: Request) -> None:
        """Prefill side: stop ``backoff`` tokens short where decode must compute them (SSM)."""
        self._require_scheduler()
        truncate_for_prefill(request, self._backoff)

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        scheduler = self._scheduler or self._require_scheduler()
        scheduler.update_state_after_alloc(request, blocks, num_external_tokens)
        if scheduler.connector.chunk_leases is not None:  # chunked pulls: prefill follows it
            scheduler.track_chunks(request)
        if self._saves is not None and raw_flag(request.kv_transfer_params, "do_remote_decode"):
            self._saves.track(request.request_id, request.num_prompt_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        scheduler = self._scheduler or self._require_scheduler()
        metadata = scheduler.build_connector_meta()
        if scheduler.connector.chunk_leases is not None:
            metadata = scheduler.step_chunks(metadata, scheduler_output)
        if self._saves is None or not len(self._saves):
            return metadata
        saves = self._saves.step(scheduled_rows(scheduler_output, self._kv_cache_config))
        return NixlPDMetadata(metadata.step, metadata.announce, saves)

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        self._require_scheduler().update_connector_output(connector_output)

    def request_finished(
        self, request: Request, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        return self.request_finished_all_groups(request, (block_ids,))

    def request_finished_all_groups(
        self, request: Request, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        scheduler = self._scheduler or self._require_scheduler()
        if self._saves is not None:
            self._saves.forget(request.request_id)  # aborted mid-prefill: nothing to stage
        return scheduler.request_finished(request, block_ids)

    def get_loaded_kv_cache_group_ids(self, request: Request) -> tuple[int, ...]:
        return self._kv_cache_config.transfer_group_ids

    def set_xfer_handshake_metadata(
        self, metadata: dict[int, KVConnectorHandshakeMetadata]
    ) -> None:
        self._require_scheduler().start_side_channel(metadata)

    @property
    def side_channel_port(self) -> int:
        """The scheduler's bound side-channel port (what decode engines dial)."""
        return self._require_scheduler().connector.side_channel_port

    # ---- worker side -------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self._require_worker().register_kv_caches(kv_caches)

    def get_handshake_metadata(self) -> KVConnectorHandshakeMetadata | None:
        return self._require_worker().get_handshake_metadata()

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        metadata = self._get_connector_metadata()
        if not isinstance(metadata, NixlPDMetadata):
            raise UnsupportedConfiguration(
                f"expected NixlPDMetadata from the scheduler, got {type(metadata).__name__}: "
                "both roles of an engine must use NixlPDConnector"
            )
        self._require_worker().start_load_kv(metadata)

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Loads complete between steps (asynchronously); nothing to wait for per layer."""

    def save_kv_layer(
        self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any
    ) -> None:
        """Pull mode: decode reads prefill's blocks; prefill saves nothing."""

    def wait_for_save(self) -> None:
        """Pull mode saves nothing, except with host staging: then the blocks of requests
        whose prefill completed this step are copied device->host before the step ends."""
        if self._worker is not None and self.has_connector_metadata():
            metadata = self._get_connector_metadata()
            if isinstance(metadata, NixlPDMetadata):
                self._worker.wait_for_save(metadata)

    def set_host_xfer_buffer_ops(self, copy_operation: CopyBlocksOp) -> None:
        """vLLM's model runner hands over its platform's block copy (used when staging).

        Not on vLLM's CPU platform: it has no block swap ops (its cache is host memory, so
        vLLM's own connector never stages there); our torch copy serves a forced staging."""
        if self._worker is not None and _platform_device() != "cpu":
            self._worker.set_copy_op(copy_operation)

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        metadata = self._get_connector_metadata() if self.has_connector_metadata() else None
        bound = metadata if isinstance(metadata, NixlPDMetadata) else None
        return self._require_worker().get_transfer_results(bound)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        results = self.get_transfer_results(finished_req_ids)
        return results.finished_sending, results.finished_recving

    def build_connector_worker_meta(self) -> KVConnectorWorkerMetadata | None:
        return self._require_worker().build_worker_meta()

    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        """Worker: its reports' counts and this process's metrics since the last call.
        Scheduler: this process's metrics (leases, frees), when it runs apart from the workers."""
        if self._worker is not None:
            return self._worker.stats()
        stats = NixlPDStats.from_interval(default_recorder().take_interval())
        return None if stats.is_empty() else stats

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KVConnectorStats:
        return NixlPDStats(data=dict(data or {}))

    @classmethod
    def build_prom_metrics(
        cls,
        vllm_config: VllmConfig,
        metric_types: dict[type[PromMetric], type[PromMetricT]],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> KVConnectorPromMetrics | None:
        """connector.observability.metrics on vLLM's /metrics (see connector/vllm/metrics.py)."""
        return NixlPDPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    def get_block_ids_with_load_errors(self) -> set[int]:
        """The local blocks of this rank's loads that failed since the last call: vLLM marks
        them invalid, so none of them is ever cached (connector/vllm/worker.py). Failures are
        also reported per request (failed_recving); a cache of several groups gets only that."""
        return self._require_worker().take_load_error_block_ids()

    def shutdown(self) -> None:
        if self._scheduler is not None:
            self._scheduler.connector.shutdown()
        if self._worker is not None:
            self._worker.shutdown()


def _platform_device() -> str:
    from vllm.platforms import current_platform

    return str(current_platform.device_type)


def _tp_rank(tp_size: int) -> int:
    from vllm.distributed import parallel_state

    if parallel_state.model_parallel_is_initialized():
        return int(parallel_state.get_tensor_model_parallel_rank())
    if tp_size == 1:
        return 0
    raise UnsupportedConfiguration(
        f"tensor_parallel_size={tp_size} but vLLM's parallel state is not initialized, so this "
        "worker's TP rank is unknown; pass tp_rank= when constructing NixlPDConnector directly"
    )
