"""What the scheduler side tells the worker ranks each step, and what the ranks report back.

The scheduler builds one ConnectorMetadata per engine step and hands the same value to every
worker rank; each rank returns a WorkerReport from get_finished(). Both are plain msgspec
Structs so an engine may ship them between processes as bytes.

A failed load's outcome (``LoadFailure``) is a kind from one enum and a message for people.
The kind travels with the message from where the failure is decided (a worker rank, the
scheduler's params check) to the engine: metrics label by it, code branches on it, and no code
reads the message's text. The message says what went wrong and what to do.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from typing import NamedTuple

import msgspec

from connector.lease_binding import KVSalt
from connector.protocol import BlockDigest, ReaderId, TokenDigest, lease_key

BlockIds = tuple[tuple[int, ...], ...]  # logical block ids, one tuple per cache group
# The largest block id anywhere on the path: vLLM's block tables are int32 tensors and the
# prepared-list planner indexes NIXL descriptors in int32 (worker/plan/whole_blocks.py), so an
# id above this could never name a real block; params refuse it at the door.
MAX_BLOCK_ID = 2**31 - 1


class FailureKind(enum.StrEnum):
    """Why a load failed, bounded (a metrics label); each value is its label."""

    ABORTED = "aborted"  # the request ended first: no failure of the load itself
    HANDSHAKE = "handshake"  # prefill's side channel or agent could not be reached or paired
    HANDSHAKE_TIMEOUT = "handshake_timeout"
    PARAMS = "params"  # the kv_transfer_params were refused, or changed under the load
    PLAN = "plan"  # decode's blocks or the pairing cannot take this load
    TRANSFER = "transfer"  # a READ failed
    TRANSFER_TIMEOUT = "transfer_timeout"
    INTERNAL = "internal"  # a connector bug, contained to this request
    LEASE_EXPIRED = "lease_expired"  # prefill no longer held the lease when the READs landed
    PREFILL_RESTARTED = "prefill_restarted"  # the boot that leased is gone, its lease with it
    LEASE_UNPROVEN = "lease_unproven"  # prefill could not be asked, or the params name no lease
    DIGEST = "digest"  # verify_kv: the bytes read are not the bytes prefill saved
    TOKENS_MISMATCH = "tokens_mismatch"  # the lease holds other tokens than this prompt
    BLOCKS_MISMATCH = "blocks_mismatch"  # the load reads other blocks than the lease holds
    ENGINE = "engine"  # the engine reported the load failed before this rank did
    # Overlapped dispatch (docs/overlap.md): decode waited for prefill's lease announcement
    PREFILL_FAILED = "prefill_failed"  # prefill ended the request without a lease
    PREFILL_TIMEOUT = "prefill_timeout"  # no announcement within the wait (dead, never sent)


class LoadFailure(msgspec.Struct, frozen=True, forbid_unknown_fields=True, array_like=True):
    """One load's failure: its ``kind`` and a ``message`` saying what happened."""

    kind: FailureKind
    message: str

    def __str__(self) -> str:
        return self.message


ABORTED_LOAD = LoadFailure(FailureKind.ABORTED, "aborted")  # the request ended first


def one_failure(failures: dict[int, LoadFailure]) -> LoadFailure:
    """One failure for a request its ranks failed (tp_rank -> why): the ranks' shared one, or
    the lowest failing rank's kind with a message naming it."""
    reasons = set(failures.values())
    if len(reasons) == 1:
        return reasons.pop()
    rank = min(failures)
    first = failures[rank]
    return LoadFailure(
        first.kind,
        f"tp_rank {rank}: {first.message} ({len(failures) - 1} other rank(s) failed too)",
    )


class SideChannelBoot(NamedTuple):
    """One boot of a remote engine's side channel: where a message goes, and the boot it is for
    ("": not known yet, learned with Hello). Keyed by engine and boot too: an engine restarted
    on the same host:port is another side channel, so a refusal from one never silences the
    other."""

    engine_id: str
    host: str
    port: int
    boot_id: str = ""

    def __str__(self) -> str:
        return f"engine {self.engine_id!r} at {self.host}:{self.port}"


class RemoteSource(msgspec.Struct, frozen=True, forbid_unknown_fields=True, gc=False):
    """Where a request's prompt KV lives: the prefill engine and its blocks."""

    engine_id: str
    host: str
    port: int
    tp_size: int
    remote_request_id: str  # the prefill side's request id: with lease_id, the lease key
    remote_block_ids: BlockIds  # prefill's logical blocks for tokens [0, num_tokens), per group
    boot_id: str = ""  # prefill's side-channel boot when it leased ("": params had none)
    lease_id: str = ""  # the lease prefill drew for these blocks ("": none, load unprovable)
    # The tokens the remote blocks hold when a load may read fewer (a pull from decode, whose
    # blocks also hold the answer; the params' remote_num_tokens): the load then reads from the
    # leading blocks only. None: the blocks cover exactly the load's tokens, the LoadSpec's
    # num_tokens (prefill's lease).
    remote_num_tokens: int | None = None
    # Set by the reader, never taken from params: the tokens this load expects the blocks to
    # hold (its prompt's first ones; digested by its ranks from the LoadSpec's ids on their
    # transfer thread), and who reads (this engine and boot; set by its scheduler). Lease
    # checks send both (connector/lease_binding.py, scheduler/readers.py).
    tokens: TokenDigest | None = None
    reader: ReaderId | None = None
    # Set by the reader's ranks (transfer thread) from the above: the digest of the blocks
    # its READs come from and the tokens it assumes they hold (connector/lease_binding.py).
    blocks: BlockDigest | None = None

    @property
    def side_channel(self) -> SideChannelBoot:
        """The side channel the params name, as the boot that leased."""
        return SideChannelBoot(self.engine_id, self.host, self.port, self.boot_id)

    @property
    def lease_key(self) -> str:
        """The lease as prefill's side channel and free notifications name it."""
        return lease_key(self.remote_request_id, self.lease_id)


class LoadSpec(msgspec.Struct, frozen=True, forbid_unknown_fields=True, gc=False):
    """Decode: read tokens [num_cached_tokens, num_tokens) of a request from its prefill engine.

    ``num_tokens`` is where the load ends: the tokens decode holds once it succeeded. The remote
    blocks may hold more (``source.remote_num_tokens``, a pull from decode).

    ``local_block_ids`` are decode's logical blocks for the uncached suffix, per group: the
    blocks covering tokens [num_cached_tokens, num_tokens) (an SSM group: its one state block,
    or none on a full hit). ``num_cached_tokens`` is decode's local prefix-cache hit.

    ``token_ids`` (the reader's prompt: the engine's own list, not copied) and ``kv_salt``
    (what else their KV depends on): each rank digests the first ``num_tokens`` into
    ``source.tokens`` on its transfer thread (worker/loads.py), so the engine thread never
    packs or hashes them. None: ``source.tokens`` is used as given.

    Chunked pulls (docs/overlap.md): one load arrives as several LoadSpecs of one request id,
    each reading tokens [num_read_tokens, num_tokens) into ``read_block_ids`` (decode's blocks
    for them, per group) from the blocks prefill announced so far. ``chunk``: more follow;
    the rank posts these READs and reports nothing. The last one (``chunk`` False) reads the
    rest, then proves the whole load: its lease check and (verify_kv) claims cover tokens
    [num_cached_tokens, num_tokens) in ``local_block_ids``, every chunk included.
    """

    request_id: str
    local_block_ids: BlockIds
    num_tokens: int
    num_cached_tokens: int
    source: RemoteSource
    token_ids: Sequence[int] | None = None
    kv_salt: KVSalt = ()
    chunk: bool = False
    num_read_tokens: int | None = None  # None: num_cached_tokens (a whole load)
    read_block_ids: BlockIds | None = None  # None: local_block_ids


class ReleaseSpec(msgspec.Struct, frozen=True, forbid_unknown_fields=True, gc=False):
    """Decode: the request will not read (aborted); tell its prefill engine to free the blocks.

    ``failure`` (chunked pulls): the load whose chunk READs went out fails with it instead,
    reported once none of its READs is live."""

    request_id: str
    source: RemoteSource
    failure: LoadFailure | None = None


class DigestSpec(msgspec.Struct, frozen=True, forbid_unknown_fields=True, gc=False):
    """Prefill, with verify_kv: digest this lease's blocks (worker/kv_digest.py) and report it."""

    key: str  # the lease key (connector/protocol.py lease_key), as in ``sends``
    block_ids: BlockIds  # the leased logical blocks, per group
    num_tokens: int  # the tokens whose KV they hold


class StageSpec(msgspec.Struct, frozen=True, forbid_unknown_fields=True, gc=False):
    """Host staging: copy this lease's blocks device->host, then report its key in
    ``WorkerReport.staged`` (a decode engine's hold: its answer's KV exists only on the device
    when the lease starts, and no reader is told the lease holds until every rank copied it)."""

    key: str  # the lease key (connector/protocol.py lease_key), as in ``sends``
    request_id: str
    block_ids: BlockIds  # the leased logical blocks, per transfer group, in the lease's order


class GroupDigests(msgspec.Struct, frozen=True, forbid_unknown_fields=True, array_like=True):
    """One rank's digests of one group of a lease: uint64 little-endian [units, heads]."""

    group: int
    first_unit: int
    model_heads: tuple[int, ...]  # the table's columns
    values: bytes


class ConnectorMetadata(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """One engine step's instructions for every worker rank."""

    loads: tuple[LoadSpec, ...] = ()
    releases: tuple[ReleaseSpec, ...] = ()
    # Prefill: lease keys (connector/protocol.py lease_key) of the leases taken since the last
    # step; ranks expect free notifications for them.
    sends: tuple[str, ...] = ()
    # Prefill: lease keys the scheduler has stopped waiting for (lease expired, released over
    # the side channel); ranks drop their notification counts for them.
    forgotten: tuple[str, ...] = ()
    # Prefill with verify_kv: the leases of ``sends`` to digest.
    digests: tuple[DigestSpec, ...] = ()
    # Host staging: held leases whose blocks the engine adapter copies device->host this step.
    stage_out: tuple[StageSpec, ...] = ()
    # Prefill with chunked pulls: this step's number; each rank echoes it after the step's
    # forward (``WorkerReport.saved_step``), so the scheduler knows which chunks are written.
    step_seq: int = 0


class WorkerReport(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """What one worker rank finished since its last report."""

    tp_rank: int
    # Prefill: every expected free notification for these lease keys reached this rank.
    finished_sending: tuple[str, ...] = ()
    # Decode: this rank holds the request's KV.
    finished_recving: tuple[str, ...] = ()
    # Decode: this rank could not load the request; request id -> why (kind and message).
    failed_recving: dict[str, LoadFailure] = msgspec.field(default_factory=dict)
    # Prefill with verify_kv: lease key -> this rank's digests of its blocks, per group.
    digests: dict[str, tuple[GroupDigests, ...]] = msgspec.field(default_factory=dict)
    # Prefill with host staging and verify_kv: requests whose device->host copy left host
    # blocks that differ from their device blocks; their leases end (nothing is read).
    unsaved: tuple[str, ...] = ()
    # Host staging: lease keys of ``stage_out`` whose device->host copy this rank finished.
    staged: tuple[str, ...] = ()
    # Prefill with chunked pulls: the last ``step_seq`` whose forward this rank finished.
    saved_step: int = 0
