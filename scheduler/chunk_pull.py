"""Decode: what to READ at each of prefill's chunk announcements, and whether they still agree.

Chunked pulls (docs/overlap.md, "Pulling chunks as prefill computes them"): prefill announces
a running request's whole blocks under one lease, chunk by chunk, then its whole prompt at
``request_finished``. One ``ChunkedPull`` per decode load (engine thread) turns each
announcement into the next READ (``Increment``: tokens [start, end), the remote blocks that
hold them and decode's blocks they go to) and refuses any announcement that does not extend
what was already read under the same lease:

- the same prefill engine, boot, remote request id and lease id as the first one read from
  (prefill ends a lease on preemption and draws a new one; the old blocks may be reused);
- each group's block list begins with every block already read from, same ids, same order
  (a running request's table only grows);
- no fewer tokens than already read, no more than the load's.

A refusal is a LoadFailure: the load fails, never succeeds on bytes from two leases. While
no increment was handed out yet (so no READ can have run), a new lease replaces the old one:
its blocks were never read. The proof after the last READ (worker/lease_proof.py) then covers the whole
load: the lease the first READ came from, held after the last, bound to every block read and
to the whole prompt's tokens.

Worked example, block size 16, decode holds tokens [0, 16) locally (num_cached_tokens 16),
loads 70 tokens into local blocks (L0, L1, L2, L3, L4):
announce 32 tokens in (R0, R1)          -> READ [16, 32): R1 -> L1
announce 64 tokens in (R0, R1, R2, R3)  -> READ [32, 64): R2, R3 -> L2, L3
final, 70 tokens in (R0, ..., R4)       -> READ [64, 70): R4 -> L4, then prove all of it.
Pure: no clocks, threads or I/O.
"""

from __future__ import annotations

import dataclasses

from connector.layout import GroupKind
from connector.metadata import BlockIds, FailureKind, LoadFailure, RemoteSource

# Groups whose blocks can be read chunk by chunk (a sliding window frees early blocks during
# prefill, an SSM group holds only the state after the last token).
CHUNKABLE_KINDS = (GroupKind.FULL, GroupKind.MLA)


class ChunkRefused(Exception):
    """An announcement that does not extend what this load read; ``failure`` fails the load."""

    def __init__(self, failure: LoadFailure) -> None:
        super().__init__(failure.message)
        self.failure = failure


@dataclasses.dataclass(frozen=True, slots=True)
class Increment:
    """READ tokens [start_token, end_token): ``remote_block_ids`` into ``local_block_ids``,
    one tuple per group, block for block. ``final``: the last READ; the proof follows it."""

    start_token: int
    end_token: int
    remote_block_ids: BlockIds
    local_block_ids: BlockIds
    final: bool


def _identity(source: RemoteSource) -> tuple[str, str, str, str]:
    return source.engine_id, source.boot_id, source.remote_request_id, source.lease_id


class ChunkedPull:
    """``local_block_ids``: decode's blocks for the whole prompt per group (as allocated, its
    cached prefix included); ``block_sizes``: tokens per block of each group; the load reads
    tokens [num_cached_tokens, num_tokens)."""

    def __init__(
        self,
        local_block_ids: BlockIds,
        block_sizes: tuple[int, ...],
        *,
        num_cached_tokens: int,
        num_tokens: int,
    ) -> None:
        if len(local_block_ids) != len(block_sizes):
            raise ValueError(f"{len(local_block_ids)} block lists for {len(block_sizes)} groups")
        self._local = local_block_ids
        self._block_sizes = block_sizes
        self._num_tokens = num_tokens
        self._num_read_tokens = num_cached_tokens  # tokens [0, this) are in decode's blocks
        self._read_from: BlockIds = tuple(() for _ in block_sizes)  # remote blocks read, per group
        self._num_announced_tokens = 0  # the most tokens announced under the current lease
        self._identity: tuple[str, str, str, str] | None = None
        self._posted = False  # an increment was handed out: a READ may have run
        self._done = False

    @property
    def num_read_tokens(self) -> int:
        """Tokens decode holds so far: its cached prefix plus every increment handed out."""
        return self._num_read_tokens

    @property
    def lease_id(self) -> str | None:
        """The lease the load reads under (None before the first announcement)."""
        return None if self._identity is None else self._identity[3]

    def next(self, source: RemoteSource, num_tokens: int, *, final: bool) -> Increment | None:
        """The READ an announcement of ``num_tokens`` tokens in ``source`` adds (None: nothing
        new yet). Raises ChunkRefused when it does not extend what was read."""
        if self._done:
            raise _refused("an announcement came after the final one")
        self._check_identity(source)
        if not final and any(num_tokens % size for size in self._block_sizes):
            raise _refused(f"a partial announcement of {num_tokens} tokens ends mid-block")
        if num_tokens < self._num_announced_tokens:
            raise _refused(
                f"prefill announced {num_tokens} tokens after {self._num_announced_tokens}"
            )
        if final and num_tokens < self._num_tokens:
            raise _refused(
                f"the final announcement holds {num_tokens} tokens; the load needs "
                f"{self._num_tokens}",
                FailureKind.PARAMS,
            )
        end_token = self._num_tokens if final else min(num_tokens, self._num_tokens)
        self._check_extends(source.remote_block_ids, end_token)
        self._num_announced_tokens = num_tokens
        self._done = final
        if end_token <= self._num_read_tokens and not final:
            return None  # nothing past what decode holds (its cached prefix, or read)
        return self._increment(source.remote_block_ids, end_token, final)

    def _check_identity(self, source: RemoteSource) -> None:
        identity = _identity(source)
        if self._identity is None or (identity != self._identity and not self._posted):
            if self._identity is not None:  # nothing read under the old lease: start over
                self._read_from = tuple(() for _ in self._block_sizes)
                self._num_announced_tokens = 0
            self._identity = identity
            return
        if identity != self._identity:
            engine_id, boot_id, request_id, lease_id = identity
            raise _refused(
                f"prefill's lease for this transfer changed while decode read it (was "
                f"{self._identity[2]}@{self._identity[3]} on boot {self._identity[1]!r}, "
                f"now {request_id}@{lease_id} on boot {boot_id!r}): prefill preempted, "
                "aborted or restarted the request, and the blocks already read may have "
                "been reused"
            )

    def _check_extends(self, remote_block_ids: BlockIds, end_token: int) -> None:
        if len(remote_block_ids) != len(self._block_sizes):
            raise _refused(
                f"the announcement names {len(remote_block_ids)} block groups, decode has "
                f"{len(self._block_sizes)}",
                FailureKind.PARAMS,
            )
        for group, (ids, read, size) in enumerate(
            zip(remote_block_ids, self._read_from, self._block_sizes, strict=True)
        ):
            if tuple(ids[: len(read)]) != read:
                raise _refused(
                    f"group {group}'s announced blocks do not begin with the {len(read)} "
                    "blocks decode already read from"
                )
            if len(ids) < -(-end_token // size):
                raise _refused(
                    f"group {group} names {len(ids)} blocks for {end_token} tokens",
                    FailureKind.PARAMS,
                )
            if len(self._local[group]) < -(-end_token // size):
                raise _refused(
                    f"decode allocated {len(self._local[group])} blocks in group {group} "
                    f"for {end_token} tokens",
                    FailureKind.PLAN,
                )

    def _increment(self, remote_block_ids: BlockIds, end_token: int, final: bool) -> Increment:
        start_token = self._num_read_tokens
        remote, local = [], []
        for ids, local_ids, size in zip(
            remote_block_ids, self._local, self._block_sizes, strict=True
        ):
            first, end = start_token // size, -(-end_token // size)
            remote.append(tuple(ids[first:end]))
            local.append(tuple(local_ids[first:end]))
        self._read_from = tuple(
            tuple(ids[: -(-end_token // size)])
            for ids, size in zip(remote_block_ids, self._block_sizes, strict=True)
        )
        self._num_read_tokens = end_token
        self._posted = True
        return Increment(start_token, end_token, tuple(remote), tuple(local), final)


def _refused(message: str, kind: FailureKind = FailureKind.LEASE_EXPIRED) -> ChunkRefused:
    return ChunkRefused(LoadFailure(kind, f"chunked pull: {message}"))
