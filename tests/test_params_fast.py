"""The one-convert path of parse_kv_transfer_params decides exactly as the key-by-key path."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from connector.errors import InvalidTransferParams
from connector.params import (
    KVTransferParams,
    _convert_whole,
    _parse_key_by_key,
    params_for_decode,
    parse_kv_transfer_params,
)
from tests.test_params import PREFILL_DONE

RETURNED_BY_PREFILL = {
    **params_for_decode(
        engine_id="prefill-0", request_id="cmpl-1", block_ids=(tuple(range(128)),),
        host="127.0.0.1", port=5600, tp_size=1,
    ),
    "remote_num_tokens": 2048,
}  # fmt: skip
TOY_PROXY_TO_PREFILL = {
    "do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
    "remote_block_ids": None, "remote_host": None, "remote_port": None,
}  # fmt: skip


@pytest.mark.parametrize(
    "raw",
    [
        RETURNED_BY_PREFILL,
        PREFILL_DONE,
        TOY_PROXY_TO_PREFILL,
        {"do_remote_decode": True},
        {**PREFILL_DONE, "remote_host": "höst"},
    ],
    ids=[
        "prefill's reply",
        "two groups",
        "the toy proxy's request",
        "do_remote_decode alone",
        "non-ASCII text",
    ],
)
def test_the_usual_params_take_one_convert(raw: dict[str, Any]) -> None:
    assert _convert_whole(raw) == _parse_key_by_key(raw) != None  # noqa: E711


LONG_WAY: list[tuple[str, dict[str, Any]]] = [
    ("an unknown key", {**PREFILL_DONE, "x_router": 1}),
    ("a router key named like our field", {"do_remote_decode": True, "ignored_keys": ["a"]}),
    ("a string port", {**PREFILL_DONE, "remote_port": "5600"}),
    ("a flat block list", {**PREFILL_DONE, "remote_block_ids": [1, 2]}),
    ("a null flag", {"do_remote_decode": None}),
    ("a lone surrogate", {**PREFILL_DONE, "remote_request_id": "a\ud800"}),
    ("an empty block list", {**PREFILL_DONE, "remote_block_ids": []}),
    ("both flags", {**PREFILL_DONE, "do_remote_decode": True}),
    ("a missing host", {k: v for k, v in PREFILL_DONE.items() if k != "remote_host"}),
]


@pytest.mark.parametrize("raw", [c[1] for c in LONG_WAY], ids=[c[0] for c in LONG_WAY])
def test_what_the_convert_cannot_decide_goes_the_long_way(raw: dict[str, Any]) -> None:
    assert _convert_whole(raw) is None


def outcome(parse: Any, raw: Any) -> KVTransferParams | None | str:
    try:
        return parse(raw)  # type: ignore[no-any-return]
    except InvalidTransferParams as exc:
        return f"refused: {exc}"


# Values near the rules' edges for every known key, plus unknown keys and odd key types.
EDGE_VALUES = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-3, max_value=3),
    st.sampled_from([65535, 65536, 2**31 - 1, 2**31, 2**40, 2**40 + 1, 10**40]),
    st.floats(allow_nan=False, width=16),
    st.sampled_from(["", "pull", "push", "5600", "x", "höst", "a\ud800", "x" * 4097]),
    st.lists(st.integers(min_value=-1, max_value=2**31), max_size=3),
    st.lists(st.lists(st.integers(min_value=-1, max_value=5), max_size=3), max_size=3),
    st.lists(st.one_of(st.integers(0, 3), st.lists(st.integers(0, 3))), max_size=3),
)
KEYS = st.sampled_from(
    [*PREFILL_DONE, "do_remote_decode", "remote_num_tokens", "transfer_mode", "ignored_keys",
     "x_router", 1, "\ud800"]
)  # fmt: skip


@settings(max_examples=1500, database=None)
@given(st.sampled_from([PREFILL_DONE, {}, {"do_remote_decode": True}]), st.dictionaries(KEYS, EDGE_VALUES, max_size=4), st.sets(st.sampled_from(list(PREFILL_DONE)), max_size=2))  # fmt: skip
def test_both_paths_decide_alike(
    base: dict[Any, Any], changes: dict[Any, Any], dropped: set[str]
) -> None:
    raw = {key: value for key, value in {**base, **changes}.items() if key not in dropped}
    assert outcome(parse_kv_transfer_params, raw) == outcome(_parse_key_by_key, raw)
