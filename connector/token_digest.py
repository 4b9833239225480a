"""Token digests: bind a lease to the token ids its blocks hold, not only to the blocks.

Params name blocks, not tokens: params paired with another prompt (a router bug, a retried
request with an edited prompt, a multi-turn history the client edited) would load KV of
other tokens and answer with wrong text. So the holder keeps the token ids it leased, the
reader sends the digest of the ids it expects (its own prompt's first N), and the holder
compares before the reader posts any READ (scheduler/leases.py).

The digest is blake2b with an 8-byte output over the count (uint64 little-endian) and the
ids as int32 little-endian: ``digest([5, 7], 2) = blake2b(pack("<Q", 2) + pack("<2i", 5, 7))``.
The count is in it so a prefix never digests like a longer run. About 15 us per 1000 tokens
for a reader's pack and digest, 5 us for a holder's compare (benchmarks/README.md).

Some KV depends on more than the ids: a LoRA adapter, a cache salt, the images behind
multimodal placeholder ids. The engine names those inputs as a ``KVSalt``: parts
``(position, bytes)``, each the first token whose KV it affects (0 for an adapter or a salt,
a multimodal item's placeholder offset) and bytes both sides derive alike from the request.
The parts that affect the digested tokens (position < count) follow the ids, each as
``pack("<QQ", position, len(bytes)) + bytes``; with none the digest is the ids' alone, so a
request without such inputs digests as before. A reader and a holder whose requests differ in
any of them then disagree for every count the parts reach.

A holder keeps its ids as ``HeldTokens``: the engine's own list until a check first needs
them, packed then on the side-channel thread, so finishing a request packs nothing.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence

from connector.protocol import TokenDigest

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
