"""Per-request traces: one structured debug line per request per rank, and its metrics.

Decode: a ``LoadTimeline`` rides on each in-flight load and is stamped at its state changes
(scheduled, handshake ready, planned, posted, done); when the load ends, ``load_ended``
records the request's metrics and, at debug level on the ``nixl_pd.trace`` logger, writes one
JSON line with the timeline (milliseconds since scheduled) and sizes. Prefill: ``send_ended``
writes one line when a request's free notifications are all in. Times are seconds on the
caller's clock, passed in: this module reads no clock.

    nixl_pd.trace {"event":"load","request_id":"r1","agent":"decode-0","outcome":"ok",...}
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import dataclass, field

import msgspec

from connector.metadata import LoadFailure
from connector.observability.metrics import (
    LOADS_FAILED,
    LOADS_FINISHED,
    POST_SECONDS,
    TRANSFER_BYTES,
    TRANSFER_DESCRIPTORS,
    TRANSFER_SECONDS,
    MetricsRecorder,
)

trace_logger = logging.getLogger("nixl_pd.trace")


@dataclass
class LoadTimeline:
    """When one load on one rank reached each state (seconds, caller's clock), and its sizes."""

    scheduled_s: float
    handshake_ready_s: float | None = None
    planned_s: float | None = None
    posted_s: float | None = None
    done_s: float | None = None
    num_bytes: int = 0
    num_descriptors: int = 0
    remote_ranks: tuple[int, ...] = ()
    notified_ranks: set[int] = field(default_factory=set)

    def planned(self, now_s: float, reads: Iterable[tuple[int, int, int]]) -> None:
        """Stamp the plan: ``reads`` is (remote rank, bytes, descriptors) per READ."""
        self.planned_s = now_s
        ranks: list[int] = []
        for remote_rank, num_bytes, num_descriptors in reads:
            ranks.append(remote_rank)
            self.num_bytes += num_bytes
            self.num_descriptors += num_descriptors
        self.remote_ranks = tuple(ranks)


class LoadTrace(
    msgspec.Struct, frozen=True, forbid_unknown_fields=True, tag_field="event", tag="load"
):
    """The trace line of one load on one rank; times in ms since the load was scheduled."""

    request_id: str
    remote_request_id: str
    remote_engine_id: str
    agent: str  # this rank's NIXL agent name: which rank the line is from
    outcome: str  # "ok" or the failure kind (connector/metadata.py FailureKind)
    reason: str | None
    handshake_ready_ms: float | None
    planned_ms: float | None
    posted_ms: float | None
    done_ms: float | None
    ended_ms: float
    num_bytes: int
    num_descriptors: int
    remote_ranks: tuple[int, ...]
    notified_ranks: tuple[int, ...]


class SendTrace(
    msgspec.Struct, frozen=True, forbid_unknown_fields=True, tag_field="event", tag="send"
):
    """The trace line of one prefill lease on one rank: its free notifications are all in."""

    lease_key: str  # connector/protocol.py lease_key: the prefill request id @ lease id
    num_notifications: int
    senders: tuple[str, ...]  # the decode agents that notified
    # From the lease (or an early first notification, whichever came first) to the last one.
    waited_ms: float


def _ms(start_s: float, when_s: float | None) -> float | None:
    return None if when_s is None else round((when_s - start_s) * 1e3, 3)


def load_ended(
    recorder: MetricsRecorder,
    timeline: LoadTimeline,
    *,
    ids: tuple[str, str, str, str],  # (request id, remote request id, remote engine id, agent)
    reason: LoadFailure | None,
    now_s: float,
) -> None:
    """Record a finished load's metrics and write its trace line, built only when the trace
    logger is on: this runs once per load."""
    if reason is None:
        recorder.inc(LOADS_FINISHED)
    else:
        recorder.inc(LOADS_FAILED, reason.kind.value)
    if timeline.planned_s is not None and timeline.posted_s is not None:
        recorder.observe(POST_SECONDS, timeline.posted_s - timeline.planned_s)
        recorder.observe(TRANSFER_BYTES, timeline.num_bytes)
        recorder.observe(TRANSFER_DESCRIPTORS, timeline.num_descriptors)
    if reason is None and timeline.posted_s is not None and timeline.done_s is not None:
        recorder.observe(TRANSFER_SECONDS, timeline.done_s - timeline.posted_s)
    if not trace_logger.isEnabledFor(logging.DEBUG):
        return
    start_s = timeline.scheduled_s
    trace = LoadTrace(
        *ids,
        outcome="ok" if reason is None else reason.kind.value,
        reason=None if reason is None else reason.message,
        handshake_ready_ms=_ms(start_s, timeline.handshake_ready_s),
        planned_ms=_ms(start_s, timeline.planned_s),
        posted_ms=_ms(start_s, timeline.posted_s),
        done_ms=_ms(start_s, timeline.done_s),
        ended_ms=_ms(start_s, now_s) or 0.0,
        num_bytes=timeline.num_bytes,
        num_descriptors=timeline.num_descriptors,
        remote_ranks=timeline.remote_ranks,
        notified_ranks=tuple(sorted(timeline.notified_ranks)),
    )
    trace_logger.debug("%s", msgspec.json.encode(trace).decode())


def send_ended(
    lease_key: str, senders: Iterable[str], *, first_seen_s: float, now_s: float
) -> None:
    """Write a prefill lease's trace line (every expected notification arrived)."""
    if not trace_logger.isEnabledFor(logging.DEBUG):
        return
    names = tuple(sorted(senders))
    trace = SendTrace(lease_key, len(names), names, _ms(first_seen_s, now_s) or 0.0)
    trace_logger.debug("%s", msgspec.json.encode(trace).decode())
