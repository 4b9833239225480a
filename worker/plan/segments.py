"""Stage 1 of the recipe (worker/plan/recipe.py): cut a request into token segments per cache group.

A *segment* is a token range [a, b) that stays inside one kernel block on both sides: the
token range is cut at every multiple of either side's kernel block size. Example, decode
kernel 16, prefill kernel 8, tokens [4, 30)::

    cuts:      4     8     16    24   30
    segments:  [4,8) [8,16) [16,24) [24,30)
    decode:    kb0   kb0    kb1     kb1       (kernel block of the decode side)
    prefill:   kb0   kb1    kb2     kb3

Within a segment a token's slot is ``t % kernel_block_size`` on each side, so the bytes of a
plane follow from the layout formula (connector/layout.py).

Which tokens a group reads, given decode's prefix hit ``c`` and the prompt length ``n``:

    FULL, MLA        [c, n)
    SLIDING_WINDOW   [max(c, n - window + 1), n)   (the next token's window,
                     connector.layout.window_read_start; ids of blocks before it may be
                     vLLM's null block)
    SSM              no tokens: prefill's last block (its state) -> decode's last block

A group whose block format is opaque (connector/layout.py BlockFormat) widens its range to
whole kernel blocks: the bytes of a token inside such a block are the kernel's business.

A request is untrusted input: every impossible count, out-of-pool id or repeated block raises
TransferPlanError naming the group, the side and the value (``check_request``).

Pure: ints and numpy arrays.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import numpy.typing as npt

from connector.errors import TransferPlanError
from connector.layout import GroupKind, window_read_start
from worker.plan.pairing import Int64Array

if TYPE_CHECKING:  # annotations only: no import at run time
    from worker.plan.pairing import GroupPairing, SideBlocks


Mask = npt.NDArray[np.bool_]  # per segment of a group: selected or not


@dataclass(frozen=True)
class Segments:
    """Token segments of one group, each inside one kernel block on both sides."""

    local_blocks: Int64Array  # decode kernel block id
    local_slots: Int64Array  # token slot of the segment's first token in that block
    remote_blocks: Int64Array
    remote_slots: Int64Array
    num_tokens: Int64Array  # tokens in the segment
    # Where known (both sides cut tokens alike), the positions of the segments shorter than
    # a kernel block: a hint that spares the hot path a comparison; None: unknown.
    partial_at: tuple[int, ...] | None = None

    def where(self, mask: Mask) -> Segments:
        """The segments ``mask`` selects."""
        return Segments(
            self.local_blocks[mask],
            self.local_slots[mask],
            self.remote_blocks[mask],
            self.remote_slots[mask],
            self.num_tokens[mask],
        )


RequestSegments = tuple[Segments | None, ...]  # per cache group; None: the group reads nothing


def cut_segments(
    groups: Sequence[GroupPairing],
    local_block_ids: Sequence[Sequence[int]],
    remote_block_ids: Sequence[Sequence[int]],
    *,
    num_tokens: int,
    num_cached_tokens: int,
) -> RequestSegments:
    """Validate a request and cut it into token segments per group (None: nothing read).

    ``local_block_ids[g]``: decode's logical blocks covering [num_cached_tokens, num_tokens);
    ``remote_block_ids[g]``: prefill's logical blocks covering [0, num_tokens).
    """
    check_request(groups, local_block_ids, remote_block_ids, num_tokens, num_cached_tokens)
    return tuple(
        _group_segments(
            g, local_block_ids[g.index], remote_block_ids[g.index], num_tokens, num_cached_tokens
        )
        for g in groups
    )


def leading_remote_blocks(
    groups: Sequence[GroupPairing], remote_block_ids: Sequence[Sequence[int]], num_tokens: int
) -> tuple[Sequence[int], ...]:
    """The remote blocks covering tokens [0, num_tokens), per group: the leading ones.

    A pull from decode (multi-turn) reads fewer tokens than decode's blocks hold (its
    answer, a prompt that diverges): its block size is the remote's, known only here.
    Block size 16, 40 tokens, ids [7, 8, 9, 4] -> [7, 8, 9]. SSM groups pass unchanged;
    a group with too few blocks too (``cut_segments`` refuses it with the counts).
    """
    return tuple(
        ids if g.kind is GroupKind.SSM else ids[: ceil_div(num_tokens, g.remote.block_size)]
        for g, ids in zip(groups, remote_block_ids, strict=False)
    ) + tuple(remote_block_ids[len(groups) :])


def _group_segments(
    g: GroupPairing,
    local_ids: Sequence[int],
    remote_block_ids: Sequence[int],
    num_tokens: int,
    num_cached: int,
) -> Segments | None:
    if g.kind is GroupKind.SSM:
        if not local_ids:
            return None
        local_block = used_ids(g, "decode", local_ids, len(local_ids) - 1, len(local_ids), g.local)
        num_remote = len(remote_block_ids)
        remote_block = used_ids(
            g, "prefill", remote_block_ids, num_remote - 1, num_remote, g.remote
        )
        return one_segment(int(local_block[0]), int(remote_block[0]), num_tokens=1)
    start = num_cached
    if g.kind is GroupKind.SLIDING_WINDOW and g.window is not None:
        start = max(num_cached, window_read_start(num_tokens, g.window))
    if start >= num_tokens:
        return None
    end = num_tokens
    if g.whole_blocks:
        start, end = _whole_kernel_blocks(start, num_tokens, g.local.kernel_block_size)
    local_first = num_cached // g.local.block_size
    local_lo, local_hi = start // g.local.block_size, ceil_div(num_tokens, g.local.block_size)
    remote_lo, remote_hi = start // g.remote.block_size, ceil_div(num_tokens, g.remote.block_size)
    local_used = used_ids(
        g, "decode", local_ids, local_lo - local_first, local_hi - local_first, g.local
    )
    remote_used = used_ids(g, "prefill", remote_block_ids, remote_lo, remote_hi, g.remote)
    if g.local.block_size == g.remote.block_size and g.local.ratio == g.remote.ratio:
        return same_blocks_segments(start, end, g.local, local_used, remote_used, local_lo)
    return token_segments(
        start, end, g.local, g.remote, local_used, local_lo, remote_used, remote_lo
    )


def same_blocks_segments(
    start: int,
    end: int,
    blocks: SideBlocks,
    local_used: Int64Array,
    remote_used: Int64Array,
    first_logical: int,
) -> Segments:
    """token_segments when both sides cut tokens alike (same logical and kernel block sizes):
    one segment per kernel block, fewer numpy calls on the hot path. ``*_used`` are the
    logical ids of blocks [first_logical, ...) covering [start, end) on each side.

    Kernel 4, ratio 2, tokens [6, 15): kernel positions 1..3, i.e. (logical 0, kernel 1),
    (logical 1, kernel 0), (logical 1, kernel 1); tokens per segment 2, 4, 3; first slot 2.
    """
    kernel = blocks.kernel_block_size
    first, last = start // kernel, (end - 1) // kernel
    if blocks.ratio == 1:  # kernel positions are the logical blocks themselves
        local_blocks, remote_blocks = local_used, remote_used
    else:
        positions = np.arange(first, last + 1, dtype=np.int64)
        logical = positions // blocks.ratio - first_logical
        within = positions % blocks.ratio
        local_blocks = local_used[logical] * blocks.ratio + within
        remote_blocks = remote_used[logical] * blocks.ratio + within
    head, tail = start - first * kernel, (last + 1) * kernel - end  # tokens cut off each end
    num_tokens = np.full(last + 1 - first, kernel, dtype=np.int64)
    slots = np.zeros(len(num_tokens), dtype=np.int64)
    if head:
        num_tokens[0] -= head
        slots[0] = head
    if tail:
        num_tokens[-1] -= tail
    last_at = len(num_tokens) - 1
    partial_at = ((0,) if head else ()) + ((last_at,) if tail and (last_at or not head) else ())
    return Segments(local_blocks, slots, remote_blocks, slots, num_tokens, partial_at)


def _whole_kernel_blocks(start: int, end: int, kernel_block_size: int) -> tuple[int, int]:
    """[start, end) widened to the kernel blocks holding it, for opaque block formats.

    Kernel 4, tokens [6, 9) -> [4, 12): blocks 1 and 2 whole. The widening stays inside
    blocks both sides already hold (a prefix hit and the window start stay block-aligned
    below, the last partial block is allocated above), and the slots past the prompt hold
    nothing decode reads before it writes them itself.
    """
    first = start // kernel_block_size * kernel_block_size
    return first, ceil_div(end, kernel_block_size) * kernel_block_size


def _cuts(start: int, end: int, local_kernel: int, remote_kernel: int) -> Int64Array:
    """[start, every kernel boundary of either side inside (start, end), end]."""
    small, large = sorted((local_kernel, remote_kernel))
    if large % small == 0:
        inner = np.arange((start // small + 1) * small, end, small, dtype=np.int64)
    else:
        inner = np.union1d(
            np.arange((start // small + 1) * small, end, small, dtype=np.int64),
            np.arange((start // large + 1) * large, end, large, dtype=np.int64),
        )
    return np.concatenate(([start], inner, [end])).astype(np.int64, copy=False)


def _kernel_blocks(
    starts: Int64Array, side: SideBlocks, logical_ids: Int64Array, first_logical: int
) -> tuple[Int64Array, Int64Array]:
    """(kernel block id, slot) of each token position; ``logical_ids[0]`` is logical block ``first_logical``."""
    logical = logical_ids[starts // side.block_size - first_logical]
    within = starts % side.block_size
    return logical * side.ratio + within // side.kernel_block_size, starts % side.kernel_block_size


def token_segments(
    start: int,
    end: int,
    local: SideBlocks,
    remote: SideBlocks,
    local_ids: Int64Array,
    local_first_logical: int,
    remote_block_ids: Int64Array,
    remote_first_logical: int,
) -> Segments:
    """Segments of tokens [start, end) (non-empty) given each side's logical block ids."""
    cuts = _cuts(start, end, local.kernel_block_size, remote.kernel_block_size)
    starts = cuts[:-1]
    local_blocks, local_slots = _kernel_blocks(starts, local, local_ids, local_first_logical)
    remote_blocks, remote_slots = _kernel_blocks(
        starts, remote, remote_block_ids, remote_first_logical
    )
    return Segments(local_blocks, local_slots, remote_blocks, remote_slots, np.diff(cuts))


def one_segment(local_block: int, remote_block: int, *, num_tokens: int) -> Segments:
    """A single segment from slot 0 of each block (an SSM state block: one token)."""
    zero = np.zeros(1, dtype=np.int64)
    return Segments(zero + local_block, zero, zero + remote_block, zero, zero + num_tokens)


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def check_request(
    groups: Sequence[GroupPairing],
    local_block_ids: Sequence[Sequence[int]],
    remote_block_ids: Sequence[Sequence[int]],
    num_tokens: int,
    num_cached_tokens: int,
) -> None:
    """Raise TransferPlanError unless every group holds the blocks tokens
    [num_cached_tokens, num_tokens) need on decode and [0, num_tokens) on prefill."""
    if num_tokens <= 0 or not 0 <= num_cached_tokens <= num_tokens:
        raise TransferPlanError(
            f"num_tokens={num_tokens} and num_cached_tokens={num_cached_tokens}: need "
            "0 <= num_cached_tokens <= num_tokens and num_tokens > 0"
        )
    for side, ids in (("decode", local_block_ids), ("prefill", remote_block_ids)):
        if len(ids) != len(groups):
            raise TransferPlanError(
                f"{side} block ids have {len(ids)} groups, the layout has {len(groups)}"
            )
    for g in groups:
        num_local, num_remote = len(local_block_ids[g.index]), len(remote_block_ids[g.index])
        _check_counts(g, num_local, num_remote, num_tokens, num_cached_tokens)


def _check_counts(
    g: GroupPairing, num_local: int, num_remote: int, num_tokens: int, num_cached: int
) -> None:
    if g.kind is GroupKind.SSM:
        if num_local > 0 and num_remote == 0:
            raise TransferPlanError(
                f"group {g.index} (SSM): decode has a state block but prefill sent none"
            )
        return
    if num_cached % g.local.block_size != 0:
        raise TransferPlanError(
            f"group {g.index}: num_cached_tokens={num_cached} is not a multiple of decode's block "
            f"size {g.local.block_size}; a prefix hit covers whole blocks"
        )
    expected_local = ceil_div(num_tokens, g.local.block_size) - num_cached // g.local.block_size
    expected_remote = ceil_div(num_tokens, g.remote.block_size)
    if num_local != expected_local or num_remote != expected_remote:
        raise TransferPlanError(
            f"group {g.index}: for tokens [{num_cached}, {num_tokens}) decode needs {expected_local} "
            f"blocks of {g.local.block_size} tokens and got {num_local}; prefill needs {expected_remote} "
            f"blocks of {g.remote.block_size} tokens for [0, {num_tokens}) and got {num_remote}"
        )


def used_ids(
    g: GroupPairing, side: str, ids: Sequence[int], lo: int, hi: int, blocks: SideBlocks
) -> Int64Array:
    """ids[lo:hi] as an array; each must be a distinct block of the side's pool.

    Hot path: ascending ids (the common allocation) cost one comparison, their ends bound
    them and they cannot repeat; other ids are sorted (short lists) or counted (long ones).
    """
    if isinstance(ids, np.ndarray):
        used = ids[lo:hi].astype(np.int64, copy=False)
    else:
        used = _int64s(g, side, ids[lo:hi])
    if len(used) == 0:
        return used
    ascending = len(used) == 1 or np.count_nonzero(used[1:] <= used[:-1]) == 0
    ordered = used if ascending else None
    if ordered is None and len(used) <= SORT_MAX_IDS:
        ordered = np.sort(used)
    low, high = (ordered[0], ordered[-1]) if ordered is not None else (used.min(), used.max())
    if low < 0 or high >= blocks.num_blocks:
        bad = used[(used < 0) | (used >= blocks.num_blocks)]
        raise TransferPlanError(
            f"group {g.index}: {side} block id {int(bad[0])} is outside the pool [0, {blocks.num_blocks})"
        )
    repeated = _first_repeat(used, ordered, int(high)) if ordered is not used else None
    if repeated is not None:
        raise TransferPlanError(
            f"group {g.index}: {side} block ids repeat block {repeated}; "
            "each block of a request must be distinct"
        )
    return used


def _int64s(g: GroupPairing, side: str, ids: Sequence[int]) -> Int64Array:
    """Python ints as a read-only int64 array. struct packs a tuple of ints 3-4x faster than
    np.fromiter iterates it (2,048 ids: 9 us against 30)."""
    try:
        return np.frombuffer(struct.pack(f"{len(ids)}q", *ids), dtype=np.int64)
    except struct.error as error:
        raise TransferPlanError(
            f"group {g.index}: {side} block ids must be integers within int64 ({error})"
        ) from None


SORT_MAX_IDS = 256  # up to here sorting finds repeats fastest; past it, counting (if dense)


def _first_repeat(ids: Int64Array, ordered: Int64Array | None, high: int) -> int | None:
    """The smallest id that occurs twice in ``ids`` (all in [0, high]), or None; ``ordered``
    is ``ids`` sorted, if at hand.

    Counting costs O(high), sorting O(n log n): count when the ids are dense enough
    (2,048 ids in a pool of 16k: 7 us against 40).
    """
    if ordered is None and high < 32 * len(ids):
        counts = np.bincount(ids)
        return int(np.argmax(counts > 1)) if counts.max() > 1 else None
    if ordered is None:
        ordered = np.sort(ids)
    same = ordered[1:] == ordered[:-1]
    return int(ordered[1:][same][0]) if np.count_nonzero(same) else None
