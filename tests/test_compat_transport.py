"""worker.handshake.check_transport: peers need a NIXL backend in common that reads their memory."""

from __future__ import annotations

import pytest

from connector.errors import UnsupportedConfiguration
from connector.memory import HOST_MEMORY, Memory, MemoryKind
from worker.handshake import check_transport

GPU = Memory(MemoryKind.GPU, 0)
UCX_GPU = {"UCX": ("DRAM", "VRAM"), "POSIX": ("DRAM", "FILE")}
UCX_HOST_ONLY = {"UCX": ("DRAM",)}

ACCEPTED = [
    ("the same single backend", ("UCX",), ("UCX",), None, ("UCX",)),
    ("common ones in the local order", ("POSIX", "UCX"), ("UCX", "POSIX"), None, ("POSIX", "UCX")),
    ("a GPU-capable common backend", ("UCX",), ("UCX", "LIBFABRIC"), UCX_GPU, ("UCX",)),
]


@pytest.mark.parametrize(
    ("local", "remote", "mem_types", "expected"),
    [case[1:] for case in ACCEPTED],
    ids=[case[0] for case in ACCEPTED],
)
def test_accepted(
    local: tuple[str, ...], remote: tuple[str, ...], mem_types: dict | None, expected: tuple
) -> None:
    got = check_transport(
        local, remote, local_memory=GPU, remote_memory=HOST_MEMORY, backend_memory_types=mem_types
    )
    assert got == expected


def test_no_backend_in_common_is_refused_naming_both_lists() -> None:
    with pytest.raises(
        UnsupportedConfiguration,
        match=r"no NIXL backend in common: this rank has \['UCX'\], the peer \['LIBFABRIC'\]",
    ):
        check_transport(("UCX",), ("LIBFABRIC",))


def test_without_memory_types_only_the_backends_are_checked() -> None:
    assert check_transport(("UCX",), ("UCX",), remote_memory=GPU) == ("UCX",)


def test_a_host_only_backend_cannot_read_gpu_memory() -> None:
    with pytest.raises(UnsupportedConfiguration, match=r"GPU 0 \(VRAM\).*kv_buffer_device"):
        check_transport(("UCX",), ("UCX",), remote_memory=GPU, backend_memory_types=UCX_HOST_ONLY)
