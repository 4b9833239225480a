"""Prove a load's lease: after its READs landed, ask prefill whether that very lease still holds.

Why a held lease proves the bytes, what each check costs and how a failure reads:
docs/integrity.md, "Lease-proven loads". Here: the proof after the READs alone makes a load
successful, and names what the load reads (connector/lease_binding.py: its blocks and the
tokens it assumes they hold), so prefill answers "held" only for that lease's very blocks
(``BLOCKS_MISMATCH`` otherwise). A first check runs when the load arrives, alongside the
handshake, unless that prefill boot's side channel answered a lease check in the last
``lease_precheck_skip`` seconds: a lease already gone then fails the load before any READ.
Skipping it changes when a dead lease is noticed, never what is reported.

A host-staged lease (a decode engine's hold, scheduler/leases.py) starts not readable and
becomes readable once its holder's copy is done, so for it "held after the READs" does not
imply "held during them": the holder says which leases started so
(``Staging.HELD_AFTER_COPY``), and such a load succeeds only if a check before its first READ
saw the lease held. That check waits (bounded) while the answer is pending; a load that
skipped it fails ("staged copy not proven ready before the READs"). A side channel that
answered for a staged lease is never a reason to skip the check before the READs again.

Checks are batched: the transfer thread collects the checks one pass submits and
``dispatch`` sends them as one LeaseCheck per prefill engine boot (worker/lease_checks.py);
each load still gets prefill's answer for its own lease, asked after its own READs landed.

Threading contract: check threads only talk to side channels (through the injected checks)
and put answers on a queue; the transfer thread submits, dispatches and collects. Each check
is bounded by its own timeout, and every submitted check ends in exactly one answer.
"""

from __future__ import annotations

import itertools
import logging
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import NamedTuple

from connector.errors import (
    BlocksMismatch,
    ConnectorError,
    LeaseRefused,
    PeerRestarted,
    TokensMismatch,
)
from connector.metadata import RemoteSource, SideChannelBoot
from connector.outcomes import FailureKind, LoadFailure
from connector.protocol import DIGEST_OK, DIGEST_PENDING, DigestClaim
from worker.lease_checks import Answer, BatchCheck, DigestCheck, Staging, is_held

logger = logging.getLogger(__name__)

# One side channel, the boot it is asked about, and whether the checks come after the READs
# (asked again while silent) or before (not): the checks one LeaseCheck carries.
BatchKey = tuple[SideChannelBoot, bool]  # (the side channel, patient)
MAX_HEARD = 4096  # side channels remembered as recently heard; the oldest is forgotten

DIGEST_RETRY_S = 0.01  # prefill's ranks report digests a step or two after the lease
DIGEST_WAIT_S = 10.0  # give up on digests that never come (a prefill without verify_kv)
STAGED_RETRY_S = 0.01  # a staged lease's copy runs in the holder's next step or two
STAGED_WAIT_S = 10.0  # give up on a staged copy that never ends (the holder stopped stepping)

# Failure messages start with these words, for people reading logs; code reads the kind.
LEASE_EXPIRED = "lease expired"
LEASE_UNPROVEN = "lease not proven"
PREFILL_RESTARTED = "the prefill engine restarted since it leased"
DIGEST_FAILED = "digest"
TOKENS_MISMATCH = "tokens mismatch"  # the holder's blocks hold other tokens than the prompt
BLOCKS_MISMATCH = "blocks mismatch"  # the READs came from other blocks than the lease holds


def unprovable_reason(remote: RemoteSource) -> LoadFailure | None:
    """Why a load from ``remote`` can never be proven (its params name no lease), or None."""
    if remote.lease_id and remote.boot_id:
        return None
    return LoadFailure(
        FailureKind.LEASE_UNPROVEN,
        f"{LEASE_UNPROVEN}: the kv_transfer_params of prefill request "
        f"{remote.remote_request_id!r} carry no remote_lease_id/remote_boot_id, so decode "
        "cannot show prefill held the blocks while it read them; pass through every key the "
        "prefill engine returned, and run the same nixl-pd-connector on both engines",
    )


BEFORE_READS = "before any READ was posted"
AFTER_READS = "when this rank's READs completed"


def lease_failure(
    remote: RemoteSource, held: Answer, when: str = AFTER_READS, *, seen_held: bool = False
) -> LoadFailure | None:
    """The load's failure for a check's answer, or None when the lease held.

    ``seen_held``: a check before the load's first READ said the lease was held (needed, after
    the READs, for a lease that was not readable at first)."""
    if held is True:
        return None
    if held is Staging.HELD_AFTER_COPY and (when == BEFORE_READS or seen_held):
        return None
    what = (
        f"prefill engine {remote.engine_id!r} request {remote.remote_request_id!r} "
        f"(lease {remote.lease_id})"
    )
    if isinstance(held, Staging):
        return _staged_failure(what, held, when)
    if held is False:
        return LoadFailure(
            FailureKind.LEASE_EXPIRED,
            f"{LEASE_EXPIRED}: {what} was no longer held {when} (expired, released, or "
            "ended by another reader); its blocks may hold another request's KV, so nothing "
            "read from them is used",
        )
    if isinstance(held, PeerRestarted):
        return LoadFailure(
            FailureKind.PREFILL_RESTARTED, f"{LEASE_EXPIRED}: {what}: {PREFILL_RESTARTED} ({held})"
        )
    if isinstance(held, TokensMismatch):
        return LoadFailure(
            FailureKind.TOKENS_MISMATCH,
            f"{TOKENS_MISMATCH}: {what} is held for other tokens than this request's prompt "
            f"({held}): the kv_transfer_params were paired with another prompt (a router "
            "bug, a retried request with an edited prompt, an edited history), so nothing "
            "is read from those blocks",
        )
    if isinstance(held, BlocksMismatch):
        return LoadFailure(
            FailureKind.BLOCKS_MISMATCH,
            f"{BLOCKS_MISMATCH}: {what} does not hold the blocks this load reads ({held}): "
            "the kv_transfer_params' remote_block_ids or remote_num_tokens were edited on "
            "the way (a router, a client, another connector), so nothing read from those "
            "blocks is used; pass the params on exactly as the engine returned them",
        )
    return LoadFailure(
        FailureKind.LEASE_UNPROVEN,
        f"{LEASE_UNPROVEN}: asking {what} whether the lease holds failed: {held}",
    )


def _staged_failure(what: str, held: Staging, when: str) -> LoadFailure:
    if held is Staging.PENDING and when == BEFORE_READS:
        return LoadFailure(
            FailureKind.LEASE_UNPROVEN,
            f"{LEASE_UNPROVEN}: {what} stages its KV through host memory, and its copy was "
            f"not done within {STAGED_WAIT_S} s {when}; nothing is read from its blocks",
        )
    return LoadFailure(
        FailureKind.LEASE_UNPROVEN,
        f"{LEASE_UNPROVEN}: {what} was not readable when leased (its KV was still being "
        "copied to the host memory NIXL reads) and this load did not see it held before its "
        "first READ: staged copy not proven ready before the READs, so nothing read is used",
    )


def digest_failure(remote: RemoteSource, verdict: str) -> LoadFailure:
    """The load's failure when verify_kv's claims were not confirmed."""
    if verdict == DIGEST_PENDING:
        verdict = (
            "prefill reported no digests for this lease (is verify_kv on for the prefill "
            "engine too?)"
        )
    return LoadFailure(
        FailureKind.DIGEST,
        f"{DIGEST_FAILED}: prefill engine {remote.engine_id!r} request "
        f"{remote.remote_request_id!r}: {verdict}",
    )


class LeaseProofs:
    """A small pool of check threads; answers come back by ticket through ``take``."""

    def __init__(
        self,
        check: BatchCheck,
        *,
        check_digests: DigestCheck | None = None,
        max_threads: int = 4,
        digest_wait_s: float = DIGEST_WAIT_S,
        on_answer: Callable[[], None] | None = None,  # called (check thread) after each answer
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._check = check
        self._clock = clock
        self._on_answer = on_answer
        self._check_digests = check_digests
        self._digest_wait_s = digest_wait_s
        self._closing = threading.Event()  # ends digest and staged-copy retries at shutdown
        self._pool = ThreadPoolExecutor(max_workers=max_threads, thread_name_prefix="lease")
        self._tickets = itertools.count(1)
        # (ticket, failure, the side channel that answered or None if none did, and
        # whether it answered for a staged lease)
        self._answers: queue.SimpleQueue[
            tuple[int, LoadFailure | None, SideChannelBoot | None, bool]
        ] = queue.SimpleQueue()
        # The transfer thread only: checks not yet dispatched, answers arrived, tickets whose
        # load no longer waits, when each side channel last answered, and the side channels
        # that answered for a staged lease (their loads always check before the READs).
        self._batches: dict[BatchKey, list[_Item]] = {}
        self._arrived: dict[int, LoadFailure | None] = {}
        self._abandoned: set[int] = set()
        self._heard_s: dict[SideChannelBoot, float] = {}
        self._staging: dict[SideChannelBoot, None] = {}
        self.num_batches = 0  # LeaseCheck batches dispatched (tests, benchmarks)

    def submit(
        self,
        remote: RemoteSource,
        when: str = AFTER_READS,
        claims: tuple[DigestClaim, ...] = (),
        *,
        seen_held: bool = False,
    ) -> int:
        """Queue a check of ``remote``'s lease (and, with ``claims``, of the digests of what
        was read: asked alone, at once); ``dispatch`` sends the queued ones, and the answer
        comes back from ``take(ticket)``. ``seen_held`` (after the READs): a check before the
        load's first READ said the lease was held."""
        ticket = next(self._tickets)
        item = _Item(ticket, remote, when, seen_held)
        if claims:
            self._pool.submit(self._run_digests, item, claims)
            return ticket
        patient = when != BEFORE_READS
        self._batches.setdefault((remote.side_channel, patient), []).append(item)
        return ticket

    def dispatch(self) -> None:
        """Send the queued checks, one batch per destination; checks whose load stopped
        waiting (abandoned) are answered at once without asking."""
        batches, self._batches = self._batches, {}
        for destination, batch in batches.items():
            wanted = [item for item in batch if item.ticket not in self._abandoned]
            self._abandoned.difference_update(item.ticket for item in batch)
            if wanted:
                self.num_batches += 1
                self._pool.submit(self._run_batch, wanted, destination[-1])

    def heard_within(self, remote: RemoteSource, window_s: float) -> bool:
        """Whether the side channel ``remote`` names, as the boot it names, answered a lease
        check in the last ``window_s`` seconds (held or not: it is alive and that boot), and
        never answered for a staged lease (whose loads must check before their READs)."""
        self._collect()
        side_channel = remote.side_channel
        heard_s = self._heard_s.get(side_channel)
        if heard_s is None or side_channel in self._staging:
            return False
        return self._clock() - heard_s <= window_s

    def take(self, ticket: int) -> tuple[bool, LoadFailure | None]:
        """(answered?, failure or None if the lease held) for ``ticket``."""
        self._collect()
        if ticket not in self._arrived:
            return False, None
        return True, self._arrived.pop(ticket)

    def abandon(self, ticket: int) -> None:
        """The load no longer waits for ``ticket`` (aborted): drop its answer when it comes."""
        self._collect()
        if ticket in self._arrived:
            del self._arrived[ticket]
        else:
            self._abandoned.add(ticket)

    def close(self) -> None:
        """Wait for running checks (each bounded by its timeout) and stop the threads."""
        self._closing.set()
        self._pool.shutdown(wait=True, cancel_futures=True)

    def _collect(self) -> None:
        while not self._answers.empty():  # one consumer (the transfer thread): empty() is exact
            ticket, reason, heard, staged = self._answers.get_nowait()
            if heard is not None:
                self._heard(heard, staged)
            if ticket in self._abandoned:
                self._abandoned.discard(ticket)
            else:
                self._arrived[ticket] = reason

    def _heard(self, side_channel: SideChannelBoot, staged: bool) -> None:
        self._heard_s.pop(side_channel, None)  # re-inserted last: the dict stays oldest-first
        self._heard_s[side_channel] = self._clock()
        if len(self._heard_s) > MAX_HEARD:
            del self._heard_s[next(iter(self._heard_s))]
        if staged and side_channel not in self._staging:
            self._staging[side_channel] = None
            if len(self._staging) > MAX_HEARD:
                del self._staging[next(iter(self._staging))]

    def _run_batch(self, batch: list[_Item], patient: bool) -> None:
        answers = self._ask_batch(batch, patient)
        if not patient:  # before the READs: a staged lease's pending copy is waited for
            answers = self._while_pending(batch, answers)
        for item, held in zip(batch, answers, strict=True):
            self._put(item, held)
        self._answered()

    def _ask_batch(self, batch: list[_Item], patient: bool) -> list[Answer]:
        answers: list[Answer]
        try:
            answers = self._check([item.remote for item in batch], patient)
            if len(answers) != len(batch):
                raise ConnectorError(f"{len(answers)} answers to {len(batch)} lease checks")
        except ConnectorError as error:
            answers = [error] * len(batch)
        except Exception as error:  # a bug must still answer, never leave a load waiting
            logger.exception("a lease check of %d lease(s) crashed", len(batch))
            answers = [ConnectorError(f"lease check crashed: {error!r}")] * len(batch)
        return answers

    def _while_pending(self, batch: list[_Item], answers: list[Answer]) -> list[Answer]:
        """Ask again for the leases whose staged copy is pending, until it is done (bounded
        by STAGED_WAIT_S); the other answers stand."""
        waited_s = 0.0
        answers = list(answers)
        while waited_s < STAGED_WAIT_S:
            waiting = [index for index, held in enumerate(answers) if held is Staging.PENDING]
            if not waiting or self._closing.wait(STAGED_RETRY_S):
                break
            waited_s += STAGED_RETRY_S
            again = self._ask_batch([batch[index] for index in waiting], False)
            for index, held in zip(waiting, again, strict=True):
                answers[index] = held
        return answers

    def _put(self, item: _Item, held: Answer, verdict: str = DIGEST_OK) -> None:
        reason = lease_failure(item.remote, held, item.when, seen_held=item.seen_held)
        if reason is None and verdict != DIGEST_OK:
            reason = digest_failure(item.remote, verdict)
        staged = isinstance(held, Staging)
        self._answers.put((item.ticket, reason, _answered_by(item.remote, held), staged))

    def _run_digests(self, item: _Item, claims: tuple[DigestClaim, ...]) -> None:
        held: Answer
        verdict = DIGEST_OK
        try:
            held, verdict = self._held_and_digests(item.remote, claims)
        except ConnectorError as error:
            held = error
        except Exception as error:  # a bug must still answer, never leave a load waiting
            logger.exception("lease check of %s crashed", item.remote.remote_request_id)
            held = ConnectorError(f"lease check crashed: {error!r}")
        self._put(item, held, verdict)
        self._answered()

    def _answered(self) -> None:
        if self._on_answer is not None:
            self._on_answer()  # e.g. wake the transfer thread: its load is waiting on this

    def _held_and_digests(
        self, remote: RemoteSource, claims: tuple[DigestClaim, ...]
    ) -> tuple[bool | Staging, str]:
        """Ask until prefill's ranks have reported their digests (bounded)."""
        if self._check_digests is None:
            raise ConnectorError("verify_kv is on but this rank has no digest check")
        waited_s = 0.0
        while True:
            held, verdict = self._check_digests(remote, claims)
            if not is_held(held) or verdict != DIGEST_PENDING or waited_s >= self._digest_wait_s:
                return held, verdict
            if self._closing.wait(DIGEST_RETRY_S):
                return held, "shutting down before prefill reported its digests"
            waited_s += DIGEST_RETRY_S


class _Item(NamedTuple):
    """One submitted check: its ticket, the lease, when it is asked (BEFORE_READS or after),
    and (after the READs) whether a check before them saw the lease held."""

    ticket: int
    remote: RemoteSource
    when: str
    seen_held: bool


def _answered_by(remote: RemoteSource, held: Answer) -> SideChannelBoot | None:
    """The side channel (as the boot ``remote`` names) when this answer came from it: held,
    not held, held for another reader's tokens or blocks, or a staged lease's answer; None
    when it did not answer (silent, restarted, refused)."""
    if isinstance(held, bool | LeaseRefused | Staging):
        return remote.side_channel
    return None
