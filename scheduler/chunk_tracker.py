"""Prefill: which whole blocks of a still-running prompt hold written KV, chunk by chunk.

Chunked pulls (docs/overlap.md, "Pulling chunks as prefill computes them") announce a
request's completed blocks while later chunks compute. The scheduler-side hook that sees a
chunk scheduled (``build_connector_meta``) runs *before* the forward pass that writes it, and
with async scheduling a step ahead of it; so a chunk counts as written only once every rank
reported the forward of its step done (the ranks echo the step's sequence number after the
forward, read at ``update_connector_output``). Pure: the caller passes the step's rows (as
``connector.vllm.staging.scheduled_rows`` yields them), the preempted request ids and the
ranks' echoed step; this class keeps block lists and token counts, nothing else.

    step(s, rows)   remember, per tracked row: after step s, tokens [0, computed + scheduled)
    saved(s)        every step <= s is written: the whole-block prefixes that grew
    preempted       forget the blocks (vLLM freed them); a request that had announced
                    blocks is returned so its lease ends before any forward can reuse them

Only whole blocks are announced: with block size 16, 40 written tokens announce 32 (two
blocks per group); the half-filled third block goes out with a later chunk or the final
announcement. Groups of different block sizes announce a common multiple (16 and 32: 32).

Bounded: at most ``max_requests`` requests tracked (another is not tracked: it gets only
today's final announcement), each with its block lists and at most one pending chunk per
step in flight.
"""

from __future__ import annotations

import dataclasses
import math
from collections import deque
from collections.abc import Iterable

from connector.metadata import BlockIds
from connector.staging import ScheduledRow

MAX_TRACKED_REQUESTS = 4096


@dataclasses.dataclass(frozen=True, slots=True)
class ChunkAnnouncement:
    """A request's KV written so far: ``num_tokens`` tokens in ``block_ids`` (per group, whole
    blocks, in order). ``generation`` counts the request's announcements from 1 (a preemption
    does not reset it: step() reports the preempted requests whose lease must end)."""

    request_id: str
    block_ids: BlockIds
    num_tokens: int
    generation: int


@dataclasses.dataclass(slots=True)
class _Tracked:
    num_prompt_tokens: int
    block_ids: list[list[int]] = dataclasses.field(default_factory=list)
    pending: deque[tuple[int, int]] = dataclasses.field(default_factory=deque)  # (step, tokens)
    num_announced_tokens: int = 0
    generation: int = 0


class ChunkTracker:
    """Engine thread only. ``block_sizes``: tokens per logical block of each transfer group."""

    def __init__(
        self, block_sizes: tuple[int, ...], max_requests: int = MAX_TRACKED_REQUESTS
    ) -> None:
        if not block_sizes or min(block_sizes) <= 0:
            raise ValueError(f"block sizes must be positive, got {block_sizes}")
        self._block_sizes = block_sizes
        self._unit_tokens = math.lcm(*block_sizes)  # whole blocks in every group
        self._max_requests = max_requests
        self._tracked: dict[str, _Tracked] = {}

    def __len__(self) -> int:
        return len(self._tracked)

    def track(self, request_id: str, num_prompt_tokens: int) -> bool:
        """Follow a request whose KV goes to decode chunk by chunk; False when the table is
        full (the request then gets only its final announcement)."""
        if request_id in self._tracked:
            return True
        if len(self._tracked) >= self._max_requests:
            return False
        self._tracked[request_id] = _Tracked(num_prompt_tokens)
        return True

    def forget(self, request_id: str) -> None:
        """The request finished (or aborted): its final announcement, if any, is not ours."""
        self._tracked.pop(request_id, None)

    def step(
        self, step_seq: int, rows: Iterable[ScheduledRow], preempted: Iterable[str] = ()
    ) -> tuple[str, ...]:
        """A step was scheduled (before its forward): note what each tracked row will have
        written after it. Returns the preempted requests that had announced blocks: their
        lease must end now, before a forward can write the blocks vLLM just freed."""
        ended = self._preempt(preempted)
        for row in rows:
            tracked = self._tracked.get(row.request_id)
            if tracked is None:
                continue
            _add_blocks(tracked, row)
            written = min(
                row.num_computed_tokens + row.num_scheduled_tokens, tracked.num_prompt_tokens
            )
            tracked.pending.append((step_seq, written))
        return ended

    def saved(self, step_seq: int) -> list[ChunkAnnouncement]:
        """Every rank finished the forward of steps up to ``step_seq``: the requests whose
        whole-block prefix grew, with their blocks so far."""
        announcements = []
        for request_id, tracked in self._tracked.items():
            written = 0
            while tracked.pending and tracked.pending[0][0] <= step_seq:
                written = max(written, tracked.pending.popleft()[1])
            num_tokens = written - written % self._unit_tokens
            if num_tokens <= tracked.num_announced_tokens:
                continue
            block_ids = self._whole_blocks(tracked, num_tokens)
            if block_ids is None:  # vLLM's rows gave fewer blocks than the tokens need
                continue
            tracked.num_announced_tokens = num_tokens
            tracked.generation += 1
            announcements.append(
                ChunkAnnouncement(request_id, block_ids, num_tokens, tracked.generation)
            )
        return announcements

    def _preempt(self, preempted: Iterable[str]) -> tuple[str, ...]:
        ended = []
        for request_id in preempted:
            tracked = self._tracked.get(request_id)
            if tracked is None:
                continue
            if tracked.num_announced_tokens:
                ended.append(request_id)
            tracked.block_ids, tracked.num_announced_tokens = [], 0
            tracked.pending.clear()  # a forward in flight writes blocks no longer ours
        return tuple(ended)

    def _whole_blocks(self, tracked: _Tracked, num_tokens: int) -> BlockIds | None:
        """Each group's first blocks holding ``num_tokens`` tokens."""
        if len(tracked.block_ids) != len(self._block_sizes):
            return None
        groups = []
        for ids, block_size in zip(tracked.block_ids, self._block_sizes, strict=True):
            num_blocks = num_tokens // block_size
            if len(ids) < num_blocks:
                return None
            groups.append(tuple(ids[:num_blocks]))
        return tuple(groups)


def _add_blocks(tracked: _Tracked, row: ScheduledRow) -> None:
    """Append a row's new blocks (a new or resumed request's row carries its whole table)."""
    if row.block_ids is None:
        return
    if row.full_table or not tracked.block_ids:
        tracked.block_ids = [list(group) for group in row.block_ids]
        return
    for group, ids in zip(tracked.block_ids, row.block_ids, strict=True):
        group.extend(ids)
