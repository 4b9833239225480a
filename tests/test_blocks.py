"""Block-id helpers of the stable contract (worker/blocks.py)."""

from __future__ import annotations

import pytest

from connector.errors import TransferPlanError, UnsupportedConfiguration
from worker.blocks import apply_prefix_caching, logical_to_kernel_block_ids


@pytest.mark.parametrize(
    ("block_ids", "ratio", "ssm_groups", "expected"),
    [
        # seed 000, case 1: FA + SWA groups, both expanded with ratio 2.
        (([0, 1, 2], [3, 4]), 2, (), [[0, 1, 2, 3, 4, 5], [6, 7, 8, 9]]),
        (([5], []), 3, (), [[15, 16, 17], []]),
        (([7, 2], [9]), 1, (), [[7, 2], [9]]),
        # SSM state blocks are never split.
        (([0, 1], [10, 11]), 4, (1,), [[0, 1, 2, 3, 4, 5, 6, 7], [10, 11]]),
    ],
    ids=["seed000-fa-swa-ratio-2", "empty-group", "ratio-1-identity", "ssm-passes-through"],
)
def test_logical_to_kernel_block_ids(block_ids, ratio, ssm_groups, expected):
    assert logical_to_kernel_block_ids(block_ids, ratio, ssm_groups) == expected


def test_seed000_remote_ratio_261_with_ssm_group_passing_through():
    # Seed 000, case 2: Nemotron-like hybrid, 261 kernel blocks per logical FA block. vLLM's
    # expected [0, 1, 261, 262, 522, 523] took only its local ratio (2) kernel blocks per
    # logical block; the contract expands every kernel block of the logical block.
    fa, ssm = logical_to_kernel_block_ids(([0, 1, 2], [10, 11]), 261, ssm_groups=(1,))
    assert ssm == [10, 11]
    assert fa == list(range(3 * 261))
    assert [fa[0], fa[1], fa[261], fa[262], fa[522], fa[523]] == [0, 1, 261, 262, 522, 523]


@pytest.mark.parametrize(
    ("block_ids", "ratio", "ssm_groups", "message"),
    [
        (([0],), 0, (), r"ratio must be in 1\.\.4096 kernel blocks per logical block, got 0"),
        (([0],), 10**9, (), r"ratio must be in 1\.\.4096 .*, got 1000000000; pass block_size //"),
        (([0],), 2.0, (), "ratio must be an integer .*, got float 2.0; pass block_size //"),
        (([0],), True, (), "ratio must be an integer .*, got bool True"),
        (([0],), "2", (), "ratio must be an integer .*, got str '2'"),
        (([0, -3],), 2, (), "block_ids group 0: block id -3 is negative; block ids index"),
        (([2**31],), 2, (), r"block id 2147483648 is above 2147483647"),
        (([0, 1.5],), 2, (), "block_ids group 0: block id 1.5 is a float, not an integer"),
        (([0, True],), 2, (), "block_ids group 0: block id True is a bool, not an integer"),
        (([4, 5, 4],), 2, (), "block_ids group 0: block id 4 appears twice; .* is corrupt"),
        (([0], [3, 3]), 2, (0,), "block_ids group 1: block id 3 appears twice"),
        ([0, 1], 2, (), r"block_ids group 0 is int 0, not a list of block ids; .* \[\[\.\.\.\]\]"),
        ("0,1", 2, (), "block_ids must be a list of block-id lists, one per cache group, got str"),
        ((["01"],), 2, (), "block_ids group 0: block id '01' is a str, not an integer"),
        (([0],), 2, (4,), r"SSM group index 4 is not one of 1 groups; pass indices in 0\.\.0"),
        (([0],), 2, (True,), "SSM group index True is not one of 1 groups"),
        (([0],), 2, "0", "ssm_groups must be a collection of group indices, got '0'"),
    ],
    ids=[
        "zero-ratio",
        "huge-ratio",
        "float-ratio",
        "bool-ratio",
        "string-ratio",
        "negative-id",
        "huge-id",
        "float-id",
        "bool-id",
        "duplicate-id",
        "duplicate-id-in-attention-group-beside-ssm",
        "flat-list-instead-of-groups",
        "string-instead-of-groups",
        "string-id",
        "ssm-group-out-of-range",
        "ssm-group-bool",
        "ssm-groups-string",
    ],
)  # fmt: skip
def test_logical_to_kernel_block_ids_rejects(block_ids, ratio, ssm_groups, message):
    with pytest.raises(TransferPlanError, match=message):
        logical_to_kernel_block_ids(block_ids, ratio, ssm_groups)


@pytest.mark.parametrize(
    ("local", "remote", "kwargs", "expected"),
    [
        # seed 001: SSM prefix trim only (3 placeholders + the real state).
        ([list(range(10)), [42]], [list(range(10)), [40, 41, 42, 43]], {},
         ([list(range(10)), [42]], [list(range(10)), [43]])),
        # seed 001: FA partial prefix hit, homogeneous TP: 4 blocks cached locally.
        ([list(range(6, 10)), [42]], [list(range(10)), [42]], {},
         ([list(range(6, 10)), [42]], [list(range(6, 10)), [42]])),
        # seed 001: both at once.
        ([[6, 7, 8, 9], [99]], [list(range(10)), [10, 20, 99]], {},
         ([[6, 7, 8, 9], [99]], [[6, 7, 8, 9], [99]])),
        # The seed's open risk: an empty local group must read nothing (x[-0:] is the whole list).
        ([[], []], [[1, 2, 3], [7, 8]], {}, ([[], []], [[], []])),
        # Full hit on the FA group only; SSM still pairs its tail.
        ([[], [5]], [[1, 2, 3], [7, 8]], {}, ([[], [5]], [[], [8]])),
        # Several local SSM entries: the real state is the last on both sides.
        ([[4], [3, 5]], [[1], [7, 8]], {}, ([[4], [5]], [[1], [8]])),
        # SSM placeholders may repeat (a null block); attention ids may not.
        ([[1], [3]], [[1], [0, 0, 3]], {}, ([[1], [3]], [[1], [3]])),
    ],
    ids=[
        "seed001-ssm-trim-only",
        "seed001-fa-prefix-hit-homo-tp",
        "seed001-fa-hit-and-ssm-trim",
        "empty-local-groups-read-nothing",
        "full-hit-fa-ssm-tail",
        "ssm-local-tail",
        "ssm-placeholders-may-repeat",
    ],
)  # fmt: skip
def test_apply_prefix_caching_equal_ratios(local, remote, kwargs, expected):
    assert (
        apply_prefix_caching(
            local, remote, ssm_groups=(1,), local_ratio=10, remote_ratio=10, **kwargs
        )
        == expected
    )


@pytest.mark.parametrize(
    ("local", "remote", "local_ratio", "remote_ratio", "num_tokens", "expected"),
    [
        # Decode logical 32 (2 kernel blocks of 16), prefill logical 16. 70 tokens, decode has
        # [0, 32) cached: decode kernel blocks cover kernel indices 2..5, prefill 0..4. vLLM
        # paired decode block k with prefill block k + 1 here.
        ([10, 11, 12, 13], [20, 21, 22, 23, 24], 2, 1, 70, ([10, 11, 12], [22, 23, 24])),
        # Reader block smaller than writer block (vLLM supports only the reverse).
        ([30, 31, 32], [40, 41, 42, 43, 44, 45], 1, 2, 70, ([30, 31, 32], [42, 43, 44])),
        # No prefix hit: every kernel block holding a token is paired by position.
        ([0, 1, 2, 3, 4, 5], [7, 8, 9, 10, 11], 2, 1, 70, ([0, 1, 2, 3, 4], [7, 8, 9, 10, 11])),
        # Full hit: nothing to pair.
        ([], [7, 8, 9, 10, 11], 2, 1, 70, ([], [])),
    ],
    ids=["decode-larger-partial-hit", "decode-smaller-partial-hit", "no-hit", "full-hit"],
)
def test_apply_prefix_caching_different_ratios_pairs_by_token(
    local, remote, local_ratio, remote_ratio, num_tokens, expected
):
    got = apply_prefix_caching(
        [local], [remote], local_ratio=local_ratio, remote_ratio=remote_ratio,
        num_tokens=num_tokens, kernel_block_size=16,
    )  # fmt: skip
    assert got == ([expected[0]], [expected[1]])


def test_apply_prefix_caching_different_ratios_without_token_count_is_unsupported():
    with pytest.raises(
        UnsupportedConfiguration, match="pairing them needs num_tokens and kernel_block_size"
    ):
        apply_prefix_caching([[1, 2]], [[1, 2, 3, 4]], local_ratio=2, remote_ratio=1)


@pytest.mark.parametrize(
    ("local", "remote", "kwargs", "message"),
    [
        ([[1, 2, 3]], [[1, 2]], {}, "decode wants 3 kernel blocks but prefill has only 2"),
        ([[1], [2]], [[1]], {}, "decode has 2 cache groups but prefill sent 1"),
        ([[1], [2]], [[1], []], {"ssm_groups": (1,)}, r"group 1 \(SSM\): decode expects a state block"),
        ([[1, 2]], [[1, 2, 3]], {"local_ratio": 2, "num_tokens": 70, "kernel_block_size": 16},
         "prefill 3 \\(expected 5\\)"),
        ([[1, 2]], [[1]], {"local_ratio": 2, "num_tokens": 0, "kernel_block_size": 16}, "must all be positive"),
        ([[1, 2]], [[1]], {"local_ratio": 2, "num_tokens": 7.5, "kernel_block_size": 16},
         "num_tokens must be an integer or None, got float 7.5"),
        ([[1]], [[1]], {"remote_ratio": 10**6}, r"remote_ratio must be in 1\.\.4096 .*got 1000000"),
        ([[1]], [[1]], {"local_ratio": 0}, r"local_ratio must be in 1\.\.4096 .*got 0"),
        ([[1]], [[1, 2, 1]], {}, "remote_ids group 0: block id 1 appears twice"),
        ([[-1]], [[1]], {}, "local_ids group 0: block id -1 is negative"),
        ([[1]], "1", {}, "remote_ids must be a list of block-id lists, one per cache group, got str"),
    ],
    ids=["local-longer-than-remote", "group-count-mismatch", "ssm-remote-empty",
         "wrong-remote-count-for-tokens", "zero-tokens", "float-tokens", "huge-remote-ratio",
         "zero-local-ratio", "duplicate-remote-id", "negative-local-id", "remote-as-a-string"],
)  # fmt: skip
def test_apply_prefix_caching_rejects_impossible_inputs(local, remote, kwargs, message):
    with pytest.raises(TransferPlanError, match=message):
        apply_prefix_caching(local, remote, **kwargs)
