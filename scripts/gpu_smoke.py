"""GPU smoke run: real vLLM prefill/decode on CUDA, direct (VRAM) and host-staged, vs one engine.

    bash scripts/gpu_smoke.sh [--python PATH] [--model DIR_OR_HF_NAME] [--modes direct,staged]

For each mode it starts a reference engine, a prefill engine and a decode engine (vLLM's
OpenAI server, our connector loaded by module path, examples/vllm/proxy.py in front), sends
greedy prompts of several lengths through the proxy and to the reference, and prints one line
per mode: PASS when every completion's token ids match the reference, with the decode
engine's transfer GB/s (nixl_pd_transfer_bytes / nixl_pd_transfer_seconds from its
/metrics). Two GPUs: prefill on GPU 0, decode on GPU 1; one GPU: all engines share it.

Without a CUDA GPU it prints that it ran nothing and exits 0: no pass is claimed. Exit 1: a
mode failed; exit 2: bad usage or a GPU machine without vLLM in ``--python``.
Stdlib only here; the engines run in ``--python`` (an environment with CUDA vLLM 0.33).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from tests import real_vllm_harness as harness  # noqa: E402

MODES = ("direct", "staged")
PROMPT_LENGTHS = (1, 15, 16, 17, 100, 500, 1000)
MAX_TOKENS = 8
ENGINES = {"reference": None, "prefill": "kv_producer", "decode": "kv_consumer"}


def probe_gpus(python: str) -> tuple[int, str]:
    """(CUDA devices seen by ``python``'s torch, why none) without importing torch here."""
    code = "import torch; print(torch.cuda.device_count() if torch.cuda.is_available() else 0)"
    try:
        result = subprocess.run(
            [python, "-c", code], capture_output=True, text=True, timeout=120, check=False
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        return 0, f"{python} could not run ({exc})"
    if result.returncode != 0:
        last = (result.stderr.strip().splitlines() or ["no output"])[-1]
        return 0, f"{python} has no working torch: {last}"
    count = int(result.stdout.strip() or 0)
    return count, "" if count else f"torch in {python} sees no CUDA device"


def has_vllm(python: str) -> bool:
    check = subprocess.run([python, "-c", "import vllm"], capture_output=True, check=False)
    return check.returncode == 0


def kv_config(role: str, mode: str) -> dict[str, object]:
    """--kv-transfer-config of one side; staged mode adds our kv_buffer_device key. No
    verify_kv: it digests host memory, and the direct mode registers the GPU cache."""
    config = harness.kv_transfer_config("nixlpd", role, verify_kv=False)
    if mode == "staged":
        config["kv_connector_extra_config"] = {"kv_buffer_device": "cpu"}
    return config


def devices(num_gpus: int) -> dict[str, str]:
    """CUDA_VISIBLE_DEVICES per engine: decode on its own GPU when there are two."""
    decode = "1" if num_gpus >= 2 else "0"
    return {"reference": "0", "prefill": "0", "decode": decode}


@dataclass(frozen=True)
class GpuEngineSpec(harness.EngineSpec):
    """The harness's engine, started on one GPU by ``python`` with a memory share."""

    python: str = "python3"
    cuda_devices: str | None = "0"  # None: a CPU engine (the --cpu stand-in run)
    gpu_memory_utilization: float = 0.25

    def command(self) -> list[str]:
        command = [self.python, *super().command()[1:]]
        if self.cuda_devices is None:
            return command
        share = ["--gpu-memory-utilization", str(self.gpu_memory_utilization)]
        return ["env", f"CUDA_VISIBLE_DEVICES={self.cuda_devices}", *command, *share]


def transfer_gbps(metrics_text: str) -> float | None:
    """Decode's bytes READ over its transfer seconds, summed over ranks; None before any."""

    def summed(name: str) -> float:
        pattern = rf"^{name}(?:\{{[^}}]*\}})?\s+(\S+)$"
        return sum(float(v) for v in re.findall(pattern, metrics_text, flags=re.MULTILINE))

    seconds = summed("nixl_pd_transfer_seconds_sum")
    num_bytes = summed("nixl_pd_transfer_bytes_sum")
    return num_bytes / seconds / 1e9 if seconds > 0 else None


def prompts(vocab_size: int = 500) -> list[list[int]]:
    return [[(7 * i + 3 * n) % (vocab_size - 3) + 3 for i in range(n)] for n in PROMPT_LENGTHS]


def run_mode(mode: str, args: argparse.Namespace, num_gpus: int, log_dir: Path) -> bool:
    """One mode's engines, prompts and verdict line; num_gpus 0 is the --cpu stand-in."""
    share = 0.25 if num_gpus < 2 else 0.4
    where: dict[str, str | None] = {**devices(num_gpus)} if num_gpus else dict.fromkeys(ENGINES)
    specs = {
        name: GpuEngineSpec(
            name,
            args.model,
            harness.free_port(),
            kv_config(role, mode) if role else None,
            harness.free_port() if role else None,
            python=args.python,
            cuda_devices=where[name],
            gpu_memory_utilization=share,
        )
        for name, role in ENGINES.items()
    }
    engines = {name: harness.Engine(spec, log_dir) for name, spec in specs.items()}
    proxy = None
    try:
        for engine in engines.values():
            engine.start()
        for engine in engines.values():
            engine.wait_ready()
        port = harness.free_port()
        proxy = harness.make_server(
            harness.HOST, port, engines["prefill"].url, engines["decode"].url
        )
        threading.Thread(target=proxy.serve_forever, daemon=True).start()
        matched = 0
        for prompt in prompts():
            got = harness.complete(f"http://{harness.HOST}:{port}", prompt, MAX_TOKENS)
            want = harness.complete(engines["reference"].url, prompt, MAX_TOKENS)
            matched += got.token_ids == want.token_ids
        gbps = transfer_gbps(engines["decode"].metrics())
    except (harness.EngineError, harness.RequestFailed, OSError) as exc:
        print(f"gpu_smoke: FAIL {mode}: {exc}", flush=True)
        return False
    finally:
        if proxy is not None:
            proxy.shutdown()
            proxy.server_close()
        for engine in engines.values():
            engine.cleanup()
    total = len(PROMPT_LENGTHS)
    ok = matched == total
    rate = "n/a" if gbps is None else f"{gbps:.3f} GB/s"
    verdict = "PASS" if ok else "FAIL"
    label = f"{mode}, CPU stand-in (not a GPU run)" if not num_gpus else mode
    print(f"gpu_smoke: {verdict} {label}: {matched}/{total} prompts match the single engine; "
          f"transfer {rate}", flush=True)  # fmt: skip
    return ok


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--python",
        default=os.environ.get("NIXL_PD_GPU_PYTHON", "python3"),
        help="python of an environment with CUDA vLLM 0.33 and this package (default: python3)",
    )
    parser.add_argument(
        "--model", default=None, help="model dir or HF name (default: the tier's tiny Llama)"
    )
    parser.add_argument("--modes", default=",".join(MODES), help="comma list of direct,staged")
    parser.add_argument(
        "--cpu",
        action="store_true",
        help="run the same flow on vLLM's CPU platform (e.g. --python .venv-vllm/bin/python) "
        "to check the script and the staged path; it proves nothing about GPUs",
    )
    args = parser.parse_args(argv)
    if os.sep in args.python:  # engines start in their own directories; keep the venv link
        args.python = os.path.abspath(args.python)
    args.modes = [m for m in args.modes.split(",") if m]
    unknown = set(args.modes) - set(MODES)
    if unknown or not args.modes:
        parser.error(f"--modes: unknown {sorted(unknown)}; choose from {', '.join(MODES)}")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    num_gpus, why = (0, "") if args.cpu else probe_gpus(args.python)
    if num_gpus == 0 and not args.cpu:
        print(f"gpu_smoke: no CUDA GPU here ({why}); ran nothing, no pass claimed", flush=True)
        return 0
    if not has_vllm(args.python):
        print(f"gpu_smoke: {num_gpus} GPU(s), but {args.python} cannot import vllm; "
              "pip install vllm==0.33.0 && pip install -e . there, or pass --python", flush=True)  # fmt: skip
        return 2
    log_dir = Path(tempfile.mkdtemp(prefix="nixlpd-gpu-smoke-"))
    if args.model is None:
        harness.VLLM_PYTHON = Path(args.python)  # build_model writes with the engines' python
        args.model = str(harness.build_model(log_dir / "tiny-llama"))
    where = "CPU stand-in, no GPU" if args.cpu else f"{num_gpus} GPU(s)"
    print(f"gpu_smoke: {where}; engine logs in {log_dir}", flush=True)
    results = {mode: run_mode(mode, args, num_gpus, log_dir) for mode in args.modes}
    ok = all(results.values())
    scope = " (CPU stand-in, not a GPU run)" if args.cpu else ""
    print(f"gpu_smoke: {'PASS' if ok else 'FAIL'}{scope} {json.dumps(results)}", flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
