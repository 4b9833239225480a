"""Decode side: the loads in flight on one rank, each from its LoadSpec to its one outcome.

A ``Load``'s states, its moves and what it owes at its end are worker/load_lifecycle.py's;
this table drives them: it plans a load (worker/plan/recipe.py ``plan_request``), posts the
READs of each remote rank it reads (worker/reads.py: one, or two: by index and by byte
ranges), asks prefill for the lease proof once they landed (worker/lease_proof.py), then,
success or not, sends every covered remote rank its free notification.

A READ past the transfer timeout leaves its load QUARANTINED (why: worker/load_lifecycle.py),
counted in nixl_pd_quarantined_* metrics and, past QUARANTINE_WARN_TIMEOUTS transfer timeouts,
logged as an error once. A bug on a load's path fails it the same way.

An abort (ReleaseSpec) drops a not-yet-posted load, notifies every covered remote rank so
prefill frees its blocks, and ends with reason "aborted"; an abort during a READ waits for it.
A failed load notifies the covered ranks too (best effort), so prefill does not hold its
blocks until the lease expires; except when prefill restarted since it leased: that boot's
agent is gone, and a notification to it would block this thread until UCX gives up.

Transfer thread only (worker/connector.py): this module calls the NIXL agent.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import msgspec

from connector.errors import ConnectorError
from connector.lease_binding import bound_to_blocks, token_digest
from connector.memory import HOST_MEMORY, Memory
from connector.metadata import FailureKind, LoadFailure, LoadSpec, RemoteSource
from connector.observability.metrics import (
    QUARANTINED_BLOCKS,
    QUARANTINED_LOADS,
    UNQUARANTINED_BLOCKS,
    MetricsRecorder,
    default_recorder,
)
from connector.protocol import DigestClaim
from worker.lease_proof import LeaseProofs
from worker.load_lifecycle import (
    BEFORE_READS,
    Load,
    OnMove,
    RankLoadState,
    ReadKey,
    handshake_failure,
    notify_rest,
    record_outcome,
    unprovable_reason,
    with_handshake_phases,
    with_timeline,
)
from worker.nixl_api import NixlAgent, TransferState
from worker.plan.recipe import RankPlan, TransferRequest, plan_request
from worker.reads import MakeRead, read_makers
from worker.stall_watch import Wait

if TYPE_CHECKING:  # annotations only: keeps the run-time import chain short
    from worker.peers import Peer, PeerLink

logger = logging.getLogger(__name__)

MAX_RECENT_IDS = 4096  # ended request ids remembered so a late abort is not reported twice
QUARANTINE_WARN_TIMEOUTS = 4  # a quarantine this many transfer timeouts long is logged as stuck

Outcome = tuple[str, LoadFailure | None]  # (request id, failure or None for success)


def checked_source(spec: LoadSpec) -> RemoteSource:
    """``spec.source`` as the load's lease checks send it: naming the blocks its READs come
    from and the tokens it expects them to hold (the digest of the LoadSpec's ids, when it
    carries them). Called on the transfer thread: the engine thread packs and hashes nothing."""
    source = bound_to_blocks(spec)
    if spec.token_ids is None:
        return source
    tokens = token_digest(spec.token_ids, spec.num_tokens, spec.kv_salt)
    return msgspec.structs.replace(source, tokens=tokens)


class LoadTable:
    """The loads in flight on one rank, keyed by (decode) request id."""

    def __init__(
        self,
        agent: NixlAgent,
        *,
        local_region_addresses: Sequence[int],
        local_memory: Memory = HOST_MEMORY,
        clock: Callable[[], float],
        transfer_timeout_s: float,  # a request's READs are given up after this long on this rank
        handshake_wait_s: float,  # a load waits at most this long for its peer's handshake
        on_peer_failure: Callable[[Peer], None],
        proofs: LeaseProofs,
        precheck_skip_s: float = 0.0,  # see lease_precheck_skip (connector/config.py)
        claims: Callable[[LoadSpec], tuple[DigestClaim, ...]] | None = None,  # verify_kv
        metrics: MetricsRecorder | None = None,  # None: the process's default_recorder()
        on_move: OnMove | None = None,  # tests watch every load's moves
    ) -> None:
        self._agent = agent
        self._on_move = on_move
        self._metrics = metrics or default_recorder()
        self._local_addresses = tuple(local_region_addresses)
        self._local_memory = local_memory
        self._clock = clock
        self._timeout_s = transfer_timeout_s
        self._quarantine_warn_s = QUARANTINE_WARN_TIMEOUTS * transfer_timeout_s
        self._handshake_wait_s = handshake_wait_s
        self._on_peer_failure = on_peer_failure
        self._proofs = proofs
        self._precheck_skip_s = precheck_skip_s
        self._claims = claims
        self._loads: dict[str, Load] = {}
        self._recent: OrderedDict[str, None] = OrderedDict()  # ended ids, to spot late aborts

    def __contains__(self, request_id: object) -> bool:
        return request_id in self._loads

    def __len__(self) -> int:
        return len(self._loads)

    def add(self, spec: LoadSpec, peer: Peer) -> None:
        load = self._loads.get(spec.request_id)
        if load is not None and load.spec is not None and load.spec.chunk:
            load.queued.append(spec)  # chunked pulls: READ once the chunks before it landed
            return
        if load is not None:
            logger.warning(
                "request %s is already loading; duplicate LoadSpec ignored", spec.request_id
            )
            return
        self._recent.pop(spec.request_id, None)
        source = checked_source(spec)
        load = self._new_load(spec.request_id, source, peer, spec)
        self._loads[spec.request_id] = load
        if unprovable_reason(source) is not None:
            return  # it fails before posting anything
        if self._precheck_skip_s and self._proofs.heard_within(source, self._precheck_skip_s):
            load.prechecked = True  # READs go out at once; the check after them decides
        else:
            load.proof_ticket = self._proofs.submit(source, BEFORE_READS)

    def abort(
        self, request_id: str, remote: RemoteSource, peer: Peer, failure: LoadFailure | None = None
    ) -> None:
        """Abort a request; one never loaded here gets a record only to notify prefill (one
        this rank already reported is left alone). ``failure`` (chunked pulls): a load whose
        chunk READs went out fails with it instead, once none of them is live."""
        load = self._loads.get(request_id)
        if load is None and request_id in self._recent:
            logger.info("request %s aborted after this rank reported it; nothing to do", request_id)
            return
        if load is None:
            load = self._loads[request_id] = self._new_load(request_id, remote, peer, None)
        load.queued.clear()
        if failure is None or load.aborting:
            load.abort()
            return
        load.fail(failure)
        if load.chunk_read:
            load.end()
        elif load.reading:
            load.settle()

    def _new_load(
        self, request_id: str, remote: RemoteSource, peer: Peer, spec: LoadSpec | None
    ) -> Load:
        peer.num_loads += 1  # the peer's agents stay loaded until this load ends
        return Load(request_id, remote, peer, spec, self._clock(), self._on_move)

    def advance(self) -> list[Outcome]:
        """Move every load as far as it can go; returns the loads that ended."""
        outcomes: list[Outcome] = []
        for load in list(self._loads.values()):
            try:
                self._step(load)
            except Exception as error:  # one request's bug must not stop the engine
                self._internal_error(load, error)
            if load.ended:
                outcomes.append(self._finish(load))
        self._proofs.dispatch()  # this pass's lease checks: one message per prefill boot
        return outcomes

    def waits(self) -> list[Wait]:
        """What each load waits on now, for the stall watchdog (worker/stall_watch.py)."""
        return [_wait_of(load) for load in self._loads.values()]

    def abandon_all(self) -> None:
        """Shutdown: release every live READ handle (best effort) and drop the records."""
        live = [load.request_id for load in self._loads.values() if load.posted]
        if live:  # NIXL does not stop them: their bytes may still land in this memory
            logger.error(
                "shutting down with READs in flight for requests %s; NIXL cannot cancel them, "
                "so their blocks must not be reused before this process exits",
                live[:8],
            )
        for load in self._loads.values():
            for key in list(load.posted):
                self._drop_handle(load, key)
            load.peer.num_loads -= 1
        self._loads.clear()

    def _internal_error(self, load: Load, error: Exception) -> None:
        """A bug on one load's path fails that load, not the engine. A READ NIXL still runs
        (or whose state is unknown) keeps the blocks (FAILING), checked again each pass:
        releasing it would not stop it (UCX), and its blocks would go to another request."""
        if not load.internal_error_logged:
            load.internal_error_logged = True
            logger.exception(
                "request %s: unexpected error; the load fails, reported once none of its "
                "READs can still land",
                load.request_id,
            )
        load.fail(LoadFailure(FailureKind.INTERNAL, f"internal error: {error!r}"))
        for key, handle in list(load.posted.items()):
            try:
                live = self._agent.check(handle) is TransferState.IN_PROGRESS
            except ConnectorError:  # NIXL ended it in an error: nothing of it lands any more
                live = False
            except Exception:  # its state is unknown: keep its blocks
                live = True
            if not live:
                self._drop_handle(load, key)
        if load.posted:
            load.settle()
        elif not load.ended:
            load.end()

    def _drop_handle(self, load: Load, key: ReadKey) -> None:
        try:
            self._release(load, key)
        except Exception:  # the agent is in an unknown state: forget the handle anyway
            logger.exception("request %s: dropping READ handle", load.request_id)
            del load.posted[key]
            load.peer.num_live_transfers -= 1

    def _step(self, load: Load) -> None:
        if load.chunk_read and load.queued:
            self._next_chunk(load)
        if load.waiting:
            self._start(load)
        if load.reading:  # also right after posting: a small READ often lands inside post()
            self._poll(load)
            load.settle()
        if load.confirming:
            self._confirm(load)

    def _next_chunk(self, load: Load) -> None:
        """Chunked pulls: post the next LoadSpec's READs (the last one's proof covers all)."""
        spec = load.queued.pop(0)
        load.spec, load.source = spec, checked_source(spec)
        load.move(RankLoadState.READING)
        load.reads_started_s = self._clock()
        link = load.peer.link
        if link is None:
            load.fail(handshake_failure(load.source, load.peer))
        else:
            self._post(load, spec, link)
        load.settle()

    def _confirm(self, load: Load) -> None:
        """Every READ landed: succeed only once prefill says the lease still holds."""
        if load.proof_ticket is None:
            reason = unprovable_reason(load.source)
            if reason is not None:
                load.fail(reason)
                load.end()
                return
            claims: tuple[DigestClaim, ...] = ()
            if self._claims is not None and load.spec is not None:
                claims = self._claims(load.spec)
            load.proof_ticket = self._proofs.submit(
                load.source, claims=claims, seen_held=load.seen_held
            )
            return  # asked at the end of this pass, with the other checks for that prefill
        answered, reason = self._proofs.take(load.proof_ticket)
        if not answered:
            return
        load.proof_ticket = None
        if reason is not None:
            load.fail(reason)
        load.end()

    def _start(self, load: Load) -> None:
        peer = load.peer
        if peer.waiting:
            # Handshakes are bounded by their own timeouts; this bounds the wait for any other
            # reason (a queue of handshakes to dead peers ahead of this one, a lost result).
            if self._clock() - load.created_s > self._handshake_wait_s:
                load.fail(
                    LoadFailure(
                        FailureKind.HANDSHAKE_TIMEOUT,
                        f"handshake with prefill engine {peer.engine_id} at {peer.address} did "
                        f"not finish within {self._handshake_wait_s} s",
                    )
                )
                load.end()
            return
        link = peer.link
        if link is not None and load.timeline.handshake_ready_s is None:
            load.timeline.handshake_ready_s = self._clock()
        if link is None:
            load.fail(handshake_failure(load.source, peer))
            load.end()
        elif load.aborting or load.spec is None or load.failure is not None:
            load.end()
        elif self._lease_holds_before_reads(load):
            self._post(load, load.spec, link)
            load.settle()

    def _lease_holds_before_reads(self, load: Load) -> bool:
        """Whether to post: the check started at ``add`` said the lease holds. False while it
        is unanswered (the load waits; the check's own timeouts and retries bound it) or after
        the load failed for it."""
        if load.prechecked:
            return True
        reason = unprovable_reason(load.source)
        if reason is None and load.proof_ticket is not None:
            answered, reason = self._proofs.take(load.proof_ticket)
            if not answered:
                return False
            load.proof_ticket = None
        if reason is not None:
            load.fail(reason)
            load.end()
            return False
        load.prechecked = load.seen_held = True
        return True

    def _post(self, load: Load, spec: LoadSpec, link: PeerLink) -> None:
        local, start = spec.local_block_ids, spec.num_cached_tokens
        if spec.read_block_ids is not None and spec.num_read_tokens is not None:
            local, start = spec.read_block_ids, spec.num_read_tokens  # chunked: this window
        if start >= spec.num_tokens:
            return  # chunked: the chunks before read it all; the proof follows
        remote, pulls = spec.source.remote_block_ids, spec.source.remote_num_tokens is not None
        request = TransferRequest(local, remote, spec.num_tokens, start, remote_holds_more=pulls)
        try:
            plans = plan_request(link.plan, request).reads
        except ConnectorError as error:
            load.fail(LoadFailure(FailureKind.PLAN, f"cannot plan the transfer: {error}"))
            return
        unknown = sorted({plan.remote_rank for plan in plans} - set(link.agent_names))
        if unknown:
            load.fail(
                LoadFailure(
                    FailureKind.PLAN,
                    f"the plan reads remote ranks {unknown} this rank did not handshake with",
                )
            )
            return
        # (bytes, descriptors) per READ: a READ by index has no per-descriptor lengths to sum
        sizes = ((plan.remote_rank, *size) for plan in plans for size in plan.sizes())
        load.timeline.planned(self._clock(), sizes)
        for plan in plans:
            if not self._post_rank(load, link, plan):
                return
        load.timeline.posted_s = self._clock()

    def _post_rank(self, load: Load, link: PeerLink, plan: RankPlan) -> bool:
        """Post the one or two READs of a remote rank, carrying no notification: it goes once
        the lease is proven (or the load failed)."""
        makers = read_makers(
            self._agent, link, plan,
            local_addresses=self._local_addresses, local_memory=self._local_memory,
        )  # fmt: skip
        return all(self._post_read(load, key, make) for key, make in makers)

    def _post_read(self, load: Load, key: ReadKey, make: MakeRead) -> bool:
        try:
            handle = make()
        except ConnectorError as error:
            self._transfer_failed(load, key[0], error)
            return False
        load.posted[key] = handle
        load.peer.num_live_transfers += 1
        try:
            self._agent.post(handle)
        except ConnectorError as error:
            self._transfer_failed(load, key[0], error)
            self._release(load, key)
            return False
        return True

    def _poll(self, load: Load) -> None:
        for key, handle in list(load.posted.items()):
            remote_rank = key[0]
            try:
                state = self._agent.check(handle)
            except ConnectorError as error:
                self._transfer_failed(load, remote_rank, error)
                self._release(load, key)
                continue
            if state is TransferState.DONE:
                load.timeline.done_s = self._clock()
                self._release(load, key)
            elif self._clock() - (load.reads_started_s or load.created_s) > self._timeout_s:
                # Not released: releasing an unfinished READ does not stop it (UCX).
                self._quarantine(
                    load,
                    LoadFailure(
                        FailureKind.TRANSFER_TIMEOUT,
                        f"READ from prefill engine {load.peer.engine_id} rank {remote_rank} did "
                        f"not finish within {self._timeout_s} s",
                    ),
                )

    def _quarantine(self, load: Load, reason: LoadFailure) -> None:
        """Hold a timed-out load, unreported with its blocks, until its READs end."""
        now_s = self._clock()
        if load.quarantine(reason, now_s):
            self._metrics.inc(QUARANTINED_LOADS)
            self._metrics.inc(QUARANTINED_BLOCKS, amount=_num_blocks(load))
            logger.warning(
                "request %s: %s; its %d blocks stay quarantined (not reported to the engine) "
                "until NIXL says the READ ended",
                load.request_id, reason, _num_blocks(load),
            )  # fmt: skip
            return
        held_s = now_s - (load.quarantined_s or now_s)
        if held_s > self._quarantine_warn_s and not load.stuck_logged:
            load.stuck_logged = True
            logger.error(
                "request %s: a READ from prefill engine %s at %s has not ended %.0f s after its "
                "timeout; its %d blocks stay held until it does. NIXL cannot cancel a READ: "
                "resume or stop that prefill engine (its disconnect ends the READ in an error)",
                load.request_id, load.peer.engine_id, load.peer.address, held_s,
                _num_blocks(load),
            )  # fmt: skip

    def _finish(self, load: Load) -> Outcome:
        del self._loads[load.request_id]
        load.peer.num_loads -= 1
        self._recent[load.request_id] = None
        if len(self._recent) > MAX_RECENT_IDS:
            self._recent.popitem(last=False)
        if load.proof_ticket is not None:  # aborted while prefill was being asked
            self._proofs.abandon(load.proof_ticket)
        reason = with_timeline(load, with_handshake_phases(load, load.reason), self._clock())
        if reason is not None and reason.kind is FailureKind.PREFILL_RESTARTED:
            # The boot that leased is gone: nothing to free there, and a notification to its
            # dead agent would block this thread until UCX gives up on it (~20 s measured).
            self._on_peer_failure(load.peer)
        elif not notify_rest(self._agent, load):
            # Like a failed READ: the peer's agent is gone (a prefill restarted under the same
            # engine id, whose lease check failed before any READ): handshake anew next time.
            self._on_peer_failure(load.peer)
        if load.state is RankLoadState.FAILED:
            logger.warning("request %s failed: %s", load.request_id, reason)
        if load.quarantined_s is not None:
            self._metrics.inc(UNQUARANTINED_BLOCKS, amount=_num_blocks(load))
            held_s = self._clock() - load.quarantined_s
            logger.warning(
                "request %s: its READs ended %.1f s into quarantine; its blocks go back",
                load.request_id, held_s,
            )  # fmt: skip
        record_outcome(self._metrics, self._agent.name, load, reason, self._clock())
        return load.request_id, reason

    def _transfer_failed(self, load: Load, remote_rank: int, error: ConnectorError) -> None:
        load.fail(
            LoadFailure(
                FailureKind.TRANSFER,
                f"READ from prefill engine {load.peer.engine_id} rank {remote_rank} failed: {error}",
            )
        )
        self._on_peer_failure(load.peer)

    def _release(self, load: Load, key: ReadKey) -> None:
        """Release the handle of a READ that ended (DONE, failed, or never posted)."""
        try:
            self._agent.release(load.posted[key])
        except ConnectorError as error:
            logger.warning("request %s: releasing READ handle failed: %s", load.request_id, error)
        del load.posted[key]
        load.peer.num_live_transfers -= 1


def _wait_of(load: Load) -> Wait:
    peer = load.peer
    if load.waiting:
        kind = "handshake" if peer.waiting else "lease check"
    else:
        kind = "proof" if load.confirming else "reads"
    return Wait(load.request_id, kind, peer.engine_id, peer.address)


def _num_blocks(load: Load) -> int:
    return 0 if load.spec is None else sum(len(ids) for ids in load.spec.local_block_ids)
