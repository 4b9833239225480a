"""Prove a load's lease: after its READs landed, ask prefill whether that very lease still holds.

A first check runs when the load arrives, alongside the handshake, unless prefill's side
channel (that boot) answered a lease check in the last ``lease_precheck_skip`` seconds: a
lease already gone then fails the load before any READ is posted (no bandwidth spent on bytes
that cannot be used, no READ against a dead or restarted prefill's agent). A load to a side
channel heard from recently posts its READs at once, which saves a round trip on the path to
the first token. The second check, after the READs, is the proof, and it alone makes a load
successful: skipping the first check changes when a dead lease is noticed, never what is
reported.

Block ids are addresses, not capabilities: a READ returns whatever the blocks hold when it
runs. A load is therefore reported successful only when prefill says, after the last READ of
this rank completed, that the lease the params name is still held. A held lease was held
during every READ: prefill never revives an ended lease, and lease ids are random per lease,
so a later lease of a repeated request id cannot answer for an earlier one. Both checks
name what the load reads (connector/block_digest.py): the blocks, per group in order, and
the tokens it assumes they hold, so prefill answers "held" only for a load that reads that
lease's very blocks (``BLOCKS_MISMATCH`` otherwise). The free
notifications go out only after the answer, so this rank's own notification cannot end the
lease before it is checked.

Checks are batched: the transfer thread collects the checks one pass submits and
``dispatch`` sends them as one LeaseCheck per prefill engine boot (worker/lease_checks.py), so
a burst of loads from one prefill costs it one message per pass, not one per load. Each load
still gets prefill's answer for its own lease, asked after its own READs landed.

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

from connector.errors import (
    BlocksMismatch,
    ConnectorError,
    LeaseRefused,
    PeerRestarted,
    TokensMismatch,
)
from connector.metadata import RemoteSource
from connector.protocol import DIGEST_OK, DIGEST_PENDING, DigestClaim
from worker.lease_checks import BatchCheck, DigestCheck

logger = logging.getLogger(__name__)

# One side channel, the boot it is asked about, and whether the checks come after the READs
# (asked again while silent) or before (not): the checks one LeaseCheck carries.
Destination = tuple[str, int, str, str, bool]  # (host, port, engine id, boot id, patient)
SideChannelBoot = tuple[str, int, str]  # (host, port, boot id): who answered a check
MAX_HEARD = 4096  # side channels remembered as recently heard; the oldest is forgotten

DIGEST_RETRY_S = 0.01  # prefill's ranks report digests a step or two after the lease
DIGEST_WAIT_S = 10.0  # give up on digests that never come (a prefill without verify_kv)

# Failure reasons start with these (connector/observability/metrics.py maps them to bounded kinds).
LEASE_EXPIRED = "lease expired"
LEASE_UNPROVEN = "lease not proven"
# A failure reason with this in it: the boot that leased is gone, and its agent with it
PREFILL_RESTARTED = "the prefill engine restarted since it leased"
DIGEST_FAILED = "digest"
TOKENS_MISMATCH = "tokens mismatch"  # the holder's blocks hold other tokens than the prompt
BLOCKS_MISMATCH = "blocks mismatch"  # the READs came from other blocks than the lease holds


def unprovable_reason(remote: RemoteSource) -> str | None:
    """Why a load from ``remote`` can never be proven (its params name no lease), or None."""
    if remote.lease_id and remote.boot_id:
        return None
    return (
        f"{LEASE_UNPROVEN}: the kv_transfer_params of prefill request "
        f"{remote.remote_request_id!r} carry no remote_lease_id/remote_boot_id, so decode "
        "cannot show prefill held the blocks while it read them; pass through every key the "
        "prefill engine returned, and run the same nixl-pd-connector on both engines"
    )


BEFORE_READS = "before any READ was posted"
AFTER_READS = "when this rank's READs completed"


def lease_failure(
    remote: RemoteSource, held: bool | ConnectorError, when: str = AFTER_READS
) -> str | None:
    """The load's failure reason for a check's answer, or None when the lease held."""
    if held is True:
        return None
    what = (
        f"prefill engine {remote.engine_id!r} request {remote.remote_request_id!r} "
        f"(lease {remote.lease_id})"
    )
    if held is False:
        return (
            f"{LEASE_EXPIRED}: {what} was no longer held {when} (expired, released, or "
            "ended by another reader); its blocks may hold another request's KV, so nothing "
            "read from them is used"
        )
    if isinstance(held, PeerRestarted):
        return f"{LEASE_EXPIRED}: {what}: {PREFILL_RESTARTED} ({held})"
    if isinstance(held, TokensMismatch):
        return (
            f"{TOKENS_MISMATCH}: {what} is held for other tokens than this request's prompt "
            f"({held}): the kv_transfer_params were paired with another prompt (a router "
            "bug, a retried request with an edited prompt, an edited history), so nothing "
            "is read from those blocks"
        )
    if isinstance(held, BlocksMismatch):
        return (
            f"{BLOCKS_MISMATCH}: {what} does not hold the blocks this load reads ({held}): "
            "the kv_transfer_params' remote_block_ids or remote_num_tokens were edited on "
            "the way (a router, a client, another connector), so nothing read from those "
            "blocks is used; pass the params on exactly as the engine returned them"
        )
    return f"{LEASE_UNPROVEN}: asking {what} whether the lease holds failed: {held}"


def digest_failure(remote: RemoteSource, verdict: str) -> str:
    """The load's failure reason when verify_kv's claims were not confirmed."""
    if verdict == DIGEST_PENDING:
        verdict = (
            "prefill reported no digests for this lease (is verify_kv on for the prefill "
            "engine too?)"
        )
    return (
        f"{DIGEST_FAILED}: prefill engine {remote.engine_id!r} request "
        f"{remote.remote_request_id!r}: {verdict}"
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
        self._closing = threading.Event()  # ends digest retries at shutdown
        self._pool = ThreadPoolExecutor(max_workers=max_threads, thread_name_prefix="lease")
        self._tickets = itertools.count(1)
        # (ticket, failure reason, the side channel that answered or None if none did)
        self._answers: queue.SimpleQueue[tuple[int, str | None, SideChannelBoot | None]] = (
            queue.SimpleQueue()
        )
        # The transfer thread only: checks not yet dispatched, answers arrived, tickets whose
        # load no longer waits, and when each side channel last answered.
        self._batches: dict[Destination, list[tuple[int, RemoteSource, str]]] = {}
        self._arrived: dict[int, str | None] = {}
        self._abandoned: set[int] = set()
        self._heard_s: dict[SideChannelBoot, float] = {}
        self.num_batches = 0  # LeaseCheck batches dispatched (tests, benchmarks)

    def submit(
        self, remote: RemoteSource, when: str = AFTER_READS, claims: tuple[DigestClaim, ...] = ()
    ) -> int:
        """Queue a check of ``remote``'s lease (and, with ``claims``, of the digests of what
        was read: asked alone, at once); ``dispatch`` sends the queued ones, and the answer
        comes back from ``take(ticket)``."""
        ticket = next(self._tickets)
        if claims:
            self._pool.submit(self._run_digests, ticket, remote, when, claims)
            return ticket
        patient = when != BEFORE_READS
        destination = (remote.host, remote.port, remote.engine_id, remote.boot_id, patient)
        self._batches.setdefault(destination, []).append((ticket, remote, when))
        return ticket

    def dispatch(self) -> None:
        """Send the queued checks, one batch per destination; checks whose load stopped
        waiting (abandoned) are answered at once without asking."""
        batches, self._batches = self._batches, {}
        for destination, batch in batches.items():
            wanted = [item for item in batch if item[0] not in self._abandoned]
            self._abandoned.difference_update(item[0] for item in batch)
            if wanted:
                self.num_batches += 1
                self._pool.submit(self._run_batch, wanted, destination[-1])

    def heard_within(self, remote: RemoteSource, window_s: float) -> bool:
        """Whether the side channel ``remote`` names, as the boot it names, answered a lease
        check in the last ``window_s`` seconds (held or not: it is alive and that boot)."""
        self._collect()
        heard_s = self._heard_s.get((remote.host, remote.port, remote.boot_id))
        return heard_s is not None and self._clock() - heard_s <= window_s

    def take(self, ticket: int) -> tuple[bool, str | None]:
        """(answered?, failure reason or None if the lease held) for ``ticket``."""
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
            ticket, reason, heard = self._answers.get_nowait()
            if heard is not None:
                self._heard(heard)
            if ticket in self._abandoned:
                self._abandoned.discard(ticket)
            else:
                self._arrived[ticket] = reason

    def _heard(self, side_channel: SideChannelBoot) -> None:
        self._heard_s.pop(side_channel, None)  # re-inserted last: the dict stays oldest-first
        self._heard_s[side_channel] = self._clock()
        if len(self._heard_s) > MAX_HEARD:
            del self._heard_s[next(iter(self._heard_s))]

    def _run_batch(self, batch: list[tuple[int, RemoteSource, str]], patient: bool) -> None:
        answers: list[bool | ConnectorError]
        try:
            answers = self._check([remote for _, remote, _ in batch], patient)
            if len(answers) != len(batch):
                raise ConnectorError(f"{len(answers)} answers to {len(batch)} lease checks")
        except ConnectorError as error:
            answers = [error] * len(batch)
        except Exception as error:  # a bug must still answer, never leave a load waiting
            logger.exception("a lease check of %d lease(s) crashed", len(batch))
            answers = [ConnectorError(f"lease check crashed: {error!r}")] * len(batch)
        for (ticket, remote, when), held in zip(batch, answers, strict=True):
            heard = _answered_by(remote, held)
            self._answers.put((ticket, lease_failure(remote, held, when), heard))
        self._answered()

    def _run_digests(
        self, ticket: int, remote: RemoteSource, when: str, claims: tuple[DigestClaim, ...]
    ) -> None:
        held: bool | ConnectorError
        verdict = DIGEST_OK
        try:
            held, verdict = self._held_and_digests(remote, claims)
        except ConnectorError as error:
            held = error
        except Exception as error:  # a bug must still answer, never leave a load waiting
            logger.exception("lease check of %s crashed", remote.remote_request_id)
            held = ConnectorError(f"lease check crashed: {error!r}")
        reason = lease_failure(remote, held, when)
        if reason is None and verdict != DIGEST_OK:
            reason = digest_failure(remote, verdict)
        self._answers.put((ticket, reason, _answered_by(remote, held)))
        self._answered()

    def _answered(self) -> None:
        if self._on_answer is not None:
            self._on_answer()  # e.g. wake the transfer thread: its load is waiting on this

    def _held_and_digests(
        self, remote: RemoteSource, claims: tuple[DigestClaim, ...]
    ) -> tuple[bool, str]:
        """Ask until prefill's ranks have reported their digests (bounded)."""
        if self._check_digests is None:
            raise ConnectorError("verify_kv is on but this rank has no digest check")
        waited_s = 0.0
        while True:
            held, verdict = self._check_digests(remote, claims)
            if not held or verdict != DIGEST_PENDING or waited_s >= self._digest_wait_s:
                return held, verdict
            if self._closing.wait(DIGEST_RETRY_S):
                return held, "shutting down before prefill reported its digests"
            waited_s += DIGEST_RETRY_S


def _answered_by(remote: RemoteSource, held: bool | ConnectorError) -> SideChannelBoot | None:
    """The side channel (as the boot ``remote`` names) when this answer came from it: held,
    not held, or held for another reader's tokens or blocks; None when it did not answer (silent, restarted,
    refused)."""
    if isinstance(held, bool | LeaseRefused):
        return (remote.host, remote.port, remote.boot_id)
    return None
