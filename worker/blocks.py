"""Block-id helpers of the stable contract: logical to kernel ids, and prefix-cache trimming.

The planner does not use these (it works in token ranges); they exist for callers that think
in block ids and match vLLM's helpers on the cases vLLM gets right, without its bugs.

Kernel-level ids: logical block ``b`` with ``ratio`` kernel blocks per logical block holds
kernel blocks ``b * ratio .. b * ratio + ratio - 1``. SSM state blocks are never split.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence

from connector.errors import TransferPlanError, UnsupportedConfiguration


def logical_to_kernel_block_ids(
    block_ids: Sequence[Sequence[int]], ratio: int, ssm_groups: Collection[int] = ()
) -> list[list[int]]:
    """Per group ``[b * ratio + k for b in group for k in range(ratio)]``; SSM groups unchanged."""
    if ratio < 1:
        raise TransferPlanError(f"kernel blocks per logical block must be >= 1, got {ratio}")
    _check_ssm_groups(ssm_groups, len(block_ids))
    result: list[list[int]] = []
    for index, group in enumerate(block_ids):
        _check_ids(group, index)
        if index in ssm_groups:
            result.append(list(group))
        else:
            result.append([b * ratio + k for b in group for k in range(ratio)])
    return result


def apply_prefix_caching(
    local_ids: Sequence[Sequence[int]],
    remote_ids: Sequence[Sequence[int]],
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
    if len(local_ids) != len(remote_ids):
        raise TransferPlanError(
            f"decode has {len(local_ids)} cache groups but prefill sent {len(remote_ids)}; "
            "both engines must serve the same model"
        )
    _check_ssm_groups(ssm_groups, len(local_ids))
    locals_out: list[list[int]] = []
    remotes_out: list[list[int]] = []
    for index, (local, remote) in enumerate(zip(local_ids, remote_ids, strict=True)):
        if index in ssm_groups:
            pair = _pair_ssm(list(local), list(remote), index)
        elif local_ratio == remote_ratio:
            pair = _end_trim(list(local), list(remote), index)
        else:
            pair = _pair_by_token(
                list(local), list(remote), index, local_ratio, remote_ratio,
                num_tokens, kernel_block_size,
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


def _check_ssm_groups(ssm_groups: Collection[int], num_groups: int) -> None:
    for index in ssm_groups:
        if not 0 <= index < num_groups:
            raise TransferPlanError(f"SSM group index {index} is not one of {num_groups} groups")


def _check_ids(group: Sequence[int], index: int) -> None:
    for block_id in group:
        if block_id < 0:
            raise TransferPlanError(f"group {index}: block id {block_id} is negative")
