"""Transfer planning, the recipe: a PeerPlan once per handshake, ``plan_request`` once per request.

Every transfer is "tokens [a, b) of group g, heads [h0, h1), from prefill's kernel blocks to
decode's kernel blocks"; byte ranges come from token ranges through each side's own geometry,
so heterogeneous block sizes, partial prefix hits, TP head slices and per-layer page sizes are
correct by construction. Who owns each stage:

    handshake, once per (local rank, remote engine): ``peer_plan``
      pair the layouts (validate, plane classes)   worker/plan/pairing.py
      prepared rows per remote rank                worker/plan/whole_blocks.py prepared_rows
      who notifies, with which count               worker/topology.py notification_duty
    per request: ``plan_request``
      1. cut segments (and check the request)      worker/plan/segments.py
      2. split whole and partial blocks            worker/plan/whole_blocks.py split_request
      3. whole blocks by index or by row ranges    worker/plan/whole_blocks.py indexed_request,
         (the cost rule)                             whole_ranges, reads_by_index
      4. partial blocks as exact runs              worker/plan/exact_runs.py
      5. one result: a RequestPlan                 here

A remote rank without prepared rows (tests, benchmarks, a pairing that is not whole-block
addressable) reads everything through stage 4. Production (worker/loads.py), the tests and
the benchmarks call the same ``plan_request``; ``path`` forces one way for the tests and
benchmarks that compare them. Pure: ints and numpy arrays.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping, Sequence

import msgspec

from connector.layout import RankLayout
from worker.plan.exact_runs import ByteRuns, concatenate, exact_runs
from worker.plan.pairing import GroupPairing, pair_groups, validate_pair
from worker.plan.segments import RequestSegments, cut_segments, leading_remote_blocks
from worker.plan.whole_blocks import (
    PreparedRequest,
    PreparedRows,
    RequestSplit,
    indexed_request,
    prepared_rows,
    reads_by_index,
    split_request,
    whole_ranges,
)
from worker.topology import head_shapes, notification_duty


class PeerPlan(msgspec.Struct, frozen=True):
    """What a rank knows, from the handshake on, about reading one remote engine.

    Building it (``peer_plan``) validates the pairing and raises UnsupportedConfiguration.
    """

    groups: tuple[GroupPairing, ...]  # per cache group: block sizes, plane classes per rank
    read_ranks: tuple[int, ...]  # remote ranks some group reads from, ascending
    duty: Mapping[int, int]  # remote rank this rank covers -> its free notification's count
    never_read: tuple[int, ...]  # covered ranks no group reads (replicated heads, MLA)
    rows: Mapping[int, PreparedRows] = msgspec.field(default_factory=dict)  # rank -> by index

    def without_rows(self, ranks: Sequence[int]) -> PeerPlan:
        """The same plan with ``ranks`` read by byte ranges only (their lists failed)."""
        rows = {rank: found for rank, found in self.rows.items() if rank not in ranks}
        return msgspec.structs.replace(self, rows=rows)


def peer_plan(
    local: RankLayout,
    remote: RankLayout,
    *,
    duty: Mapping[int, int] | None = None,
    local_addresses: Sequence[int] = (),
    local_device: int = 0,
    remote_addresses: Mapping[int, tuple[Sequence[int], int]] | None = None,
) -> PeerPlan:
    """Pair ``local`` (this decode rank) with ``remote`` (a prefill engine's rank layout).

    ``duty``: the peer's (worker/peers.py computes it before the handshake); None: computed
    here by the same rule. ``remote_addresses``: remote rank -> (its region addresses, its
    memory's device); each rank given gets prepared rows if its pairing allows READs by
    index. None: byte ranges only.
    """
    validate_pair(local, remote)
    groups = pair_groups(local, remote)
    if duty is None:
        duty = notification_duty(local.tp_rank, local.tp_size, remote.tp_size, head_shapes(local))
    read_ranks = tuple(sorted({rank for g in groups for rank in g.classes}))
    rows: dict[int, PreparedRows] = {}
    for rank, (addresses, device) in (remote_addresses or {}).items():
        found = prepared_rows(
            groups, rank, local_addresses=local_addresses, local_device=local_device,
            remote_addresses=addresses, remote_device=device,
        )  # fmt: skip
        if found is not None and rank in read_ranks:
            rows[rank] = found
    never_read = tuple(rank for rank in duty if rank not in read_ranks)
    return PeerPlan(groups, read_ranks, dict(duty), never_read, rows)


class TransferRequest(msgspec.Struct, frozen=True):
    """One request as the planner sees it.

    ``local_block_ids[g]``: decode's logical blocks covering [num_cached_tokens, num_tokens);
    ``remote_block_ids[g]``: prefill's logical blocks covering [0, num_tokens), or, with
    ``remote_holds_more`` (a pull from decode, multi-turn), leading blocks covering them.
    """

    local_block_ids: Sequence[Sequence[int]]
    remote_block_ids: Sequence[Sequence[int]]
    num_tokens: int
    num_cached_tokens: int
    remote_holds_more: bool = False


class ReadPath(enum.Enum):
    """How whole blocks of a rank with prepared rows are read."""

    CHEAPER = "cheaper"  # the cost rule picks (production)
    BY_INDEX = "by_index"  # by index wherever there are rows
    BY_RANGES = "by_ranges"  # byte ranges, whole blocks straight from the rows
    EXACT = "exact"  # ignore the rows: every segment through stage 4


# The members by module name: on Python 3.11 reading a member through its class costs
# ~0.4 us, and the per-request path compares up to three.
_CHEAPER, _BY_INDEX, _EXACT = ReadPath.CHEAPER, ReadPath.BY_INDEX, ReadPath.EXACT


class RankPlan(msgspec.Struct, frozen=True):
    """What one request reads from one remote rank: by index, by byte ranges, or both (the
    whole blocks by index and the partial segments as ranges: two READs)."""

    remote_rank: int
    by_index: PreparedRequest | None
    ranges: ByteRuns | None

    @property
    def num_reads(self) -> int:
        return (self.by_index is not None) + (self.ranges is not None)

    def sizes(self) -> list[tuple[int, int]]:
        """(bytes, descriptors) of each READ, for the load's timeline; a READ by index counts
        its indices (before NIXL merges them)."""
        found = []
        if self.by_index is not None:
            found.append((self.by_index.num_bytes, len(self.by_index.local_indices)))
        if self.ranges is not None:
            found.append((self.ranges.num_bytes, len(self.ranges)))
        return found


class RequestPlan(msgspec.Struct, frozen=True):
    reads: tuple[RankPlan, ...]  # one per remote rank actually read (may be empty)
    notify_only: tuple[int, ...]  # covered remote ranks this request reads nothing from
    consumers: Mapping[int, int]  # remote rank -> count to put in its free notification


def plan_request(
    peer: PeerPlan, request: TransferRequest, path: ReadPath = ReadPath.CHEAPER
) -> RequestPlan:
    """The READs of ``request`` from ``peer``; raises TransferPlanError for an impossible one."""
    remote_block_ids = request.remote_block_ids
    if request.remote_holds_more:
        remote_block_ids = leading_remote_blocks(peer.groups, remote_block_ids, request.num_tokens)
    segments = cut_segments(  # 1
        peer.groups,
        request.local_block_ids,
        remote_block_ids,
        num_tokens=request.num_tokens,
        num_cached_tokens=request.num_cached_tokens,
    )
    reads: list[RankPlan] = []
    for rank in peer.read_ranks:  # 2-4 per remote rank
        found = _plan_rank(peer, segments, rank, path)
        if found is not None:
            reads.append(found)
    notify_only = peer.never_read
    if len(reads) < len(peer.read_ranks):  # a rank read by some group, by none this time
        read = {found.remote_rank for found in reads}
        notify_only = tuple(rank for rank in peer.duty if rank not in read)
    return RequestPlan(tuple(reads), notify_only, peer.duty)  # 5


def _plan_rank(
    peer: PeerPlan, segments: RequestSegments, rank: int, path: ReadPath
) -> RankPlan | None:
    rows = None if path is _EXACT else peer.rows.get(rank)
    if rows is None:  # 4 only: every segment as exact runs
        runs = exact_runs(peer.groups, segments, rank)
        return None if runs is None else RankPlan(rank, None, runs)
    split = split_request(rows, segments)  # 2
    if path is _BY_INDEX or (path is _CHEAPER and reads_by_index(split)):  # 3
        return _by_index(peer, segments, rank, split)
    return _by_ranges(peer, segments, rank, split)


def _by_index(
    peer: PeerPlan, segments: RequestSegments, rank: int, split: RequestSplit
) -> RankPlan | None:
    """Whole blocks by index (one READ), partial segments as exact runs (a second READ)."""
    partial = exact_runs(peer.groups, segments, rank, split.partial) if split.num_partial else None
    indexed = indexed_request(split) if split.num_indices else None
    if indexed is None and partial is None:
        return None
    return RankPlan(rank, indexed, partial)


def _by_ranges(
    peer: PeerPlan, segments: RequestSegments, rank: int, split: RequestSplit
) -> RankPlan | None:
    """One READ of byte ranges: whole blocks straight from the rows, partial segments exact."""
    parts = whole_ranges(split)
    if split.num_partial:
        partial = exact_runs(peer.groups, segments, rank, split.partial)
        if partial is not None:
            parts.append(partial)
    return RankPlan(rank, None, concatenate(parts)) if parts else None
