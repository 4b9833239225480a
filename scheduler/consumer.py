"""Decode-side request state: which prompts to load from which prefill engine, and their outcome.

Each request's load is one record in a Book, moved only along REQUEST_LOAD_LIFECYCLE
(scheduler/lifecycles.py): get_num_new_matched_tokens (MATCHED) -> update_state_after_alloc
(ALLOCATED: decode's blocks known) -> build_connector_meta (LOADING: LoadSpec emitted to every
rank) -> every rank reports -> REPORTED once, in finished_recving or failed_recving. An abort
before the LoadSpec went out sends a ReleaseSpec instead so the prefill engine frees its blocks
at once. Only the engine thread calls this class.

The record lives until request_finished, whatever happens before: once prefill was told to
free (RELEASING, RELEASED) or the load was reported, an engine that asks again (preemption, a
prefix-cache reset, a failed allocation) gets (0, False) and computes locally. A new load can
never start on blocks prefill already freed. Prefill is told to free only when the engine
decided: at allocation with nothing to load (a full local prefix hit), as vLLM's own connector
does, or at request_finished; never at an ask, which the engine may repeat with a smaller hit.

In multi-turn mode a prefill engine loads through this same class: its source is the decode
engine holding an earlier turn (``RemoteSource.num_tokens`` set), and a successful pull is
counted in ``nixl_pd_pulled_tokens_total``.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Iterable, Sequence

from connector.errors import TransferPlanError
from connector.layout import GroupSpec
from connector.metadata import BlockIds, LoadSpec, ReleaseSpec, RemoteSource, WorkerReport
from connector.metrics import PULLED_TOKENS, MetricsRecorder, default_recorder
from connector.protocol import lease_key
from scheduler.heartbeats import HeartbeatSender
from scheduler.lifecycles import REQUEST_LOAD_LIFECYCLE, Book, OnMove, RequestLoadState
from scheduler.suffix import uncached_suffix_blocks

logger = logging.getLogger(__name__)

# The states as module names: shorter to read, and the hooks compare them on every call (a
# global is ~3x cheaper to read than an Enum class attribute on Python 3.11).
MATCHED, ALLOCATED, LOADING = (
    RequestLoadState.MATCHED,
    RequestLoadState.ALLOCATED,
    RequestLoadState.LOADING,
)
DRAINING, REPORTED, ENDED = (
    RequestLoadState.DRAINING,
    RequestLoadState.REPORTED,
    RequestLoadState.ENDED,
)
RELEASING, REPORTED_RELEASING = RequestLoadState.RELEASING, RequestLoadState.REPORTED_RELEASING
RELEASED = RequestLoadState.RELEASED
_RANKS_ANSWER_LOAD = (LOADING, DRAINING)  # a LoadSpec or ReleaseSpec the engine waits on
_RANKS_HOLD_BLOCKS = (ALLOCATED, LOADING, DRAINING)  # at request_finished: delay the free
_RANKS_ANSWER_RELEASE = (RELEASING, REPORTED_RELEASING)  # a ReleaseSpec nobody waits on
_HEARTBEATING = (MATCHED, ALLOCATED, LOADING, DRAINING)  # prefill must keep the KV
_PENDING = tuple(state for state in RequestLoadState if state not in (REPORTED, RELEASED, ENDED))


@dataclasses.dataclass(slots=True)
class _Load:
    """One tracked decode load; ``state`` says where it stands (Book moves it)."""

    source: RemoteSource
    num_tokens: int
    num_cached_tokens: int
    state: RequestLoadState = RequestLoadState.NEW
    local_block_ids: BlockIds | None = None  # decode's blocks for the uncached suffix
    unplannable: str = ""  # why decode's blocks cannot take the load: fails it at the next step
    ranks_done: set[int] = dataclasses.field(default_factory=set)  # answered the Load/ReleaseSpec
    failures: dict[int, str] = dataclasses.field(default_factory=dict)  # tp_rank -> reason
    finished: bool = False  # request_finished was called: forget the record once it is quiet


class Consumer:
    def __init__(
        self,
        *,
        groups: tuple[GroupSpec, ...],
        tp_size: int,
        heartbeats: HeartbeatSender,
        heartbeat_interval_s: float,
        clock: Callable[[], float],
        on_move: OnMove | None = None,  # sees every state change (tests)
        metrics: MetricsRecorder | None = None,  # None: the process's default_recorder()
    ) -> None:
        self._metrics = metrics or default_recorder()
        self._groups = groups
        self._tp_size = tp_size
        self._heartbeats = heartbeats
        self._heartbeat_interval_s = heartbeat_interval_s
        self._clock = clock
        self._next_heartbeat_s = clock() + heartbeat_interval_s
        self._loads: Book[RequestLoadState, _Load] = Book(
            REQUEST_LOAD_LIFECYCLE, what="load", on_move=on_move
        )
        # Outboxes: what the next metadata and take_finished hand over.
        self._pending_releases: list[ReleaseSpec] = []
        self._finished: list[str] = []
        self._failed: dict[str, str] = {}

    def get_num_new_matched_tokens(
        self, request_id: str, source: RemoteSource, num_tokens: int, num_cached_tokens: int
    ) -> tuple[int, bool]:
        load = self._loads.get(request_id)
        num_new_tokens = num_tokens - num_cached_tokens
        if load is None:
            self._loads.start(request_id, _Load(source, num_tokens, num_cached_tokens), MATCHED)
        elif load.state is MATCHED:
            # Scheduled again before allocation: the local prefix hit may have changed.
            load.source, load.num_tokens = source, num_tokens
            load.num_cached_tokens = num_cached_tokens
        else:
            return 0, False  # allocated, loading, reported or released: never a new load
        # Nothing to load (a full local prefix hit): prefill is released at allocation, once
        # the engine decided; an ask may be repeated with a smaller hit.
        return (num_new_tokens, True) if num_new_tokens > 0 else (0, False)

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
        """The loads and releases for the next metadata; also sends heartbeats when due."""
        allocated = self._loads.in_state(ALLOCATED)
        loads = [spec for request_id, load in allocated if (spec := self._emit(request_id, load))]
        releases, self._pending_releases = tuple(self._pending_releases), []
        self._send_heartbeats_if_due()
        return tuple(loads), releases

    def request_finished(self, request_id: str, source: RemoteSource) -> tuple[bool, None]:
        """(True, None) while ranks may still touch the request's blocks, else (False, None).

        ``source`` is where the request's KV lives, from its params.
        """
        load = self._loads.get(request_id)
        if load is None:
            # Aborted before the engine ever asked about it: prefill still holds the KV.
            self._release_over_side_channel(source)
            return False, None
        state = load.state
        load.finished = True
        if state in (REPORTED, RELEASED):
            self._loads.move(request_id, ENDED)
        elif state is REPORTED_RELEASING:
            self._loads.move(request_id, RELEASING)
        elif state is MATCHED:  # no blocks yet: nothing of ours to hold
            self._release_only(request_id, load, RELEASING)
        elif state is ALLOCATED:
            logger.info("request %s aborted before its load started; releasing prefill", request_id)
            self._pending_releases.append(ReleaseSpec(request_id, load.source))
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

    def take_finished(self) -> tuple[tuple[str, ...], dict[str, str]]:
        finished, self._finished = tuple(self._finished), []
        failed, self._failed = self._failed, {}
        return finished, failed

    def _emit(self, request_id: str, load: _Load) -> LoadSpec | None:
        local_block_ids = load.local_block_ids
        if local_block_ids is None:  # ALLOCATED: its suffix, or why it has none
            self._fail_now(request_id, load, load.unplannable)
            return None
        self._loads.move(request_id, LOADING)
        return LoadSpec(
            request_id, local_block_ids, load.num_tokens, load.num_cached_tokens, load.source
        )

    def on_engine_outcomes(self, finished: Iterable[str], failed: Iterable[str]) -> None:
        """The engine's own word that loads ended: ``finished`` ids (``failed`` among them).

        vLLM aggregates the ranks' results itself and may know before (or without) our
        reports; its word ends the load for every rank that has not reported yet. Ids that are
        not loads we track (already reported, or never ours) are ignored.
        """
        failed_ids = set(failed)
        for request_id in finished:
            load = self._loads.get(request_id)
            if load is None or load.state not in _RANKS_ANSWER_LOAD:
                continue
            reason = "the engine reported the load as failed" if request_id in failed_ids else None
            for tp_rank in range(self._tp_size):
                if tp_rank not in load.ranks_done:
                    load.ranks_done.add(tp_rank)
                    if reason is not None:
                        load.failures.setdefault(tp_rank, reason)
            self._settle(request_id, load)

    def _record(self, request_id: str, tp_rank: int, reason: str | None) -> None:
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

    def _settle(self, request_id: str, load: _Load) -> None:
        """Every rank is done with ``load``: report it once, as received or failed."""
        if load.failures:
            self._failed[request_id] = _failure_reason(load.failures)
            self._release_over_side_channel(load.source)
        else:
            self._finished.append(request_id)
            if load.source.num_tokens is not None:  # a pull of an earlier turn from decode
                self._metrics.inc(PULLED_TOKENS, amount=load.num_tokens - load.num_cached_tokens)
        # Until request_finished, get_num_new_matched_tokens says (0, False) for it.
        self._loads.move(request_id, ENDED if load.state is DRAINING else REPORTED)

    def _release_only(self, request_id: str, load: _Load, target: RequestLoadState) -> None:
        """Move ``load`` to a releasing state and tell prefill to free its blocks."""
        self._loads.move(request_id, target)
        self._tell_prefill_to_free(request_id, load)

    def _tell_prefill_to_free(self, request_id: str, load: _Load) -> None:
        """Through the ranks (a ReleaseSpec) and the side channel, whichever arrives first."""
        self._pending_releases.append(ReleaseSpec(request_id, load.source))
        self._release_over_side_channel(load.source)

    def _release_over_side_channel(self, source: RemoteSource) -> None:
        # The ranks' free notifications need a NIXL handshake; when that is what failed (peer
        # unreachable or incompatible), only the side channel can still free prefill's blocks
        # before the lease ends. Releasing an already-freed request is a no-op there.
        self._heartbeats.submit_release(
            source.host,
            source.port,
            [lease_key(source.remote_request_id, source.lease_id)],
            engine_id=source.engine_id,
            boot_id=source.boot_id,
        )

    def _fail_now(self, request_id: str, load: _Load, reason: str) -> None:
        logger.warning("request %s failed: %s", request_id, reason)
        self._release_only(request_id, load, REPORTED_RELEASING)
        self._failed[request_id] = reason

    def _send_heartbeats_if_due(self) -> None:
        now = self._clock()
        if now < self._next_heartbeat_s:
            return
        self._next_heartbeat_s = now + self._heartbeat_interval_s
        # One heartbeat per prefill engine boot; its side channel refuses ids meant for another.
        by_engine: dict[tuple[str, int, str, str], list[str]] = {}
        for _, load in self._loads.records(*_HEARTBEATING):
            source = load.source
            engine = (source.host, source.port, source.engine_id, source.boot_id)
            by_engine.setdefault(engine, []).append(
                lease_key(source.remote_request_id, source.lease_id)
            )
        for (host, port, engine_id, boot_id), remote_request_ids in sorted(by_engine.items()):
            self._heartbeats.submit(
                host, port, remote_request_ids, engine_id=engine_id, boot_id=boot_id
            )

    @property
    def has_pending_work(self) -> bool:
        """Loads or releases the ranks have not finished: the engine must keep stepping."""
        return bool(self._pending_releases) or self._loads.count(*_PENDING) > 0

    @property
    def num_tracked(self) -> int:
        """Requests this class holds any state for (0 once every request finished and reported)."""
        return len(self._loads)


def _failure_reason(failures: dict[int, str]) -> str:
    """One reason for the request: the ranks' shared reason, or the lowest failing rank's."""
    reasons = set(failures.values())
    if len(reasons) == 1:
        return reasons.pop()
    rank = min(failures)
    return f"tp_rank {rank}: {failures[rank]} ({len(failures) - 1} other rank(s) failed too)"
