"""A failed load's outcome: a kind from one enum, and a message for people.

The kind travels with the message from where the failure is decided (a worker rank, the
scheduler's params check) to the engine: metrics label by it, code branches on it, and no code
reads the message's text. The message says what went wrong and what to do.
"""

from __future__ import annotations

import enum

import msgspec


class FailureKind(enum.StrEnum):
    """Why a load failed, bounded (a metrics label); each value is its label."""

    ABORTED = "aborted"  # the request ended first: no failure of the load itself
    HANDSHAKE = "handshake"  # prefill's side channel or agent could not be reached or paired
    HANDSHAKE_TIMEOUT = "handshake_timeout"
    PARAMS = "params"  # the kv_transfer_params were refused, or changed under the load
    PLAN = "plan"  # decode's blocks or the pairing cannot take this load
    TRANSFER = "transfer"  # a READ failed
    TRANSFER_TIMEOUT = "transfer_timeout"
    INTERNAL = "internal"  # a connector bug, contained to this request
    LEASE_EXPIRED = "lease_expired"  # prefill no longer held the lease when the READs landed
    PREFILL_RESTARTED = "prefill_restarted"  # the boot that leased is gone, its lease with it
    LEASE_UNPROVEN = "lease_unproven"  # prefill could not be asked, or the params name no lease
    DIGEST = "digest"  # verify_kv: the bytes read are not the bytes prefill saved
    TOKENS_MISMATCH = "tokens_mismatch"  # the lease holds other tokens than this prompt
    BLOCKS_MISMATCH = "blocks_mismatch"  # the load reads other blocks than the lease holds
    ENGINE = "engine"  # the engine reported the load failed before this rank did
    # Overlapped dispatch (docs/overlap.md): decode waited for prefill's lease announcement
    PREFILL_FAILED = "prefill_failed"  # prefill ended the request without a lease
    PREFILL_TIMEOUT = "prefill_timeout"  # no announcement within the wait (dead, never sent)


class LoadFailure(msgspec.Struct, frozen=True, forbid_unknown_fields=True, array_like=True):
    """One load's failure: its ``kind`` and a ``message`` saying what happened."""

    kind: FailureKind
    message: str

    def __str__(self) -> str:
        return self.message


ABORTED_LOAD = LoadFailure(FailureKind.ABORTED, "aborted")  # the request ended first


def one_failure(failures: dict[int, LoadFailure]) -> LoadFailure:
    """One failure for a request its ranks failed (tp_rank -> why): the ranks' shared one, or
    the lowest failing rank's kind with a message naming it."""
    reasons = set(failures.values())
    if len(reasons) == 1:
        return reasons.pop()
    rank = min(failures)
    first = failures[rank]
    return LoadFailure(
        first.kind,
        f"tp_rank {rank}: {first.message} ({len(failures) - 1} other rank(s) failed too)",
    )
