"""scripts/gpu_smoke.sh: without a GPU it runs nothing and claims nothing; its pieces are right."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from connector.config import ConnectorConfig

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "scripts"))

import gpu_smoke  # noqa: E402


def _has_cuda() -> bool:
    import torch

    return bool(torch.cuda.is_available())


@pytest.mark.skipif(_has_cuda(), reason="a CUDA machine runs the real smoke run instead")
def test_without_a_gpu_it_says_so_and_exits_0_claiming_no_pass() -> None:
    result = subprocess.run(
        ["bash", str(REPO / "scripts" / "gpu_smoke.sh"), "--python", sys.executable],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    assert "gpu_smoke: no CUDA GPU here" in result.stdout
    assert "no pass claimed" in result.stdout
    assert "PASS" not in result.stdout


def test_a_bad_mode_is_a_usage_error() -> None:
    result = subprocess.run(
        ["bash", str(REPO / "scripts" / "gpu_smoke.sh"), "--modes", "direct,fast"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 2
    assert "unknown ['fast']" in result.stderr


def test_staged_mode_sets_our_kv_buffer_device_key_and_the_config_accepts_it() -> None:
    direct = gpu_smoke.kv_config("kv_producer", "direct")
    staged = gpu_smoke.kv_config("kv_consumer", "staged")
    assert "kv_connector_extra_config" not in direct
    assert staged["kv_connector_extra_config"] == {"kv_buffer_device": "cpu"}
    assert staged["kv_connector_module_path"] == "connector.vllm"
    extra = staged["kv_connector_extra_config"]
    assert ConnectorConfig.from_sources(extra, {}).kv_buffer_device == "cpu"  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("num_gpus", "decode_device"), [(1, "0"), (2, "1"), (8, "1")], ids=["one", "two", "eight"]
)
def test_decode_gets_its_own_gpu_when_there_are_two(num_gpus: int, decode_device: str) -> None:
    assert gpu_smoke.devices(num_gpus) == {
        "reference": "0",
        "prefill": "0",
        "decode": decode_device,
    }


def test_engine_command_pins_the_gpu_and_runs_the_given_python() -> None:
    config = gpu_smoke.kv_config("kv_consumer", "staged")
    spec = gpu_smoke.GpuEngineSpec(
        "decode", Path("/models/m"), 8200, config, 5700, python="/gpu/bin/python",
        cuda_devices="1", gpu_memory_utilization=0.4,
    )  # fmt: skip
    command = spec.command()
    assert command[:5] == [
        "env",
        "CUDA_VISIBLE_DEVICES=1",
        "/gpu/bin/python",
        "-m",
        "vllm.entrypoints.openai.api_server",
    ]
    assert command[-2:] == ["--gpu-memory-utilization", "0.4"]
    sent = json.loads(command[command.index("--kv-transfer-config") + 1])
    assert sent["kv_connector_extra_config"] == {"kv_buffer_device": "cpu"}


METRICS = """\
# HELP nixl_pd_transfer_bytes Decode: bytes READ per request and rank.
nixl_pd_transfer_bytes_sum{engine="0"} 3e9
nixl_pd_transfer_bytes_count{engine="0"} 4
nixl_pd_transfer_seconds_sum{engine="0"} 1.5
nixl_pd_transfer_bytes_sum{engine="1"} 1e9
nixl_pd_transfer_seconds_sum{engine="1"} 0.5
"""


def test_transfer_gbps_sums_bytes_over_seconds_across_label_sets() -> None:
    assert gpu_smoke.transfer_gbps(METRICS) == pytest.approx(2.0)
    assert gpu_smoke.transfer_gbps("# nothing transferred yet\n") is None


def test_the_cpu_stand_in_starts_plain_engines_and_never_claims_a_gpu() -> None:
    spec = gpu_smoke.GpuEngineSpec(
        "prefill", Path("/models/m"), 8100, None, None, python="/v/bin/python", cuda_devices=None
    )
    command = spec.command()
    assert command[0] == "/v/bin/python"
    assert "--gpu-memory-utilization" not in command
    assert not any(part.startswith("CUDA_VISIBLE_DEVICES") for part in command)
    args = gpu_smoke.parse_args(["--cpu", "--python", "relative/bin/python"])
    assert args.cpu and Path(args.python).is_absolute()
    assert args.python.endswith("relative/bin/python")  # the venv link is kept, not resolved
