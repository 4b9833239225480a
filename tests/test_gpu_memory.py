"""What the real NIXL agent is asked to do for GPU memory and backends (recorded, no GPU needed).

worker.nixl_real is imported against tests/nixl_recorder.py, a stand-in for ``nixl._api`` that
records every call: the memory type names, the device column of every row, the backends.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from connector.config import ConnectorConfig
from connector.errors import UnsupportedConfiguration
from connector.geometry import build_rank_layout
from connector.memory import HOST_MEMORY, Memory, MemoryKind
from tests.nixl_recorder import Recorder, load_recorded_nixl_real
from tests.test_worker_parts import BASE
from worker.connector import WorkerConnector

GPU_3 = Memory(MemoryKind.GPU, 3)


@pytest.fixture
def recorded(monkeypatch: pytest.MonkeyPatch) -> tuple[Any, Recorder]:
    recorder = Recorder()
    return load_recorded_nixl_real(monkeypatch, recorder), recorder


@pytest.mark.parametrize(
    ("memory", "mem_type", "device"),
    [(HOST_MEMORY, "DRAM", 0), (GPU_3, "VRAM", 3)],
    ids=["host-memory-is-DRAM-on-device-0", "gpu-3-is-VRAM-on-device-3"],
)
def test_regions_are_registered_with_their_memory_type_and_device(
    recorded: tuple[Any, Recorder], memory: Memory, mem_type: str, device: int
) -> None:
    nixl_real, recorder = recorded
    agent = nixl_real.RealNixlAgent("a", backends=("UCX",))
    agent.register_regions([(0x1000, 256), (0x9000, 512)], memory)
    assert recorder.of("register_memory") == [
        ([[0x1000, 256, device], [0x9000, 512, device]], mem_type)
    ]


def test_a_read_describes_each_side_with_its_own_memory(recorded: tuple[Any, Recorder]) -> None:
    nixl_real, recorder = recorded
    agent = nixl_real.RealNixlAgent("decode", backends=("UCX",))
    peer = agent.add_remote_agent(b"metadata-of-prefill")
    local = np.array([[0x1000, 64, 3], [0x2000, 64, 3]], dtype=np.int64)
    remote = np.array([[0x7000, 64, 1], [0x8000, 64, 1]], dtype=np.int64)
    agent.make_read(
        peer, local, remote, b"req:1", local_memory=GPU_3, remote_memory=Memory(MemoryKind.GPU, 1)
    )
    assert recorder.of("get_xfer_descs") == [
        (local.tolist(), "VRAM"),
        (remote.tolist(), "VRAM"),
    ]
    ((op, _, _, name, notif),) = recorder.of("initialize_xfer")
    assert (op, name, notif) == ("READ", "prefill", b"req:1")


def test_a_gpu_reader_of_a_host_peer_mixes_types(recorded: tuple[Any, Recorder]) -> None:
    nixl_real, recorder = recorded
    agent = nixl_real.RealNixlAgent("decode", backends=("UCX",))
    peer = agent.add_remote_agent(b"metadata-of-prefill")
    rows = np.array([[0x1000, 64, 0]], dtype=np.int64)
    agent.make_read(peer, rows + [0, 0, 2], rows, local_memory=Memory(MemoryKind.GPU, 2))
    assert [mem for _, mem in recorder.of("get_xfer_descs")] == ["VRAM", "DRAM"]


def test_every_configured_backend_is_created(recorded: tuple[Any, Recorder]) -> None:
    nixl_real, recorder = recorded
    nixl_real.RealNixlAgent("a", backends=("UCX", "POSIX"), num_threads=4)
    assert recorder.of("create_backend") == [("UCX", {"num_threads": "4"}), ("POSIX", {})]


def test_a_backend_nixl_lacks_is_refused_naming_the_installed_ones(
    recorded: tuple[Any, Recorder],
) -> None:
    nixl_real, _ = recorded
    with pytest.raises(UnsupportedConfiguration, match=r"'LIBFABRIC' is not available.*'UCX'"):
        nixl_real.RealNixlAgent("a", backends=("LIBFABRIC",))


def test_a_worker_on_gpu_registers_vram_and_tells_peers(recorded: tuple[Any, Recorder]) -> None:
    nixl_real, recorder = recorded
    config = ConnectorConfig(backends=("UCX", "POSIX"))
    agent = nixl_real.RealNixlAgent("prefill-r0", backends=config.backends)
    worker = WorkerConnector(
        config, engine_id="prefill", tp_rank=0, tp_size=1, spec=BASE, agent=agent
    )
    region_bytes = build_rank_layout(BASE, 0, 1).region_bytes
    addresses = [0x10000 * (i + 1) for i in range(len(region_bytes))]
    try:
        worker.register_kv_caches(addresses, GPU_3)
        handshake = worker.get_handshake_metadata()
    finally:
        worker.shutdown()
    ((rows, mem_type),) = recorder.of("register_memory")
    assert mem_type == "VRAM"
    assert rows == [[a, n, 3] for a, n in zip(addresses, region_bytes, strict=True)]
    assert handshake.memory == GPU_3
    assert handshake.backends == ("UCX", "POSIX")
