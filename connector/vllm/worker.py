"""NixlPDConnector's worker-rank half: vLLM's KV tensors in, our WorkerConnector driven.

The WorkerConnector is created at register_kv_caches, once the tensors tell the kernel block
sizes. Each step the rank runs the scheduler's instructions, keeps its WorkerReport for the
scheduler (vLLM's worker metadata), and echoes the scheduler's decisions to vLLM.

A load this rank ran that fails is reported twice, as vLLM's own connector does: by request
(failed_recving, on which vLLM's kv_load_failure_policy frees the request's blocks uncached or
recomputes it from scratch) and by block (get_block_ids_with_load_errors: the load's local
blocks, which its READs may have written), which vLLM's scheduler never caches either: it
fails ("fail") or recomputes ("recompute") every request whose computed tokens reach one.
Either way no later request's prefix-cache lookup hits bytes a failed load left behind.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING

import msgspec
import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorTransferResults

from connector.config import ConnectorConfig
from connector.errors import UnsupportedConfiguration
from connector.geometry import build_rank_layout
from connector.layout import KVCacheSpec
from connector.memory import HOST_MEMORY
from connector.metadata import BlockIds, FailureKind, LoadFailure, WorkerReport
from connector.observability.metrics import default_recorder
from connector.vllm.devices import memory_of
from connector.vllm.layout import kernel_block_sizes_of, region_addresses
from connector.vllm.metrics import NixlPDStats
from connector.vllm.scheduler import (
    NixlPDHandshakeMetadata,
    NixlPDMetadata,
    NixlPDWorkerMeta,
    merge,
)
from connector.vllm.staging import CopyBlocksOp, HostBuffer
from scheduler.requests import FinishedRequests
from worker.connector import WorkerConnector
from worker.load_lifecycle import DIGEST_FAILED
from worker.nixl_api import NixlAgent

if TYPE_CHECKING:
    from vllm.v1.kv_cache_interface import KVCacheConfig


logger = logging.getLogger(__name__)

STAGED_COPY_DIFFERS = LoadFailure(
    FailureKind.DIGEST,
    f"{DIGEST_FAILED}: the host-to-device copy of the staged blocks differs from the host "
    "bytes the READs brought (which matched prefill's digests); the device blocks cannot be "
    "trusted, so nothing of them is used",
)


def _failed_after_all(report: WorkerReport, failures: dict[str, LoadFailure]) -> WorkerReport:
    """``report`` with ``failures`` moved from finished_recving to failed_recving."""
    return msgspec.structs.replace(
        report,
        finished_recving=tuple(rid for rid in report.finished_recving if rid not in failures),
        failed_recving={**report.failed_recving, **failures},
    )


def load_error_block_ids(
    loads: dict[str, BlockIds], failed: Iterable[str], num_cache_groups: int
) -> set[int]:
    """The local blocks of the ``failed`` loads, for vLLM's invalid_block_ids.

    A flat set of ids names blocks only in a single-group cache: vLLM's scheduler refuses
    block-level failures in a cache of several groups (ids repeat across groups), so there
    the per-request report (failed_recving) alone keeps them out of the prefix cache.
    """
    if num_cache_groups != 1:
        return set()
    return {block for rid in failed if rid in loads for group in loads[rid] for block in group}


class WorkerSide:
    """One worker rank's half: our WorkerConnector, created once the KV tensors are known."""

    def __init__(
        self,
        config: ConnectorConfig,
        *,
        engine_id: str,
        tp_rank: int,
        tp_size: int,
        agent: NixlAgent,
        kv_cache_config: KVCacheConfig,
        spec_for: Callable[[tuple[int, ...]], KVCacheSpec],
        staging: bool = False,
    ) -> None:
        self._config = config
        self._engine_id = engine_id
        self._tp_rank = tp_rank
        self._tp_size = tp_size
        self._agent = agent
        self._kv_cache_config = kv_cache_config
        self._spec_for = spec_for  # kernel block sizes -> our spec
        self._connector: WorkerConnector | None = None
        self._reports: list[WorkerReport] = []
        self._echo = FinishedRequests()  # announced by the scheduler, not yet echoed
        self._awaited: set[str] = set()  # LoadSpecs run here: this rank reports them to vLLM
        # The local blocks each awaited load fills: staging copies them to the device, and a
        # failed load's are reported to vLLM as invalid.
        self._load_blocks: dict[str, BlockIds] = {}
        self._invalid_block_ids: set[int] = set()  # failed loads' blocks, not yet taken by vLLM
        self._last_run: NixlPDMetadata | None = None
        self._staging = staging
        self._host: HostBuffer | None = None  # staging: what NIXL registers instead
        self._last_saved: NixlPDMetadata | None = None
        self._unsaved: list[str] = []  # staging + verify_kv: saves whose host copy differs
        self._staged: list[str] = []  # staging: lease keys of holds copied device->host

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        """Register the KV tensors (host or one GPU), or with staging a host mirror of them."""
        spec = self._spec_for(kernel_block_sizes_of(self._kv_cache_config, kv_caches))
        registered, memory = kv_caches, HOST_MEMORY
        if self._staging:
            on_gpu = any(tensor.is_cuda for tensor in kv_caches.values())
            self._host = HostBuffer(kv_caches, spec, pin=on_gpu and torch.cuda.is_available())
            registered = self._host.host
        else:
            memory = memory_of(kv_caches.values())
        connector = WorkerConnector(
            self._config,
            engine_id=self._engine_id,
            tp_rank=self._tp_rank,
            tp_size=self._tp_size,
            spec=spec,
            agent=self._agent,
        )
        layout = build_rank_layout(spec, self._tp_rank, self._tp_size)
        connector.register_kv_caches(region_addresses(layout, spec, registered), memory)
        self._connector = connector

    def set_copy_op(self, copy_op: CopyBlocksOp) -> None:
        """vLLM's own block copy for this platform (set_host_xfer_buffer_ops); staging only."""
        if self._host is not None:
            self._host.copy_op = copy_op

    def wait_for_save(self, metadata: NixlPDMetadata) -> None:
        """Staging: copy device->host, before the step ends, the blocks of requests whose
        prefill completed this step (their params reach decode only after it) and of holds
        for a next turn (``stage_out``: their leases become readable once every rank copied)."""
        if self._host is None or metadata is self._last_saved:
            return
        self._last_saved = metadata
        request_ids = [save.request_id for save in metadata.saves]
        request_ids += [hold.request_id for hold in metadata.step.stage_out]
        blocks = [save.block_ids for save in metadata.saves]
        blocks += [hold.block_ids for hold in metadata.step.stage_out]
        self._host.to_host(blocks)
        unsaved: set[str] = set()
        if self._config.verify_kv:  # the digests will prove the host copy: it must be right
            for index in self._host.copies_differ(blocks):
                logger.warning(
                    "request %s: the device->host copy of its KV differs from the device "
                    "blocks; its lease ends",
                    request_ids[index],
                )
                unsaved.add(request_ids[index])
            self._unsaved.extend(unsaved)
        self._staged.extend(
            hold.key for hold in metadata.step.stage_out if hold.request_id not in unsaved
        )

    def get_handshake_metadata(self) -> NixlPDHandshakeMetadata:
        handshake = self._require().get_handshake_metadata()
        return NixlPDHandshakeMetadata(msgspec.msgpack.encode(handshake))

    def start_load_kv(self, metadata: NixlPDMetadata) -> None:
        """Run one step's instructions; a metadata already run (same object) is ignored."""
        if metadata is self._last_run:
            return
        self._last_run = metadata
        self._require().start_load_kv(metadata.step)
        self._awaited.update(load.request_id for load in metadata.step.loads)
        self._load_blocks.update(
            (load.request_id, load.local_block_ids) for load in metadata.step.loads
        )
        self._echo = merge(self._echo, metadata.announce)

    def get_transfer_results(self, metadata: NixlPDMetadata | None) -> KVConnectorTransferResults:
        """This rank's report goes to the worker metadata; vLLM gets the scheduler's echo.

        ``metadata`` is the step's bound metadata: run here if the engine skipped
        start_load_kv this step, so no instruction and no echo is ever lost.
        """
        if metadata is not None:
            self.start_load_kv(metadata)
        report = self._require().get_finished()
        if self._last_run is not None and self._last_run.step.step_seq:
            # After the step's forward (vLLM asks for results then): its chunks are written.
            report = msgspec.structs.replace(report, saved_step=self._last_run.step.step_seq)
        if self._unsaved or self._staged:
            report = msgspec.structs.replace(
                report, unsaved=tuple(self._unsaved), staged=tuple(self._staged)
            )
            self._unsaved.clear()
            self._staged.clear()
        echo, self._echo = self._echo, FinishedRequests()
        # Loads this rank ran are reported to vLLM now, by every rank (vLLM's aggregator waits
        # for all of them, as for its own connector); the scheduler never echoes those.
        ended = self._awaited.intersection((*report.finished_recving, *report.failed_recving))
        self._awaited -= ended
        failed = set(echo.failed_recving) | ended.intersection(report.failed_recving)
        if miscopied := self._copy_loaded_to_device(ended - failed):
            report = _failed_after_all(report, miscopied)
            failed |= miscopied.keys()
        self._invalid_block_ids |= load_error_block_ids(
            self._load_blocks, ended & failed, len(self._kv_cache_config.kv_cache_groups)
        )
        # Loads no longer awaited (finished or failed) leave.
        self._load_blocks = {rid: ids for rid, ids in self._load_blocks.items() if rid not in ended}
        self._reports.append(report)
        return KVConnectorTransferResults(
            finished_sending=set(echo.finished_sending),
            # vLLM 0.33 wants failed loads in finished_recving too: that ends their wait.
            finished_recving=set(echo.finished_recving) | failed | ended,
            failed_recving=failed,
        )

    def _copy_loaded_to_device(self, loaded: set[str]) -> dict[str, LoadFailure]:
        """Staging: the host buffer holds what the READs brought; the device needs it before
        vLLM hears the load finished. One batched copy for every load ended this step. With
        verify_kv, the device copy is compared with the host bytes (which the lease check
        proved equal to prefill's): the loads whose copy differs, with the reason."""
        if self._host is None:
            return {}
        request_ids = [rid for rid in sorted(loaded) if rid in self._load_blocks]
        blocks = [self._load_blocks[rid] for rid in request_ids]  # failed ones copy nothing
        self._host.to_device(blocks)
        if not self._config.verify_kv:
            return {}
        return {
            request_ids[index]: STAGED_COPY_DIFFERS for index in self._host.copies_differ(blocks)
        }

    def take_load_error_block_ids(self) -> set[int]:
        """The local blocks of the loads this rank reported failed since the last call (vLLM
        asks right after get_transfer_results, every step); a cache of several groups: none."""
        invalid, self._invalid_block_ids = self._invalid_block_ids, set()
        return invalid

    def stats(self) -> NixlPDStats | None:
        """Counters of the reports not yet handed to the scheduler (this step's), and what
        this process recorded into connector.observability.metrics since the last call."""
        stats = NixlPDStats.from_interval(default_recorder().take_interval())
        for report in self._reports:
            stats = stats.aggregate(NixlPDStats.from_report(report))  # type: ignore[assignment]
        return None if stats.is_empty() else stats

    def build_worker_meta(self) -> NixlPDWorkerMeta | None:
        reports, self._reports = tuple(self._reports), []
        return NixlPDWorkerMeta(reports) if reports else None

    def shutdown(self) -> None:
        if self._connector is not None:
            self._connector.shutdown()
            self._connector = None
        self._agent.close()

    def _require(self) -> WorkerConnector:
        if self._connector is None:
            raise UnsupportedConfiguration(
                "the worker connector has no KV caches yet: vLLM calls register_kv_caches first"
            )
        return self._connector
