"""Lease ids: random 64-bit ids as 16 hex digits, drawn from os.urandom in batches."""

from __future__ import annotations

import string

import pytest

from scheduler.producer import LeaseIds


def test_lease_ids_are_16_hex_digits_and_never_repeat_across_batches() -> None:
    ids = LeaseIds()
    drawn = [ids.draw() for _ in range(3 * LeaseIds.BATCH + 1)]  # refills the batch 3 times
    assert all(len(i) == 16 and set(i) <= set(string.hexdigits.lower()) for i in drawn)
    assert len(set(drawn)) == len(drawn)


def test_each_batch_is_one_urandom_call(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[int] = []

    def urandom(num_bytes: int) -> bytes:
        calls.append(num_bytes)
        return (bytes(range(256)) * (num_bytes // 256 + 1))[:num_bytes]

    monkeypatch.setattr("scheduler.producer.os.urandom", urandom)
    ids = LeaseIds()
    drawn = [ids.draw() for _ in range(LeaseIds.BATCH + 1)]
    assert calls == [8 * LeaseIds.BATCH, 8 * LeaseIds.BATCH]
    assert drawn[0] == "0001020304050607" and drawn[1] == "08090a0b0c0d0e0f"
