"""TP mapping: tp_ratio, read_sources, expected_notifications and their consistency."""

from __future__ import annotations

import pytest

from connector.errors import UnsupportedConfiguration
from worker.topology import (
    ReadSource,
    covered_ranks,
    expected_notifications,
    read_sources,
    tp_ratio,
)


@pytest.mark.parametrize(
    ("local_tp", "remote_tp", "expected"),
    [(1, 1, 1), (4, 2, 2), (8, 1, 8), (2, 4, -2), (1, 8, -8)],
    ids=["equal", "decode-larger", "decode-8x", "prefill-larger", "prefill-8x"],
)
def test_tp_ratio(local_tp, remote_tp, expected):
    assert tp_ratio(local_tp, remote_tp) == expected


@pytest.mark.parametrize(
    ("local_tp", "remote_tp", "message"),
    [
        (3, 2, "decode TP 3 and prefill TP 2 do not divide one another"),
        (4, 6, "decode TP 4 and prefill TP 6 do not divide"),
        (0, 2, r"must be in 1\.\.65536, got local 0 and remote 2; pass each engine's"),
        (2, -4, r"must be in 1\.\.65536, got local 2 and remote -4"),
        (2**40, 1, r"must be in 1\.\.65536, got local 1099511627776 and remote 1"),
        (2.0, 1, "local_tp must be an integer, got float 2.0"),
        (1, True, "remote_tp must be an integer, got bool True"),
        (1, "2", "remote_tp must be an integer, got str '2'"),
    ],
    ids=["3-over-2", "4-under-6", "zero", "negative", "huge", "float", "bool", "string"],
)
def test_tp_ratio_rejects(local_tp, remote_tp, message):
    with pytest.raises(UnsupportedConfiguration, match=message):
        tp_ratio(local_tp, remote_tp)


def _sources(local_rank, local_tp, remote_tp, heads, replicated=False):
    return read_sources(local_rank, local_tp, remote_tp, heads, replicated=replicated)


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        ((0, 1, 1, 8), [ReadSource(0, range(8), range(8))]),
        # decode TP 4 > prefill TP 2: a head slice of one rank.
        ((1, 4, 2, 8), [ReadSource(0, range(0, 2), range(2, 4))]),
        ((3, 4, 2, 8), [ReadSource(1, range(0, 2), range(2, 4))]),
        # prefill TP 4 > decode TP 2: several ranks into local head slices.
        (
            (1, 2, 4, 8),
            [ReadSource(2, range(0, 2), range(0, 2)), ReadSource(3, range(2, 4), range(0, 2))],
        ),
        ((0, 1, 4, 8), [ReadSource(r, range(2 * r, 2 * r + 2), range(0, 2)) for r in range(4)]),
        # TP > heads: prefill TP 4 with 2 heads (ranks 0,1 hold head 0); decode TP 1 reads each
        # head once.
        (
            (0, 1, 4, 2),
            [ReadSource(0, range(0, 1), range(0, 1)), ReadSource(2, range(1, 2), range(0, 1))],
        ),
        # decode TP 4 with 2 heads: decode ranks 0 and 1 both hold head 0 and spread over replicas.
        ((1, 4, 4, 2), [ReadSource(1, range(1), range(1))]),
        ((3, 4, 1, 2), [ReadSource(0, range(0, 1), range(1, 2))]),
        # MLA: one rank serves the whole latent.
        ((0, 1, 4, 1, True), [ReadSource(0, range(1), range(1))]),
        ((1, 2, 4, 1, True), [ReadSource(2, range(1), range(1))]),
        ((3, 4, 2, 1, True), [ReadSource(1, range(1), range(1))]),
    ],
    ids=[
        "same-tp",
        "decode-larger-rank1",
        "decode-larger-rank3",
        "prefill-larger-rank1",
        "prefill-4x-into-1",
        "prefill-tp-over-heads",
        "decode-tp-over-heads",
        "decode-tp-over-heads-vs-tp1",
        "mla-decode-1-prefill-4",
        "mla-decode-2-prefill-4",
        "mla-decode-4-prefill-2",
    ],
)
def test_read_sources(args, expected):
    assert _sources(*args) == expected


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        ((0, 1, 4, 1, True), [0, 1, 2, 3]),  # seed 002: notification-only to ranks 1..3
        ((1, 2, 4, 1, True), [2, 3]),
        ((0, 1, 4, 2), [0, 1, 2, 3]),  # replicated heads: ranks 1 and 3 notified, not read
        ((2, 4, 4, 2), [2, 3]),
        ((1, 4, 2, 8), [0]),
    ],
    ids=[
        "mla-1-from-4",
        "mla-2-from-4",
        "replicated-heads-1-from-4",
        "replicated-heads-4-from-4",
        "slice",
    ],
)
def test_covered_ranks(args, expected):
    local_rank, local_tp, remote_tp, heads, *rest = args
    assert (
        covered_ranks(local_rank, local_tp, remote_tp, heads, replicated=bool(rest and rest[0]))
        == expected
    )


PAIRS = [(1, 1), (1, 2), (2, 1), (2, 4), (4, 2), (1, 4), (4, 1), (8, 2), (2, 8)]
HEADS = [1, 2, 4, 8]


@pytest.mark.parametrize("replicated", [False, True], ids=["sharded", "mla"])
@pytest.mark.parametrize("heads", HEADS, ids=[f"{h}-heads" for h in HEADS])
@pytest.mark.parametrize(("local_tp", "remote_tp"), PAIRS, ids=[f"d{d}-p{p}" for d, p in PAIRS])
def test_notifications_match_coverage_and_reads_cover_every_head(
    local_tp, remote_tp, heads, replicated
):
    covering = {r: 0 for r in range(remote_tp)}
    for rank in range(local_tp):
        sources = _sources(rank, local_tp, remote_tp, heads, replicated)
        covered = covered_ranks(rank, local_tp, remote_tp, heads, replicated=replicated)
        assert {s.remote_rank for s in sources} <= set(covered)
        local_heads = sorted(h for s in sources for h in s.local_heads)
        assert local_heads == list(range(len(local_heads))) and local_heads  # every local head once
        for remote_rank in covered:
            covering[remote_rank] += 1
    for remote_rank, count in covering.items():
        assert count >= 1, f"prefill rank {remote_rank} is never notified"
        assert (
            expected_notifications(remote_rank, local_tp, remote_tp, heads, replicated=replicated)
            == count
        )


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda: read_sources(0, 4, 6, 12), "decode TP 4 and prefill TP 6"),
        (
            lambda: read_sources(0, 1, 4, 6),
            "6 KV heads cannot be split over tensor-parallel size 4",
        ),
        (lambda: read_sources(2, 2, 1, 8), "local rank 2 is not a rank of TP size 2"),
        (lambda: read_sources(0, 1, 1, 0), r"num_kv_heads must be in 1\.\.1048576, got 0"),
        (lambda: read_sources(0, 1, 1, 2**30), r"num_kv_heads must be in 1\.\.1048576, got"),
        (lambda: read_sources(0, 1, 1, 8.0), "num_kv_heads must be an integer, got float 8.0"),
        (lambda: read_sources(-1, 2, 1, 8), "local rank -1 is not a rank of TP size 2"),
        (lambda: read_sources(None, 2, 1, 8), "local_rank must be an integer, got NoneType None"),
        (lambda: expected_notifications(4, 1, 4, 8), "remote rank 4 is not a rank of TP size 4"),
        (
            lambda: expected_notifications(0, 10**9, 1, 8),
            r"must be in 1\.\.65536, got local 1000000000",
        ),
        (lambda: expected_notifications("0", 1, 4, 8), "remote_rank must be an integer, got str"),
        (lambda: covered_ranks(0, 1, 0, 8), r"must be in 1\.\.65536, got local 1 and remote 0"),
    ],
    ids=[
        "tp-not-divisible",
        "heads-not-divisible",
        "rank-out-of-range",
        "zero-heads",
        "huge-heads",
        "float-heads",
        "negative-rank",
        "rank-none",
        "remote-rank-out-of-range",
        "huge-local-tp-never-loops",
        "remote-rank-string",
        "zero-remote-tp",
    ],
)
def test_topology_rejects(call, message):
    with pytest.raises(UnsupportedConfiguration, match=message):
        call()
