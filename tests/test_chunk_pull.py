"""Decode's chunked pull: each announcement's READ, and refusal of any that does not extend
what was read under the same lease (the load must fail, never succeed on two leases' bytes)."""

from __future__ import annotations

from typing import Any

import msgspec
import pytest

from connector.metadata import RemoteSource
from scheduler.chunk_pull import ChunkedPull, ChunkRefused, Increment

LOCAL = ((100, 101, 102, 103, 104),)  # decode's blocks for 80 tokens (block size 16)


def _source(blocks: tuple[int, ...], **overrides: Any) -> RemoteSource:
    source = RemoteSource(
        engine_id="prefill-0",
        host="127.0.0.1",
        port=5600,
        tp_size=1,
        remote_request_id="p-1",
        remote_block_ids=(blocks,),
        boot_id="boot-a",
        lease_id="lease-a",
    )
    return msgspec.structs.replace(source, **overrides)


def _pull(num_cached_tokens: int = 0, num_tokens: int = 70) -> ChunkedPull:
    return ChunkedPull(LOCAL, (16,), num_cached_tokens=num_cached_tokens, num_tokens=num_tokens)


def test_chunks_then_the_final_read_every_token_once_into_the_matching_blocks() -> None:
    pull = _pull()
    assert pull.next(_source((0, 1)), 32, final=False) == Increment(
        0, 32, ((0, 1),), ((100, 101),), False
    )
    assert pull.next(_source((0, 1, 2, 3)), 64, final=False) == Increment(
        32, 64, ((2, 3),), ((102, 103),), False
    )
    assert pull.next(_source((0, 1, 2, 3, 4)), 70, final=True) == Increment(
        64, 70, ((4,),), ((104,),), True
    )
    assert pull.num_read_tokens == 70 and pull.lease_id == "lease-a"


def test_decodes_cached_prefix_is_not_read_and_an_announcement_inside_it_reads_nothing() -> None:
    pull = _pull(num_cached_tokens=32)
    assert pull.next(_source((0,)), 16, final=False) is None
    assert pull.next(_source((0, 1, 2)), 48, final=False) == Increment(
        32, 48, ((2,),), ((102,),), False
    )
    assert pull.next(_source((0, 1, 2, 3, 4)), 70, final=True) == Increment(
        48, 70, ((3, 4),), ((103, 104),), True
    )


def test_a_repeated_announcement_reads_nothing_new() -> None:
    pull = _pull()
    pull.next(_source((0, 1)), 32, final=False)
    assert pull.next(_source((0, 1)), 32, final=False) is None


def test_a_final_announcement_without_partials_reads_the_whole_load() -> None:
    pull = _pull(num_cached_tokens=16)
    assert pull.next(_source((0, 1, 2, 3, 4)), 70, final=True) == Increment(
        16, 70, ((1, 2, 3, 4),), ((101, 102, 103, 104),), True
    )


def test_a_new_lease_before_any_read_is_adopted() -> None:
    """Prefill was preempted after announcing blocks decode never read (within its cached
    prefix): the new lease's blocks are read instead."""
    pull = _pull(num_cached_tokens=32)
    assert pull.next(_source((0,)), 16, final=False) is None
    moved = _source((7, 8, 9, 10, 11), lease_id="lease-b")
    assert pull.next(moved, 70, final=True) == Increment(
        32, 70, ((9, 10, 11),), ((102, 103, 104),), True
    )
    assert pull.lease_id == "lease-b"


@pytest.mark.parametrize(
    ("overrides", "blocks"),
    [
        ({"lease_id": "lease-b"}, (0, 1, 2, 3, 4)),
        ({"boot_id": "boot-b"}, (0, 1, 2, 3, 4)),
        ({"remote_request_id": "p-2"}, (0, 1, 2, 3, 4)),
        ({"engine_id": "prefill-1"}, (0, 1, 2, 3, 4)),
        ({}, (5, 1, 2, 3, 4)),  # the same lease naming other blocks for what was read
        ({}, (1, 0, 2, 3, 4)),
    ],
    ids=[
        "new-lease",
        "restarted-boot",
        "other-request",
        "other-engine",
        "block-replaced",
        "reordered",
    ],
)
def test_after_a_read_an_announcement_that_does_not_extend_it_fails_the_load(
    overrides: dict[str, Any], blocks: tuple[int, ...]
) -> None:
    """Prefill preempted (or restarted) the request after decode READ a chunk: whatever the
    final params say, the load fails lease_expired."""
    pull = _pull()
    pull.next(_source((0, 1)), 32, final=False)
    with pytest.raises(ChunkRefused) as refused:
        pull.next(_source(blocks, **overrides), 70, final=True)
    assert refused.value.failure.kind == "lease_expired"
    assert refused.value.failure.message.startswith("chunked pull: ")


@pytest.mark.parametrize(
    ("announce", "kind", "message"),
    [
        ((((0, 1, 2),), 40, False), "lease_expired", "ends mid-block"),
        ((((0,),), 16, False), "lease_expired", "announced 16 tokens after 32"),
        ((((0, 1, 2, 3),), 64, True), "params", "holds 64 tokens; the load needs 70"),
        ((((0, 1),), 48, False), "params", "names 2 blocks for 48 tokens"),
    ],
    ids=["partial-mid-block", "fewer-tokens", "final-too-short", "too-few-blocks"],
)
def test_malformed_announcements_fail_the_load(
    announce: tuple[tuple[tuple[int, ...], ...], int, bool], kind: str, message: str
) -> None:
    pull = _pull()
    pull.next(_source((0, 1)), 32, final=False)
    blocks, num_tokens, final = announce
    with pytest.raises(ChunkRefused) as refused:
        pull.next(_source(blocks[0]), num_tokens, final=final)
    assert refused.value.failure.kind == kind and message in refused.value.failure.message


def test_nothing_is_read_after_the_final_announcement() -> None:
    pull = _pull()
    pull.next(_source((0, 1, 2, 3, 4)), 70, final=True)
    with pytest.raises(ChunkRefused, match="after the final one"):
        pull.next(_source((0, 1, 2, 3, 4)), 70, final=True)


def test_decode_with_too_few_blocks_fails_as_a_plan_failure() -> None:
    pull = ChunkedPull(((100, 101),), (16,), num_cached_tokens=0, num_tokens=70)
    with pytest.raises(ChunkRefused) as refused:
        pull.next(_source((0, 1, 2, 3, 4)), 70, final=True)
    assert refused.value.failure.kind == "plan"


def test_two_groups_advance_block_for_block() -> None:
    pull = ChunkedPull(
        ((100, 101, 102), (200, 201, 202)), (16, 16), num_cached_tokens=0, num_tokens=48
    )
    source = _source((0,), remote_block_ids=((0, 1), (5, 6)))
    assert pull.next(source, 32, final=False) == Increment(
        0, 32, ((0, 1), (5, 6)), ((100, 101), (200, 201)), False
    )
    wrong_groups = _source((0,), remote_block_ids=((0, 1, 2),))
    with pytest.raises(ChunkRefused, match="names 1 block groups"):
        pull.next(wrong_groups, 48, final=True)


def test_a_final_with_every_token_already_read_reads_nothing_but_still_ends_the_load() -> None:
    """The proof after it still runs: an empty final increment is not 'nothing to do'."""
    pull = _pull(num_tokens=64)
    pull.next(_source((0, 1, 2, 3)), 64, final=False)
    assert pull.next(_source((0, 1, 2, 3)), 64, final=True) == Increment(64, 64, ((),), ((),), True)
