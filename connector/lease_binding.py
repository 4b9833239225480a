"""Bind a lease to what its blocks hold: digests of their token ids and of the block ids.

Why (params paired with another prompt, or their block ids edited on the way): docs/integrity.md,
"Leases bound to tokens" and "Leases bound to their blocks". A reader sends both digests in
every lease check; the holder (scheduler/leases.py) refuses one that differs from its own.

Token digest: blake2b with an 8-byte output over the count (uint64 little-endian) and the
ids as int32 little-endian: ``digest([5, 7], 2) = blake2b(pack("<Q", 2) + pack("<2i", 5, 7))``.
The count is in it so a prefix never digests like a longer run.

Some KV depends on more than the ids: a LoRA adapter, a cache salt, the images behind
multimodal placeholder ids. The engine names those inputs as a ``KVSalt``: parts
``(position, bytes)``, each the first token whose KV it affects (0 for an adapter or a salt,
a multimodal item's placeholder offset) and bytes both sides derive alike from the request.
The parts that affect the digested tokens (position < count) follow the ids, each as
``pack("<QQ", position, len(bytes)) + bytes``; with none the digest is the ids' alone. A
reader and a holder whose requests differ in any of them disagree for every count they reach.

Block digest: blake2b with an 8-byte output over the token count and the group count
(uint64 little-endian each), then per group its block count (uint64) and its ids (int64
little-endian): ``digest(((3, 4), (9,)), 20) = blake2b(pack("<QQ", 20, 2) + pack("<Q", 2) +
pack("<2q", 3, 4) + pack("<Q", 1) + pack("<q", 9))``. The counts are in it so moving a block
between groups, or a dropped one, never digests alike.

The engine thread hashes nothing: a reader digests on its worker rank's transfer thread
(``bound_to_blocks``, ``token_digest``), a holder on its side-channel thread when a check
first asks (``HeldTokens`` keeps the engine's list until then, ``HeldBlocks`` the ids).
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence
from typing import TYPE_CHECKING

import msgspec

from connector.protocol import BlockDigest, TokenDigest

if TYPE_CHECKING:  # annotations only: connector/metadata.py imports KVSalt from here
    from connector.metadata import BlockIds, LoadSpec, RemoteSource

TOKEN_BYTES = 4  # int32 per token id
# What a request's KV depends on besides its ids: ((first token position affected, bytes), ...)
KVSalt = tuple[tuple[int, bytes], ...]
_SALT_PART = struct.Struct("<QQ")  # a part's position and byte count, before its bytes


def pack_tokens(token_ids: Sequence[int], num_tokens: int) -> bytes | None:
    """The first ``num_tokens`` ids as int32 little-endian bytes; None when there are fewer
    ids than that, or one does not fit int32 (nothing to bind then)."""
    num_ids = len(token_ids)
    if num_tokens < 1 or num_ids < num_tokens:
        return None
    if type(token_ids) is list and num_ids == num_tokens:
        ids: Sequence[int] = token_ids  # the whole list: unpacked without a slice copy
    else:
        ids = token_ids[:num_tokens]
    try:
        return struct.pack(f"<{num_tokens}i", *ids)
    except struct.error:
        return None


def pack_salt(salt: KVSalt, num_tokens: int) -> bytes:
    """The parts of ``salt`` that affect the first ``num_tokens`` tokens, as the digest takes
    them: ``((0, b"x"), (9, b"yz"))`` for 4 tokens -> ``pack("<QQ", 0, 1) + b"x"``."""
    return b"".join(
        _SALT_PART.pack(position, len(data)) + data
        for position, data in salt
        if position < num_tokens
    )


def digest_packed(packed: bytes, num_tokens: int, salt: bytes = b"") -> int:
    """The digest of the first ``num_tokens`` ids of ``packed`` (from ``pack_tokens``), then
    ``salt`` (from ``pack_salt`` for the same count)."""
    hasher = hashlib.blake2b(struct.pack("<Q", num_tokens), digest_size=8)
    hasher.update(memoryview(packed)[: num_tokens * TOKEN_BYTES])
    if salt:
        hasher.update(salt)
    return int.from_bytes(hasher.digest(), "little")


def token_digest(
    token_ids: Sequence[int] | None, num_tokens: int, salt: KVSalt = ()
) -> TokenDigest | None:
    """What a reader expects a lease's blocks to hold: the KV of its first ``num_tokens`` ids
    with the inputs ``salt`` names; None when it cannot say (no ids, fewer than that)."""
    packed = None if token_ids is None else pack_tokens(token_ids, num_tokens)
    if packed is None:
        return None
    return TokenDigest(num_tokens, digest_packed(packed, num_tokens, pack_salt(salt, num_tokens)))


def tokens_verdict(held: bytes, expected: TokenDigest, salt: KVSalt = ()) -> str:
    """ "" when the held ids (``pack_tokens`` bytes), with the holder's ``salt``, start with
    the tokens ``expected`` digests, else why not (for the reader's failure reason)."""
    num_held = len(held) // TOKEN_BYTES
    num_tokens = expected.num_tokens
    if num_tokens > num_held:
        return f"the lease's blocks hold {num_held} tokens, the reader expects {num_tokens}"
    if digest_packed(held, num_tokens, pack_salt(salt, num_tokens)) != expected.value:
        return (
            f"the lease's blocks hold other tokens than the reader's first {num_tokens} (or "
            "their KV was computed with another LoRA adapter, cache salt or multimodal input)"
        )
    return ""


class HeldTokens:
    """A holder's ids for one lease, and the other inputs its KV depends on (``salt``): the
    engine's list, packed (``pack_tokens``) when a check first asks, then only the bytes are
    kept (4 B per token).

    The list must keep its first ``num_tokens`` ids unchanged while the lease is held. vLLM's
    ``Request.all_token_ids`` does once the request finished: it only appends, and the edits
    it does make (our ``truncate_for_prefill`` before prefill runs, a streaming session's
    dropped last sampled token) are past the tokens a lease covers. Packing twice (two
    threads at once) gives the same bytes, so no lock is needed.
    """

    __slots__ = ("_ids", "_num_tokens", "_packed", "_salt")

    def __init__(self, token_ids: Sequence[int], num_tokens: int, salt: KVSalt = ()) -> None:
        self._ids: Sequence[int] | None = token_ids
        self._num_tokens = num_tokens
        self._packed: bytes | None = None
        self._salt = salt

    @classmethod
    def of(cls, token_ids: Sequence[int], num_tokens: int, salt: KVSalt = ()) -> HeldTokens | None:
        """The first ``num_tokens`` of ``token_ids``, unpacked, with ``salt``; None when there
        are fewer ids (nothing to bind, as ``pack_tokens`` says)."""
        if num_tokens < 1 or len(token_ids) < num_tokens:
            return None
        return cls(token_ids, num_tokens, salt)

    def packed(self) -> bytes | None:
        """The ids as ``pack_tokens`` bytes; None if one does not fit int32 (every reader is
        refused then)."""
        ids = self._ids
        if ids is not None:
            self._packed = pack_tokens(ids, self._num_tokens)
            self._ids = None  # packed: drop the engine's list
        return self._packed

    def verdict(self, expected: TokenDigest) -> str:
        """``tokens_verdict`` of these ids; refused when they cannot be packed."""
        packed = self.packed()
        if packed is None:
            return "the lease's token ids do not fit int32, so no reader can show it expects them"
        return tokens_verdict(packed, expected, self._salt)


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
