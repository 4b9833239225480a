"""The prefill lease table: how long finished requests' blocks stay held for decode to read.

A lease starts when prefill finishes a do_remote_decode request. Decode heartbeats extend it;
a release (decode will never read) or expiry ends it early; ``complete`` drops it once every
rank saw its free notifications. Time is passed in (``now``, seconds on the caller's clock) so
tests drive it explicitly. The engine thread and the side-channel thread share one table.
It holds only what the side-channel thread must see (which ids are held, until when, and which
were released); each lease's lifecycle state is Producer's record (LEASE_LIFECYCLE).

A heartbeat or release can only touch the lease it names, by its lease key
(``request_id@lease_id``, connector/protocol.py ``lease_key``): a name with no held lease
(never leased here, already ended, or an earlier lease of a repeated request id) is *stray*:
counted in ``stats``, and nothing else happens. A lease taken without a lease id answers to
its bare request id. Recently ended names are remembered (bounded) to tell "already ended"
from "never leased".

Each lease also has a lease id, drawn at random when it starts and returned in the params:
``held`` answers decode's LeaseCheck for that very lease, so a later lease of a repeated
request id never vouches for an earlier one's blocks.

A lease is bound to its blocks and their token ids (connector/lease_binding.py; why:
docs/integrity.md): a ref gets "held" only for exactly those blocks and token count, and
tokens that are a prefix of the lease's ids (all of them with an SSM or sliding-window group:
``HeldBlocks.exact``; a chunked pull's earlier blocks too: ``HeldBlocks.grown_from``); else it
is refused, with the reason (``Refusal``). A lease taken without a binding (this table's own
tests) answers for its id alone.

With host staging a decode engine's hold starts not readable (docs/architecture.md, Threads,
"Host staging"): ``await_copy`` marks it so, ``copy_done`` makes it readable once every rank
copied; a LeaseCheck answers it ``pending`` until then and ``staged`` after (worker/lease_proof.py
says why a reader must then have seen it held before its first READ).

Readers that name themselves claim the held leases their messages name (scheduler/readers.py);
a message from a new boot of a reader engine ends the leases only its earlier boot claimed,
handed to the engine thread by ``take_reader_restarted``.
"""

from __future__ import annotations

import dataclasses
import heapq
import threading
from collections import OrderedDict
from collections.abc import Iterable, Sequence

from connector.lease_binding import HeldBlocks, HeldTokens
from connector.metadata import GroupDigests
from connector.protocol import (
    REFUSED_BLOCKS,
    REFUSED_TOKENS,
    LeaseRef,
    LeaseStatus,
    ReaderId,
    Refusal,
    lease_key,
)
from scheduler.digests import RankDigests, verify_claims
from scheduler.readers import ReaderBoots

MAX_ENDED_IDS = 4096  # ended lease ids remembered to classify late messages


@dataclasses.dataclass
class LeaseStats:
    """Ids named by heartbeats and releases that had no held lease."""

    stray_never_leased: int = 0  # this engine never leased the id (or forgot it long ago)
    stray_already_ended: int = 0  # the lease had already completed, expired or been released


@dataclasses.dataclass(slots=True)
class _Held:
    """One held lease: what the side-channel thread must see of it."""

    lease_id: str
    expiry_s: float
    duration_s: float  # what a heartbeat extends it by (decode's multi-turn holds: their own)
    tokens: HeldTokens | None  # the token ids it is bound to (None: unbound); never replaced
    blocks: HeldBlocks | None  # the blocks it is bound to (None: unbound); never replaced
    staged: bool = False  # started not readable (host staging)
    copying: bool = False  # staged, and its copy is not done yet
    # verify_kv: tp_rank -> that rank's digest tables
    digests: dict[int, tuple[GroupDigests, ...]] = dataclasses.field(default_factory=dict)


class LeaseTable:
    """Thread-safe map from prefill request id to its held lease."""

    def __init__(self, duration_s: float, *, num_ranks: int = 1) -> None:
        self._duration_s = duration_s
        self._num_ranks = num_ranks  # prefill ranks that report digests (verify_kv)
        # Guards every field below: every method uses them under it.
        self._lock = threading.Lock()
        self._held: dict[str, _Held] = {}  # request id -> its held lease
        # (expiry time, request id, lease id), earliest first: ``expired`` looks only at the
        # leases that are due, not at every held one. An extension pushes a new entry and
        # leaves the old one, skipped when it comes up (no longer that lease's expiry).
        self._due: list[tuple[float, str, str]] = []
        self._by_name: dict[str, str] = {}  # held leases: lease key (or bare id) -> request id
        self._readers = ReaderBoots()  # which reader boot claimed which held lease
        self._released: list[str] = []  # released over the side channel, not yet taken
        self._reader_restarted: list[str] = []  # ended for their reader's restart, not yet taken
        self._ended: OrderedDict[str, None] = OrderedDict()  # recently ended ids, oldest first
        self._stats = LeaseStats()

    @property
    def stats(self) -> LeaseStats:
        """A snapshot of the stray counters."""
        with self._lock:
            return dataclasses.replace(self._stats)

    @property
    def duration_s(self) -> float:
        return self._duration_s

    def lease(
        self,
        request_id: str,
        now: float,
        lease_id: str = "",
        duration_s: float | None = None,
        tokens: HeldTokens | None = None,
        blocks: HeldBlocks | None = None,
    ) -> float:
        """Hold ``request_id``'s blocks until ``now + duration_s`` (default: the table's; or
        until extended), as lease ``lease_id``, bound to the token ids ``tokens`` and the
        blocks ``blocks`` (digested by the first check that needs them; None: unbound);
        returns the expiry time. The id leased again starts afresh (readable, no digests)."""
        duration_s = self._duration_s if duration_s is None else duration_s
        expiry_s = now + duration_s
        name = lease_key(request_id, lease_id)
        with self._lock:
            earlier = self._that_lease(request_id, lease_id) if lease_id else None
            if blocks is not None and earlier is not None and earlier.blocks is not None:
                blocks.grown_from(earlier.blocks)  # a chunked pull's lease, grown
            self._held[request_id] = _Held(lease_id, expiry_s, duration_s, tokens, blocks)
            heapq.heappush(self._due, (expiry_s, request_id, lease_id))
            self._by_name[name] = request_id
            self._ended.pop(name, None)
        return expiry_s

    def held(self, refs: Iterable[tuple[str, str]], now: float) -> tuple[bool, ...]:
        """For each (request id, lease id): is that very lease held, and not past its expiry?

        Past expiry counts as not held even before ``expired`` collects it: the engine thread
        may free those blocks at any moment.
        """
        with self._lock:
            return tuple(
                self._live(request_id, lease_id, now) is not None for request_id, lease_id in refs
            )

    def _live(self, request_id: str, lease_id: str, now: float) -> _Held | None:
        """That very lease, if held and not past its expiry. Lock held."""
        lease = self._that_lease(request_id, lease_id)
        return lease if lease is not None and lease.expiry_s > now else None

    def _that_lease(self, request_id: str, lease_id: str) -> _Held | None:
        """``request_id``'s held lease if it is ``lease_id``. Lock held."""
        lease = self._held.get(request_id)
        return lease if lease is not None and lease.lease_id == lease_id else None

    def await_copy(self, request_id: str) -> None:
        """Host staging: the held lease of ``request_id`` is not readable until ``copy_done``
        (call it before the lease's params leave, so no reader ever saw it readable)."""
        with self._lock:
            lease = self._held.get(request_id)
            if lease is not None:
                lease.staged = lease.copying = True

    def copy_done(self, request_id: str, lease_id: str) -> bool:
        """Every rank copied the lease's blocks to the host: readable from now on. False if
        that very lease is not held."""
        with self._lock:
            lease = self._that_lease(request_id, lease_id)
            if lease is not None:
                lease.copying = False
            return lease is not None

    def add_digests(
        self, request_id: str, lease_id: str, tp_rank: int, tables: tuple[GroupDigests, ...]
    ) -> bool:
        """Keep a rank's digests of a held lease (verify_kv); False if that lease is not held."""
        with self._lock:
            lease = self._that_lease(request_id, lease_id)
            if lease is not None:
                lease.digests[tp_rank] = tables
            return lease is not None

    def check(self, refs: Sequence[LeaseRef], now: float) -> LeaseStatus:
        """Answer a LeaseCheck: each lease held (for a reader expecting the tokens the ref
        names; not while its host copy is pending)? and, for refs with digest claims, do they
        match the ranks' digests (verify_kv)?"""
        # One hold of the lock: a lease that ends in between cannot mix its answers with a
        # later lease's.
        with self._lock:
            live = [self._live(ref.remote_request_id, ref.lease_id, now) for ref in refs]
            staged = tuple(lease is not None and lease.staged for lease in live)
            pending = tuple(lease is not None and lease.copying for lease in live)
        # Pack and hash after releasing the lock: a lease's binding is never replaced.
        refused = tuple(
            None if lease is None or wait else refusal(ref, lease.tokens, lease.blocks)
            for ref, lease, wait in zip(refs, live, pending, strict=True)
        )
        held = tuple(
            lease is not None and not wait and why is None
            for lease, wait, why in zip(live, pending, refused, strict=True)
        )
        refused = refused if any(refused) else ()
        pending, staged = (pending if any(pending) else ()), (staged if any(staged) else ())
        if not any(ref.claims for ref in refs):
            return LeaseStatus(held, refused=refused, pending=pending, staged=staged)
        with self._lock:
            verdicts = tuple(
                verify_claims(ref.claims, self._digests(ref.remote_request_id), self._num_ranks)
                if ref.claims and is_held
                else ""
                for ref, is_held in zip(refs, held, strict=True)
            )
        return LeaseStatus(held, verdicts, refused, pending, staged)

    def _digests(self, request_id: str) -> RankDigests:
        """The digest tables of ``request_id``'s held lease ({} when none is held). Lock held."""
        lease = self._held.get(request_id)
        return {} if lease is None else lease.digests

    def seen(self, reader: ReaderId, names: Iterable[str]) -> int:
        """A message from ``reader`` named the leases ``names`` (lease keys; only held ones
        are claimed). End the leases only an earlier boot of that reader engine claimed;
        returns how many it ended."""
        with self._lock:
            held = [name for name in names if name in self._by_name]
            orphaned = self._readers.seen(reader, held)
            for name in orphaned:
                request_id = self._by_name[name]
                self._end(request_id)
                self._reader_restarted.append(request_id)
        return len(orphaned)

    def take_reader_restarted(self) -> tuple[str, ...]:
        """Ids ended since the last call because their only reader restarted."""
        with self._lock:
            ended, self._reader_restarted = tuple(self._reader_restarted), []
        return ended

    def extend(self, names: Iterable[str], now: float) -> int:
        """Push the held leases ``names`` names (lease keys) out to now plus their duration;
        returns how many were held."""
        with self._lock:
            held = self._split_stray(names)
            for request_id in held:
                lease = self._held[request_id]
                expiry_s = now + lease.duration_s
                if expiry_s > lease.expiry_s:
                    lease.expiry_s = expiry_s
                    heapq.heappush(self._due, (expiry_s, request_id, lease.lease_id))
        return len(held)

    def release(self, names: Iterable[str]) -> int:
        """End held leases now (decode will never read); returns how many were held.

        The ids come back from ``take_released`` so the engine thread can free their blocks.
        """
        with self._lock:
            held = self._split_stray(names)
            for request_id in held:
                self._end(request_id)
            self._released.extend(held)
        return len(held)

    def complete(self, request_id: str) -> bool:
        """Drop ``request_id``'s lease (all ranks reported); True if it was still held."""
        with self._lock:
            if request_id not in self._held:
                return False
            self._end(request_id)
            return True

    def expired(self, now: float) -> tuple[str, ...]:
        """Remove and return the leases whose expiry time is at or before ``now``.

        O(due entries), not O(held leases): the engine thread calls it every step.
        """
        ended: list[str] = []
        with self._lock:
            due = self._due
            while due and due[0][0] <= now:
                expiry_s, request_id, lease_id = heapq.heappop(due)
                lease = self._that_lease(request_id, lease_id)
                if lease is not None and lease.expiry_s == expiry_s:
                    self._end(request_id)
                    ended.append(request_id)
                # else extended, ended, or an earlier lease of a repeated id: stale entry
        return tuple(ended)

    def take_released(self) -> tuple[str, ...]:
        """Ids released over the side channel since the last call."""
        with self._lock:
            released, self._released = tuple(self._released), []
        return released

    def __contains__(self, request_id: object) -> bool:
        with self._lock:
            return request_id in self._held

    def __len__(self) -> int:
        with self._lock:
            return len(self._held)

    def _split_stray(self, names: Iterable[str]) -> list[str]:
        """The request ids of the held leases ``names`` name (lease keys); count the rest as
        stray. Lock held."""
        held: list[str] = []
        for name in dict.fromkeys(names):
            request_id = self._by_name.get(name)
            if request_id is not None:
                held.append(request_id)
            elif name in self._ended:
                self._stats.stray_already_ended += 1
            else:
                self._stats.stray_never_leased += 1
        return held

    def _end(self, request_id: str) -> None:
        """Drop a held lease and remember that it ended. Lock held."""
        name = lease_key(request_id, self._held.pop(request_id).lease_id)
        del self._by_name[name]
        self._readers.forget(name)
        self._ended[name] = None
        if len(self._ended) > MAX_ENDED_IDS:
            self._ended.popitem(last=False)


def refusal(ref: LeaseRef, tokens: HeldTokens | None, blocks: HeldBlocks | None) -> Refusal | None:
    """Why a held lease bound to ``tokens`` and ``blocks`` is not held for ``ref``'s reader,
    or None: the blocks first (edited params), then the tokens (another prompt)."""
    if blocks is not None:
        why = blocks.verdict(ref.blocks)
        if why:
            return Refusal(REFUSED_BLOCKS, why)
    if tokens is None:
        return None  # unbound: this table's own tests only (Producer binds every lease)
    expected = ref.tokens
    if expected is None:
        return Refusal(
            REFUSED_TOKENS,
            "the reader does not say which tokens it expects (an engine that passes no token "
            "ids, or an older nixl-pd-connector): a lease is read only by a reader that does",
        )
    if blocks is not None and blocks.exact and expected.num_tokens != blocks.num_tokens:
        return Refusal(
            REFUSED_TOKENS,
            f"the lease holds an SSM or sliding-window state after exactly {blocks.num_tokens} "
            f"tokens, the reader reads {expected.num_tokens}: a state is read only whole",
        )
    why = tokens.verdict(expected)
    return Refusal(REFUSED_TOKENS, why) if why else None
