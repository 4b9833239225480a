"""Host staging, pure part: which kernel blocks a step copies between device cache and host buffer.

Where the NIC cannot read device memory, each worker registers a host buffer laid out like its
KV cache instead. Prefill copies a request's blocks device->host in the step its prefill
completes (before the request's params can reach a decode engine); decode copies the blocks it
loaded host->device before it reports the load finished. This module decides which blocks;
the engine's adapter moves the bytes, one batched copy per cache group per step.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import msgspec
import numpy as np
import numpy.typing as npt

from connector.errors import TransferPlanError
from connector.metadata import BlockIds

KernelIds = npt.NDArray[np.int64]


class StagedBlocks(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """One request's logical blocks that a step copies: one tuple per transfer group, in the
    order the lease names them (an engine's groups outside transfers are not staged)."""

    request_id: str
    block_ids: BlockIds


def kernel_block_ids(
    entries: Iterable[BlockIds], ratios: Sequence[int], *, null_block: int | None = 0
) -> tuple[KernelIds, ...]:
    """Every entry's logical blocks as kernel block ids: one sorted, unique array per group.

    Each entry names exactly the groups of ``ratios`` (the transfer groups), in that order;
    any other count raises TransferPlanError rather than copy one group's ids into another.
    Logical block b of a group with ratio r (kernel blocks per logical block) is kernel blocks
    [b*r, b*r + r); e.g. r=2, blocks (3, 5) -> (6, 7, 10, 11). ``null_block`` (the engine's
    placeholder block, 0 in vLLM and the example engine) is never copied: it holds no KV.
    """
    per_group: list[list[int]] = [[] for _ in ratios]
    for entry in entries:
        if len(entry) != len(ratios):
            raise TransferPlanError(
                f"staged blocks name {len(entry)} cache groups, but the host buffer mirrors "
                f"{len(ratios)} transfer groups: a staged copy must name exactly the transfer "
                "groups, in the lease's order (the engine adapter selects them)"
            )
        for group, group_ids in enumerate(entry):
            per_group[group].extend(group_ids)
    result = []
    for ids, ratio in zip(per_group, ratios, strict=True):
        logical = np.unique(np.asarray(ids, dtype=np.int64))
        if null_block is not None:
            logical = logical[logical != null_block]
        kernels = (logical[:, None] * ratio + np.arange(ratio, dtype=np.int64)).reshape(-1)
        result.append(kernels)
    return tuple(result)


@dataclass(frozen=True)
class ScheduledRow:
    """One request scheduled in a step, as the engine's scheduler output says.

    ``block_ids`` (one tuple per transfer group, in the lease's order) are the request's whole
    block table when ``full_table`` (new or resumed requests), else only the blocks added this
    step (None: none added).
    """

    request_id: str
    block_ids: BlockIds | None
    full_table: bool
    num_computed_tokens: int
    num_scheduled_tokens: int


@dataclass
class _Tracked:
    num_prompt_tokens: int
    block_ids: list[list[int]] = field(default_factory=list)


class SaveTracker:
    """Prefill: follows requests whose KV goes to a remote decode until their prefill completes.

    ``track`` a request when it is scheduled for remote decode; ``step`` with the step's
    scheduled rows returns what to copy device->host this step: every block of each request
    whose prompt is fully computed by the end of the step (chunked prefill accumulates the
    blocks added step by step, so a block half-filled by an earlier chunk is copied whole
    once the last chunk ran). ``forget`` drops an aborted request.
    """

    def __init__(self) -> None:
        self._tracked: dict[str, _Tracked] = {}

    def __len__(self) -> int:
        return len(self._tracked)

    def track(self, request_id: str, num_prompt_tokens: int) -> None:
        if request_id not in self._tracked:
            self._tracked[request_id] = _Tracked(num_prompt_tokens)

    def forget(self, request_id: str) -> None:
        self._tracked.pop(request_id, None)

    def step(self, rows: Iterable[ScheduledRow]) -> tuple[StagedBlocks, ...]:
        saves = []
        for row in rows:
            tracked = self._tracked.get(row.request_id)
            if tracked is None:
                continue
            _add_blocks(tracked, row)
            if row.num_computed_tokens + row.num_scheduled_tokens >= tracked.num_prompt_tokens:
                del self._tracked[row.request_id]
                blocks = tuple(tuple(group) for group in tracked.block_ids)
                saves.append(StagedBlocks(row.request_id, blocks))
        return tuple(saves)


def _add_blocks(tracked: _Tracked, row: ScheduledRow) -> None:
    if row.block_ids is None:
        return
    if row.full_table:
        tracked.block_ids = [list(group) for group in row.block_ids]
        return
    if not tracked.block_ids:
        tracked.block_ids = [[] for _ in row.block_ids]
    for group, ids in zip(tracked.block_ids, row.block_ids, strict=True):
        group.extend(ids)


def contiguous_runs(source_ids: KernelIds, target_ids: KernelIds) -> npt.NDArray[np.int64]:
    """Maximal runs in which both sides' block ids advance by one, as (source start, target
    start, num_blocks) rows: source (4, 5, 6, 9) -> target (4, 5, 6, 9) is [(4, 4, 3), (9, 9, 1)].
    A run is one slice copy: no gather buffer, one transfer."""
    if len(source_ids) == 0:
        return np.zeros((0, 3), dtype=np.int64)
    source = np.asarray(source_ids, dtype=np.int64)
    target = np.asarray(target_ids, dtype=np.int64)
    breaks = np.flatnonzero((np.diff(source) != 1) | (np.diff(target) != 1)) + 1
    starts = np.concatenate(([0], breaks))
    ends = np.concatenate((breaks, [len(source)]))
    return np.column_stack((source[starts], target[starts], ends - starts))
