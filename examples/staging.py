"""The example engine's host staging: NIXL reads a host mirror of the KV buffers, copied per step.

The engine's own RankBuffers stand in for device memory (the model computes into them); with
``EngineConfig.staged`` each rank also keeps a host mirror laid out the same way, and that is
what the connector registers. As in the vLLM adapter: prefill copies a request's blocks
device->host in the step its prefill completes, before request_finished hands its params out;
decode copies the blocks a load filled host->device before the request starts running.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from connector.layout import KVCacheSpec
from connector.metadata import BlockIds, ConnectorMetadata
from connector.staging import kernel_block_ids
from examples.kv_cache import NULL_BLOCK, RankBuffers, copy_kernel_blocks


class HostStaging:
    """Every rank's host mirror, and the blocks of loads still in flight (decode)."""

    def __init__(self, spec: KVCacheSpec, tp_size: int) -> None:
        self.host = [RankBuffers(spec, rank, tp_size) for rank in range(tp_size)]
        self._ratios = [group.ratio for group in spec.groups]
        self._loads: dict[str, BlockIds] = {}  # request id -> decode blocks its load fills
        self.num_kernel_blocks_copied = 0

    def region_addresses(self, tp_rank: int) -> list[int]:
        """What rank ``tp_rank`` registers with NIXL: its host mirror."""
        return self.host[tp_rank].region_addresses

    def note_loads(self, metadata: ConnectorMetadata) -> None:
        self._loads.update((load.request_id, load.local_block_ids) for load in metadata.loads)

    def save(self, device: Sequence[RankBuffers], entries: Iterable[BlockIds]) -> None:
        """Prefill: these requests' blocks, device->host, one batched copy per rank."""
        self._copy(device, self.host, list(entries))

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
            copy_kernel_blocks(source_rank, target_rank, ids)
        self.num_kernel_blocks_copied += sum(len(group) for group in ids) * len(source)
