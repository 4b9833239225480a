"""The kernel's floor under fragmented READs on one host: one process_vm_readv per descriptor.

    .venv/bin/python -m benchmarks.cma_floor        # needs a C compiler (cc); ~1 min

UCX's CMA transport, which NIXL uses between two processes on one host, copies each READ
descriptor with its own process_vm_readv. benchmarks/cma_floor.c reads the same bytes from a
child process with no UCX or NIXL in the way: 32 KiB pieces at shuffled addresses one per
call (a fragmented layer-outermost READ), the same pieces many per call (what batching
descriptors into one syscall would give), and 1 MiB pieces (the big-descriptor ceiling), each
with 1 and 2 threads. The ratios to the 1 MiB row of the same thread count bound what any
connector on this transport can reach with one descriptor per (layer plane, block).
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import tempfile
from pathlib import Path

SOURCE = Path(__file__).with_name("cma_floor.c")
PIECE = 32 * 1024
CEILING_PIECE = 1024 * 1024
MODES = (("32 KiB, one per call", PIECE, 1), ("32 KiB, 64 per call", PIECE, 64),
         ("1 MiB, one per call", CEILING_PIECE, 1))  # fmt: skip


def _compile(work_dir: Path) -> Path:
    compiler = shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        raise SystemExit("cma_floor needs a C compiler (cc or gcc) on PATH")
    binary = work_dir / "cma_floor"
    subprocess.run([compiler, "-O2", "-pthread", "-o", str(binary), str(SOURCE)], check=True)
    return binary


def _run(binary: Path, mib: int, piece: int, per_call: int, threads: int, repeats: int) -> str:
    args = [str(binary), str(mib), str(piece), str(per_call), str(threads), str(repeats)]
    return subprocess.run(args, check=True, capture_output=True, text=True, timeout=300).stdout


def _gbps(line: str) -> tuple[float, float]:
    """(GB/s, CPU µs per piece) from the binary's line."""
    words = line.replace(",", "").split()
    return float(words[words.index("GB/s") - 1]), float(words[words.index("CPU") - 1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=int, default=256, help="bytes read per repeat, MiB")
    parser.add_argument("--repeats", type=int, default=7, help="the best repeat counts")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds; median")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="cma-floor-") as work:
        binary = _compile(Path(work))
        results: dict[tuple[str, int], list[tuple[float, float]]] = {}
        for _ in range(args.rounds):
            for threads in (1, 2):
                for label, piece, per_call in MODES:
                    line = _run(binary, args.mib, piece, per_call, threads, args.repeats)
                    results.setdefault((label, threads), []).append(_gbps(line))
    print("| pieces | threads | GB/s | / 1 MiB pieces, same threads | CPU µs per piece |")
    print("|---|---:|---:|---:|---:|")
    for (label, threads), samples in results.items():
        gbps = sorted(sample[0] for sample in samples)[len(samples) // 2]
        cpu = sorted(sample[1] for sample in samples)[len(samples) // 2]
        ceiling = sorted(s[0] for s in results[(MODES[-1][0], threads)])[len(samples) // 2]
        print(f"| {label} | {threads} | {gbps:.2f} | {gbps / ceiling:.2f} | {cpu:.2f} |")


if __name__ == "__main__":
    main()
