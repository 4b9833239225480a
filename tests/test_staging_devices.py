"""connector.vllm.devices.memory_of and connector.vllm.staging.staging_enabled."""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch

if importlib.util.find_spec("vllm") is None and not os.environ.get("NIXL_PD_REQUIRE_VLLM"):
    pytest.skip("vllm is not installed (scripts/install_vllm.sh)", allow_module_level=True)

from connector.config import ConnectorConfig  # noqa: E402
from connector.errors import UnsupportedConfiguration  # noqa: E402
from connector.memory import HOST_MEMORY, Memory, MemoryKind  # noqa: E402
from connector.vllm.devices import memory_of  # noqa: E402
from connector.vllm.staging import staging_enabled  # noqa: E402


def test_cpu_tensors_are_host_memory() -> None:
    assert memory_of([torch.zeros(4), torch.zeros(2)]) == HOST_MEMORY


@pytest.mark.parametrize("index", [0, 3])
def test_cuda_tensors_are_gpu_memory_of_their_device(index: int) -> None:
    # Meta-device stand-ins cannot claim cuda; the device is what memory_of reads.
    class OnCuda:
        device = torch.device("cuda", index)

    assert memory_of([OnCuda(), OnCuda()]) == Memory(MemoryKind.GPU, index)  # type: ignore[list-item]


def test_tensors_on_two_devices_are_refused_naming_both() -> None:
    class OnCuda:
        device = torch.device("cuda", 1)

    with pytest.raises(UnsupportedConfiguration, match=r"2 devices \(cpu, cuda:1\)"):
        memory_of([torch.zeros(1), OnCuda()])  # type: ignore[list-item]


def test_a_device_nixl_cannot_register_points_at_staging() -> None:
    with pytest.raises(UnsupportedConfiguration, match='"kv_buffer_device": "cpu"'):
        memory_of([torch.zeros(1, device="meta")])


STAGING_CASES = [
    ("our key cpu stages, even on a cpu platform", "cpu", "cpu", "cpu", True),
    ("our key cuda never stages", "cuda", "cpu", "cuda", False),
    ("vLLM's cpu buffer stages on a GPU platform", None, "cpu", "cuda", True),
    ("vLLM's cpu buffer on a cpu platform: the cache is host memory", None, "cpu", "cpu", False),
    ("vLLM's cuda buffer registers device memory", None, "cuda", "cuda", False),
]


@pytest.mark.parametrize(
    ("ours", "vllms", "platform", "expected"),
    [case[1:] for case in STAGING_CASES],
    ids=[case[0] for case in STAGING_CASES],
)
def test_staging_enabled(ours: str | None, vllms: str, platform: str, expected: bool) -> None:
    config = ConnectorConfig(kv_buffer_device=ours)
    assert staging_enabled(config, vllms, platform) is expected


COPY_CASES = [
    ("one long run: slice copies", list(range(3, 19))),
    ("fragmented: one gather and scatter", [1, 4, 7, 10, 13]),
    ("two runs, still sliced", [*range(0, 8), *range(20, 28)]),
]


@pytest.mark.parametrize("ids", [case[1] for case in COPY_CASES], ids=[c[0] for c in COPY_CASES])
def test_torch_copy_blocks_moves_exactly_the_named_blocks(ids: list[int]) -> None:
    from connector.vllm.staging import torch_copy_blocks

    source = {"a": torch.randn(32, 2, 4, 8), "b": torch.randn(32, 2, 4, 8).permute(0, 2, 1, 3)}
    target = {name: torch.zeros_like(tensor) for name, tensor in source.items()}
    torch_copy_blocks(source, target, ids, ids, "d2h")
    for name, tensor in source.items():
        for block in range(32):
            expected = tensor[block] if block in ids else torch.zeros_like(tensor[block])
            assert torch.equal(target[name][block], expected), (name, block)
