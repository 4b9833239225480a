"""Does decode's engine use CPU while it waits for prefill in overlapped mode? (ttft_bench)

    UCX_NET_DEVICES=lo .venv/bin/python -m benchmarks.ttft_busy_probe [--tokens 2048] [--pin]

Starts our pair as ttft_bench does (overlapped proxy and sequential proxy in front), warms
both, then reads the CPU time (utime+stime from /proc/PID/stat, every process of the decode
engine) over: 5 s idle, one overlapped request, one sequential request. Prints decode's CPU
seconds and its share of each window's wall time. Every process is stopped on the way out.
"""

from __future__ import annotations

import argparse
import os
import random
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from benchmarks.ttft_bench import (
    MAX_TOKENS,
    REQUEST_TIMEOUT_S,
    build_model,
    fresh_prompt,
    pair_engines,
    proxies,
    running,
)
from benchmarks.ttft_stream import stream_token_times
from tests.real_vllm_harness import Engine

IDLE_WINDOW_S = 5.0


def engine_cpu_s(engine: Engine) -> dict[str, float]:
    """CPU seconds (user+system) of every process of ``engine``, by process name."""
    ticks = os.sysconf("SC_CLK_TCK")
    by_name: dict[str, float] = {}
    for pid in engine.pids():
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
        except OSError:
            continue
        name = stat[stat.index("(") + 1 : stat.rindex(")")]
        fields = stat[stat.rindex(")") + 2 :].split()
        by_name[name] = by_name.get(name, 0.0) + (int(fields[11]) + int(fields[12])) / ticks
    return by_name


def affinity(engine: Engine) -> set[str]:
    lists = set()
    for pid in engine.pids():
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("Cpus_allowed_list"):
                lists.add(line.split()[1])
    return lists


def window(label: str, decode: Engine, action: Callable[[], None]) -> None:
    before, started = engine_cpu_s(decode), time.monotonic()
    action()
    after, wall = engine_cpu_s(decode), time.monotonic() - started
    parts = {name: after.get(name, 0.0) - before.get(name, 0.0) for name in after}
    total = sum(parts.values())
    detail = ", ".join(f"{name} {cpu:.2f}" for name, cpu in sorted(parts.items()) if cpu > 0.005)
    print(
        f"{label:>34}: wall {wall:6.2f} s, decode CPU {total:6.2f} s "
        f"({100 * total / wall:5.1f}% of one core)  [{detail}]",
        flush=True,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--pin", action="store_true", help="prefill on CPU 0, decode on CPU 1")
    args = parser.parse_args()
    work_dir = Path(tempfile.mkdtemp(prefix="ttft-probe-"))
    (work_dir / "logs").mkdir()
    model_dir = build_model(work_dir / "model")
    prefill, decode = pair_engines(model_dir, "nixlpd", work_dir / "logs", overlap=True)
    cpus = {id(prefill): {0}, id(decode): {1}} if args.pin else None
    rng = random.Random(1)
    with (
        running([prefill, decode], cpus),
        proxies(["ours", "ours-overlap"], prefill, decode) as urls,
    ):
        print(f"affinity: prefill {affinity(prefill)}, decode {affinity(decode)}", flush=True)
        for url in urls.values():
            stream_token_times(url, fresh_prompt(rng, 256), MAX_TOKENS, REQUEST_TIMEOUT_S)

        def request(mode: str) -> Callable[[], None]:
            def send() -> None:
                prompt = fresh_prompt(rng, args.tokens)
                times = stream_token_times(urls[mode], prompt, MAX_TOKENS, REQUEST_TIMEOUT_S)
                print(f"    {mode}: first token {times.first_s:.2f} s", flush=True)

            return send

        window("idle", decode, lambda: time.sleep(IDLE_WINDOW_S))
        window(f"overlapped request, {args.tokens} tok", decode, request("ours-overlap"))
        window(f"sequential request, {args.tokens} tok", decode, request("ours"))
        window("idle", decode, lambda: time.sleep(IDLE_WINDOW_S))


if __name__ == "__main__":
    main()
