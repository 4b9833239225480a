"""verify_kv on prefill: check a decode rank's digest claims against the ranks' own digests.

Each prefill rank reports, per lease, a table of digests [units, its model heads] per group
(worker/kv_digest.py). A decode rank claims the sum over the units and model heads it READ;
the sum of the same cells of prefill's tables must be equal. A head held by several prefill
ranks (replicated KV heads) is taken from the lowest rank that reported it. Pure.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np

from connector.metadata import GroupDigests
from connector.protocol import DIGEST_OK, DIGEST_PENDING, DigestClaim

RankDigests = Mapping[int, Sequence[GroupDigests]]  # prefill tp_rank -> its tables


def verify_claims(claims: Sequence[DigestClaim], reported: RankDigests, num_ranks: int) -> str:
    """DIGEST_OK, DIGEST_PENDING (a rank holding a claimed cell has not reported yet), or why
    the claims do not match."""
    for claim in claims:
        verdict = _verify(claim, reported, num_ranks)
        if verdict != DIGEST_OK:
            return verdict
    return DIGEST_OK


def _verify(claim: DigestClaim, reported: RankDigests, num_ranks: int) -> str:
    units = range(claim.first_unit, claim.first_unit + claim.num_units)
    total = np.uint64(0)
    for head in claim.model_heads:
        cell = _column(claim.group, head, units, reported)
        if cell is None:
            if len(reported) < num_ranks:
                return DIGEST_PENDING
            return (
                f"prefill holds no digest of group {claim.group} model head {head} units "
                f"[{units.start}, {units.stop}): the reader read what the lease does not cover"
            )
        with np.errstate(over="ignore"):
            total += cell
    if int(total) != claim.value:
        return (
            f"digest mismatch in group {claim.group}, units [{units.start}, {units.stop}), "
            f"model heads {list(claim.model_heads)}: the bytes read are not the bytes prefill "
            "saved for this lease"
        )
    return DIGEST_OK


def _column(group: int, head: int, units: range, reported: RankDigests) -> np.uint64 | None:
    """The sum over ``units`` of model head ``head``'s digests, from the lowest rank with it."""
    for tp_rank in sorted(reported):
        for table in reported[tp_rank]:
            if table.group != group or head not in table.model_heads:
                continue
            values = np.frombuffer(table.values, dtype="<u8").reshape(-1, len(table.model_heads))
            start = units.start - table.first_unit
            if start < 0 or units.stop - table.first_unit > len(values):
                return None
            column = table.model_heads.index(head)
            return values[start : units.stop - table.first_unit, column].sum(dtype=np.uint64)
    return None
