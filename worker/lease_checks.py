"""Lease checks over prefill's side channel: one LeaseCheck per prefill engine boot per batch,
asked again while unanswered, and silent side channels remembered for a while.

The transfer thread batches the checks of one pass by the side channel and boot they go to
(worker/lease_proof.py); this module turns a batch into one message (split past
MAX_REFS_PER_MESSAGE) and its answer into one result per load. Whether a ref is held is
prefill's answer for that very ref: batching never lends one lease's answer to another.
Runs on the check threads; ``SilentSideChannels`` is thread-safe.
"""

from __future__ import annotations

import enum
import functools
import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import TypeVar

from connector.config import ConnectorConfig
from connector.errors import (
    BlocksMismatch,
    ConnectorError,
    HandshakeError,
    PeerRestarted,
    SideChannelTimeout,
    TokensMismatch,
)
from connector.metadata import RemoteSource, SideChannelBoot
from connector.protocol import (
    DIGEST_OK,
    REFUSED_BLOCKS,
    DigestClaim,
    LeaseRef,
    LeaseStatus,
    Refusal,
)

logger = logging.getLogger(__name__)
_Answer = TypeVar("_Answer")


class Staging(enum.Enum):
    """A holder's answer for a host-staged lease (scheduler/leases.py), besides held or not."""

    PENDING = enum.auto()  # held, but its device->host copy is not done: not readable yet
    HELD_AFTER_COPY = enum.auto()  # held and readable, but it was not readable at first


# Held (True), not held (False), a staged lease's answer, or the error that kept it from being
# asked (TokensMismatch: held, but for other tokens).
Answer = bool | Staging | ConnectorError


def is_held(answer: Answer) -> bool:
    """Whether the holder said the lease is held and readable now."""
    return answer is True or answer is Staging.HELD_AFTER_COPY


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
            self._until[remote.side_channel] = (
                self._clock() + self._window_s,
                str(error),
            )


def asked_again(
    config: ConnectorConfig,
    ask: Callable[[], _Answer],
    remote: RemoteSource | None = None,
    silence: SilentSideChannels | None = None,
    *,
    patient: bool = True,
) -> _Answer:
    """``ask()``, asked up to ``handshake_retries`` more times while prefill's side channel
    does not answer (HandshakeError): a prefill paused for less than that (SIGSTOP, a long GC,
    a busy host) still proves its lease. PeerRestarted is final at once: another boot
    answered, and the lease died with the one that issued it. Not ``patient`` (the check
    before any READ), a side channel silent through one timeout is not asked again: a dead
    prefill fails the load after one timeout. With ``silence``, a side channel that stayed
    silent through every retry fails the next checks at once for a while."""
    if silence is not None and remote is not None:
        silence.check(remote)
    for attempt in range(config.handshake_retries + 1):
        try:
            return ask()
        except PeerRestarted:
            raise
        except HandshakeError as error:
            silent_once = not patient and isinstance(error, SideChannelTimeout)
            if silent_once or attempt == config.handshake_retries:
                if silence is not None and remote is not None:
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
    from connector.net.side_channel_client import check_leases_status

    silence = silence or SilentSideChannels(config.handshake_timeout_s)

    def ask(remote: RemoteSource, claims: tuple[DigestClaim, ...]) -> tuple[bool | Staging, str]:
        status = check_leases_status(
            remote.host,
            remote.port,
            [lease_ref(remote, claims)],
            engine_id=remote.engine_id,
            boot_id=remote.boot_id,
            secret=config.side_channel_secret,
            timeout_s=config.handshake_timeout_s,
            max_message_bytes=config.max_message_bytes,
            reader=remote.reader,
        )
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
    from connector.net.side_channel_client import check_leases_status

    def ask(remotes: Sequence[RemoteSource]) -> list[Answer]:
        first = remotes[0]
        return answers(
            check_leases_status(
                first.host,
                first.port,
                [lease_ref(remote) for remote in remotes],
                engine_id=first.engine_id,
                boot_id=first.boot_id,
                secret=config.side_channel_secret,
                timeout_s=config.handshake_timeout_s,
                max_message_bytes=config.max_message_bytes,
                reader=first.reader,
            )
        )

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


def lease_ref(remote: RemoteSource, claims: tuple[DigestClaim, ...] = ()) -> LeaseRef:
    """The LeaseRef a check of ``remote`` sends: the lease, the digest claims, the tokens the
    load expects the blocks to hold, and the blocks and token count its READs assume."""
    return LeaseRef(remote.remote_request_id, remote.lease_id, claims, remote.tokens, remote.blocks)


def answers(status: LeaseStatus) -> list[Answer]:
    """Per ref: held, not held, the holder's refusal (a lease held, but not for this reader):
    BlocksMismatch (it reads other blocks or another token count) or TokensMismatch (the
    blocks hold other tokens), or a staged lease's Staging answer."""
    refused = status.refused or (None,) * len(status.held)
    if not status.staged:
        return [
            held if why is None else _refusal_error(why.kind, why.reason)
            for held, why in zip(status.held, refused, strict=True)
        ]
    pending = status.pending or (False,) * len(status.held)
    return [
        _staged_answer(held, why, wait, staged)
        for held, why, wait, staged in zip(
            status.held, refused, pending, status.staged, strict=True
        )
    ]


def _staged_answer(held: bool, refused: Refusal | None, pending: bool, staged: bool) -> Answer:
    if refused is not None:
        return _refusal_error(refused.kind, refused.reason)
    if pending:
        return Staging.PENDING
    return Staging.HELD_AFTER_COPY if held and staged else held


def _refusal_error(kind: str, reason: str) -> ConnectorError:
    return BlocksMismatch(reason) if kind == REFUSED_BLOCKS else TokensMismatch(reason)


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
