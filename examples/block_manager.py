"""The example engine's block bookkeeping: per-group pools, block tables, prefix caching and
admission that reserves each request's growth.

Logical blocks only (the engine's allocation unit, one pool per cache group; block 0 of every
pool is the null block, a placeholder). Where those blocks live in memory is
``examples.kv_cache``'s job.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from connector.errors import ConnectorError, UnsupportedConfiguration
from connector.layout import GroupKind, KVCacheSpec
from connector.metadata import BlockIds

NULL_BLOCK = 0


class PoolExhausted(ConnectorError):
    """A request needs a block and its group's pool has none left for it: fail that request."""


@dataclass
class BlockPool:
    """One cache group's logical blocks: ref counts, an LRU free queue and the prefix-cache map."""

    num_blocks: int
    ref_counts: list[int] = field(default_factory=list)
    free: OrderedDict[int, None] = field(default_factory=OrderedDict)  # evictable, LRU first
    by_hash: dict[bytes, int] = field(default_factory=dict)
    hash_of: dict[int, bytes] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.ref_counts = [0] * self.num_blocks
        self.free = OrderedDict((block, None) for block in range(1, self.num_blocks))

    def allocate(self) -> int:
        if not self.free:
            raise PoolExhausted(f"the pool of {self.num_blocks - 1} blocks has none free")
        block, _ = self.free.popitem(last=False)
        old_hash = self.hash_of.pop(block, None)
        if old_hash is not None:
            del self.by_hash[old_hash]
        self.ref_counts[block] = 1
        return block

    def touch(self, block: int) -> None:
        self.free.pop(block, None)
        self.ref_counts[block] += 1

    def release(self, block: int) -> None:
        if block == NULL_BLOCK:
            return
        self.ref_counts[block] -= 1
        if self.ref_counts[block] == 0:
            self.free[block] = None

    def cache(self, block: int, block_hash: bytes) -> None:
        if block != NULL_BLOCK and block_hash not in self.by_hash and block not in self.hash_of:
            self.by_hash[block_hash] = block
            self.hash_of[block] = block_hash

    @property
    def num_used(self) -> int:
        """Blocks some request still holds (not free and not merely evictable)."""
        return self.num_blocks - 1 - len(self.free)


def block_hashes(token_ids: Sequence[int], block_size: int) -> list[bytes]:
    """Chained hashes of every full block of ``token_ids``: block j covers [j*B, (j+1)*B)."""
    hashes: list[bytes] = []
    previous = b""
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        data = np.asarray(token_ids[start : start + block_size], dtype=np.int64).tobytes()
        previous = hashlib.blake2b(previous + data, digest_size=16).digest()
        hashes.append(previous)
    return hashes


class BlockManager:
    """Block tables per request and group, with hash-based prefix caching across requests.

    Admission reserves growth: a request admitted with ``max_num_tokens`` may later ``grow``
    to that many tokens without failing, because free blocks promised to admitted requests are
    not offered to new ones (``can_admit``). Invariant, per pool: free blocks >= reserved.
    """

    def __init__(self, spec: KVCacheSpec) -> None:
        self.block_size = spec.groups[0].block_size
        if any(group.block_size != self.block_size for group in spec.groups):
            raise UnsupportedConfiguration("the example engine needs one block size for all groups")
        self.kinds = [group.kind for group in spec.groups]
        self.pools = [BlockPool(group.num_blocks) for group in spec.groups]
        self.tables: dict[str, list[list[int]]] = {}
        self.reserved: dict[str, list[int]] = {}  # request id -> blocks per pool still promised
        self.num_reserved = [0] * len(self.pools)  # per pool: sum over requests

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def find_prefix_hit(self, token_ids: Sequence[int], max_hit_tokens: int) -> int:
        """Cached tokens (a whole number of blocks, at most ``max_hit_tokens``) for this prompt.

        Attention groups need every block of the prefix cached; an SSM group needs only the
        state at the hit boundary (block k-1), since earlier states are never read.
        """
        hashes = block_hashes(token_ids, self.block_size)[: max_hit_tokens // self.block_size]
        num_blocks = 0
        for block_hash in hashes:
            if not all(
                block_hash in pool.by_hash
                for pool, kind in zip(self.pools, self.kinds, strict=True)
                if kind is not GroupKind.SSM
            ):
                break
            num_blocks += 1
        for k in range(num_blocks, 0, -1):
            if all(
                hashes[k - 1] in pool.by_hash
                for pool, kind in zip(self.pools, self.kinds, strict=True)
                if kind is GroupKind.SSM
            ):
                return k * self.block_size
        return 0

    def can_admit(
        self, token_ids: Sequence[int], num_hit_tokens: int, *, max_num_tokens: int
    ) -> bool:
        """True if a request with this prefix hit can grow to ``max_num_tokens`` tokens in
        every group without touching blocks promised to requests already admitted."""
        num_hit_blocks = num_hit_tokens // self.block_size
        hashes = block_hashes(token_ids, self.block_size)[:num_hit_blocks]
        for index, pool in enumerate(self.pools):
            hits = self._hit_blocks(index, hashes)
            # Touching a hit block that sits in the free queue takes it out of the queue.
            num_free_hits = sum(1 for block in hits if block in pool.free)
            available = len(pool.free) - num_free_hits - self.num_reserved[index]
            if available < self.blocks_for(max_num_tokens) - num_hit_blocks:
                return False
        return True

    def _hit_blocks(self, index: int, hashes: Sequence[bytes]) -> list[int]:
        """The cached blocks pool ``index`` touches for these hit hashes (SSM: the last only)."""
        pool = self.pools[index]
        if self.kinds[index] is GroupKind.SSM:
            hashes = hashes[len(hashes) - 1 :] if hashes else []
        return [pool.by_hash[block_hash] for block_hash in hashes]

    def allocate(
        self,
        request_id: str,
        token_ids: Sequence[int],
        num_hit_tokens: int,
        num_tokens: int,
        *,
        remote_tokens: int = 0,
        max_num_tokens: int | None = None,
    ) -> BlockIds:
        """Create the request's block tables for ``num_tokens`` tokens: hits first, then fresh;
        reserve blocks for growth up to ``max_num_tokens`` (call ``can_admit`` first).

        SSM groups get the null block as placeholder for hit blocks before the last one and,
        when ``remote_tokens`` will be loaded, for every loaded block except the one holding
        the state after the load.
        """
        num_hit_blocks = num_hit_tokens // self.block_size
        hashes = block_hashes(token_ids, self.block_size)[:num_hit_blocks]
        last_loaded = self.blocks_for(num_hit_tokens + remote_tokens) - 1
        tables: list[list[int]] = []
        for pool, kind in zip(self.pools, self.kinds, strict=True):
            table: list[int] = []
            for j, block_hash in enumerate(hashes):
                if kind is GroupKind.SSM and j < num_hit_blocks - 1:
                    table.append(NULL_BLOCK)
                    continue
                block = pool.by_hash[block_hash]
                pool.touch(block)
                table.append(block)
            for j in range(num_hit_blocks, self.blocks_for(num_tokens)):
                placeholder = kind is GroupKind.SSM and remote_tokens > 0 and j < last_loaded
                table.append(NULL_BLOCK if placeholder else pool.allocate())
            tables.append(table)
        self.tables[request_id] = tables
        num_max_blocks = self.blocks_for(max(num_tokens, max_num_tokens or 0))
        self.reserved[request_id] = [num_max_blocks - len(table) for table in tables]
        for index, num_blocks in enumerate(self.reserved[request_id]):
            self.num_reserved[index] += num_blocks
        return self.block_ids(request_id)

    def grow(self, request_id: str, num_tokens: int) -> None:
        """Make room for ``num_tokens`` tokens in every group: reserved blocks first, then
        unpromised free ones; PoolExhausted (nothing changed for other requests) if none."""
        reserved = self.reserved[request_id]
        for index, table in enumerate(self.tables[request_id]):
            while len(table) < self.blocks_for(num_tokens):
                table.append(self._take_block(request_id, index, num_tokens, reserved))

    def _take_block(self, request_id: str, index: int, num_tokens: int, reserved: list[int]) -> int:
        pool = self.pools[index]
        if reserved[index] > 0:
            reserved[index] -= 1
            self.num_reserved[index] -= 1
        elif len(pool.free) <= self.num_reserved[index]:
            raise PoolExhausted(
                f"request {request_id} needs a block of group {index} for {num_tokens} tokens "
                f"beyond what it reserved, and the pool's {len(pool.free)} free blocks are "
                "promised to other requests: admit it with a larger max_num_tokens"
            )
        return pool.allocate()

    def block_ids(self, request_id: str) -> BlockIds:
        return tuple(tuple(table) for table in self.tables[request_id])

    def cache_blocks(
        self, request_id: str, token_ids: Sequence[int], num_valid_tokens: int
    ) -> None:
        """Offer the request's full, valid blocks to the prefix cache (null blocks are skipped)."""
        hashes = block_hashes(token_ids[:num_valid_tokens], self.block_size)
        for pool, table in zip(self.pools, self.tables[request_id], strict=True):
            for block, block_hash in zip(table, hashes, strict=False):
                pool.cache(block, block_hash)

    def free(self, request_id: str) -> None:
        """Drop the request's references, tail first (tail blocks are evicted first), and
        its unused reservation."""
        for index, num_blocks in enumerate(self.reserved.pop(request_id, [])):
            self.num_reserved[index] -= num_blocks
        for pool, table in zip(self.pools, self.tables.pop(request_id), strict=True):
            for block in reversed(table):
                pool.release(block)

    @property
    def num_used_blocks(self) -> int:
        return sum(pool.num_used for pool in self.pools)
