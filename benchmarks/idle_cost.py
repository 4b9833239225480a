"""What an idle P/D pair costs in CPU, ours against vLLM's connector, on real vLLM engines.

    flock /tmp/nixl-pd-real.lock env UCX_NET_DEVICES=lo .venv/bin/python -m benchmarks.idle_cost

benchmarks/latency_budget.py's two pairs (the real-vLLM tier's engines, ours and vLLM's
NixlConnector), each warmed with one request of each size, then left alone: every process of
each engine (API server, engine core, worker: TP 1, so one rank) is sampled from
/proc/<pid>/stat for ``--idle-s`` seconds, the pairs one at a time while the other is stopped
(SIGSTOP), so one pair's spinning cannot slow the other's sample. The same vLLM engine runs
under both connectors, so the difference between the two columns is the connectors'.
"""

from __future__ import annotations

import argparse
import os
import random
import tempfile
import time
from pathlib import Path

from benchmarks.latency_budget import VOCAB_IDS, _engine, _long_model, _route, _serve_only
from tests.real_vllm_harness import Engine

CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


def _cpu_s(engine: Engine) -> float:
    """CPU seconds (user + system) used so far by every process of ``engine``."""
    total = 0
    for pid in engine.pids():
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue  # it ended
        total += int(fields[11]) + int(fields[12])  # utime, stime
    return total / CLOCK_TICKS


def _warm(pair: tuple[Engine, Engine], prompt: list[int], seq: int, side: str) -> None:
    """One request through the pair, asked once more if it failed (a first handshake can
    time out on 2 busy cores: vLLM's connector waits 5 s for it)."""
    try:
        _route(pair, prompt, seq, side)
    except Exception as error:  # noqa: BLE001 - any failure of a warm-up: try once more
        print(f"{side}: warm-up request failed ({error!r}); asking once more")
        _route(pair, prompt, seq + 5, side)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--idle-s", type=float, default=20.0, help="sampled seconds per pair")
    args = parser.parse_args()
    work_dir = Path(tempfile.mkdtemp(prefix="idle-cost-"))
    logs = work_dir / "logs"
    logs.mkdir()
    model_dir = _long_model(work_dir)
    pairs = {side: (_engine(model_dir, logs, side, "producer"),
                    _engine(model_dir, logs, side, "consumer")) for side in ("ours", "vLLM")}  # fmt: skip
    engines = [engine for pair in pairs.values() for engine in pair]
    rng = random.Random(0)
    try:
        for engine in engines:
            engine.start()
        for engine in engines:
            engine.wait_ready()
        for seq, (side, pair) in enumerate(pairs.items()):
            _serve_only(pairs, side)
            for index, num_tokens in enumerate((128, 1024)):  # handshakes done, leases freed
                prompt = [rng.choice(VOCAB_IDS) for _ in range(num_tokens)]
                _warm(pair, prompt, 99000 + 10 * seq + index, side)
        print(f"| pair | role | % of a core while idle ({args.idle_s:.0f} s) |")
        print("|---|---|---:|")
        for side, pair in pairs.items():
            _serve_only(pairs, side)
            time.sleep(2.0)  # the last request's frees and notifications settle
            before = [_cpu_s(engine) for engine in pair]
            started = time.monotonic()
            time.sleep(args.idle_s)
            elapsed = time.monotonic() - started
            for role, engine, cpu_s in zip(("prefill", "decode"), pair, before, strict=True):
                share = (_cpu_s(engine) - cpu_s) / elapsed * 100
                print(f"| {side} | {role} | {share:.1f} |")
    finally:
        _serve_only(pairs, None)
        for engine in engines:
            engine.cleanup()


if __name__ == "__main__":
    main()
