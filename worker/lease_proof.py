"""Prove a load's lease: after its READs landed, ask prefill whether that very lease still holds.

Why a held lease proves the bytes, what each check costs and how a failure reads:
docs/integrity.md, "Lease-proven loads"; what an answer means for the load:
worker/load_lifecycle.py (``lease_failure``). Only the proof after the READs makes a load
successful, and its ref names the blocks read and the tokens they should hold
(connector/lease_binding.py). A first check runs when the load arrives, unless that prefill
boot's side channel answered one in the last ``lease_precheck_skip`` seconds: skipping it
changes when a dead lease is noticed, never what is reported.

A host-staged lease (a decode engine's hold) becomes readable only once its holder's copy is
done, so "held after the READs" does not imply "held during them": such a load succeeds only
if a check before its first READ saw it held (``Staging.HELD_AFTER_COPY``). That check waits
(bounded) while the copy is pending, and a side channel that answered for a staged lease is
never a reason to skip it again.

Batched: ``dispatch`` sends a pass's checks as one LeaseCheck per prefill engine boot (split
past MAX_REFS_PER_MESSAGE), asked again while unanswered; a side channel silent through every
retry fails the next checks at once for a while (``SilentSideChannels``). Each ref gets
prefill's answer for its own lease: batching never lends one lease's answer to another.

Threading contract: check threads only talk to side channels (through the injected checks)
and put answers on a queue; the transfer thread submits, dispatches and collects. Each check
is bounded by its own timeout, and every submitted check ends in exactly one answer.
"""

from __future__ import annotations

import functools
import itertools
import logging
import queue
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import NamedTuple, TypeVar

from connector.config import ConnectorConfig
from connector.errors import (
    BlocksMismatch,
    ConnectorError,
    HandshakeError,
    LeaseRefused,
    PeerRestarted,
    SideChannelTimeout,
    TokensMismatch,
)
from connector.metadata import LoadFailure, RemoteSource, SideChannelBoot
from connector.protocol import (
    DIGEST_OK,
    DIGEST_PENDING,
    REFUSED_BLOCKS,
    DigestClaim,
    LeaseRef,
    LeaseStatus,
    Refusal,
)
from worker.load_lifecycle import (
    AFTER_READS,
    BEFORE_READS,
    STAGED_WAIT_S,
    Answer,
    Staging,
    digest_failure,
    lease_failure,
)

logger = logging.getLogger(__name__)
_Answer = TypeVar("_Answer")


# One side channel, the boot it is asked about, and whether the checks come after the READs
# (asked again while silent) or before (not): the checks one LeaseCheck carries.
BatchKey = tuple[SideChannelBoot, bool]  # (the side channel, patient)
MAX_HEARD = 4096  # side channels remembered as recently heard; the oldest is forgotten

DIGEST_RETRY_S = 0.01  # prefill's ranks report digests a step or two after the lease
DIGEST_WAIT_S = 10.0  # give up on digests that never come (a prefill without verify_kv)
STAGED_RETRY_S = 0.01  # a staged lease's copy runs in the holder's next step or two

# Is the lease ``remote`` names held by its prefill engine right now? Raises ConnectorError
# when prefill cannot be asked (PeerRestarted: it is another boot, so the lease is gone).
LeaseCheck = Callable[[RemoteSource], bool | Staging]
# The same question for many leases of one prefill engine boot (one side channel): one answer
# per remote, in order. The flag says whether a silent side channel is asked again (after the
# READs: a paused prefill may still prove the lease) or not (before: the load fails after one
# timeout).
BatchCheck = Callable[[Sequence[RemoteSource], bool], list[Answer]]
# verify_kv: the same question with the reader's digest claims: (held?, DIGEST_OK, DIGEST_PENDING
# or why the claims do not match).
DigestCheck = Callable[[RemoteSource, tuple[DigestClaim, ...]], tuple[bool | Staging, str]]

MAX_REFS_PER_MESSAGE = 4096  # ~100 bytes per ref: well under max_message_bytes' 64 KiB floor x 8


class LeaseProofs:
    """A pool of four check threads; answers come back by ticket through ``take``."""

    def __init__(
        self,
        check: BatchCheck,
        *,
        check_digests: DigestCheck | None = None,
        on_answer: Callable[[], None] | None = None,  # called (check thread) after each answer
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._check = check
        self._clock = clock
        self._on_answer = on_answer
        self._check_digests = check_digests
        self._closing = threading.Event()  # ends digest and staged-copy retries at shutdown
        self._pool = ThreadPoolExecutor(max_workers=4, thread_name_prefix="lease")
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
        reason = lease_failure(
            item.remote, held, item.when, seen_held=item.seen_held, staged_wait_s=STAGED_WAIT_S
        )
        if reason is None and verdict != DIGEST_OK:
            reason = digest_failure(item.remote, verdict)
        # Did the side channel, as the boot the lease names, answer? Held or not, refused for
        # another reader's tokens or blocks, or staged: yes; silent or restarted: no.
        answered = isinstance(held, bool | LeaseRefused | Staging)
        heard = item.remote.side_channel if answered else None
        self._answers.put((item.ticket, reason, heard, isinstance(held, Staging)))

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
            readable = held is True or held is Staging.HELD_AFTER_COPY  # held and readable now
            if not readable or verdict != DIGEST_PENDING or waited_s >= DIGEST_WAIT_S:
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


class SilentSideChannels:
    """Side channels whose lease checks went unanswered through every retry, for a while.

    Without it, every load to a dead prefill would wait out all its retries, each holding one
    of the few check threads that loads to healthy prefills share. Thread-safe (check threads).
    """

    def __init__(self, window_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self._window_s = window_s
        self._clock = clock
        self._lock = threading.Lock()  # guards _until
        self._until: dict[SideChannelBoot, tuple[float, str]] = {}  # -> (until, why)

    def check(self, remote: RemoteSource) -> None:
        """Raise HandshakeError at once for a side channel that was just found silent."""
        key = remote.side_channel
        with self._lock:
            until_s, why = self._until.get(key, (0.0, ""))
            if self._clock() >= until_s:
                self._until.pop(key, None)
                return
        raise HandshakeError(f"{why} (a lease check less than {self._window_s} s ago)")

    def silent(self, remote: RemoteSource, error: HandshakeError) -> None:
        with self._lock:
            self._until[remote.side_channel] = (self._clock() + self._window_s, str(error))


def asked_again(
    config: ConnectorConfig,
    ask: Callable[[], _Answer],
    remote: RemoteSource,
    silence: SilentSideChannels,
    *,
    patient: bool = True,
) -> _Answer:
    """``ask()``, asked up to ``handshake_retries`` more times while prefill's side channel
    does not answer (HandshakeError): a prefill paused for less than that (SIGSTOP, a long GC,
    a busy host) still proves its lease. PeerRestarted is final at once: another boot
    answered, and the lease died with the one that issued it. Not ``patient`` (the check
    before any READ), a side channel silent through one timeout is not asked again: a dead
    prefill fails the load after one timeout. A side channel that stayed silent through every
    retry fails the next checks at once for a while (``silence``)."""
    silence.check(remote)
    for attempt in range(config.handshake_retries + 1):
        try:
            return ask()
        except PeerRestarted:
            raise
        except HandshakeError as error:
            silent_once = not patient and isinstance(error, SideChannelTimeout)
            if silent_once or attempt == config.handshake_retries:
                silence.silent(remote, error)
                raise
            logger.info("lease check failed (attempt %d), asking again: %s", attempt + 1, error)
    raise AssertionError("unreachable: the last attempt returns or raises")


def side_channel_checks(
    config: ConnectorConfig, silence: SilentSideChannels | None = None
) -> tuple[LeaseCheck, DigestCheck]:
    """The lease check and verify_kv's digest check over the side channel the params name
    (naming their boot: no Hello), retried while unanswered (``asked_again``), sharing what
    they learn of silent side channels."""
    silence = silence or SilentSideChannels(config.handshake_timeout_s)

    def ask(remote: RemoteSource, claims: tuple[DigestClaim, ...]) -> tuple[bool | Staging, str]:
        status = _lease_status(config, remote, [lease_ref(remote, claims)])
        held = answers(status)[0]
        if isinstance(held, ConnectorError):  # LeaseRefused: fails the load, never retried
            raise held
        return held, status.digests[0] if claims else DIGEST_OK

    def check_digests(
        remote: RemoteSource, claims: tuple[DigestClaim, ...]
    ) -> tuple[bool | Staging, str]:
        return asked_again(config, lambda: ask(remote, claims), remote, silence)

    def check(remote: RemoteSource) -> bool | Staging:
        return check_digests(remote, ())[0]

    return check, check_digests


def side_channel_batch_check(config: ConnectorConfig, silence: SilentSideChannels) -> BatchCheck:
    """Check many leases of one prefill engine boot in one LeaseCheck (per
    MAX_REFS_PER_MESSAGE), asked again while unanswered, as ``side_channel_checks`` does."""

    def ask(remotes: Sequence[RemoteSource]) -> list[Answer]:
        return answers(_lease_status(config, remotes[0], [lease_ref(r) for r in remotes]))

    def check(remotes: Sequence[RemoteSource], patient: bool) -> list[Answer]:
        results: list[Answer] = []
        for start in range(0, len(remotes), MAX_REFS_PER_MESSAGE):
            part = remotes[start : start + MAX_REFS_PER_MESSAGE]
            asking = functools.partial(ask, part)
            try:
                results.extend(asked_again(config, asking, part[0], silence, patient=patient))
            except ConnectorError as error:
                results.extend([error] * len(part))
        return results

    return check


def _lease_status(
    config: ConnectorConfig, remote: RemoteSource, refs: list[LeaseRef]
) -> LeaseStatus:
    """One LeaseCheck of ``refs`` to the prefill boot ``remote`` names, as ``remote.reader``."""
    from connector.net.side_channel_client import check_leases_status

    return check_leases_status(
        remote.host,
        remote.port,
        refs,
        engine_id=remote.engine_id,
        boot_id=remote.boot_id,
        secret=config.side_channel_secret,
        timeout_s=config.handshake_timeout_s,
        max_message_bytes=config.max_message_bytes,
        reader=remote.reader,
    )


def lease_ref(remote: RemoteSource, claims: tuple[DigestClaim, ...] = ()) -> LeaseRef:
    """The LeaseRef a check of ``remote`` sends: the lease, the digest claims, the tokens the
    load expects the blocks to hold, and the blocks and token count its READs assume."""
    return LeaseRef(remote.remote_request_id, remote.lease_id, claims, remote.tokens, remote.blocks)


def answers(status: LeaseStatus) -> list[Answer]:
    """Per ref: held, not held, the holder's refusal (a lease held, but not for this reader):
    BlocksMismatch (it reads other blocks or another token count) or TokensMismatch (the
    blocks hold other tokens), or a staged lease's Staging answer."""
    all_false = (False,) * len(status.held)
    refused = status.refused or (None,) * len(status.held)
    staged = status.staged or all_false
    # Only staged leases pend.
    pending = (status.pending or all_false) if status.staged else all_false
    return [
        _answer(held, why, wait, was_staged)
        for held, why, wait, was_staged in zip(status.held, refused, pending, staged, strict=True)
    ]


def _answer(held: bool, refused: Refusal | None, pending: bool, staged: bool) -> Answer:
    if refused is not None:
        mismatch = BlocksMismatch if refused.kind == REFUSED_BLOCKS else TokensMismatch
        return mismatch(refused.reason)
    if pending:
        return Staging.PENDING
    return Staging.HELD_AFTER_COPY if held and staged else held


def one_by_one(check: LeaseCheck) -> BatchCheck:
    """A BatchCheck that asks ``check`` once per remote (an injected single check: tests)."""

    def batch(remotes: Sequence[RemoteSource], patient: bool) -> list[Answer]:
        answers: list[Answer] = []
        for remote in remotes:
            try:
                answers.append(check(remote))
            except ConnectorError as error:
                answers.append(error)
        return answers

    return batch
