"""The example engine's host staging: NIXL reads a host mirror of the KV buffers, copied per step.

The engine's own RankBuffers stand in for device memory (the model computes into them); with
``EngineConfig.staged`` each rank also keeps a host mirror laid out the same way, and that is
what the connector registers. As in the vLLM adapter: prefill copies a request's blocks
device->host in the step its prefill completes, before request_finished hands its params out;
decode copies the blocks a load filled host->device before the request starts running. A
hold for the next turn (multi-turn) is copied device->host in the step after request_finished
(``ConnectorMetadata.stage_out``); each rank then reports it in ``WorkerReport.staged`` (or,
with verify_kv and a copy that differs from the device, in ``unsaved``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence

import numpy as np
import numpy.typing as npt

from connector.layout import KVCacheSpec
from connector.metadata import BlockIds, ConnectorMetadata, StageSpec, WorkerReport
from connector.staging import kernel_block_ids
from examples.kv_cache import NULL_BLOCK, RankBuffers, copy_kernel_blocks

# (source rank, target rank, kernel block ids per group): copy_kernel_blocks, or a test's own
CopyOp = Callable[[RankBuffers, RankBuffers, Sequence[npt.NDArray[np.int64]]], None]


class HostStaging:
    """Every rank's host mirror, and the blocks of loads still in flight (decode)."""

    def __init__(self, spec: KVCacheSpec, tp_size: int) -> None:
        self.host = [RankBuffers(spec, rank, tp_size) for rank in range(tp_size)]
        self._ratios = [group.ratio for group in spec.groups]
        self._loads: dict[str, BlockIds] = {}  # request id -> decode blocks its load fills
        self.num_kernel_blocks_copied = 0
        self.copy_op: CopyOp = copy_kernel_blocks

    def region_addresses(self, tp_rank: int) -> list[int]:
        """What rank ``tp_rank`` registers with NIXL: its host mirror."""
        return self.host[tp_rank].region_addresses

    def note_loads(self, metadata: ConnectorMetadata) -> None:
        self._loads.update((load.request_id, load.local_block_ids) for load in metadata.loads)

    def save(self, device: Sequence[RankBuffers], entries: Iterable[BlockIds]) -> None:
        """Prefill: these requests' blocks, device->host, one batched copy per rank."""
        self._copy(device, self.host, list(entries))

    def save_holds(
        self, device: Sequence[RankBuffers], specs: Sequence[StageSpec], *, verify: bool
    ) -> list[WorkerReport]:
        """Holds: their blocks, device->host; per rank, the report of what it copied (with
        ``verify``, a copy that differs from the device is reported unsaved instead)."""
        self._copy(device, self.host, [spec.block_ids for spec in specs])
        reports = []
        for rank, (source, target) in enumerate(zip(device, self.host, strict=True)):
            differ = set()
            if verify:
                differ = {spec.key for spec in specs if self._differ(source, target, spec)}
            reports.append(
                WorkerReport(
                    rank,
                    staged=tuple(spec.key for spec in specs if spec.key not in differ),
                    unsaved=tuple(spec.request_id for spec in specs if spec.key in differ),
                )
            )
        return reports

    def _differ(self, device: RankBuffers, host: RankBuffers, spec: StageSpec) -> bool:
        """Whether a rank's host copy of these blocks is not, byte for byte, its device's."""
        ids = kernel_block_ids([spec.block_ids], self._ratios, null_block=NULL_BLOCK)
        for group, group_ids in enumerate(ids):
            for device_layer, host_layer in zip(
                device.views[group], host.views[group], strict=True
            ):
                for device_plane, host_plane in zip(device_layer, host_layer, strict=True):
                    if device_plane[group_ids].tobytes() != host_plane[group_ids].tobytes():
                        return True
        return False

    def load(self, device: Sequence[RankBuffers], request_ids: Iterable[str]) -> None:
        """Decode: the blocks these finished loads filled, host->device."""
        entries = [self._loads.pop(rid) for rid in request_ids if rid in self._loads]
        self._copy(self.host, device, entries)

    def forget(self, request_ids: Iterable[str]) -> None:
        """Failed loads: their host blocks hold nothing to copy."""
        for request_id in request_ids:
            self._loads.pop(request_id, None)

    def _copy(
        self, source: Sequence[RankBuffers], target: Sequence[RankBuffers], entries: list[BlockIds]
    ) -> None:
        if not entries:
            return
        ids = kernel_block_ids(entries, self._ratios, null_block=NULL_BLOCK)
        for source_rank, target_rank in zip(source, target, strict=True):
            self.copy_op(source_rank, target_rank, ids)
        self.num_kernel_blocks_copied += sum(len(group) for group in ids) * len(source)
