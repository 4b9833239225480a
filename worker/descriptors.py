"""Validate what callers hand a NIXL agent: regions, READ descriptor pairs, remote agent names.

Shared by the real agent and FakeNixl so both reject bad input with the same messages
(tests/test_nixl_contract.py holds them to it); pure numpy, no nixl import.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence

import numpy as np
import numpy.typing as npt

from connector.errors import TransferFailed
from worker.nixl_api import Descriptors, Indices, StridedRows


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


def check_known_remote(agent_name: str, remote_agent: str, known: Collection[str]) -> None:
    """Raise TransferFailed unless agent ``agent_name`` loaded ``remote_agent``'s metadata."""
    if remote_agent not in known:
        raise TransferFailed(
            f"unknown remote agent {remote_agent!r}: agent {agent_name!r} has not loaded "
            f"its metadata (known: {sorted(known)}). Handshake first"
        )


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


def checked_strided_rows(rows: StridedRows) -> StridedRows:
    """A prepared list's rows as a fresh (M, 5) int64 array, M > 0, every field sane."""
    checked = np.array(rows, dtype=np.int64)
    if checked.ndim != 2 or checked.shape[1] != 5 or len(checked) == 0:
        raise TransferFailed(
            f"prepared list rows have shape {checked.shape}; expected (M, 5) rows of "
            "(address, length_bytes, device_id, stride_bytes, count), M > 0"
        )
    if (checked[:, 1] <= 0).any() or (checked[:, 3] <= 0).any() or (checked[:, 4] <= 0).any():
        raise TransferFailed(
            "prepared list rows need positive length_bytes, stride_bytes and count"
        )
    return checked


def list_entries(rows: StridedRows) -> int:
    """How many entries (indices) a prepared list of these rows has."""
    return int(rows[:, 4].sum())


INT32_LIMIT = 2**31  # NIXL's indices are int32: a list's entries past this cannot be read


def checked_indices(
    local_entries: int, local: Indices, remote_entries: int, remote: Indices
) -> tuple[npt.NDArray[np.int32], npt.NDArray[np.int32]]:
    """Both index arrays as int32 (NIXL's index type), equally long, non-empty and inside
    their lists; int32 input is not copied."""
    local_idx = np.asarray(local).ravel()
    remote_idx = np.asarray(remote).ravel()
    if len(local_idx) != len(remote_idx) or len(local_idx) == 0:
        raise TransferFailed(
            f"a READ by index needs as many local as remote indices, at least one: got "
            f"{len(local_idx)} local and {len(remote_idx)} remote"
        )
    for side, indices, entries in (
        ("local", local_idx, local_entries),
        ("remote", remote_idx, remote_entries),
    ):
        if indices.dtype.kind not in "iu":
            raise TransferFailed(f"{side} indices have dtype {indices.dtype}; pass integer indices")
        low, high = int(indices.min()), int(indices.max())
        if low < 0 or high >= min(entries, INT32_LIMIT):
            bad = low if low < 0 else high
            raise TransferFailed(
                f"{side} index {bad} is outside the prepared list of {entries} entries; "
                "prepare the list again after the peer's handshake"
            )
    return local_idx.astype(np.int32, copy=False), remote_idx.astype(np.int32, copy=False)


def expand(rows: StridedRows, indices: Indices) -> Descriptors:
    """The (N, 3) descriptors that entries ``indices`` of a prepared list stand for."""
    firsts = np.cumsum(rows[:, 4]) - rows[:, 4]
    row = np.searchsorted(firsts, indices, side="right") - 1
    expanded = np.empty((len(indices), 3), dtype=np.int64)
    expanded[:, 0] = rows[row, 0] + (indices - firsts[row]) * rows[row, 3]
    expanded[:, 1] = rows[row, 1]
    expanded[:, 2] = rows[row, 2]
    return expanded
