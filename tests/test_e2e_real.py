"""End to end over real NIXL (UCX on loopback): prefill and decode as separate processes.

A representative subset of the FakeNixl matrix, run through the demo exactly as
`nixl-pd demo` runs it: two server processes, the toy router, a single-engine reference.
"""

from __future__ import annotations

import os
from pathlib import Path

import msgspec
import pytest

from examples.demo import DemoOptions, run_demo
from examples.engine import EngineConfig
from examples.server import ServerProcess

pytestmark = pytest.mark.real_nixl

BASE = DemoOptions(requests=3, prompt_len=48, max_tokens=4, timeout_s=90.0)


def _replace(options: DemoOptions, **changes: object) -> DemoOptions:
    return msgspec.structs.replace(options, **changes)


def _case(**changes: object) -> DemoOptions:
    return _replace(BASE, **changes)


CASES = {
    "dense-tp1-1-defaults": BASE,
    "dense-tp2-4-decode-smaller-blocks-kernel-split-hnd-partial-hit": _case(
        model="dense",
        prefill_tp=2,
        decode_tp=4,
        prefill_block_size=16,
        decode_block_size=8,
        decode_kernel_block_size=4,
        layout="hnd",
        decode_prefix_hit=0.5,
    ),
    "mla-tp2-1-prefill-tp-larger": _case(model="mla", prefill_tp=2, decode_tp=1),
    "hybrid-swa-tp1-2-prefill-larger-blocks-kernel-split": _case(
        model="hybrid-swa",
        prefill_tp=1,
        decode_tp=2,
        prefill_block_size=32,
        prefill_kernel_block_size=16,
        decode_block_size=16,
    ),
    "hybrid-ssm-tp2-1-decode-larger-blocks-partial-hit": _case(
        model="hybrid-ssm",
        prefill_tp=2,
        decode_tp=1,
        prefill_block_size=8,
        decode_block_size=16,
        decode_prefix_hit=0.5,
    ),
    "hybrid-ssm-tp1-1-full-hit": _case(model="hybrid-ssm", decode_prefix_hit=1.0),
}


@pytest.mark.parametrize("options", list(CASES.values()), ids=list(CASES))
def test_separate_processes_over_real_nixl_match_single_engine(options: DemoOptions) -> None:
    result = run_demo(options)

    assert result.errors == []
    assert result.failed_requests == 0
    assert result.tokens_match
    assert result.kv_match
    assert (result.leaked_blocks_prefill, result.leaked_blocks_decode) == (0, 0)
    assert result.mode == "nixl-ucx-loopback"
    if options.decode_prefix_hit < 1.0:
        assert result.bytes_transferred > 0


def test_incompatible_models_are_refused_at_handshake_over_real_nixl() -> None:
    options = _replace(BASE, model="dense", decode_model="mla", requests=1, drain_timeout_s=0.5)

    result = run_demo(options)

    assert result.failed_requests == 1
    assert not result.ok
    assert "handshake with prefill engine" in result.errors[0]
    assert (
        "prefill and decode engines are not compatible: group0.head_dim: local '16', "
        "remote '8'" in result.errors[0]
    )


def test_a_server_that_cannot_start_reports_why_and_is_reaped(tmp_path: Path) -> None:
    config = EngineConfig("prefill-bad", role="prefill", model="gpt")
    server = ServerProcess(config, env=dict(os.environ), log_path=str(tmp_path / "log"))
    try:
        with pytest.raises(
            ConnectionError,
            match="prefill-bad failed: UnsupportedConfiguration: "
            "unknown model 'gpt'; choose one of",
        ):
            server.wait_ready(timeout_s=60.0)
    finally:
        server.close()

    assert server.process.returncode is not None
