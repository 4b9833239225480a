"""Host staging inside vLLM: when to stage, the scheduler's rows, and the host buffer's copies.

The pure decisions (which blocks, when) live in connector.staging; this module reads vLLM's
objects and moves bytes with torch (or with the copy op vLLM's model runner hands over in
``set_host_xfer_buffer_ops``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Literal

import numpy as np
import torch

from connector.config import ConnectorConfig
from connector.errors import UnsupportedConfiguration
from connector.layout import KVCacheSpec
from connector.metadata import BlockIds
from connector.staging import KernelIds, ScheduledRow, contiguous_runs, kernel_block_ids

try:
    from vllm.utils.gpu_sync_debug import gpu_sync_allowed
except ImportError:  # vLLM builds without the GPU-sync checker
    gpu_sync_allowed = contextlib.nullcontext  # type: ignore[assignment]

if TYPE_CHECKING:
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig

Direction = Literal["h2d", "d2h"]
# vLLM's CopyBlocksOp: (src caches, dst caches, src block ids, dst block ids, direction).
CopyBlocksOp = Callable[
    [dict[str, torch.Tensor], dict[str, torch.Tensor], list[int], list[int], Direction], None
]


def staging_enabled(
    config: ConnectorConfig, vllm_kv_buffer_device: str | None, platform_device: str
) -> bool:
    """Stage through host memory? Both roles of an engine decide the same way, from config.

    Our key ``kv_buffer_device`` decides when set ("cpu": stage, also in front of a CPU cache,
    which is how the tests stand CPU tensors in for a GPU cache). Unset, vLLM's own
    ``kv_transfer_config.kv_buffer_device`` decides as for vLLM's NixlConnector: "cpu" stages
    on an accelerator platform; on a CPU platform the cache is host memory already.
    """
    if config.kv_buffer_device is not None:
        return config.kv_buffer_device == "cpu"
    return vllm_kv_buffer_device == "cpu" and platform_device != "cpu"


def scheduled_rows(
    scheduler_output: SchedulerOutput, kv_cache_config: KVCacheConfig
) -> Iterator[ScheduledRow]:
    """Every request scheduled this step, with its blocks in the transfer groups only.

    vLLM's scheduler output has a block list per KV cache group; a lease (and so the host
    buffer) holds the transfer groups, in ``transfer_group_ids`` order, and a group outside
    transfers may come first (vLLM 0.33's HiSparse layout). Groups (hot, source, indexer) with
    transfer ids (1, 2) -> rows of (source, indexer) blocks, as the lease names them.
    """
    tokens = scheduler_output.num_scheduled_tokens
    for new in scheduler_output.scheduled_new_reqs:
        yield ScheduledRow(
            new.req_id,
            _transfer_blocks(kv_cache_config, new.req_id, new.block_ids),
            True,
            int(new.num_computed_tokens),
            int(tokens.get(new.req_id, 0)),
        )
    cached = scheduler_output.scheduled_cached_reqs
    for index, request_id in enumerate(cached.req_ids):
        yield ScheduledRow(
            request_id,
            _transfer_blocks(kv_cache_config, request_id, cached.new_block_ids[index]),
            request_id in cached.resumed_req_ids,
            int(cached.num_computed_tokens[index]),
            int(tokens.get(request_id, 0)),
        )


def _transfer_blocks(
    kv_cache_config: KVCacheConfig, request_id: str, groups: Sequence[Sequence[int]] | None
) -> BlockIds | None:
    """The transfer groups' block lists out of a row of every cache group's."""
    if groups is None:
        return None
    num_groups = len(kv_cache_config.kv_cache_groups)
    if len(groups) != num_groups:
        raise UnsupportedConfiguration(
            f"vLLM's scheduler output gives request {request_id!r} block lists for "
            f"{len(groups)} KV cache groups, but the KV cache config has {num_groups}; "
            "cannot tell which are the transfer groups to stage: run the vLLM version this "
            "connector supports (0.33)"
        )
    return tuple(
        tuple(int(b) for b in groups[group]) for group in kv_cache_config.transfer_group_ids
    )


# Copy run by run (slices, no gather buffer) while a layer needs at most one slice copy per
# this many blocks; more fragmented ids take one gather and one scatter per layer instead.
BLOCKS_PER_SLICE_COPY = 8


def torch_copy_blocks(
    src: dict[str, torch.Tensor],
    dst: dict[str, torch.Tensor],
    src_ids: list[int],
    dst_ids: list[int],
    direction: Direction,
) -> None:
    """The copy op when the engine gives none: per layer, a few slice copies of contiguous
    runs, or one gather and one scatter when the ids are fragmented."""
    runs = contiguous_runs(np.asarray(src_ids), np.asarray(dst_ids))
    by_runs = len(runs) * BLOCKS_PER_SLICE_COPY <= len(src_ids)
    for name, source in src.items():
        target = dst[name]
        if by_runs:
            for src_start, dst_start, num_blocks in runs.tolist():
                target[dst_start : dst_start + num_blocks].copy_(
                    source[src_start : src_start + num_blocks]
                )
            continue
        src_index = torch.tensor(src_ids, dtype=torch.long, device=source.device)
        dst_index = torch.tensor(dst_ids, dtype=torch.long, device=target.device)
        target.index_copy_(0, dst_index, source.index_select(0, src_index).to(target.device))


class HostBuffer:
    """Host tensors laid out like a rank's device KV tensors; NIXL registers these instead.

    Dim 0 of every layer tensor counts kernel blocks (vLLM's layer-outermost layouts), so a
    block copy is an index_select/index_copy along dim 0 of whole block tensors, batched: one
    copy op call per cache group per step.
    """

    def __init__(
        self, device_caches: Mapping[str, torch.Tensor], spec: KVCacheSpec, *, pin: bool
    ) -> None:
        self._groups = [[layer.name for layer in group.layers] for group in spec.groups]
        names = [name for group in self._groups for name in group]
        missing = [name for name in names if name not in device_caches]
        if missing:
            raise UnsupportedConfiguration(
                f"register_kv_caches has no tensor for layers {missing[:3]} of the KV cache "
                f"groups (got {len(device_caches)} layers); cannot mirror them in host memory"
            )
        self.device = {name: device_caches[name] for name in names}
        self.host = _host_mirrors(self.device, pin)
        self._ratios = [group.ratio for group in spec.groups]
        self.copy_op: CopyBlocksOp = torch_copy_blocks

    def to_host(self, entries: Sequence[BlockIds]) -> None:
        """Copy these logical blocks device->host."""
        self._copy(entries, "d2h")

    def to_device(self, entries: Sequence[BlockIds]) -> None:
        """Copy these logical blocks host->device."""
        self._copy(entries, "h2d")

    def copies_differ(self, entries: Sequence[BlockIds]) -> list[int]:
        """Indexes of ``entries`` whose device blocks are not, byte for byte, their host
        blocks (verify_kv, after a copy: a copy op that went wrong leaves the bytes the
        READs brought, and prefill's digests proved, behind in host memory only)."""
        differ = []
        for index, entry in enumerate(entries):
            kernel_ids = kernel_block_ids([entry], self._ratios)
            for names, ids in zip(self._groups, kernel_ids, strict=True):
                if len(ids) and not all(self._same(name, ids) for name in names):
                    differ.append(index)
                    break
        return differ

    def _same(self, name: str, ids: KernelIds) -> bool:
        host, device = self.host[name], self.device[name]
        index = torch.as_tensor(ids, dtype=torch.long)
        with gpu_sync_allowed():
            on_device = device.index_select(0, index.to(device.device)).cpu()
        # Bytes, not values: NaN is not equal to itself, and -0.0 equals 0.0.
        return torch.equal(
            on_device.view(torch.uint8), host.index_select(0, index).view(torch.uint8)
        )

    def _copy(self, entries: Sequence[BlockIds], direction: Direction) -> None:
        if not entries:
            return
        source, target = (
            (self.device, self.host) if direction == "d2h" else (self.host, self.device)
        )
        kernel_ids = kernel_block_ids(entries, self._ratios)
        # Synchronous on purpose, as in vLLM's NixlConnector: a d2h copy must have landed
        # before the step ends (decode may READ right after), an h2d one before the load is
        # reported. vLLM's GPU-sync checker (a debug mode) is told these syncs are meant.
        with gpu_sync_allowed():
            for names, ids in zip(self._groups, kernel_ids, strict=True):
                if len(ids) == 0:
                    continue
                id_list = ids.tolist()
                self.copy_op(
                    {name: source[name] for name in names},
                    {name: target[name] for name in names},
                    id_list,
                    id_list,
                    direction,
                )


def _host_mirrors(device: Mapping[str, torch.Tensor], pin: bool) -> dict[str, torch.Tensor]:
    """One host storage per device storage, and each layer's view into it at the same offset
    with the same shape and strides: byte for byte the device layout, whichever it is (layers
    interleaved per block in one buffer included), so the region geometry holds for both."""
    storages: dict[int, torch.UntypedStorage] = {}
    mirrors = {}
    for name, tensor in device.items():
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in storages:
            buffer = torch.zeros(storage.nbytes(), dtype=torch.uint8, pin_memory=pin)
            storages[storage.data_ptr()] = buffer.untyped_storage()
        host = storages[storage.data_ptr()]
        view = torch.empty(0, dtype=tensor.dtype)
        mirrors[name] = view.set_(host, tensor.storage_offset(), tensor.shape, tensor.stride())
    return mirrors
