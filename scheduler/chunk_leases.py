"""Prefill, chunked pulls: announce a running request's written blocks under one lease.

With ``chunked_pull`` on (docs/overlap.md, "Pulling chunks as prefill computes them"), a
request with a transfer key is followed chunk by chunk (scheduler/chunk_tracker.py): once
every rank echoed the step that wrote a chunk, its whole blocks go on the transfer board as a
partial announcement, params exactly as decode would get at request_finished for those
blocks, under a lease held in the LeaseTable from the first announcement on (the PRODUCING
lease). It frees nothing when it ends: the blocks are the running request's own. Each later
announcement re-binds the same lease id to the longer prefix; ``finish`` hands the id to
Producer, which binds it to the whole prompt, so "held after decode's last READ" means "held
during every READ since the first chunk".

The lease ends (so every later proof under it fails) before anyone else can write the blocks:
at a preemption (in the step that freed them, before its forward), at an abort, at decode's
cancel (the board releases it), or by expiry; the next announcement then draws a new lease id.

Only requests that can be read chunk by chunk are followed: a transfer key, no host staging,
and every transfer group full attention or MLA (``eligible``). Engine thread only.
"""

from __future__ import annotations

import dataclasses
import logging
import re
from collections.abc import Callable, Iterable, Sequence

from connector.layout import GroupSpec
from connector.lease_binding import HeldBlocks, HeldTokens, KVSalt
from connector.metadata import WorkerReport
from connector.params import params_for_decode
from connector.protocol import lease_key
from connector.staging import ScheduledRow
from scheduler.chunk_pull import CHUNKABLE_KINDS
from scheduler.chunk_tracker import ChunkAnnouncement, ChunkTracker
from scheduler.leases import LeaseTable
from scheduler.producer import LeaseIds
from scheduler.transfer_board import TransferBoard

logger = logging.getLogger(__name__)

_KEY = re.compile(r"[0-9A-Za-z_.-]{1,64}")  # connector/protocol.py TransferKey


def eligible(groups: Sequence[GroupSpec], host_staging: bool) -> bool:
    """Can this engine's leases be read chunk by chunk? Not with host staging (the copy runs
    once, for the whole prompt), nor with a sliding-window or SSM group (their early blocks
    are freed, or hold only the state after the last token)."""
    return not host_staging and all(group.kind in CHUNKABLE_KINDS for group in groups)


@dataclasses.dataclass(slots=True)
class _Request:
    key: str  # the transfer key
    token_ids: Sequence[int]
    salt: KVSalt
    lease_id: str = ""  # the PRODUCING lease ("": none held)


class ChunkLeases:
    def __init__(
        self,
        *,
        groups: Sequence[GroupSpec],
        engine_id: str,
        tp_size: int,
        leases: LeaseTable,
        board: TransferBoard,
        clock: Callable[[], float],
        address: Callable[[], tuple[str, int]],
        boot_id: Callable[[], str],
    ) -> None:
        self._tracker = ChunkTracker(tuple(group.block_size for group in groups))
        self._engine_id = engine_id
        self._tp_size = tp_size
        self._leases = leases
        self._board = board
        self._clock = clock
        self._address = address
        self._boot_id = boot_id
        self._requests: dict[str, _Request] = {}
        self._lease_ids = LeaseIds()
        self._step_seq = 0

    def __len__(self) -> int:
        return len(self._requests)

    def track(
        self,
        request_id: str,
        params: object,
        num_prompt_tokens: int,
        token_ids: Sequence[int] | None,
        salt: KVSalt = (),
    ) -> bool:
        """At allocation: follow a do_remote_decode request with a transfer key."""
        if type(params) is not dict or params.get("do_remote_decode") is not True:
            return False
        key = params.get("transfer_key")
        if not isinstance(key, str) or not _KEY.fullmatch(key) or token_ids is None:
            return False
        if request_id in self._requests or not self._tracker.track(request_id, num_prompt_tokens):
            return request_id in self._requests
        self._requests[request_id] = _Request(key, token_ids, salt)
        return True

    def step(self, rows: Iterable[ScheduledRow], preempted: Iterable[str]) -> int:
        """build_connector_meta: the step's sequence number for the ranks to echo (0: nothing
        followed). A preempted request's lease ends here, before this step's forward."""
        if not self._requests:
            return 0
        self._step_seq += 1
        for request_id in self._tracker.step(self._step_seq, rows, preempted):
            self._end_lease(request_id, "preempted")
        return self._step_seq

    def saved(self, reports: Sequence[WorkerReport]) -> None:
        """update_connector_output: announce what every rank's finished forwards wrote."""
        if not self._requests:
            return
        echoed: dict[int, int] = {}
        for report in reports:
            echoed[report.tp_rank] = max(echoed.get(report.tp_rank, 0), report.saved_step)
        if len(echoed) < self._tp_size:
            return  # a rank did not report this step: its forward is not known done
        for announcement in self._tracker.saved(min(echoed.values())):
            self._announce(announcement)

    def finish(self, request_id: str, aborted: bool) -> str | None:
        """request_finished: the PRODUCING lease id for Producer to bind to the whole prompt
        (None: draw a new one). An aborted request's lease ends."""
        self._tracker.forget(request_id)
        request = self._requests.get(request_id)
        if request is None:
            return None
        if aborted or not self._held(request_id, request.lease_id):
            self._end_lease(request_id, "aborted" if aborted else "expired")
        del self._requests[request_id]
        return request.lease_id or None

    def _announce(self, announcement: ChunkAnnouncement) -> None:
        request_id, num_tokens = announcement.request_id, announcement.num_tokens
        request = self._requests.get(request_id)
        if request is None or self._board.is_cancelled(request.key):
            return
        tokens = HeldTokens.of(request.token_ids, num_tokens, request.salt)
        host, port = self._address()
        if tokens is None or port == 0:
            return
        if request.lease_id and not self._held(request_id, request.lease_id):
            self._end_lease(request_id, "expired")
        if not request.lease_id:
            request.lease_id = self._lease_ids.draw()
        held = HeldBlocks(announcement.block_ids, num_tokens, exact=False)
        self._leases.lease(request_id, self._clock(), request.lease_id, None, tokens, held)
        params = params_for_decode(
            engine_id=self._engine_id,
            request_id=request_id,
            block_ids=announcement.block_ids,
            host=host,
            port=port,
            tp_size=self._tp_size,
            num_tokens=num_tokens,
            boot_id=self._boot_id(),
            lease_id=request.lease_id,
        )
        name = lease_key(request_id, request.lease_id)
        if not self._board.announce_partial(request.key, params, name):
            request.lease_id = ""  # decode cancelled: the board released it
        elif announcement.generation == 1:
            logger.info("request %s: first chunk announced (%d tokens)", request_id, num_tokens)

    def _held(self, request_id: str, lease_id: str) -> bool:
        return bool(lease_id) and self._leases.held([(request_id, lease_id)], self._clock())[0]

    def _end_lease(self, request_id: str, why: str) -> None:
        request = self._requests.get(request_id)
        if request is None or not request.lease_id:
            return
        name, request.lease_id = lease_key(request_id, request.lease_id), ""
        if self._leases.release([name]):
            logger.info("request %s: its chunk lease ended (%s)", request_id, why)
