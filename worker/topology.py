"""Tensor-parallel mapping: which remote ranks and heads a decode rank reads, and who notifies whom.

Head placement (connector.geometry.heads_per_rank): with ``H`` model heads over ``tp`` ranks,
rank ``r`` holds ``hpr = max(1, H // tp)`` heads starting at model head ``(r // rep) * hpr``,
where ``rep = max(1, tp // H)`` ranks share (replicate) each head group.

Example, H = 8, decode TP 4 reading prefill TP 2 (decode holds 2 heads, prefill 4)::

    prefill rank 0: heads 0..3      prefill rank 1: heads 4..7
    decode 0: 0,1  decode 1: 2,3    decode 2: 4,5  decode 3: 6,7
    decode 1 reads remote heads [2, 4) of prefill rank 0 into its local heads [0, 2).

A decode rank *covers* every remote rank that holds one of its heads (for replicated MLA
planes, every remote rank whose share of ``max(local_tp, remote_tp)`` virtual slices overlaps
its own). It reads each head from one covering replica and sends notification-only messages
to the rest, so every remote rank hears from exactly the decode ranks that cover it.
"""

from __future__ import annotations

import numbers
from collections.abc import Iterable
from dataclasses import dataclass

from connector.errors import UnsupportedConfiguration
from connector.geometry import heads_per_rank
from connector.layout import RankLayout
from connector.params import short_repr

MAX_TP_SIZE = 65536  # as kv_transfer_params' tp_size; loops here are linear in it
MAX_KV_HEADS = 2**20


@dataclass(frozen=True)
class ReadSource:
    """Read ``remote_heads`` (per-rank head indices) of ``remote_rank`` into ``local_heads``."""

    remote_rank: int
    local_heads: range
    remote_heads: range


def tp_ratio(local_tp: int, remote_tp: int) -> int:
    """``local // remote`` when local >= remote, else ``-(remote // local)``."""
    _check_int("local_tp", local_tp)
    _check_int("remote_tp", remote_tp)
    if local_tp <= 0 or remote_tp <= 0 or max(local_tp, remote_tp) > MAX_TP_SIZE:
        raise UnsupportedConfiguration(
            f"tensor-parallel sizes must be in 1..{MAX_TP_SIZE}, got local {short_repr(local_tp)} "
            f"and remote {short_repr(remote_tp)}; pass each engine's tensor_parallel_size"
        )
    if max(local_tp, remote_tp) % min(local_tp, remote_tp) != 0:
        raise UnsupportedConfiguration(
            f"decode TP {local_tp} and prefill TP {remote_tp} do not divide one another; "
            "choose sizes where the larger is a multiple of the smaller"
        )
    return local_tp // remote_tp if local_tp >= remote_tp else -(remote_tp // local_tp)


@dataclass(frozen=True)
class _Placement:
    """Where one side's heads live: rank r holds [first_head(r), first_head(r) + heads)."""

    heads: int  # per rank
    replicas: int  # ranks holding the same head group

    def first_head(self, rank: int) -> int:
        return (rank // self.replicas) * self.heads

    def holders(self, head_group: int) -> range:
        return range(head_group * self.replicas, (head_group + 1) * self.replicas)


def _placement(num_kv_heads: int, tp_size: int) -> _Placement:
    return _Placement(heads_per_rank(num_kv_heads, tp_size), max(1, tp_size // num_kv_heads))


def _check_int(name: str, value: object) -> None:
    if not isinstance(value, numbers.Integral) or isinstance(value, bool):
        raise UnsupportedConfiguration(
            f"{name} must be an integer, got {type(value).__name__} {short_repr(value)}"
        )


def _check(local_rank: int, local_tp: int, remote_tp: int, num_kv_heads: int) -> None:
    tp_ratio(local_tp, remote_tp)
    _check_int("local_rank", local_rank)
    _check_int("num_kv_heads", num_kv_heads)
    if not 0 <= local_rank < local_tp:
        raise UnsupportedConfiguration(
            f"local rank {short_repr(local_rank)} is not a rank of TP size {local_tp}; ranks "
            f"are 0..{local_tp - 1}"
        )
    if not 0 < num_kv_heads <= MAX_KV_HEADS:
        raise UnsupportedConfiguration(
            f"num_kv_heads must be in 1..{MAX_KV_HEADS}, got {short_repr(num_kv_heads)}; pass "
            "the model's KV head count (num_key_value_heads)"
        )


def read_sources(
    local_rank: int, local_tp: int, remote_tp: int, num_kv_heads: int, *, replicated: bool = False
) -> list[ReadSource]:
    """The remote ranks decode rank ``local_rank`` reads, with per-rank head slices.

    ``replicated=True`` (MLA latent): every rank holds all ``num_kv_heads``; the whole block
    is read from the first covered remote rank.
    """
    _check(local_rank, local_tp, remote_tp, num_kv_heads)
    if replicated:
        whole = range(num_kv_heads)
        return [ReadSource(_covered_replicated(local_rank, local_tp, remote_tp)[0], whole, whole)]
    local = _placement(num_kv_heads, local_tp)
    remote = _placement(num_kv_heads, remote_tp)
    start = local.first_head(local_rank)
    end = start + local.heads
    sources: list[ReadSource] = []
    for head_group in range(start // remote.heads, (end - 1) // remote.heads + 1):
        group_start = head_group * remote.heads
        lo, hi = max(start, group_start), min(end, group_start + remote.heads)
        holder = remote.holders(head_group)[local_rank % remote.replicas]
        sources.append(
            ReadSource(
                holder, range(lo - start, hi - start), range(lo - group_start, hi - group_start)
            )
        )
    return sources


def _covered_replicated(local_rank: int, local_tp: int, remote_tp: int) -> list[int]:
    # Slice the replicated block into max(local_tp, remote_tp) virtual shares, one per rank of
    # the larger side; a decode rank covers the remote ranks whose shares meet its own.
    ratio = tp_ratio(local_tp, remote_tp)
    if ratio > 0:
        return [local_rank // ratio]
    return list(range(local_rank * -ratio, (local_rank + 1) * -ratio))


def covered_ranks(
    local_rank: int, local_tp: int, remote_tp: int, num_kv_heads: int, *, replicated: bool = False
) -> list[int]:
    """Every remote rank decode rank ``local_rank`` must notify (read from or not), ascending."""
    _check(local_rank, local_tp, remote_tp, num_kv_heads)
    if replicated:
        return _covered_replicated(local_rank, local_tp, remote_tp)
    remote = _placement(num_kv_heads, remote_tp)
    ranks: set[int] = set()
    for source in read_sources(local_rank, local_tp, remote_tp, num_kv_heads):
        ranks.update(remote.holders(source.remote_rank // remote.replicas))
    return sorted(ranks)


def expected_notifications(
    remote_rank: int, local_tp: int, remote_tp: int, num_kv_heads: int, *, replicated: bool = False
) -> int:
    """How many free notifications prefill rank ``remote_rank`` waits for (one per covering rank)."""
    tp_ratio(local_tp, remote_tp)
    _check_int("remote_rank", remote_rank)
    if not 0 <= remote_rank < remote_tp:
        raise UnsupportedConfiguration(
            f"remote rank {short_repr(remote_rank)} is not a rank of TP size {remote_tp}; "
            f"ranks are 0..{remote_tp - 1}"
        )
    return sum(
        remote_rank in covered_ranks(rank, local_tp, remote_tp, num_kv_heads, replicated=replicated)
        for rank in range(local_tp)
    )


HeadShape = tuple[int, bool]  # (model KV heads of a plane, replicated on every rank)


def head_shapes(layout: RankLayout) -> set[HeadShape]:
    """Distinct head shapes of a layout's planes: each has its own TP mapping."""
    return {
        (plane.model_heads, plane.replicated) for group in layout.groups for plane in group.planes
    }


def notification_duty(
    local_rank: int, local_tp: int, remote_tp: int, shapes: Iterable[HeadShape]
) -> dict[int, int]:
    """Remote rank -> free-notification count, for every remote rank ``local_rank`` notifies.

    A decode rank notifies, once, every remote rank it covers through any plane shape; the
    count is how many decode ranks do so for that remote rank. Planes with different head
    counts map differently, so the union matters. Example: 8 heads, local TP 1, remote TP 2:
    {0: 1, 1: 1}.
    """
    distinct = sorted(set(shapes))

    def covered(rank: int) -> set[int]:
        return {
            remote_rank
            for num_kv_heads, replicated in distinct
            for remote_rank in covered_ranks(
                rank, local_tp, remote_tp, num_kv_heads, replicated=replicated
            )
        }

    everyone = [covered(rank) for rank in range(local_tp)]
    return {
        remote_rank: sum(remote_rank in ranks for ranks in everyone)
        for remote_rank in sorted(everyone[local_rank])
    }
