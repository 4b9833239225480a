"""KV that depends on more than token ids: a lease binds the other inputs with the ids.

A LoRA adapter, a cache salt or multimodal inputs change a prompt's KV and not its ids; the
engine names them as a KVSalt (connector/lease_binding.py), the reader digests them with its
ids, the holder compares with its own. Unit level here; through vLLM's real Scheduler in
tests/test_vllm_token_binding.py.
"""

from __future__ import annotations

import hashlib
import struct

import pytest

from connector.lease_binding import HeldTokens, KVSalt, token_digest
from connector.protocol import REFUSED_TOKENS, LeaseRef, TokenDigest
from scheduler.leases import LeaseTable

IDS = list(range(500, 540))  # 40 tokens
SALT_A: KVSalt = ((0, b"cache_salt\0a"),)
SALT_B: KVSalt = ((0, b"cache_salt\0b"),)
IMAGE_AT_30: KVSalt = ((30, b"mm\0img-1\x004"),)


def test_a_salt_follows_the_ids_with_its_position_and_length() -> None:
    ids = [5, 7]
    salt = (0, b"xy")
    data = struct.pack("<Q", 2) + struct.pack("<2i", *ids) + struct.pack("<QQ", 0, 2) + b"xy"
    expected = int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little")
    assert token_digest(ids, 2, (salt,)) == TokenDigest(2, expected)


@pytest.mark.parametrize(
    ("salt", "other"),
    [((), SALT_A), (SALT_A, SALT_B), (((0, b"lora\0x"),), ((0, b"lora\0y"),)),
     (IMAGE_AT_30, ((30, b"mm\0img-2\x004"),)), (IMAGE_AT_30, ((31, b"mm\0img-1\x004"),)),
     (((0, b"ab"), (0, b"c")), ((0, b"a"), (0, b"bc")))],
    ids=["unsalted-vs-salted", "salt-a-vs-salt-b", "another-lora", "another-image",
         "the-image-elsewhere", "parts-cut-elsewhere"],
)  # fmt: skip
def test_the_same_ids_with_other_inputs_digest_differently(salt: KVSalt, other: KVSalt) -> None:
    assert token_digest(IDS, 40, salt) != token_digest(IDS, 40, other)


def test_without_a_salt_the_digest_is_the_ids_alone() -> None:
    """Requests without other inputs digest as before: older peers still agree."""
    assert token_digest(IDS, 40, ()) == token_digest(IDS, 40)


def test_a_part_after_the_digested_tokens_does_not_enter_their_digest() -> None:
    """An image at token 30 changes the KV of tokens 30 on, not of the first 30."""
    assert token_digest(IDS, 30, IMAGE_AT_30) == token_digest(IDS, 30)
    assert token_digest(IDS, 31, IMAGE_AT_30) != token_digest(IDS, 31)


VERDICTS = {
    "same-salt": (SALT_A, SALT_A, 40, ""),
    "another-salt": (SALT_A, SALT_B, 40, "another LoRA adapter, cache salt or multimodal input"),
    "reader-unsalted": (SALT_A, (), 40, "other tokens than the reader's first 40"),
    "holder-unsalted": ((), SALT_B, 40, "other tokens than the reader's first 40"),
    "image-past-the-readers-prefix": (IMAGE_AT_30, (), 30, ""),
    "image-within-the-readers-prefix": (IMAGE_AT_30, (), 31, "reader's first 31"),
}


@pytest.mark.parametrize(
    ("held", "reader", "num_tokens", "verdict"), VERDICTS.values(), ids=VERDICTS
)
def test_the_holder_refuses_a_reader_with_other_inputs(
    held: KVSalt, reader: KVSalt, num_tokens: int, verdict: str
) -> None:
    holder = HeldTokens.of(IDS, 40, held)
    expected = token_digest(IDS, num_tokens, reader)
    assert holder is not None and expected is not None
    found = holder.verdict(expected)
    assert (verdict in found) if verdict else found == ""


def test_the_lease_table_refuses_a_reader_with_another_cache_salt() -> None:
    table = LeaseTable(10.0)
    table.lease("p1", 0.0, "L1", tokens=HeldTokens.of(IDS, 40, SALT_A))
    same = LeaseRef("p1", "L1", tokens=token_digest(IDS, 40, SALT_A))
    other = LeaseRef("p1", "L1", tokens=token_digest(IDS, 40, SALT_B))
    status = table.check([same, other], 1.0)
    assert status.held == (True, False)
    refusal = status.refused[1]
    assert refusal is not None and refusal.kind == REFUSED_TOKENS and "cache salt" in refusal.reason
