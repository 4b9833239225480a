"""Decode-side request state: which prompts to load from which prefill engine, and their outcome.

Each decode request has one record here, from the engine's first ask to request_finished
(the vLLM adapter only translates). It moves only along REQUEST_LOAD_LIFECYCLE
(scheduler/requests.py: the states, one line each) and holds the parsed params (``parsed``,
reused while the request carries the same params object). Params bind at allocation
(scheduler/connector.py): the first ask only claims the tokens (CLAIMED, unread); refused ones
are announced as a failed load if the engine parked the request, and never loaded. The path
of read params, ask to report: docs/architecture.md, "The request's journey through the code".
Only the engine thread calls this class.

The record lives until request_finished: once prefill was told to free (RELEASING, RELEASED)
or the load was reported, an engine that asks again (preemption, a prefix-cache reset, a
failed allocation) gets (0, False) and computes locally, so no load starts on freed blocks.
Prefill is told to free only once the engine decided: at allocation with nothing to load (a
full local prefix hit), as vLLM's own connector does, at request_finished, or (an abort
before the LoadSpec went out) by a ReleaseSpec; never at an ask, which the engine may repeat
with a smaller hit.

Multi-turn: a prefill engine pulls an earlier turn from decode through this class too
(``RemoteSource.remote_num_tokens`` set; counted in ``nixl_pd_pulled_tokens_total``).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import msgspec

from connector.errors import IllegalTransition, TransferPlanError
from connector.layout import GroupSpec
from connector.lease_binding import KVSalt
from connector.lifecycle import Book, OnMove
from connector.metadata import (
    BlockIds,
    FailureKind,
    LoadFailure,
    LoadSpec,
    ReleaseSpec,
    RemoteSource,
    WorkerReport,
    one_failure,
)
from connector.observability.metrics import (
    CHUNK_READS,
    LOADS_FAILED,
    PULLED_TOKENS,
    MetricsRecorder,
    default_recorder,
)
from connector.protocol import ReaderId
from scheduler.heartbeats import HeartbeatRegistry, HeartbeatSender
from scheduler.requests import (
    REQUEST_LOAD_LIFECYCLE,
    ParsedParams,
    RequestLoadState,
    SiblingLoads,
    params_key,
    uncached_suffix_blocks,
)

logger = logging.getLogger(__name__)

# The states as module names: shorter to read, and cheaper than Enum class attributes per call.
_S = RequestLoadState
MATCHED, ALLOCATED, LOADING, DRAINING = _S.MATCHED, _S.ALLOCATED, _S.LOADING, _S.DRAINING
REPORTED, ENDED, RELEASING, RELEASED = _S.REPORTED, _S.ENDED, _S.RELEASING, _S.RELEASED
REPORTED_RELEASING, CLAIMED, REFUSING = _S.REPORTED_RELEASING, _S.CLAIMED, _S.REFUSING
REFUSED = _S.REFUSED
UNREAD_OR_REFUSED = (CLAIMED, REFUSING, REFUSED)  # no parsed source: nothing to release
_RANKS_ANSWER_LOAD = (LOADING, DRAINING)  # a LoadSpec or ReleaseSpec the engine waits on
_RANKS_HOLD_BLOCKS = (ALLOCATED, LOADING, DRAINING)  # at request_finished: delay the free
_RANKS_ANSWER_RELEASE = (RELEASING, REPORTED_RELEASING)  # a ReleaseSpec nobody waits on
# Prefill must keep the KV: heartbeated (scheduler/heartbeats.py) while in these.
# CLAIMED too: decode still means to read, however long the engine keeps it waiting.
_HEARTBEATING = (CLAIMED, MATCHED, ALLOCATED, LOADING, DRAINING)
# Claims and refusals ask nothing of the ranks: the engine steps anyway until it allocates.
_PENDING = tuple(
    state
    for state in RequestLoadState
    if state not in (REPORTED, RELEASED, ENDED, *UNREAD_OR_REFUSED)
)


@dataclasses.dataclass(slots=True)
class RequestLoad:
    """One decode request's record; ``state`` says where it stands (Book moves it)."""

    source: RemoteSource | None  # None until its params are read (CLAIMED) or if refused
    num_tokens: int
    num_cached_tokens: int
    state: RequestLoadState = RequestLoadState.NEW
    parsed: ParsedParams | None = None  # the params as read (None: unread or refused)
    # CLAIMED: the params the claim was made on; its finish releases what they name, even
    # if the request's params were edited since.
    claimed_params: Mapping[str, Any] | None = None
    refusal: str = ""  # why the params were refused (REFUSING, REFUSED)
    load_sent: bool = False  # a LoadSpec went out: the ranks report its outcome themselves
    local_block_ids: BlockIds | None = None  # decode's blocks for the uncached suffix
    unplannable: str = ""  # why decode's blocks cannot take the load: fails it at the next step
    ranks_done: set[int] = dataclasses.field(default_factory=set)  # answered the Load/ReleaseSpec
    failures: dict[int, LoadFailure] = dataclasses.field(default_factory=dict)  # tp_rank -> why
    finished: bool = False  # request_finished was called: forget the record once it is quiet
    token_ids: Sequence[int] | None = None  # the request's ids, handed on in its LoadSpec
    kv_salt: KVSalt = ()  # what else their KV depends on, digested with them


class Consumer:
    def __init__(
        self,
        *,
        groups: tuple[GroupSpec, ...],
        tp_size: int,
        heartbeats: HeartbeatSender,  # sends releases
        keepalive: HeartbeatRegistry,  # what its timer heartbeats
        siblings: SiblingLoads,  # which lease each load uses: one load per lease
        on_move: OnMove | None = None,  # sees every state change (tests)
        metrics: MetricsRecorder | None = None,  # None: the process's default_recorder()
        reader: ReaderId | None = None,  # this engine and boot, named in the ranks' checks
    ) -> None:
        self._metrics = metrics or default_recorder()
        self._reader = reader
        self._groups = groups
        self._tp_size = tp_size
        self._heartbeats = heartbeats
        self._keepalive = keepalive
        self.siblings = siblings
        # Every way out of the heartbeating states (finish, abort, failure, refusal, report)
        # is a Book move: the Book drops the lease from the registry (and the sibling table)
        # there, so none is heartbeated past its record's need. Ways in are the two first
        # moves (hold below).
        self._loads: Book[RequestLoadState, RequestLoad] = Book(
            REQUEST_LOAD_LIFECYCLE,
            what="load",
            on_move=on_move,
            watched=_HEARTBEATING,
            on_leave=self._done_with_lease,
        )
        # Outboxes: what the next metadata and take_finished hand over.
        self._pending_releases: list[ReleaseSpec] = []
        self._pending_chunks: list[LoadSpec] = []  # chunked pulls (scheduler/overlap.py)
        self._finished: list[str] = []
        self._failed: dict[str, LoadFailure] = {}
        self._by_ranks: set[str] = set()  # of the above: loads whose LoadSpec went out
        # Of the outcomes take_finished last returned, the loads whose LoadSpec went out: the
        # ranks ran them and may tell the engine themselves (vLLM's do).
        self.reported_by_ranks: frozenset[str] = frozenset()
        self._refused: dict[str, LoadFailure] = {}  # parked requests whose params were refused

    def _done_with_lease(self, request_id: str) -> None:
        self._keepalive.drop(request_id)
        self.siblings.done(request_id)

    def record(self, request_id: str) -> RequestLoad | None:
        """The request's record (read it, never write it), or None."""
        return self._loads.get(request_id)

    def get_num_new_matched_tokens(
        self,
        request_id: str,
        source: RemoteSource,
        num_tokens: int,
        num_cached_tokens: int,
        parsed: ParsedParams | None = None,
        token_ids: Sequence[int] | None = None,  # the request's; its first num_tokens are loaded
        kv_salt: KVSalt = (),  # what else their KV depends on (connector/lease_binding.py)
    ) -> tuple[int, bool]:
        """The read params' answer: ``source`` holds tokens [0, num_tokens) of the prompt."""
        load = self._loads.get(request_id)
        num_new_tokens = num_tokens - num_cached_tokens
        if load is None:
            load = RequestLoad(
                source, num_tokens, num_cached_tokens, parsed=parsed, token_ids=token_ids,
                kv_salt=kv_salt,
            )  # fmt: skip
            self._loads.start(request_id, load, MATCHED)
            self._keepalive.hold(request_id, source)
            self.siblings.reading(request_id, source.lease_key)
        elif load.state is MATCHED or load.state is CLAIMED:
            # Scheduled again before allocation (the local prefix hit may have changed), or
            # a claim whose params were just read.
            if source is not load.source:
                self._keepalive.hold(request_id, source)
            load.source, load.num_tokens = source, num_tokens
            load.num_cached_tokens, load.parsed = num_cached_tokens, parsed
            load.token_ids, load.kv_salt = token_ids, kv_salt
            if load.state is CLAIMED:
                self._loads.move(request_id, MATCHED)
        else:
            return 0, False  # allocated, loading, reported, released, refused: never a new load
        # Nothing to load (a full local prefix hit): prefill is released at allocation, once
        # the engine decided; an ask may be repeated with a smaller hit.
        return (num_new_tokens, True) if num_new_tokens > 0 else (0, False)

    def claim(
        self,
        request_id: str,
        num_new_tokens: int,
        num_cached_tokens: int,
        raw_params: Mapping[str, Any] | None = None,
    ) -> tuple[int, bool]:
        """Claim ``num_new_tokens`` (> 0) on the params' word, unread: they bind at allocation.

        For a new request or a claimed one (asked again: the local hit may have changed).
        ``raw_params`` (the request's unread params) are heartbeated off the engine thread
        while the claim waits: parsed there, once.
        """
        load = self._loads.get(request_id)
        if load is None:
            load = RequestLoad(None, num_cached_tokens + num_new_tokens, num_cached_tokens)
            load.claimed_params = raw_params
            self._loads.start(request_id, load, CLAIMED)
            if raw_params is not None:
                self._keepalive.hold(request_id, raw_params)
                self.siblings.reading(request_id, params_key(raw_params))
        elif load.state is CLAIMED:
            load.num_tokens = num_cached_tokens + num_new_tokens
            load.num_cached_tokens = num_cached_tokens
        else:
            return 0, False
        return num_new_tokens, True

    def refuse(self, request_id: str, reason: str, num_new_tokens: int) -> tuple[int, bool]:
        """The params were refused at an ask: never load. With tokens to load, claim them so
        the engine parks the request, and announce its load failed at allocation (REFUSING):
        the engine's failure policy then decides its fate. A record already past its claim
        keeps its state: its load was allocated, or went out."""
        load = self._loads.get(request_id)
        if load is not None and load.state is not CLAIMED:
            return self.ask_refused(request_id, num_new_tokens)
        logger.warning("request %s: %s", request_id, reason)
        parks = num_new_tokens > 0 and load is None
        if load is None:
            load = RequestLoad(None, num_new_tokens, 0, refusal=reason)
            self._loads.start(request_id, load, REFUSING if parks else REFUSED)
        else:
            load.refusal = reason
            self._loads.move(request_id, REFUSED)
        return (num_new_tokens, True) if parks else (0, False)

    def ask_refused(self, request_id: str, num_new_tokens: int) -> tuple[int, bool]:
        """Asked again about a refused request: claim again until the engine parks it."""
        load = self._loads.get(request_id)
        if load is not None and load.state is REFUSING and num_new_tokens > 0:
            return num_new_tokens, True
        return 0, False

    def refuse_claim(
        self,
        request_id: str,
        reason: str,
        num_external_tokens: int,
        kind: FailureKind = FailureKind.PARAMS,
    ) -> None:
        """At allocation, the claimed (or refused) request's params do not give a load.

        Parked (``num_external_tokens`` > 0): announce its load failed (``kind``), once, and
        count it in nixl_pd_loads_failed_total by that kind (no rank ran it, so no rank
        counts it); either way it never loads (REFUSED).
        """
        load = self._loads.get(request_id)
        if load is None or load.state not in (CLAIMED, REFUSING):
            return
        reason = reason or load.refusal
        if load.state is CLAIMED:
            logger.warning("request %s: %s", request_id, reason)
        load.refusal = reason
        if num_external_tokens > 0:
            self._refused[request_id] = LoadFailure(kind, reason)
            self._metrics.inc(LOADS_FAILED, kind.value)
        self._loads.move(request_id, REFUSED)

    def drop_claim(self, request_id: str) -> None:
        """At allocation, a claim whose params now ask for no load, with nothing parked."""
        load = self._loads.get(request_id)
        if load is not None and load.state is CLAIMED:
            self._loads.move(request_id, ENDED)

    def end_parked(self, request_id: str) -> None:
        """A claim parked on allocated blocks ended before it bound a load (overlapped
        dispatch): report it received (nothing read) so the engine frees its blocks."""
        load = self._loads.get(request_id)
        if load is not None and load.state is CLAIMED:
            self._loads.move(request_id, ENDED)
            self._finished.append(request_id)

    def take_refused(self) -> dict[str, LoadFailure]:
        """Refused requests the engine parked since the last call: request id -> reason."""
        refused, self._refused = self._refused, {}
        return refused

    def update_state_after_alloc(
        self, request_id: str, block_ids: Sequence[Sequence[int]], num_external_tokens: int
    ) -> None:
        load = self._loads.get(request_id)
        if load is None or load.state is not MATCHED:
            return
        if num_external_tokens == 0:
            # The engine chose not to load after all; prefill may free its blocks.
            self._release_only(request_id, load, RELEASING)
            return
        try:  # the suffix now, while the engine waits on allocation anyway
            load.local_block_ids = uncached_suffix_blocks(
                block_ids,
                self._groups,
                num_cached_tokens=load.num_cached_tokens,
                num_tokens=load.num_tokens,
            )
        except TransferPlanError as exc:
            load.unplannable = f"cannot plan the load: {exc}"
        self._loads.move(request_id, ALLOCATED)

    def take_step(self) -> tuple[tuple[LoadSpec, ...], tuple[ReleaseSpec, ...]]:
        """The loads and releases for the next metadata; tells the heartbeat timer the engine
        is alive (it stops heartbeating a wedged engine's leases)."""
        self._keepalive.engine_stepped()
        allocated = self._loads.in_state(ALLOCATED)
        loads = [spec for request_id, load in allocated if (spec := self._emit(request_id, load))]
        loads, self._pending_chunks = loads + self._pending_chunks, []
        releases, self._pending_releases = tuple(self._pending_releases), []
        return tuple(loads), releases

    def send_chunk(self, request_id: str, spec: LoadSpec) -> None:
        """Chunked pulls: one more LoadSpec of an allocated load (LOADING from the first)."""
        load = self._loads.get(request_id)
        if load is not None and load.state is ALLOCATED:
            self._loads.move(request_id, LOADING)
            load.load_sent = True
        self._pending_chunks.append(spec)
        if spec.chunk:
            self._metrics.inc(CHUNK_READS)

    def stop_chunks(self, request_id: str, failure: LoadFailure | None) -> None:
        """Chunked pulls: end a load whose chunk READs went out, failed (or aborted: None)
        once the ranks drained them; they report it as any load."""
        load = self._loads.get(request_id)
        if load is not None and load.state in _RANKS_ANSWER_LOAD:
            self._pending_releases.append(ReleaseSpec(request_id, _source_of(load), failure))

    def request_finished(self, request_id: str, source: RemoteSource | None) -> tuple[bool, None]:
        """(True, None) while ranks may still touch the request's blocks, else (False, None).

        ``source`` is where the request's KV lives, from its params (None: they ask for no
        load, or were refused).
        """
        load = self._loads.get(request_id)
        if load is None or load.state is CLAIMED:
            # Aborted before the engine ever asked about it, or finished while its params were
            # unread: prefill still holds the KV, unless another request's load reads it.
            if load is not None:
                self._loads.move(request_id, ENDED)
            elif source is not None and self.siblings.used_by_another(request_id, source.lease_key):
                source = None
            if source is not None:
                self._release_over_side_channel(source)
            return False, None
        state = load.state
        load.finished = True
        if state is REFUSING or state is REFUSED or state is REPORTED or state is RELEASED:
            self._loads.move(request_id, ENDED)
        elif state is REPORTED_RELEASING:
            self._loads.move(request_id, RELEASING)
        elif state is MATCHED:  # no blocks yet: nothing of ours to hold
            self._release_only(request_id, load, RELEASING)
        elif state is ALLOCATED:
            logger.info("request %s aborted before its load started; releasing prefill", request_id)
            self._pending_releases.append(ReleaseSpec(request_id, _source_of(load)))
            self._loads.move(request_id, DRAINING)
        elif state is LOADING:
            self._loads.move(request_id, DRAINING)
        return state in _RANKS_HOLD_BLOCKS, None

    def on_reports(self, reports: Iterable[WorkerReport]) -> None:
        for report in reports:
            for request_id in report.finished_recving:
                self._record(request_id, report.tp_rank, None)
            for request_id, reason in report.failed_recving.items():
                self._record(request_id, report.tp_rank, reason)

    def take_finished(self) -> tuple[tuple[str, ...], dict[str, LoadFailure]]:
        finished, self._finished = tuple(self._finished), []
        failed, self._failed = self._failed, {}
        self.reported_by_ranks, self._by_ranks = frozenset(self._by_ranks), set()
        return finished, failed

    def _emit(self, request_id: str, load: RequestLoad) -> LoadSpec | None:
        local_block_ids = load.local_block_ids
        if local_block_ids is None:  # ALLOCATED: its suffix, or why it has none
            self._fail_now(request_id, load, LoadFailure(FailureKind.PLAN, load.unplannable))
            return None
        self._loads.move(request_id, LOADING)
        load.load_sent = True
        token_ids, load.token_ids = load.token_ids, None  # the ranks digest them; keep none
        # The source names this reader, as its ranks' lease checks do.
        source = _source_of(load)
        if self._reader is not None:
            source = msgspec.structs.replace(source, reader=self._reader)
        return LoadSpec(
            request_id, local_block_ids, load.num_tokens, load.num_cached_tokens, source,
            token_ids, load.kv_salt,
        )  # fmt: skip

    def on_engine_outcomes(self, finished: Iterable[str], failed: Iterable[str]) -> None:
        """The engine's own word that loads ended: ``finished`` ids (``failed`` among them).
        vLLM aggregates the ranks' results and may know before (or without) our reports; its
        word ends the load for every rank not reported yet. Ids not tracked are ignored."""
        failed_ids = set(failed)
        for request_id in finished:
            load = self._loads.get(request_id)
            if load is None or load.state not in _RANKS_ANSWER_LOAD:
                continue
            reason = _ENGINE_FAILED if request_id in failed_ids else None
            for tp_rank in sorted(set(range(self._tp_size)) - load.ranks_done):
                self._record(request_id, tp_rank, reason)  # the last one settles the load

    def _record(self, request_id: str, tp_rank: int, reason: LoadFailure | None) -> None:
        load = self._loads.get(request_id)
        if load is None:
            return  # not ours, or already forgotten
        if load.state in _RANKS_ANSWER_RELEASE:
            load.ranks_done.add(tp_rank)
            if len(load.ranks_done) == self._tp_size:
                if load.state is REPORTED_RELEASING:
                    self._loads.move(request_id, REPORTED)
                else:  # the request may live on: keep its record until request_finished
                    self._loads.move(request_id, ENDED if load.finished else RELEASED)
            return
        if load.state not in _RANKS_ANSWER_LOAD:
            return  # already reported, or a report before any instruction
        load.ranks_done.add(tp_rank)
        if reason is not None:
            load.failures.setdefault(tp_rank, reason)
        if len(load.ranks_done) == self._tp_size:
            self._settle(request_id, load)

    def _settle(self, request_id: str, load: RequestLoad) -> None:
        """Every rank is done with ``load``: report it once, as received or failed."""
        source = _source_of(load)
        if load.load_sent:
            self._by_ranks.add(request_id)
        if load.failures:
            self._failed[request_id] = one_failure(load.failures)
            self._release_over_side_channel(source)
        else:
            self._finished.append(request_id)
            if source.remote_num_tokens is not None:  # a pull of an earlier turn from decode
                self._metrics.inc(PULLED_TOKENS, amount=load.num_tokens - load.num_cached_tokens)
        # Until request_finished, get_num_new_matched_tokens says (0, False) for it.
        self._loads.move(request_id, ENDED if load.state is DRAINING else REPORTED)

    def _release_only(self, request_id: str, load: RequestLoad, target: RequestLoadState) -> None:
        """Move ``load`` to a releasing state and tell prefill to free its blocks: through the
        ranks (a ReleaseSpec) and the side channel, whichever arrives first."""
        self._loads.move(request_id, target)
        source = _source_of(load)
        self._pending_releases.append(ReleaseSpec(request_id, source))
        self._release_over_side_channel(source)

    def _release_over_side_channel(self, source: RemoteSource) -> None:
        # The ranks' free notifications need a NIXL handshake; when that is what failed (peer
        # unreachable or incompatible), only the side channel can still free prefill's blocks
        # before the lease ends. Releasing an already-freed request is a no-op there.
        key = source.lease_key
        self._heartbeats.submit_release(source.side_channel, [key])

    def _fail_now(self, request_id: str, load: RequestLoad, reason: LoadFailure) -> None:
        logger.warning("request %s failed: %s", request_id, reason)
        self._release_only(request_id, load, REPORTED_RELEASING)
        self._failed[request_id] = reason

    @property
    def has_pending_work(self) -> bool:
        """Loads or releases the ranks have not finished: the engine must keep stepping."""
        return bool(self._pending_releases) or self._loads.count(*_PENDING) > 0

    @property
    def num_tracked(self) -> int:
        """Requests this class holds any state for (0 once every request finished and reported)."""
        return len(self._loads)


def _source_of(load: RequestLoad) -> RemoteSource:
    """The load's source: read params, as every state past MATCHED has (the table's order)."""
    source = load.source
    if source is None:
        raise IllegalTransition(f"a request load in state {load.state.name} has no read params")
    return source


_ENGINE_FAILED = LoadFailure(FailureKind.ENGINE, "the engine reported the load as failed")
