"""kv_transfer_params validation: every malformed dict fails with a message naming the key."""

from __future__ import annotations

from typing import Any

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from connector.errors import InvalidTransferParams
from connector.metadata import RemoteSource
from connector.params import (
    KVTransferParams,
    params_for_decode,
    params_for_prefill,
    parse_kv_transfer_params,
    validate_block_groups,
)
from connector.protocol import encode_free_notif

PREFILL_DONE: dict[str, Any] = {
    "do_remote_prefill": True,
    "remote_engine_id": "prefill-0",
    "remote_request_id": "cmpl-1",
    "remote_block_ids": [[1, 2, 3], [7]],
    "remote_host": "127.0.0.5",
    "remote_port": 5600,
    "tp_size": 2,
}


def decode_params(**changes: Any) -> dict[str, Any]:
    """PREFILL_DONE with keys changed; a value of ... deletes the key."""
    params = dict(PREFILL_DONE)
    for key, value in changes.items():
        if value is ...:
            del params[key]
        else:
            params[key] = value
    return params


def nested(depth: int) -> list[Any]:
    """[[[...[]...]]] with ``depth`` lists inside the outer one."""
    value: list[Any] = []
    for _ in range(depth):
        value = [value]
    return value


MALFORMED: list[tuple[str, Any, str]] = [
    ("params that are a list", [1, 2], "must be a JSON object"),
    ("params that are a string", "do_remote_decode", "must be a JSON object"),
    ("a key that is not a string", {1: True}, "key 1 is not a string"),
    ("do_remote_decode as the string 'true'", {"do_remote_decode": "true"}, "'do_remote_decode'"),
    ("do_remote_decode as the integer 1", {"do_remote_decode": 1}, "'do_remote_decode'"),
    (
        "do_remote_prefill as the integer 0",
        decode_params(do_remote_prefill=0),
        "'do_remote_prefill'",
    ),
    (
        "both do_remote_decode and do_remote_prefill",
        decode_params(do_remote_decode=True),
        "both true",
    ),
    (
        "prefill params without remote_engine_id",
        decode_params(remote_engine_id=...),
        "remote_engine_id",
    ),
    (
        "prefill params without remote_request_id",
        decode_params(remote_request_id=...),
        "remote_request_id",
    ),
    (
        "prefill params without remote_block_ids",
        decode_params(remote_block_ids=...),
        "remote_block_ids",
    ),
    ("prefill params without remote_host", decode_params(remote_host=...), "remote_host"),
    ("prefill params without remote_port", decode_params(remote_port=...), "remote_port"),
    (
        "prefill params with a null remote_host",
        decode_params(remote_host=None),
        "remote_host missing",
    ),
    ("an empty remote_engine_id", decode_params(remote_engine_id=""), "'remote_engine_id'"),
    ("a numeric remote_engine_id", decode_params(remote_engine_id=7), "'remote_engine_id'"),
    ("an empty remote_request_id", decode_params(remote_request_id=""), "'remote_request_id'"),
    ("a list as remote_request_id", decode_params(remote_request_id=["a"]), "'remote_request_id'"),
    ("an empty remote_host", decode_params(remote_host=""), "'remote_host'"),
    ("remote_port 0", decode_params(remote_port=0), "'remote_port'.*>= 1"),
    ("remote_port 65536", decode_params(remote_port=65536), "'remote_port'.*<= 65535"),
    ("a negative remote_port", decode_params(remote_port=-1), "'remote_port'"),
    ("remote_port as a word", decode_params(remote_port="http"), "'remote_port'.*got `str`"),
    ("remote_port with a space", decode_params(remote_port=" 5600"), "'remote_port'.*got `str`"),
    ("remote_port in non-ASCII digits", decode_params(remote_port="٥٦٠٠"), "'remote_port'"),
    ("remote_port as a numeric string too big", decode_params(remote_port="99999"), "<= 65535"),
    ("remote_port as a float", decode_params(remote_port=5600.0), "'remote_port'.*got `float`"),
    ("remote_port as a bool", decode_params(remote_port=True), "'remote_port'.*got `bool`"),
    ("tp_size 0", decode_params(tp_size=0), "'tp_size'.*>= 1"),
    ("tp_size as a bool", decode_params(tp_size=True), "'tp_size'.*got `bool`"),
    ("tp_size as a string", decode_params(tp_size="2"), "'tp_size'"),
    ("tp_size with 40 digits", decode_params(tp_size=10**40), "'tp_size'"),
    ("a negative remote_num_tokens", decode_params(remote_num_tokens=-1), "'remote_num_tokens'"),
    (
        "transfer_mode push",
        decode_params(transfer_mode="push"),
        r"'push' is not served; this connector only reads .*\('pull'\)",
    ),
    ("transfer_mode as a number", decode_params(transfer_mode=1), "'transfer_mode'.*got `int`"),
    ("remote_block_ids as a string", decode_params(remote_block_ids="1,2"), "'remote_block_ids'"),
    (
        "remote_block_ids as a dict",
        decode_params(remote_block_ids={"0": [1]}),
        "'remote_block_ids'",
    ),
    ("an empty remote_block_ids", decode_params(remote_block_ids=[]), "holds no cache group"),
    (
        "a negative block id",
        decode_params(remote_block_ids=[[1, -2]]),
        r"remote_block_ids\[0\]\[1\]",
    ),
    ("a bool block id", decode_params(remote_block_ids=[[1, True]]), "got `bool`"),
    ("a float block id", decode_params(remote_block_ids=[[1.5]]), "got `float`"),
    ("a string block id", decode_params(remote_block_ids=[["3"]]), "got `str`"),
    ("a block id above 2**31-1", decode_params(remote_block_ids=[[2**31]]), "<= 2147483647"),
    (
        "a flat list mixing ids and lists",
        decode_params(remote_block_ids=[1, [2]]),
        "'remote_block_ids'",
    ),
    ("groups mixing lists and ids", decode_params(remote_block_ids=[[1], 2]), "'remote_block_ids'"),
    ("a group of nested lists", decode_params(remote_block_ids=[[[1]]]), "'remote_block_ids'"),
    ("a null group", decode_params(remote_block_ids=[None]), "'remote_block_ids'"),
    (
        "a lone surrogate in remote_request_id",
        decode_params(remote_request_id="cmpl-\ud800"),
        r"\['remote_request_id'\]: 'cmpl-\\ud800' is not valid Unicode .*at index 5\); send UTF-8",
    ),
    (
        "a lone surrogate in an unknown key's nested value",
        {"do_remote_decode": True, "x_hint": {"tags": ["ok", "\udfff"]}},
        r"\['x_hint'\]\['tags'\]\[1\]: '\\udfff' is not valid Unicode",
    ),
    (
        "a lone surrogate in a key",
        {"do_remote_decode": True, "x\ud800": 1},
        r"kv_transfer_params key: 'x\\ud800' is not valid Unicode",
    ),
    (
        "a non-string key inside an unknown key's value",
        {"x_hint": {1: 2}},
        r"\['x_hint'\]: key 1 is not a string",
    ),
    (
        "an unknown key nested 10,000 levels deep",
        {"do_remote_decode": True, "x_hint": nested(10_000)},
        r"\['x_hint'\](\[0\]){32}: nested more than 32 levels deep",
    ),
    (
        "remote_block_ids nested 40 levels deep",
        decode_params(remote_block_ids=nested(40)),
        "nested more than 32 levels deep",
    ),
    (
        "params that are a deeply nested list",
        nested(10_000),
        "must be a JSON object, got list",
    ),
    (
        "an overlong remote_request_id",
        decode_params(remote_request_id="x" * 5000),
        "'remote_request_id'",
    ),
]


@pytest.mark.parametrize(
    ("raw", "message"), [case[1:] for case in MALFORMED], ids=[case[0] for case in MALFORMED]
)
def test_malformed_params_are_rejected_naming_the_key(raw: Any, message: str) -> None:
    with pytest.raises(InvalidTransferParams, match=message):
        parse_kv_transfer_params(raw)


def test_invalid_transfer_params_is_a_value_error() -> None:
    with pytest.raises(ValueError):
        parse_kv_transfer_params({"remote_port": "x"})


def test_long_values_are_shortened_in_the_message() -> None:
    with pytest.raises(InvalidTransferParams) as info:
        parse_kv_transfer_params(decode_params(remote_block_ids="y" * 10_000))
    assert len(str(info.value)) < 400


VALID: list[tuple[str, Any, KVTransferParams | None]] = [
    ("None means no transfer", None, None),
    ("an empty dict means no transfer", {}, None),
    ("do_remote_decode alone", {"do_remote_decode": True}, KVTransferParams(do_remote_decode=True)),
    (
        "the toy proxy's request to prefill, with null remote keys",
        {
            "do_remote_decode": True,
            "do_remote_prefill": False,
            "remote_engine_id": None,
            "remote_block_ids": None,
            "remote_host": None,
            "remote_port": None,
        },
        KVTransferParams(do_remote_decode=True),
    ),
    (
        "prefill's reply, two groups",
        PREFILL_DONE,
        KVTransferParams(
            do_remote_prefill=True,
            remote_engine_id="prefill-0",
            remote_request_id="cmpl-1",
            remote_block_ids=((1, 2, 3), (7,)),
            remote_host="127.0.0.5",
            remote_port=5600,
            tp_size=2,
        ),
    ),
    (
        "a flat block list means one group",
        decode_params(remote_block_ids=[4, 5]),
        KVTransferParams(
            do_remote_prefill=True,
            remote_engine_id="prefill-0",
            remote_request_id="cmpl-1",
            remote_block_ids=((4, 5),),
            remote_host="127.0.0.5",
            remote_port=5600,
            tp_size=2,
        ),
    ),
    (
        "unknown router keys are tolerated and listed",
        {"do_remote_decode": True, "x_router_hint": {"a": 1}, "priority": 3},
        KVTransferParams(do_remote_decode=True, ignored_keys=("priority", "x_router_hint")),
    ),
    (
        "prefill's reply without tp_size, a string port and vLLM's extra keys",
        decode_params(tp_size=..., remote_port="5600", remote_num_tokens=40, transfer_mode="pull"),
        KVTransferParams(
            do_remote_prefill=True,
            remote_engine_id="prefill-0",
            remote_request_id="cmpl-1",
            remote_block_ids=((1, 2, 3), (7,)),
            remote_host="127.0.0.5",
            remote_port=5600,
            remote_num_tokens=40,
            transfer_mode="pull",
        ),
    ),
    (
        "unknown keys may nest 32 levels and hold any valid Unicode",
        {"do_remote_decode": True, "x_hint": nested(31), "x_note": "日本\U0001f600"},
        KVTransferParams(do_remote_decode=True, ignored_keys=("x_hint", "x_note")),
    ),
    (
        "both flags false",
        {"do_remote_decode": False, "do_remote_prefill": False},
        KVTransferParams(),
    ),
]


@pytest.mark.parametrize(("raw", "expected"), [c[1:] for c in VALID], ids=[c[0] for c in VALID])
def test_valid_params_parse(raw: Any, expected: KVTransferParams | None) -> None:
    assert parse_kv_transfer_params(raw) == expected


def test_an_empty_group_is_allowed() -> None:
    parsed = parse_kv_transfer_params(decode_params(remote_block_ids=[[1], []]))
    assert parsed is not None and parsed.remote_block_ids == ((1,), ())


def test_params_for_decode_round_trip_through_the_parser() -> None:
    returned = params_for_decode(
        engine_id="prefill-0",
        request_id="cmpl-1",
        block_ids=((1, 2, 3), (7,)),
        host="127.0.0.5",
        port=5600,
        tp_size=2,
    )
    assert returned == {**PREFILL_DONE, "do_remote_decode": False, "transfer_mode": "pull"}
    parsed = parse_kv_transfer_params(returned)
    assert parsed is not None
    assert parsed.remote_source() == RemoteSource(
        engine_id="prefill-0",
        host="127.0.0.5",
        port=5600,
        tp_size=2,
        remote_request_id="cmpl-1",
        remote_block_ids=((1, 2, 3), (7,)),
    )


def test_params_for_prefill_name_a_pull_of_decode_held_blocks() -> None:
    returned = params_for_prefill(
        engine_id="decode-0",
        request_id="cmpl-1",
        block_ids=((4, 5, 6),),
        host="127.0.0.6",
        port=5700,
        tp_size=2,
        num_tokens=40,
        expiry_s=123.5,
        boot_id="boot1",
        lease_id="lease1",
    )
    assert returned["do_remote_decode"] is True and returned["do_remote_prefill"] is False
    assert returned["remote_blocks_expiry_time"] == 123.5
    parsed = parse_kv_transfer_params(returned)
    assert parsed is not None and parsed.ignored_keys == ()
    assert parsed.pull_source() == RemoteSource(
        engine_id="decode-0",
        host="127.0.0.6",
        port=5700,
        tp_size=2,
        remote_request_id="cmpl-1",
        remote_block_ids=((4, 5, 6),),
        boot_id="boot1",
        lease_id="lease1",
        remote_num_tokens=40,
    )


@pytest.mark.parametrize(
    "params",
    [
        {"do_remote_decode": True},
        {"do_remote_decode": True, "remote_engine_id": None, "remote_block_ids": None},
        {"do_remote_decode": True, "remote_block_ids": [[1]], "remote_host": "h"},
        {
            "do_remote_decode": True,
            "remote_engine_id": "d",
            "remote_request_id": "r",
            "remote_block_ids": [[]],
            "remote_host": "h",
            "remote_port": 1,
        },
    ],
    ids=["first-turn", "null-keys", "incomplete-address", "no-blocks"],
)
def test_params_without_a_complete_hold_ask_for_no_pull(params: dict[str, Any]) -> None:
    parsed = parse_kv_transfer_params(params)
    assert parsed is not None and parsed.pull_source() is None


def test_tp_size_defaults_to_1_as_vllm_assumes() -> None:
    parsed = parse_kv_transfer_params(decode_params(tp_size=...))
    assert parsed is not None and parsed.remote_source().tp_size == 1


def test_remote_source_needs_do_remote_prefill() -> None:
    with pytest.raises(InvalidTransferParams, match="do_remote_prefill is not set"):
        KVTransferParams(do_remote_decode=True).remote_source()


@pytest.mark.parametrize(
    ("block_ids", "num_groups", "message"),
    [
        ([[1], [2]], 2, None),
        ([1, 2], 1, None),
        ([[1], [2]], 1, "2 cache group.*this engine has 1"),
        ([1, 2], 3, "1 cache group.*this engine has 3"),
    ],
    ids=["two groups for two", "flat list for one", "two groups for one", "one group for three"],
)
def test_validate_block_groups(block_ids: Any, num_groups: int, message: str | None) -> None:
    params = parse_kv_transfer_params(decode_params(remote_block_ids=block_ids))
    assert params is not None
    if message is None:
        validate_block_groups(params.remote_block_ids, num_groups)
    else:
        with pytest.raises(InvalidTransferParams, match=message):
            validate_block_groups(params.remote_block_ids, num_groups)


# ---------------------------------------------------------------- fuzz: nothing untyped escapes

# Strings with anything in them: every code point, lone surrogates included (json.loads makes
# them from "\\ud800"), plus the values the validators look at.
ODD_TEXT = st.one_of(
    st.text(st.characters(exclude_categories=()), max_size=12),
    st.sampled_from(["", "\ud800", "a\udfffb", "5600", "pull", "push", "0", "-1", "true", "nan"]),
)
SCALARS = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(),
    st.integers(min_value=-(2**80), max_value=2**80),
    st.sampled_from([5000, -4400]).map(
        lambda e: 10 ** abs(e) * (1 if e > 0 else -1)
    ),  # repr raises
    st.floats(allow_nan=True),
    ODD_TEXT,
    st.binary(max_size=4),
)
JSONISH = st.recursive(
    SCALARS,
    lambda inner: st.one_of(
        st.lists(inner, max_size=4),
        st.tuples(inner, inner),
        st.dictionaries(st.one_of(ODD_TEXT, st.integers()), inner, max_size=4),
    ),
    max_leaves=12,
)
DEPTHS = st.one_of(st.none(), st.integers(min_value=1, max_value=3000))  # nested in the test
KNOWN_KEYS = [*PREFILL_DONE, "do_remote_decode", "remote_num_tokens", "transfer_mode"]


def inputs_around(value: Any) -> list[Any]:
    """One fuzzed value in every place of the params: 14 inputs (drawing is the slow part)."""
    return [
        value,
        {"x_router_hint": value},
        {"do_remote_decode": True, "x_router_hint": {"nested": [value]}},
        {value if isinstance(value, str) else "x_other": True},
        *({**PREFILL_DONE, key: value} for key in KNOWN_KEYS),
    ]


NUM_FUZZ_VALUES = 750  # x 14 places = 10,500 inputs


def check_typed_outcome(raw: Any) -> None:
    """None, a usable KVTransferParams, or InvalidTransferParams: nothing else may escape."""
    try:
        parsed = parse_kv_transfer_params(raw)
    except InvalidTransferParams as exc:
        assert str(exc).startswith("kv_transfer_params")
        return
    if parsed is None:
        return
    assert isinstance(parsed, KVTransferParams)
    msgspec.msgpack.encode(parsed)  # crosses process boundaries in the step metadata
    if parsed.do_remote_prefill:
        source = parsed.remote_source()
        encode_free_notif(source.remote_request_id, 1)  # the READ's notification: UTF-8 bytes


def test_fuzzed_params_raise_only_invalid_transfer_params() -> None:
    num_inputs = 0

    @settings(max_examples=NUM_FUZZ_VALUES, database=None)
    @given(JSONISH, DEPTHS)
    def check(value: Any, depth: int | None) -> None:
        nonlocal num_inputs
        if depth is not None:  # built here: hypothesis would repr a deep value recursively
            value = nested(depth) if depth % 2 else [value, nested(depth)]
        for raw in inputs_around(value):
            check_typed_outcome(raw)
            num_inputs += 1

    check()
    assert num_inputs >= 10_000
