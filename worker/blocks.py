"""Block-id helpers of the stable contract: logical to kernel ids, and prefix-cache trimming.

The planner does not call these: it works in token ranges and byte geometry. They serve callers
that think in block ids (the DESIGN contract), matching vLLM's helpers on the cases vLLM gets
right, without its bugs; and tests/test_planner_block_pairing.py uses them as an independent
oracle: where both apply, the planner's READs copy exactly the block pairs made here.

Kernel-level ids: logical block ``b`` with ``ratio`` kernel blocks per logical block holds
kernel blocks ``b * ratio .. b * ratio + ratio - 1``. SSM state blocks are never split.

Inputs are checked before any work: block ids are integers in 0..MAX_BLOCK_ID, unique within
an attention group (an SSM group's placeholders may repeat), ratios integers in 1..MAX_RATIO;
anything else raises TransferPlanError saying what was wrong and the value seen.
"""

from __future__ import annotations

import numbers
from collections import Counter
from collections.abc import Collection, Sequence

from connector.errors import TransferPlanError, UnsupportedConfiguration
from connector.metadata import MAX_BLOCK_ID
from connector.params import short_repr

MAX_RATIO = 4096  # kernel blocks per logical block; the largest seen in vLLM is 261 (seed 000)


def logical_to_kernel_block_ids(
    block_ids: Sequence[Sequence[int]], ratio: int, ssm_groups: Collection[int] = ()
) -> list[list[int]]:
    """Per group ``[b * ratio + k for b in group for k in range(ratio)]``; SSM groups unchanged."""
    ratio = _ratio("ratio", ratio)
    ssm = _ssm_groups(ssm_groups, _num_groups("block_ids", block_ids))
    groups = _groups("block_ids", block_ids, ssm)
    return [
        list(group) if index in ssm else [b * ratio + k for b in group for k in range(ratio)]
        for index, group in enumerate(groups)
    ]


def apply_prefix_caching(
    local_ids: Sequence[Sequence[int]],
    remote_ids: Sequence[Sequence[int]],  # the DESIGN contract's name, called by keyword outside
    *,
    ssm_groups: Collection[int] = (),
    local_ratio: int = 1,
    remote_ratio: int = 1,
    num_tokens: int | None = None,
    kernel_block_size: int | None = None,
) -> tuple[list[list[int]], list[list[int]]]:
    """Pair decode's uncached kernel blocks (``local_ids``) with prefill's (``remote_ids``).

    Both inputs are kernel-level ids per group. Returns equal-length (local, remote) lists per
    group, element i of one read into element i of the other. See DESIGN.md for the rules.
    """
    ssm = _ssm_groups(ssm_groups, _num_groups("local_ids", local_ids))
    if len(local_ids) != _num_groups("remote_ids", remote_ids):
        raise TransferPlanError(
            f"decode has {len(local_ids)} cache groups but prefill sent {len(remote_ids)}; "
            "both engines must serve the same model"
        )
    local_groups = _groups("local_ids", local_ids, ssm)
    remote_groups = _groups("remote_ids", remote_ids, ssm)
    local_ratio = _ratio("local_ratio", local_ratio)
    remote_ratio = _ratio("remote_ratio", remote_ratio)
    locals_out: list[list[int]] = []
    remotes_out: list[list[int]] = []
    for index, (local, remote) in enumerate(zip(local_groups, remote_groups, strict=True)):
        if index in ssm:
            pair = _pair_ssm(local, remote, index)
        elif local_ratio == remote_ratio:
            pair = _end_trim(local, remote, index)
        else:
            pair = _pair_by_token(
                local, remote, index, local_ratio, remote_ratio,
                _optional_int("num_tokens", num_tokens),
                _optional_int("kernel_block_size", kernel_block_size),
            )  # fmt: skip
        locals_out.append(pair[0])
        remotes_out.append(pair[1])
    return locals_out, remotes_out


def _pair_ssm(local: list[int], remote: list[int], index: int) -> tuple[list[int], list[int]]:
    """The last remote block is the real state (earlier ones are placeholders); pair the tails."""
    if not local:
        return [], []
    if not remote:
        raise TransferPlanError(
            f"group {index} (SSM): decode expects a state block but prefill sent none"
        )
    return [local[len(local) - 1]], [remote[len(remote) - 1]]


def _end_trim(local: list[int], remote: list[int], index: int) -> tuple[list[int], list[int]]:
    """Equal ratios: decode's uncached blocks are the tail of prefill's."""
    if len(local) > len(remote):
        raise TransferPlanError(
            f"group {index}: decode wants {len(local)} kernel blocks but prefill has only "
            f"{len(remote)}; the request's block lists are inconsistent"
        )
    return local, remote[len(remote) - len(local) :]


def _pair_by_token(
    local: list[int],
    remote: list[int],
    index: int,
    local_ratio: int,
    remote_ratio: int,
    num_tokens: int | None,
    kernel_block_size: int | None,
) -> tuple[list[int], list[int]]:
    """Different logical block sizes, same kernel block size: pair kernel block by token position.

    Decode's blocks end at the logical-block boundary after the last token, so the first
    uncached kernel index is ``ceil(num_tokens / local_block_size) * local_ratio - len(local)``.
    Example: num_tokens 70, kernel 16, decode logical 32 (ratio 2) with tokens [0, 32)
    cached, prefill logical 16: decode kernel blocks cover kernel indices 2..5, prefill 0..4;
    kernel index 2..4 are paired, decode's index 5 holds no token.
    """
    if num_tokens is None or kernel_block_size is None:
        raise UnsupportedConfiguration(
            f"group {index}: decode has {local_ratio} kernel blocks per logical block and "
            f"prefill {remote_ratio}; pairing them needs num_tokens and kernel_block_size"
        )
    if num_tokens <= 0 or kernel_block_size <= 0 or local_ratio < 1 or remote_ratio < 1:
        raise TransferPlanError(
            f"group {index}: num_tokens={num_tokens}, kernel_block_size={kernel_block_size}, "
            f"ratios {local_ratio}/{remote_ratio} must all be positive"
        )
    num_kernel_blocks = -(-num_tokens // kernel_block_size)
    local_end = -(-num_tokens // (local_ratio * kernel_block_size)) * local_ratio
    remote_count = -(-num_tokens // (remote_ratio * kernel_block_size)) * remote_ratio
    start = local_end - len(local)
    if start < 0 or len(local) % local_ratio != 0 or len(remote) != remote_count:
        raise TransferPlanError(
            f"group {index}: for {num_tokens} tokens decode sent {len(local)} kernel blocks "
            f"(at most {local_end}, a multiple of {local_ratio}) and prefill {len(remote)} "
            f"(expected {remote_count}); the request's block lists are inconsistent"
        )
    count = max(0, num_kernel_blocks - start)
    return local[:count], remote[start : start + count]


def _is_int(value: object) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _ratio(name: str, ratio: object) -> int:
    if not _is_int(ratio):
        raise TransferPlanError(
            f"{name} must be an integer number of kernel blocks per logical block, got "
            f"{type(ratio).__name__} {short_repr(ratio)}; pass block_size // kernel_block_size"
        )
    value = int(ratio)  # type: ignore[call-overload]
    if not 1 <= value <= MAX_RATIO:
        raise TransferPlanError(
            f"{name} must be in 1..{MAX_RATIO} kernel blocks per logical block, got "
            f"{short_repr(value)}; pass block_size // kernel_block_size of one engine's cache group"
        )
    return value


def _optional_int(name: str, value: object) -> int | None:
    if value is None:
        return None
    if not _is_int(value):
        raise TransferPlanError(
            f"{name} must be an integer or None, got {type(value).__name__} {short_repr(value)}"
        )
    return int(value)  # type: ignore[call-overload]


def _is_sequence(value: object) -> bool:
    return isinstance(value, Sequence) and not isinstance(value, str | bytes | bytearray)


def _num_groups(name: str, block_ids: object) -> int:
    if not _is_sequence(block_ids):
        raise TransferPlanError(
            f"{name} must be a list of block-id lists, one per cache group, got "
            f"{type(block_ids).__name__} {short_repr(block_ids)}"
        )
    return len(block_ids)  # type: ignore[arg-type]


def _ssm_groups(ssm_groups: object, num_groups: int) -> frozenset[int]:
    if not isinstance(ssm_groups, Collection) or isinstance(ssm_groups, str | bytes):
        raise TransferPlanError(
            f"ssm_groups must be a collection of group indices, got {short_repr(ssm_groups)}"
        )
    for index in ssm_groups:
        if not _is_int(index) or not 0 <= index < num_groups:
            raise TransferPlanError(
                f"SSM group index {short_repr(index)} is not one of {num_groups} groups; "
                f"pass indices in 0..{num_groups - 1}"
            )
    return frozenset(int(index) for index in ssm_groups)


def _groups(name: str, block_ids: Sequence[Sequence[int]], ssm: frozenset[int]) -> list[list[int]]:
    """Checked copies of every group: non-negative integer ids, unique in attention groups."""
    groups: list[list[int]] = []
    for index, group in enumerate(block_ids):
        if not _is_sequence(group):
            raise TransferPlanError(
                f"{name} group {index} is {type(group).__name__} {short_repr(group)}, not a list "
                "of block ids; pass one list per cache group (wrap a single group: [[...]])"
            )
        checked = [_block_id(name, index, block_id) for block_id in group]
        repeated = [] if index in ssm else [b for b, n in Counter(checked).items() if n > 1]
        if repeated:
            raise TransferPlanError(
                f"{name} group {index}: block id {repeated[0]} appears twice; a request holds each "
                "block once per attention group, so its block list is corrupt"
            )
        groups.append(checked)
    return groups


def _block_id(name: str, index: int, block_id: object) -> int:
    if not _is_int(block_id):
        raise TransferPlanError(
            f"{name} group {index}: block id {short_repr(block_id)} is a "
            f"{type(block_id).__name__}, not an integer"
        )
    value = int(block_id)  # type: ignore[call-overload]
    if not 0 <= value <= MAX_BLOCK_ID:
        kind = "negative" if value < 0 else f"above {MAX_BLOCK_ID}"
        raise TransferPlanError(
            f"{name} group {index}: block id {short_repr(value)} is {kind}; block ids index "
            "the engine's block pool from 0"
        )
    return value
