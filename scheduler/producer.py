"""Prefill-side request state: lease finished requests' blocks until every decode reader is done.

Each do_remote_decode request goes: request_finished (lease taken, id queued for the next
metadata's ``sends``) -> every rank reports it in finished_sending, or its lease expires, or
decode releases it over the side channel -> reported once in ``finished_sending``. Ended early
(expiry, release), its id also goes into ``forgotten`` so the ranks stop counting for it.
Only the engine thread calls this class; the lease table is the part shared with the
side-channel thread.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from typing import Any

from connector.metadata import BlockIds, WorkerReport
from connector.metrics import (
    LEASES_COMPLETED,
    LEASES_EXPIRED,
    LEASES_RELEASED,
    PREFILL_FREE_SECONDS,
    MetricsRecorder,
    default_recorder,
)
from connector.params import params_for_decode
from scheduler.leases import LeaseTable

logger = logging.getLogger(__name__)


class Producer:
    def __init__(
        self,
        *,
        engine_id: str,
        tp_size: int,
        leases: LeaseTable,
        clock: Callable[[], float],
        address: Callable[[], tuple[str, int]],
        metrics: MetricsRecorder | None = None,  # None: the process's default_recorder()
    ) -> None:
        self._engine_id = engine_id
        self._metrics = metrics or default_recorder()
        self._tp_size = tp_size
        self._leases = leases
        self._clock = clock
        self._address = address  # the side channel's (host, port) decode engines call
        self._sending: dict[str, set[int]] = {}  # request id -> ranks that reported it
        self._leased_s: dict[str, float] = {}  # request id -> when its lease was taken
        self._pending_sends: list[str] = []  # not yet in any metadata
        self._pending_forgotten: list[str] = []
        self._finished: list[str] = []
        self.num_stray_reports = 0  # finished_sending for ids with no live lease here

    def request_finished(
        self, request_id: str, block_ids: BlockIds
    ) -> tuple[bool, dict[str, Any] | None]:
        """Lease the blocks and return the params decode needs; (False, None) if we cannot."""
        if request_id in self._sending:
            logger.warning("request %s finished twice; keeping its first lease", request_id)
            return True, None
        host, port = self._address()
        if port == 0:
            logger.error(
                "request %s: the side channel is not started, so no decode engine could reach "
                "this prefill engine; freeing its blocks (call start_side_channel first)",
                request_id,
            )
            return False, None
        now_s = self._clock()
        self._leases.lease(request_id, now_s)
        self._sending[request_id] = set()
        self._leased_s[request_id] = now_s
        self._pending_sends.append(request_id)
        params = params_for_decode(
            engine_id=self._engine_id,
            request_id=request_id,
            block_ids=block_ids,
            host=host,
            port=port,
            tp_size=self._tp_size,
        )
        return True, params

    def take_step(self) -> tuple[tuple[str, ...], tuple[str, ...]]:
        """(sends, forgotten) for the next metadata, after ending expired and released leases."""
        self.end_lapsed_leases()
        sends, self._pending_sends = tuple(self._pending_sends), []
        forgotten, self._pending_forgotten = tuple(self._pending_forgotten), []
        return sends, forgotten

    def on_reports(self, reports: Iterable[WorkerReport]) -> None:
        for report in reports:
            for request_id in report.finished_sending:
                ranks = self._sending.get(request_id)
                if ranks is None:
                    self.num_stray_reports += 1  # already ended (expired, released) or not ours
                    continue
                ranks.add(report.tp_rank)
                if len(ranks) == self._tp_size:
                    self._leases.complete(request_id)
                    self._metrics.inc(LEASES_COMPLETED)
                    self._finish(request_id)
        self.end_lapsed_leases()

    def end_lapsed_leases(self) -> None:
        for request_id in self._leases.expired(self._clock()):
            if request_id in self._sending:
                logger.warning(
                    "request %s: lease of %.1f s expired before every decode reader freed it; "
                    "releasing its KV blocks",
                    request_id,
                    self._leases.duration_s,
                )
                self._metrics.inc(LEASES_EXPIRED)
                self._end_early(request_id)
        for request_id in self._leases.take_released():
            if request_id in self._sending:
                logger.info("request %s released by its decode engine", request_id)
                self._metrics.inc(LEASES_RELEASED)
                self._end_early(request_id)

    def take_finished(self) -> tuple[str, ...]:
        finished, self._finished = tuple(self._finished), []
        return finished

    def _end_early(self, request_id: str) -> None:
        if request_id in self._pending_sends:
            self._pending_sends.remove(request_id)  # the ranks never heard of it
        else:
            self._pending_forgotten.append(request_id)
        self._finish(request_id)

    def _finish(self, request_id: str) -> None:
        del self._sending[request_id]
        leased_s = self._leased_s.pop(request_id)
        self._metrics.observe(PREFILL_FREE_SECONDS, self._clock() - leased_s)
        self._finished.append(request_id)

    @property
    def has_pending_work(self) -> bool:
        """Leased requests not yet freed, or ids the ranks have not yet been told about."""
        return bool(self._sending or self._pending_sends or self._pending_forgotten)

    @property
    def num_leased(self) -> int:
        return len(self._sending)
