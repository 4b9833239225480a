"""The stable contract of DESIGN.md: names, parameters and error types outside tests call.

Behaviour is tested where each function lives (test_params, test_protocol, test_blocks,
test_topology, test_fake_nixl, test_e2e_*); this file fails when a refactor renames, moves or
re-orders what the contract names, so a move like issue 13's shows up here first.
"""

from __future__ import annotations

import importlib
import inspect

import pytest

from connector.errors import (
    InvalidNotification,
    InvalidTransferParams,
    TransferPlanError,
    UnsupportedConfiguration,
)
from connector.tools.cli import main

P = inspect.Parameter
POS, KW = P.POSITIONAL_OR_KEYWORD, P.KEYWORD_ONLY

# (module, function, [(parameter, kind, default or P.empty)]) exactly as DESIGN.md writes them
SIGNATURES = [
    ("connector.params", "parse_kv_transfer_params", [("raw", POS, P.empty)]),
    ("connector.protocol", "encode_free_notif",
     [("remote_request_id", POS, P.empty), ("consumers", POS, P.empty)]),
    ("connector.protocol", "decode_free_notif", [("msg", POS, P.empty)]),
    ("worker.blocks", "logical_to_kernel_block_ids",
     [("block_ids", POS, P.empty), ("ratio", POS, P.empty), ("ssm_groups", POS, ())]),
    ("worker.blocks", "apply_prefix_caching",
     [("local_ids", POS, P.empty), ("remote_ids", POS, P.empty), ("ssm_groups", KW, ()),
      ("local_ratio", KW, 1), ("remote_ratio", KW, 1), ("num_tokens", KW, None),
      ("kernel_block_size", KW, None)]),
    ("worker.topology", "tp_ratio", [("local_tp", POS, P.empty), ("remote_tp", POS, P.empty)]),
    ("worker.topology", "read_sources",
     [("local_rank", POS, P.empty), ("local_tp", POS, P.empty), ("remote_tp", POS, P.empty),
      ("num_kv_heads", POS, P.empty), ("replicated", KW, False)]),
    ("worker.topology", "expected_notifications",
     [("remote_rank", POS, P.empty), ("local_tp", POS, P.empty), ("remote_tp", POS, P.empty),
      ("num_kv_heads", POS, P.empty), ("replicated", KW, False)]),
]  # fmt: skip


@pytest.mark.parametrize(
    ("module", "name", "parameters"), SIGNATURES, ids=[f"{m}.{n}" for m, n, _ in SIGNATURES]
)
def test_contract_function_keeps_its_signature(module: str, name: str, parameters: list) -> None:
    function = getattr(importlib.import_module(module), name)
    seen = [(p.name, p.kind, p.default) for p in inspect.signature(function).parameters.values()]
    assert seen == parameters


def test_apply_prefix_caching_takes_the_contract_keywords() -> None:
    """The contract spells prefill's ids ``remote_ids``: callers may pass every name."""
    from worker.blocks import apply_prefix_caching

    assert apply_prefix_caching(local_ids=[[5]], remote_ids=[[1, 2]]) == ([[5]], [[2]])


@pytest.mark.parametrize(
    ("error", "base"),
    [
        (InvalidTransferParams, ValueError),
        (InvalidNotification, ValueError),
        (UnsupportedConfiguration, Exception),
        (TransferPlanError, Exception),
    ],
    ids=lambda value: value.__name__,
)
def test_contract_errors_keep_their_names_and_bases(error: type, base: type) -> None:
    assert issubclass(error, base) and error.__module__ == "connector.errors"


def test_read_source_fields_and_fake_nixl_home() -> None:
    from worker.fake import FakeNixl
    from worker.topology import read_sources

    (source,) = read_sources(0, 1, 1, 2)
    assert (source.remote_rank, source.local_heads, source.remote_heads) == (0, range(2), range(2))
    assert FakeNixl.__module__ == "worker.fake"


def test_demo_json_carries_the_contract_keys() -> None:
    from examples.demo import DemoResult

    keys = {"tokens_match", "kv_match", "requests", "bytes_transferred", "transfer_gbps"}
    keys |= {"failed_requests", "leaked_blocks_prefill", "leaked_blocks_decode"}
    assert keys <= set(DemoResult.__struct_fields__)


def test_demo_accepts_every_contract_flag(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["demo", "--help"]) == 0
    text = capsys.readouterr().out
    flags = "--prefill-tp --decode-tp --prefill-block-size --decode-block-size "
    flags += "--prefill-kernel-block-size --decode-kernel-block-size --layout --model "
    flags += "--decode-prefix-hit --requests --prompt-len --fake-nixl --json"
    assert [flag for flag in flags.split() if flag not in text] == []
    assert "{nhd,hnd}" in text and "{dense,mla,hybrid-swa,hybrid-ssm}" in text
