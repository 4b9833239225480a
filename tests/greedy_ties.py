"""When two greedy decodes of one prompt may differ: at a tie that bf16 rounding breaks.

Two engines that decode the same prompt from the same KV in bf16 can still pick different
tokens where two candidates' logprobs are nearly equal: their batches differ (prompts in flight
at once), and so do the shapes of their bf16 matmuls and the rounding of the results. A wrong
load does not look like that: it moves the whole distribution. So where the real-vLLM hybrid
tier (bf16) compares two pairs, tokens that first differ at such a tie are reported, not failed;
verify_kv has compared the loaded bytes with prefill's in any case.

Stdlib only (tests/test_greedy_ties.py runs it in the unit tier).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

# Two candidates this close (natural log) are a tie bf16 may break either way. The logits of
# the tier's tiny random models are a few units; bf16 keeps 8 significant bits (0.4%).
NEAR_TIE_NATS = 0.1


def first_difference_is_a_tie(
    a_ids: Sequence[int],
    a_top: Sequence[Mapping[int, float]],
    b_ids: Sequence[int],
    b_top: Sequence[Mapping[int, float]],
) -> bool:
    """At the first position where ``a_ids`` and ``b_ids`` differ, each side's top logprobs
    (by token id, per position) hold both picks, its own within NEAR_TIE_NATS of the other's.
    False when they do not differ, or a side lacks the logprobs to show it."""
    position = next((i for i, (x, y) in enumerate(zip(a_ids, b_ids, strict=False)) if x != y), None)
    if position is None:
        return False
    for ids, top, other in ((a_ids, a_top, b_ids), (b_ids, b_top, a_ids)):
        if position >= len(top):
            return False
        candidates = top[position]
        picked, runner_up = ids[position], other[position]
        if picked not in candidates or runner_up not in candidates:
            return False
        if candidates[picked] - candidates[runner_up] > NEAR_TIE_NATS:
            return False
    return True
