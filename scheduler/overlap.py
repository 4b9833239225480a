"""Decode's loads that wait, blocks allocated, for prefill to announce their lease (overlapped dispatch).

With overlapped dispatch (docs/overlap.md) decode's params name prefill's side channel and a
transfer key, not a lease. The request is claimed as any other (the prompt's length is
known), the engine allocates, and at allocation the load is parked here with its blocks while
a LeaseWaiter thread asks prefill for the lease. When the wait settles, the engine thread
takes it at its next step (``take_settled``) and binds the announced params exactly as it
binds a router's: from there the load is today's (scheduler/connector.py).

Only the engine thread calls this class. A parked load leaves by settling or by
``cancel`` (its request ended, or wants nothing loaded); none outlives its request.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from connector.params import AwaitedLease
from scheduler.lease_waiter import LeaseWaiter, Settled
from scheduler.requests import RequestInfo


@dataclasses.dataclass(frozen=True, slots=True)
class ParkedLoad:
    """One decode load waiting for its lease: what binding it needs once announced."""

    request: RequestInfo  # as at allocation (its params are the router's overlapped ones)
    awaited: AwaitedLease
    block_ids: tuple[tuple[int, ...], ...]  # decode's blocks per cache group, as allocated
    num_external_tokens: int


class OverlappedLoads:
    def __init__(self, waiter: LeaseWaiter) -> None:
        self._waiter = waiter
        self._parked: dict[str, ParkedLoad] = {}  # request id -> its parked load

    def park(
        self,
        request: RequestInfo,
        awaited: AwaitedLease,
        block_ids: Sequence[Sequence[int]],
        num_external_tokens: int,
    ) -> None:
        """Wait for ``awaited``'s lease; allocated again (preempted), the newest blocks count."""
        blocks = tuple(tuple(group) for group in block_ids)
        request_id = request.request_id
        self._parked[request_id] = ParkedLoad(request, awaited, blocks, num_external_tokens)
        self._waiter.wait(request_id, awaited)

    def take_settled(self) -> list[tuple[ParkedLoad, Settled]]:
        """The parked loads whose wait settled since the last call, with how."""
        settled = []
        for outcome in self._waiter.take():
            parked = self._parked.pop(outcome.request_id, None)
            if parked is not None:  # else its request ended meanwhile (and cancelled)
                settled.append((parked, outcome))
        return settled

    def cancel(self, request_id: str, awaited: AwaitedLease | None) -> bool:
        """The request will never load: stop waiting, and tell prefill to end the lease.
        ``awaited``: its params' (None: the parked load's, if any). True if it was parked."""
        parked = self._parked.pop(request_id, None)
        awaited = awaited or (parked.awaited if parked is not None else None)
        if awaited is not None:
            self._waiter.cancel(request_id, awaited)
        return parked is not None

    @property
    def has_pending_work(self) -> bool:
        """Loads still waiting: the engine must step to bind them when they settle."""
        return bool(self._parked)

    def stop(self) -> None:
        self._waiter.stop()
