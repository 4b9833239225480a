"""The example servers' request decoding never dies on input (issue 11, finding 2).

2,112 bytes of JSON nested 1,000 deep in a request's kv_transfer_params killed either server
(RecursionError; the loop caught only DecodeError). Every payload here must get one typed
Error (or a failed Output) back, and the loop must then serve a valid request. Both transports
(the socket's and stdin's) share one decoder; hypothesis feeds it generated garbage.
"""

from __future__ import annotations

import contextlib
import json
import random
import threading

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from examples.engine import Engine, EngineConfig
from examples.engine_loop import (
    MAX_PARAMS_DEPTH,
    BadCommand,
    EngineLoop,
    Error,
    Event,
    Output,
    Peer,
    decode_command,
)
from examples.request_socket import socket_command_decoder


def submit(request_id: str = "ok", **request: object) -> bytes:
    body = {"request_id": request_id, "prompt_token_ids": [1, 2, 3], "max_tokens": 2, **request}
    return json.dumps({"type": "submit", "request": body}).encode()


def nested(depth: int, leaf: str = "1") -> str:
    return "[" * depth + leaf + "]" * depth


BAD_PAYLOADS = {
    "params-nested-1000-deep-lists": submit(kv_transfer_params=None).replace(
        b'"kv_transfer_params": null', b'"kv_transfer_params": {"x": ' + nested(1000).encode() + b"}"
    ),
    "params-nested-1000-deep-objects": submit().replace(
        b'"max_tokens": 2', b'"max_tokens": 2, "kv_transfer_params": ' + (b'{"a":' * 1000)
        + b"1" + b"}" * 1000
    ),
    "params-nested-40-deep-decodes-but-refused": submit().replace(
        b'"max_tokens": 2', b'"max_tokens": 2, "kv_transfer_params": {"x": ' + nested(40).encode()
        + b"}"
    ),
    "whole-message-nested-5000-deep": nested(5000).encode(),
    "invalid-utf8": b'{"type": "submit", "request": "\xff\xfe"}',
    "not-an-object": b"42",
    "empty": b"",
    "unknown-type": b'{"type": "shutdown"}',
    "huge-int": submit().replace(b'"max_tokens": 2', b'"max_tokens": ' + b"9" * 5000),
    "nan-token": submit().replace(b"[1, 2, 3]", b"[NaN]"),
}  # fmt: skip


class ListTransport:
    """Feeds queued payloads to the loop; records what it sends; closes when drained."""

    def __init__(self, payloads: list[bytes]) -> None:
        self.payloads = [(payload, (b"client",)) for payload in payloads]
        self.sent: list[Event] = []

    def receive(self, timeout_s: float) -> list[tuple[bytes, Peer]] | None:
        if not self.payloads:
            return None
        batch, self.payloads = self.payloads[:1], self.payloads[1:]
        return batch

    def decode(self, payload: bytes) -> object:
        return decode_command(socket_command_decoder, payload)

    def send(self, peer: Peer, event: Event) -> None:
        self.sent.append(event)


@pytest.mark.parametrize("payload", list(BAD_PAYLOADS.values()), ids=list(BAD_PAYLOADS))
def test_bad_payload_gets_an_error_and_the_loop_keeps_serving(payload: bytes) -> None:
    engine = Engine(EngineConfig("local"))
    transport = ListTransport([payload, submit("after")])
    loop = EngineLoop(engine, transport)  # type: ignore[arg-type]
    loop.serve(threading.Event())
    for _ in range(20):  # the transport closed; finish the valid request
        for output in engine.step():
            transport.sent.append(Output(output))
    first, *rest = transport.sent
    assert isinstance(first, Error) and first.message.startswith("bad command: "), first
    outputs = [event.output for event in rest if isinstance(event, Output)]
    assert [(o.request_id, o.error, len(o.token_ids)) for o in outputs] == [("after", None, 2)]


def test_params_depth_error_names_the_limit() -> None:
    payload = BAD_PAYLOADS["params-nested-40-deep-decodes-but-refused"]
    with pytest.raises(BadCommand, match=rf"nested deeper than {MAX_PARAMS_DEPTH} levels"):
        decode_command(socket_command_decoder, payload)


JSON_LEAVES = st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=8)
JSON_VALUES = st.recursive(
    JSON_LEAVES,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner, max_size=4),
    max_leaves=30,
)  # fmt: skip


@settings(max_examples=2000, deadline=None, suppress_health_check=list(HealthCheck))
@given(st.binary(max_size=200))
def test_fuzz_random_bytes_decode_or_raise_bad_command(payload: bytes) -> None:
    with contextlib.suppress(BadCommand):
        decode_command(socket_command_decoder, payload)


@settings(max_examples=500, deadline=None, suppress_health_check=list(HealthCheck))
@given(JSON_VALUES, st.sampled_from(["submit", "get_info", "get_stats", "other"]))
def test_fuzz_json_shaped_commands_decode_or_raise_bad_command(value: object, tag: str) -> None:
    documents = [
        {"type": tag, "request": value},
        {"type": "submit", "request": {"request_id": "r", "prompt_token_ids": [1],
                                       "max_tokens": 1, "kv_transfer_params": value}},
    ]  # fmt: skip
    for document in documents:
        with contextlib.suppress(BadCommand):
            decode_command(socket_command_decoder, json.dumps(document).encode())


MUTATION_SEEDS = [
    submit(),
    submit(kv_transfer_params={"do_remote_prefill": True, "remote_block_ids": [[1, 2]]}),
    b'{"type": "get_info"}',
    b'{"type": "get_stats"}',
]
INSERTS = [b"[", b"{", b'{"a":', b"]", b"}", b'"', b"\\", b"\xff", b"-", b"1e999", b"null", b","]


def mutate(rng: random.Random, payload: bytes) -> bytes:
    """One of: a byte flipped, a cut, a run of one insert (deep nesting), a repeat."""
    position = rng.randrange(len(payload) + 1)
    choice = rng.randrange(4)
    if choice == 0 and payload:
        index = min(position, len(payload) - 1)
        return payload[:index] + bytes([rng.randrange(256)]) + payload[index + 1 :]
    if choice == 1:
        return payload[:position]
    if choice == 2:
        return (
            payload[:position]
            + rng.choice(INSERTS) * rng.choice([1, 3, 100, 2000])
            + payload[position:]
        )
    return payload[:position] + payload[rng.randrange(len(payload) + 1) :] * 2


def test_ten_thousand_mutated_commands_decode_or_raise_bad_command() -> None:
    rng = random.Random(11)
    outcomes = {"decoded": 0, "refused": 0}
    for _ in range(10_000):
        payload = rng.choice(MUTATION_SEEDS)
        for _ in range(rng.randrange(1, 4)):
            payload = mutate(rng, payload)
        try:
            decode_command(socket_command_decoder, payload)
            outcomes["decoded"] += 1
        except BadCommand:
            outcomes["refused"] += 1
    assert sum(outcomes.values()) == 10_000 and outcomes["refused"] > 5_000
