"""Validate what callers hand a NIXL agent: regions to register and READ descriptor pairs.

Shared by the real agent and FakeNixl so both reject bad input with the same messages
(tests/test_nixl_contract.py holds them to it); pure numpy, no nixl import.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from connector.errors import TransferFailed
from worker.nixl_api import Descriptors


def checked_regions(regions: Sequence[tuple[int, int]]) -> tuple[tuple[int, int], ...]:
    """(address, length_bytes) pairs, each positive; raises TransferFailed."""
    if not regions:
        raise TransferFailed("no memory regions to register; pass (address, length_bytes) pairs")
    for address, length_bytes in regions:
        if address <= 0 or length_bytes <= 0:
            raise TransferFailed(
                f"cannot register region (address={address}, length_bytes={length_bytes}): "
                "both must be positive"
            )
    return tuple((int(address), int(length_bytes)) for address, length_bytes in regions)


def checked_read_descriptors(
    local: Descriptors, remote: Descriptors
) -> tuple[Descriptors, Descriptors]:
    """Both lists as fresh (N, 3) int64 arrays, N > 0, with equal per-descriptor lengths."""
    local_rows = _descriptor_rows(local, "local")
    remote_rows = _descriptor_rows(remote, "remote")
    if len(local_rows) != len(remote_rows):
        raise TransferFailed(
            f"descriptor count mismatch: {len(local_rows)} local vs {len(remote_rows)} remote; "
            "a READ pairs remote[i] with local[i]"
        )
    mismatched = np.flatnonzero(local_rows[:, 1] != remote_rows[:, 1])
    if len(mismatched):
        i = int(mismatched[0])
        raise TransferFailed(
            f"descriptor length mismatch at index {i}: local {local_rows[i, 1]} bytes vs "
            f"remote {remote_rows[i, 1]} bytes ({len(mismatched)} mismatched in all)"
        )
    return local_rows, remote_rows


def _descriptor_rows(descriptors: Descriptors, side: str) -> Descriptors:
    rows = np.array(descriptors, dtype=np.int64)  # a copy: the caller may reuse its array
    if rows.ndim != 2 or rows.shape[1] != 3:
        raise TransferFailed(
            f"{side} descriptors have shape {rows.shape}; expected (N, 3) rows of "
            "(address, length_bytes, device_id)"
        )
    if len(rows) == 0:
        raise TransferFailed(
            f"empty {side} descriptor list: a READ needs at least one descriptor "
            "(use send_notif for a notification without data)"
        )
    if (rows[:, 1] <= 0).any():
        raise TransferFailed(f"{side} descriptors contain a non-positive length_bytes")
    return rows
