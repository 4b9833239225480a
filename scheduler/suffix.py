"""Which of decode's logical blocks a load fills: the uncached suffix of each cache group."""

from __future__ import annotations

from collections.abc import Sequence

from connector.errors import TransferPlanError
from connector.layout import GroupKind, GroupSpec
from connector.metadata import BlockIds

_SSM = GroupKind.SSM  # an Enum member read off its class costs ~0.5 µs on Python 3.11


def uncached_suffix_blocks(
    block_ids: Sequence[Sequence[int]],
    groups: tuple[GroupSpec, ...],
    *,
    num_cached_tokens: int,
    num_tokens: int,
) -> BlockIds:
    """Decode's blocks covering tokens [num_cached_tokens, num_tokens), per group.

    An attention group's block i holds tokens [i * block_size, (i + 1) * block_size), so the
    suffix is blocks [num_cached_tokens // block_size, ceil(num_tokens / block_size)).
    Example: block_size 16, 40 tokens, 16 cached -> blocks [1, 3) of the request's list.
    An SSM group holds one state per request, in its last block: that block, or none when
    nothing is left to load. Raises TransferPlanError if a group holds too few blocks.
    """
    if len(block_ids) != len(groups):
        raise TransferPlanError(
            f"the engine allocated {len(block_ids)} block group(s), the KV cache spec has "
            f"{len(groups)}"
        )
    if not 0 <= num_cached_tokens <= num_tokens:
        raise TransferPlanError(
            f"num_cached_tokens={num_cached_tokens} is outside [0, num_tokens={num_tokens}]"
        )
    if num_cached_tokens == num_tokens:
        return tuple(() for _ in groups)
    if len(groups) == 1:  # the usual model; this runs once per load in a step's metadata
        return (_group_suffix(0, block_ids[0], groups[0], num_cached_tokens, num_tokens),)
    return tuple(
        [
            _group_suffix(index, group_ids, group, num_cached_tokens, num_tokens)
            for index, (group_ids, group) in enumerate(zip(block_ids, groups, strict=True))
        ]
    )


def _group_suffix(
    index: int,
    group_ids: Sequence[int],
    group: GroupSpec,
    num_cached_tokens: int,
    num_tokens: int,
) -> tuple[int, ...]:
    if group.kind is _SSM:
        if not group_ids:
            raise TransferPlanError(f"cache group {index} (SSM) has no block for the state")
        return (group_ids[len(group_ids) - 1],)
    first_block = num_cached_tokens // group.block_size
    end_block = -(-num_tokens // group.block_size)
    if len(group_ids) < end_block:
        raise TransferPlanError(
            f"cache group {index}: {len(group_ids)} block(s) of {group.block_size} tokens "
            f"cannot hold {num_tokens} tokens (need {end_block})"
        )
    return tuple(group_ids[first_block:end_block])  # a copy: the engine keeps its lists


def held_blocks(
    block_ids: Sequence[Sequence[int]], groups: tuple[GroupSpec, ...], num_tokens: int
) -> BlockIds | None:
    """The blocks to hold so a reader can pull tokens [0, num_tokens) (decode in
    bidirectional mode, for a later turn; prefill, for a prompt it computed past); None when
    there is nothing a pull could use.

    Only full-attention and MLA groups hold every token's KV; a sliding window or an SSM
    state holds the sequence's end only, which a longer next prompt cannot start from.
    """
    if num_tokens <= 0 or any(group.kind not in PULLABLE_KINDS for group in groups):
        return None
    try:
        return uncached_suffix_blocks(block_ids, groups, num_cached_tokens=0, num_tokens=num_tokens)
    except TransferPlanError:
        return None


PULLABLE_KINDS = (GroupKind.FULL, GroupKind.MLA)
