"""Block digests: bind a lease to the blocks it holds, so a load's READs come from those blocks.

Params name blocks and travel through routers and clients, which may edit them: params that
keep a lease's id and tokens but name another request's ``remote_block_ids`` would read that
request's KV under a "held" proof. So the holder keeps the block ids it leased (per cache
group, in order, exactly as it put them in the params) and the tokens they hold; a reader
sends the digest of the block ids it reads and the token count it assumes they hold, and the
holder refuses a reader whose digest differs (scheduler/leases.py).

The digest is blake2b with an 8-byte output over the token count and the group count
(uint64 little-endian each), then per group its block count (uint64) and its ids (int64
little-endian): ``digest(((3, 4), (9,)), 20) = blake2b(pack("<QQ", 20, 2) + pack("<Q", 2) +
pack("<2q", 3, 4) + pack("<Q", 1) + pack("<q", 9))``. The counts are in it so moving a block
between groups, or a dropped one, never digests alike.

A reader digests on its worker rank (``bound_to_blocks``, the transfer thread), a holder on
its side-channel thread when a check first asks (``HeldBlocks``): the engine thread does
neither.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence

import msgspec

from connector.metadata import BlockIds, LoadSpec, RemoteSource
from connector.protocol import BlockDigest


def block_digest(block_ids: Sequence[Sequence[int]], num_tokens: int) -> BlockDigest | None:
    """The digest of ``block_ids`` (per group, in order) holding ``num_tokens`` tokens; None
    when an id does not fit int64 (no holder leased such an id)."""
    hasher = hashlib.blake2b(struct.pack("<QQ", num_tokens, len(block_ids)), digest_size=8)
    try:
        for group in block_ids:
            hasher.update(struct.pack(f"<Q{len(group)}q", len(group), *group))
    except struct.error:
        return None
    return BlockDigest(num_tokens, int.from_bytes(hasher.digest(), "little"))


def bound_to_blocks(spec: LoadSpec) -> RemoteSource:
    """``spec.source`` naming the blocks its READs come from and the tokens the load assumes
    they hold: the remote count the params give (a pull from decode's hold), else the load's
    own (prefill's lease covers exactly the load's tokens)."""
    source = spec.source
    remote_num_tokens = source.remote_num_tokens
    num_tokens = spec.num_tokens if remote_num_tokens is None else remote_num_tokens
    blocks = block_digest(source.remote_block_ids, num_tokens)
    return msgspec.structs.replace(source, blocks=blocks)


def blocks_verdict(held: BlockDigest, expected: BlockDigest | None) -> str:
    """ "" when the reader reads exactly the held blocks for the held token count, else why
    not (for the reader's failure reason)."""
    if expected is None:
        return (
            "the reader does not say which blocks it reads (an older nixl-pd-connector?): "
            "run the same version on both engines"
        )
    if expected.num_tokens != held.num_tokens:
        return (
            f"the lease's blocks hold {held.num_tokens} tokens, the reader assumes "
            f"{expected.num_tokens} (a pull: its params' remote_num_tokens; else the tokens "
            "it loads, which prefill's back-off must match)"
        )
    if expected.value != held.value:
        return (
            "the reader's remote_block_ids are not the blocks the lease holds (per cache "
            "group, in order): its params were edited or paired with another request's"
        )
    return ""


class HeldBlocks:
    """A holder's blocks for one lease (its own copy of the ids it put in the params), and
    whether a reader must read exactly its ``num_tokens`` (a group holds a state after them,
    or only their end: SSM, sliding window) or may read a prefix (attention only).

    A lease that grows under one id (chunked pulls: each chunk announced re-binds it to more
    blocks, then request_finished to the whole prompt) keeps what it announced before
    (``grown_from``): a reader of an earlier announcement, whose check arrives after the
    next, reads blocks the lease still holds, so its check passes.

    The digest is computed when a check first asks, then kept; two threads computing it at
    once get the same value, so no lock is needed.
    """

    __slots__ = ("_block_ids", "_digest", "_earlier", "exact", "num_tokens")

    def __init__(self, block_ids: BlockIds, num_tokens: int, *, exact: bool) -> None:
        self._block_ids = block_ids
        self._digest: BlockDigest | None = None
        self._earlier: HeldBlocks | None = None
        self.num_tokens = num_tokens
        self.exact = exact

    def grown_from(self, earlier: HeldBlocks) -> None:
        """The same lease held ``earlier`` before: keep it answering its readers, when these
        blocks extend it (its ids lead each group's, for at most as many tokens) and neither
        is exact (a state is read only whole). Anything else keeps nothing."""
        if self.exact or earlier.exact or earlier.num_tokens > self.num_tokens:
            return
        if len(earlier._block_ids) != len(self._block_ids):
            return
        for before, now in zip(earlier._block_ids, self._block_ids, strict=True):
            if tuple(now[: len(before)]) != tuple(before):
                return
        self._earlier = earlier

    def verdict(self, expected: BlockDigest | None) -> str:
        """``blocks_verdict`` of these blocks against a reader's ``expected``; "" too when it
        reads exactly what this lease held earlier (``grown_from``)."""
        held = self._digest
        if held is None:
            held = block_digest(self._block_ids, self.num_tokens)
            if held is None:  # our own ids: a block id always fits int64
                raise ValueError(f"a leased block id does not fit int64: {self._block_ids}")
            self._digest = held
        why = blocks_verdict(held, expected)
        earlier = self._earlier
        if not why or earlier is None or expected is None:
            return why
        return why if expected.num_tokens > earlier.num_tokens or earlier.verdict(expected) else ""
