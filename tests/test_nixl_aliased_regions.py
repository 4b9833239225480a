"""Real NIXL with aliased regions: vLLM lets cache groups share one buffer, so a rank can hand
the same (address, length) region over twice. NIXL accepts the repeated row but segfaults
unregistering it; the agent registers each region once. Run in a child process, since the
failure mode is the process dying."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.real_nixl

CHILD = textwrap.dedent(
    """
    import uuid
    import numpy as np
    from worker.nixl_real import RealNixlAgent

    buffer = np.zeros(1 << 16, dtype=np.uint8)
    other = np.zeros(1 << 12, dtype=np.uint8)
    agent = RealNixlAgent(f"aliased-{uuid.uuid4().hex[:8]}")
    base, size = int(buffer.ctypes.data), buffer.nbytes
    registration = agent.register_regions(
        [(base, size), (int(other.ctypes.data), other.nbytes), (base, size)]
    )
    agent.deregister(registration)
    agent.close()
    print("clean exit")
    """
)


def test_a_region_given_twice_registers_once_and_unregisters_cleanly() -> None:
    env = {**os.environ, "UCX_NET_DEVICES": "lo"}
    child = subprocess.run(
        [sys.executable, "-c", CHILD], capture_output=True, text=True, timeout=60, env=env
    )
    assert child.returncode == 0, f"child died ({child.returncode}): {child.stderr[-2000:]}"
    assert "clean exit" in child.stdout
