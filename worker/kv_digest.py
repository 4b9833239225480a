"""verify_kv: digests of a request's KV per (unit, model head), comparable across layouts.

A prefill rank digests the blocks it leased; a decode rank digests what it READ; prefill's
side channel sums its ranks' digests over exactly what the decode rank read and compares.
Both sides lay the KV out differently (block sizes, kernel splits, TP head slices, NHD/HND),
so a digest is taken of units both sides agree on:

- token-addressable block formats: one unit per token. Unit t, model head H: the head_bytes
  of (t, H) in every plane (layer, K/V) of the group, wherever each side keeps them;
- opaque block formats (moved whole between peers of one format): one unit per kernel block
  of the request (unit k covers tokens [k*kernel_block_size, (k+1)*kernel_block_size)), its
  bytes enumerated by the same geometry formula on both sides;
- SSM state groups: one unit, the request's state: the content bytes of its last block on each
  side (prefill's last leased block, decode's block the state is loaded into), never a page's
  padding, which each side may size differently.

A unit's digest is a keyed linear sum, sum(word_i * key_i) mod 2**64 over its 8-byte words
(its bytes where a head is not whole words), the keys odd numbers drawn by splitmix64 from
(group, plane, position): a wrong word always changes it (an odd key is invertible mod 2**64),
several wrong words leave it equal by chance only. Linear, so a range of units and heads sums
to one number: decode sends one uint64 per group. It guards against bugs and stale bytes, not
against an attacker who can write KV (the handshake is that gate). Pure: numpy in, numpy out.
"""

from __future__ import annotations

import ctypes
import functools
from collections.abc import Sequence

import numpy as np
import numpy.typing as npt

from connector.errors import UnsupportedConfiguration
from connector.layout import (
    GroupGeometry,
    GroupKind,
    PlaneGeometry,
    RankLayout,
    window_read_start,
)
from connector.metadata import GroupDigests
from connector.protocol import DigestClaim

Buffers = Sequence[npt.NDArray[np.uint8]]  # one byte array per region of a RankLayout
Table = npt.NDArray[np.uint64]  # digests [units, model heads of this rank]
_SEED = np.uint64(0x6E69786C2D706401)


def host_regions(
    addresses: Sequence[int], region_bytes: Sequence[int]
) -> list[npt.NDArray[np.uint8]]:
    """Byte views of registered host regions (the worker's own memory; no copy)."""
    return [
        np.ctypeslib.as_array((ctypes.c_uint8 * size).from_address(address))
        for address, size in zip(addresses, region_bytes, strict=True)
    ]


def check_digestible(layout: RankLayout) -> None:
    """Raise UnsupportedConfiguration where verify_kv cannot digest this layout."""
    for index, group in enumerate(layout.groups):
        heads = {model_heads(layout, plane) for plane in group.planes}
        if len(heads) > 1:
            raise UnsupportedConfiguration(
                f"verify_kv: the layers of cache group {index} hold different heads on rank "
                f"{layout.tp_rank}; verify_kv needs one head set per group"
            )


def model_heads(layout: RankLayout, plane: PlaneGeometry) -> tuple[int, ...]:
    """The model heads this rank holds of ``plane``, in its per-rank order.

    TP 4 over 2 KV heads: each head is replicated on 2 ranks; rank 3 holds model head 1.
    """
    if plane.replicated:
        return tuple(range(plane.num_heads))
    tp_size = layout.tp_size
    per_rank = plane.model_heads // tp_size if plane.model_heads >= tp_size else 1
    replicas = max(1, tp_size // plane.model_heads)
    first = (layout.tp_rank // replicas) * per_rank
    return tuple(range(first, first + plane.num_heads))


def unit_tokens(group: GroupGeometry) -> int:
    """Tokens per unit: 1, or a kernel block for an opaque format (the state for SSM)."""
    return 1 if group.block_format.token_addressable else group.kernel_block_size


def read_units(group: GroupGeometry, num_cached_tokens: int, num_tokens: int) -> range:
    """The units of a group decode reads for tokens [num_cached_tokens, num_tokens)."""
    if group.kind is GroupKind.SSM:  # one unit, the state, whenever tokens are left to load
        return range(1) if num_cached_tokens < num_tokens else range(0)
    start = num_cached_tokens
    if group.kind is GroupKind.SLIDING_WINDOW and group.window is not None:  # as the planner
        start = max(start, window_read_start(num_tokens, group.window))
    if start >= num_tokens:
        return range(0)
    per_unit = unit_tokens(group)
    return range(start // per_unit, -(-num_tokens // per_unit))


def digest_table(
    layout: RankLayout,
    buffers: Buffers,
    group_index: int,
    block_ids: Sequence[int],
    first_logical: int,
    units: range,
) -> Table:
    """Digests [len(units), heads of this rank] of ``units`` of one group.

    ``block_ids`` are the side's logical blocks of the group, the first of them logical block
    ``first_logical`` of the request (decode: the uncached suffix; prefill: 0).
    """
    group = layout.groups[group_index]
    tokens = _unit_token_grid(group, units)  # [units, tokens per unit]
    kernel_blocks, slots = _kernel_slots(group, block_ids, first_logical, tokens)
    num_heads = group.planes[0].num_heads if group.planes else 0
    total = np.zeros((len(units), num_heads), dtype=np.uint64)
    for plane_index, plane in enumerate(group.planes):
        # [units, tokens per unit, heads, head bytes]: the unit's bytes, copied once
        data = _plane_view(buffers[plane.region], group, plane)[kernel_blocks, slots]
        # whole words where a head is: 8x fewer products than bytes
        data = data.view(np.uint64) if plane.head_bytes % 8 == 0 else data.astype(np.uint64)
        keys = _keys(group_index, plane_index, tokens.shape[1] * data.shape[-1])
        keys = keys.reshape(tokens.shape[1], 1, data.shape[-1])
        with np.errstate(over="ignore"):
            total += (data * keys).sum(axis=(1, 3), dtype=np.uint64)
    return total


def _plane_view(
    region: npt.NDArray[np.uint8], group: GroupGeometry, plane: PlaneGeometry
) -> npt.NDArray[np.uint8]:
    """A read-only view [kernel blocks, slots, heads, head bytes] of one plane's bytes."""
    shape = (group.num_kernel_blocks, group.kernel_block_size, plane.num_heads, plane.head_bytes)
    strides = (
        plane.kernel_block_stride_bytes,
        plane.token_stride_bytes,
        plane.head_stride_bytes,
        1,
    )
    last_byte = (
        plane.offset_bytes + sum((n - 1) * st for n, st in zip(shape, strides, strict=True)) + 1
    )
    if last_byte > len(region):
        raise UnsupportedConfiguration(
            f"verify_kv: plane {plane.layer}/{plane.plane} reaches byte {last_byte} of a "
            f"{len(region)}-byte region; the registered memory does not match the layout"
        )
    return np.lib.stride_tricks.as_strided(
        region[plane.offset_bytes :], shape=shape, strides=strides, writeable=False
    )


def lease_digests(
    layout: RankLayout, buffers: Buffers, block_ids: Sequence[Sequence[int]], num_tokens: int
) -> tuple[GroupDigests, ...]:
    """Prefill: this rank's digests of a lease's blocks, per group."""
    tables = []
    for index, group in enumerate(layout.groups):
        units = read_units(group, 0, num_tokens)  # what the leased blocks hold
        if not units:
            continue
        table = digest_table(layout, buffers, index, block_ids[index], 0, units)
        heads = model_heads(layout, group.planes[0]) if group.planes else ()
        tables.append(GroupDigests(index, units.start, heads, table.astype("<u8").tobytes()))
    return tuple(tables)


def read_claims(
    layout: RankLayout,
    buffers: Buffers,
    block_ids: Sequence[Sequence[int]],
    num_cached_tokens: int,
    num_tokens: int,
) -> tuple[DigestClaim, ...]:
    """Decode: the digest sums of what this rank READ of a request, one claim per group."""
    claims = []
    for index, group in enumerate(layout.groups):
        units = read_units(group, num_cached_tokens, num_tokens)
        if not units or not group.planes:
            continue
        first_logical = num_cached_tokens // group.block_size
        table = digest_table(layout, buffers, index, block_ids[index], first_logical, units)
        total = int(table.sum(dtype=np.uint64))
        heads = model_heads(layout, group.planes[0])
        claims.append(DigestClaim(index, units.start, len(units), heads, total))
    return tuple(claims)


def _unit_token_grid(group: GroupGeometry, units: range) -> npt.NDArray[np.int64]:
    per_unit = unit_tokens(group)
    starts = np.arange(units.start, units.stop, dtype=np.int64) * per_unit
    return starts[:, None] + np.arange(per_unit, dtype=np.int64)


def _kernel_slots(
    group: GroupGeometry,
    block_ids: Sequence[int],
    first_logical: int,
    tokens: npt.NDArray[np.int64],
) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.int64]]:
    """(kernel block, slot) of each token, shaped like ``tokens``; an SSM group's one unit is
    slot 0 of its last block (earlier ids may be placeholders)."""
    ids = np.asarray(block_ids, dtype=np.int64)
    if group.kind is GroupKind.SSM:
        return np.full_like(tokens, ids[len(ids) - 1]), np.zeros_like(tokens)
    logical = ids[tokens // group.block_size - first_logical]
    kernel_block = logical * group.ratio + (tokens % group.block_size) // group.kernel_block_size
    return kernel_block, tokens % group.kernel_block_size


@functools.lru_cache(maxsize=1024)
def _keys(group_index: int, plane_index: int, length: int) -> npt.NDArray[np.uint64]:
    """splitmix64 of (group, plane, position): the same on every machine and numpy."""
    base = np.uint64((group_index * 4096 + plane_index) * 2**32)
    with np.errstate(over="ignore"):
        z = np.arange(length, dtype=np.uint64) + base + _SEED
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        keys = (z ^ (z >> np.uint64(31))) | np.uint64(1)  # odd: invertible mod 2**64
    keys.flags.writeable = False
    return keys
