"""Prefill-side request state: lease finished requests' blocks until every decode reader is done.

Each do_remote_decode request's lease is one record in a Book, moved only along
LEASE_LIFECYCLE (below): request_finished (LEASED: blocks held) -> the next
metadata's ``sends`` (ANNOUNCED) -> every rank reports it in finished_sending (COMPLETED), or
its lease expires (EXPIRED), or decode releases it over the side channel (RELEASED) -> reported
once in ``finished_sending``. Ended early once announced, its id also goes into ``forgotten`` so
the ranks stop counting for it. Only the engine thread calls this class; the LeaseTable (expiry
times and the side channel's releases) is the part shared with the side-channel thread.

Each lease draws a random lease id, returned in the params with the side channel's boot id.
The ranks count free notifications by lease key (``lease_key``: request id and lease id), so
``sends``, ``forgotten`` and the ranks' ``finished_sending`` name lease keys, never bare
request ids: a notification for an ended lease or another boot counts towards nothing here.

A decode engine in multi-turn mode holds its finished requests through this same class
(``request_finished(..., hold_s=...)``): a lease of its own duration, whose reader is the
next turn's prefill; it returns the params that prefill needs instead of decode's.

With host staging (``stage_holds``) such a hold starts not readable until every rank copied
it to the host buffer (``stage_out``, then ``WorkerReport.staged``; docs/architecture.md,
Threads, "Host staging"); its digests (verify_kv) wait for the copy. Prefill's own leases are
copied in the step prefill completed, before request_finished.

A lease expires on decode's silence, never on this engine's own deafness: while the side
channel's serving thread has been in one turn for more than DEAF_AFTER_S (stuck answering, or
without CPU or GIL), heartbeats sent here may wait unread in its queue, so no lease expires
until it has caught up, or until it has been behind for a whole lease (a stuck serving thread
does not pin blocks forever).
"""

from __future__ import annotations

import dataclasses
import enum
import logging
import os
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from connector.lease_binding import HeldBlocks, HeldTokens, KVSalt
from connector.lifecycle import Book, LifecycleState, OnMove, TransitionTable
from connector.metadata import BlockIds, DigestSpec, StageSpec, WorkerReport
from connector.observability.metrics import (
    LEASES_COMPLETED,
    LEASES_EXPIRED,
    LEASES_READER_RESTARTED,
    LEASES_RELEASED,
    LEASES_STARTED,
    PREFILL_FREE_SECONDS,
    MetricsRecorder,
    default_recorder,
)
from connector.observability.ratelimit import RateLimitedLog
from connector.params import params_for_decode, params_for_prefill
from connector.protocol import lease_key
from scheduler.leases import LeaseTable

logger = logging.getLogger(__name__)

# A side channel whose serving thread has been in one turn this long (a turn is a 50 ms poll
# and an answer) may have heartbeats waiting unread: no lease expires meanwhile.
DEAF_AFTER_S = 1.0


class LeaseState(LifecycleState):
    """Where one prefill lease stands: its blocks stay held until it ends."""

    NEW = enum.auto()
    LEASED = enum.auto()  # blocks held; the ranks hear of it in the next metadata's sends
    ANNOUNCED = enum.auto()  # in a sends: the ranks count its decode readers' free notifications
    COMPLETED = enum.auto()  # every rank saw its free notifications
    EXPIRED = enum.auto()  # no heartbeat kept it alive
    RELEASED = enum.auto()  # decode said over the side channel it will never read


_P = LeaseState
LEASE_LIFECYCLE = TransitionTable(
    "prefill lease",
    {
        _P.NEW: {_P.LEASED},
        _P.LEASED: {_P.ANNOUNCED, _P.COMPLETED, _P.EXPIRED, _P.RELEASED},
        _P.ANNOUNCED: {_P.COMPLETED, _P.EXPIRED, _P.RELEASED},
        _P.COMPLETED: (),
        _P.EXPIRED: (),
        _P.RELEASED: (),
    },
)


# The states as module names: shorter to read, and cheaper than Enum class attributes per call.
LEASED, ANNOUNCED, COMPLETED = LeaseState.LEASED, LeaseState.ANNOUNCED, LeaseState.COMPLETED
EXPIRED, RELEASED = LeaseState.EXPIRED, LeaseState.RELEASED


class LeaseIds:
    """Random lease ids, 16 hex digits, as ``secrets.token_hex(8)`` draws them (os.urandom)
    but one system call per ``BATCH`` ids: a lease id is drawn on the engine thread."""

    BATCH = 256
    _ID_BYTES = 8

    def __init__(self) -> None:
        self._pool = b""
        self._offset = 0

    def draw(self) -> str:
        offset = self._offset
        if offset == len(self._pool):
            self._pool, offset = os.urandom(self.BATCH * self._ID_BYTES), 0
        self._offset = offset + self._ID_BYTES
        return self._pool[offset : offset + self._ID_BYTES].hex()


@dataclasses.dataclass(slots=True)
class _Lease:
    """One held lease; ``state`` says where it stands (Book moves it)."""

    request_id: str
    leased_s: float  # when it was taken, on the producer's clock
    key: str  # lease_key(request id, lease id): what the ranks count notifications by
    lease_id: str
    digest: DigestSpec | None = None  # verify_kv: what the ranks digest, until announced
    hold_s: float | None = None  # decode's hold for a next turn (its own duration)
    state: LeaseState = LeaseState.NEW
    ranks_done: frozenset[int] = frozenset()  # reported finished_sending (replaced, not grown)
    stage: StageSpec | None = None  # host staging: the copy the ranks run, until sent
    ranks_staged: frozenset[int] | None = None  # host staging: ranks that copied (None: ready)


class Producer:
    def __init__(
        self,
        *,
        engine_id: str,
        tp_size: int,
        leases: LeaseTable,
        clock: Callable[[], float],
        address: Callable[[], tuple[str, int]],
        boot_id: Callable[[], str] = lambda: "",  # the side channel's boot id, once started
        metrics: MetricsRecorder | None = None,  # None: the process's default_recorder()
        on_move: OnMove | None = None,  # sees every state change (tests)
        verify_kv: bool = False,  # the ranks digest every lease's blocks
        stage_holds: bool = False,  # host staging: holds are copied device->host first
        exact_reads: bool = False,  # a group holds a state (SSM, sliding window): no prefixes
        # Seconds the side channel's serving thread has been in its current turn (0.0: none)
        side_channel_lag: Callable[[], float] = lambda: 0.0,
    ) -> None:
        self._engine_id = engine_id
        self._side_channel_lag = side_channel_lag
        self._deaf_log = RateLimitedLog(logger)
        self._exact_reads = exact_reads
        self._verify_kv = verify_kv
        self._stage_holds = stage_holds
        self._ready_digests: list[DigestSpec] = []  # staged leases' digests, once copied
        self._stage_out: list[StageSpec] = []  # staged leases announced, copy not yet asked
        self._metrics = metrics or default_recorder()
        self._tp_size = tp_size
        self._leases = leases  # expiry times and side-channel releases, shared across threads
        self._clock = clock
        self._address = address  # the side channel's (host, port) decode engines call
        self._boot_id = boot_id
        self._by_key: dict[str, _Lease] = {}  # live leases by lease key, for the ranks' reports
        self._book: Book[LeaseState, _Lease] = Book(LEASE_LIFECYCLE, what="lease", on_move=on_move)
        # Outboxes: what the next metadata and take_finished hand over.
        self._pending_forgotten: list[str] = []
        self._finished: list[str] = []
        self.num_stray_reports = 0  # finished_sending for ids with no live lease here
        self._num_started = 0  # leases started since end_lapsed_leases last counted them
        self._lease_ids = LeaseIds()

    def request_finished(
        self,
        request_id: str,
        block_ids: Sequence[Sequence[int]],
        num_tokens: int,
        *,
        hold_s: float | None = None,
        token_ids: Sequence[int] | None = None,
        kv_salt: KVSalt = (),
        lease_id: str | None = None,
    ) -> tuple[bool, dict[str, Any] | None]:
        """Lease the blocks and return the params their reader needs; (False, None) if we
        cannot.

        ``num_tokens``: the tokens whose KV the blocks hold, returned as remote_num_tokens.
        ``token_ids``: the request's ids, its first ``num_tokens`` those tokens: the lease is
        bound to them and to ``block_ids`` (a reader expecting other tokens, or reading other
        blocks, is refused). Without them (None, or fewer ids) nothing is offered: a lease
        that could not say what its blocks hold would vouch for any reader. ``kv_salt``:
        what else their KV depends on, bound with them (connector/lease_binding.py).
        ``lease_id``: the id of the lease chunked pulls drew while the request ran
        (scheduler/chunk_leases.py), bound here to the whole prompt; None draws one.
        ``hold_s`` (a decode engine in bidirectional mode): hold the finished request's
        blocks that long for the next turn's prefill, and return the params it needs.
        """
        if self._book.get(request_id) is not None:
            logger.warning("request %s finished twice; keeping its first lease", request_id)
            return True, None
        host, port = self._address()
        if port == 0:
            logger.error(
                "request %s: the side channel is not started, so no engine could reach this "
                "one to read the blocks; freeing them (call start_side_channel first)",
                request_id,
            )
            return False, None
        # Bound to the engine's ids as they are: the side-channel thread packs them when a
        # check needs them, not the engine thread now (connector/lease_binding.py HeldTokens).
        tokens = None if token_ids is None else HeldTokens.of(token_ids, num_tokens, kv_salt)
        if tokens is None:
            logger.warning(
                "request %s: %s, so its KV is not offered to another engine (it is computed there)",
                request_id,
                "the engine passed no token ids (prompt embeddings?)"
                if token_ids is None
                else f"the engine passed {len(token_ids)} token ids for {num_tokens} tokens",
            )
            return False, None
        now_s = self._clock()
        lease_id = lease_id or self._lease_ids.draw()
        key = lease_key(request_id, lease_id)
        # Our own copy of the ids the params name: the params travel on and may be edited.
        blocks: BlockIds = tuple(tuple(group) for group in block_ids)
        held = HeldBlocks(blocks, num_tokens, exact=self._exact_reads)
        expiry_s = self._leases.lease(request_id, now_s, lease_id, hold_s, tokens, held)
        staged = hold_s is not None and self._stage_holds
        digest = DigestSpec(key, blocks, num_tokens) if self._verify_kv else None
        lease = _Lease(request_id, now_s, key, lease_id, digest, hold_s)
        if staged:
            self._leases.await_copy(request_id)  # before its params leave: never seen readable
            lease.stage = StageSpec(key, request_id, blocks)
            lease.ranks_staged = frozenset()
        self._book.start(request_id, lease, LEASED)
        self._by_key[key] = lease
        self._num_started += 1  # counted at the step's end: one metrics call, not one a lease
        if hold_s is None:
            return True, params_for_decode(
                engine_id=self._engine_id,
                request_id=request_id,
                block_ids=block_ids,
                host=host,
                port=port,
                tp_size=self._tp_size,
                num_tokens=num_tokens,
                boot_id=self._boot_id(),
                lease_id=lease_id,
            )
        return True, params_for_prefill(
            engine_id=self._engine_id,
            request_id=request_id,
            block_ids=block_ids,
            host=host,
            port=port,
            tp_size=self._tp_size,
            num_tokens=num_tokens,
            expiry_s=expiry_s,
            boot_id=self._boot_id(),
            lease_id=lease_id,
        )

    def take_step(self) -> tuple[tuple[str, ...], tuple[str, ...], tuple[DigestSpec, ...]]:
        """(sends, forgotten, digests) for the next metadata, as lease keys, after ending
        expired and released leases. Host staging: ``take_stage_out`` right after."""
        self.end_lapsed_leases()
        announced = [
            self._book.move(request_id, ANNOUNCED) for request_id in self._book.ids(LEASED)
        ]
        sends = tuple(lease.key for lease in announced)
        digests = self._ready_digests  # staged leases copied since the last step
        self._ready_digests = []
        for lease in announced:
            if lease.stage is not None:
                self._stage_out.append(lease.stage)
                lease.stage = None  # sent once
            if lease.digest is not None and lease.ranks_staged is None:
                digests.append(lease.digest)
                lease.digest = None  # sent once; the ranks keep nothing of it
        forgotten, self._pending_forgotten = tuple(self._pending_forgotten), []
        return sends, forgotten, tuple(digests)

    def take_stage_out(self) -> tuple[StageSpec, ...]:
        """Host staging: the holds announced by the last ``take_step``, for the ranks to copy."""
        stage_out, self._stage_out = tuple(self._stage_out), []
        return stage_out

    def on_reports(self, reports: Iterable[WorkerReport]) -> None:
        for report in reports:
            for unsaved in report.unsaved:
                self._end_unsaved(unsaved, report.tp_rank)
            for key in report.staged:
                self._on_staged(key, report.tp_rank)
            for key, tables in report.digests.items():
                lease = self._by_key.get(key)
                if lease is not None:
                    self._leases.add_digests(
                        lease.request_id, lease.lease_id, report.tp_rank, tables
                    )
            for key in report.finished_sending:
                lease = self._by_key.get(key)
                if lease is None:
                    self.num_stray_reports += 1  # already ended (expired, released) or not ours
                    continue
                lease.ranks_done |= {report.tp_rank}
                if len(lease.ranks_done) == self._tp_size:
                    self._leases.complete(lease.request_id)
                    self._metrics.inc(LEASES_COMPLETED)
                    self._finish(lease.request_id, COMPLETED)
        self.end_lapsed_leases()

    def _side_channel_deaf(self) -> bool:
        """Is the side channel too far behind to have read the heartbeats sent to it? Then no
        lease ends on its clock now: a heartbeat may wait unread in its queue. Past one lease
        duration the leases end anyway: a stuck serving thread must not pin blocks forever."""
        lag_s = self._side_channel_lag()
        if not DEAF_AFTER_S < lag_s <= self._leases.duration_s:
            return False
        self._deaf_log.warning(
            "side channel deaf", "no lease expires while the side channel's serving thread "
            "has not turned for %.1f s: heartbeats sent to this engine may be waiting unread; "
            "past %.0f s the leases end anyway", lag_s, self._leases.duration_s,
        )  # fmt: skip
        return True

    def end_lapsed_leases(self) -> None:
        if self._num_started:  # every lease that may end here is counted as started first
            self._metrics.inc(LEASES_STARTED, amount=self._num_started)
            self._num_started = 0
        if self._side_channel_deaf():
            return
        for request_id in self._leases.expired(self._clock()):
            lease = self._book.get(request_id)
            if lease is None:
                continue
            if lease.hold_s is not None:
                logger.info(
                    "request %s: no next turn pulled its KV within %.1f s; releasing its blocks",
                    request_id,
                    lease.hold_s,
                )
            else:
                logger.warning(
                    "request %s: lease of %.1f s expired before every decode reader freed it; "
                    "releasing its KV blocks",
                    request_id,
                    self._leases.duration_s,
                )
            self._metrics.inc(LEASES_EXPIRED)
            self._end_early(request_id, EXPIRED)
        for request_id in self._leases.take_released():
            if self._book.get(request_id) is not None:
                logger.info("request %s released by its decode engine", request_id)
                self._metrics.inc(LEASES_RELEASED)
                self._end_early(request_id, RELEASED)
        for request_id in self._leases.take_reader_restarted():
            if self._book.get(request_id) is not None:
                logger.info(
                    "request %s: the only reader that claimed its lease restarted; releasing "
                    "its blocks",
                    request_id,
                )
                self._metrics.inc(LEASES_READER_RESTARTED)
                self._end_early(request_id, RELEASED)

    def _on_staged(self, key: str, tp_rank: int) -> None:
        """A rank copied a staged lease's blocks to the host; with every rank's copy done the
        lease becomes readable, and (verify_kv) its digests go out with the next step."""
        lease = self._by_key.get(key)
        if lease is None or lease.ranks_staged is None:
            return  # ended meanwhile (expired, released, unsaved), or not staged
        lease.ranks_staged |= {tp_rank}
        if len(lease.ranks_staged) < self._tp_size:
            return
        lease.ranks_staged = None
        self._leases.copy_done(lease.request_id, lease.lease_id)
        if lease.digest is not None:
            self._ready_digests.append(lease.digest)
            lease.digest = None

    def _end_unsaved(self, request_id: str, tp_rank: int) -> None:
        """A rank's staged copy of the request's blocks differs from its device blocks (host
        staging, verify_kv): the digests and every READ would prove the host copy, so the
        lease ends now and no reader is told it holds."""
        lease = self._book.get(request_id)
        if lease is None:
            logger.warning(
                "request %s: tp_rank %d's device->host copy of its KV differs from the device "
                "blocks, but it holds no lease (not finished yet, or already ended)",
                request_id,
                tp_rank,
            )
            return
        logger.warning(
            "request %s: tp_rank %d's device->host copy of its KV differs from the device "
            "blocks; ending its lease, so decode fails the load (its failure policy decides) "
            "instead of reading that copy",
            request_id,
            tp_rank,
        )
        self._leases.release([lease.key])
        self._metrics.inc(LEASES_RELEASED)
        self._end_early(request_id, RELEASED)

    def take_finished(self) -> tuple[str, ...]:
        finished, self._finished = tuple(self._finished), []
        return finished

    def _end_early(self, request_id: str, ended: LeaseState) -> None:
        lease = self._book.get(request_id)
        if lease is not None and lease.state is ANNOUNCED:
            self._pending_forgotten.append(lease.key)  # LEASED: the ranks never heard of it
        self._finish(request_id, ended)

    def _finish(self, request_id: str, ended: LeaseState) -> None:
        lease = self._book.move(request_id, ended)
        del self._by_key[lease.key]
        if lease.hold_s is None:  # a prefill lease, not decode's hold for a next turn
            self._metrics.observe(PREFILL_FREE_SECONDS, self._clock() - lease.leased_s)
        self._finished.append(request_id)

    @property
    def has_pending_work(self) -> bool:
        """Leased requests not yet freed, or ids the ranks have not yet been told about."""
        return len(self._book) > 0 or bool(self._pending_forgotten)

    @property
    def num_leased(self) -> int:
        return len(self._book)
