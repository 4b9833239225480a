"""Side by side with vLLM 0.33's NixlConnector, part by part (``--parts``, each runnable alone).

- ``worker``: the decode worker's ``start_load_kv`` per request (benchmarks/vs_vllm_worker.py).
- ``hooks``: every scheduler hook per request (benchmarks/vs_vllm_scheduler.py).
- ``schedule``: vLLM's real Scheduler's ``schedule()`` at N waiting requests (same module).
- ``wire``: GB/s of real NIXL READs against the same-run big-descriptor ceiling
  (benchmarks/vs_vllm_wire.py; two processes over UCX on loopback).
- ``e2e``: TTFT and inter-token latency of P->D with real vLLM engines, against one engine
  and against vLLM's own connector (benchmarks/vs_vllm_e2e.py; minutes, several GiB).

Sides are interleaved in ``--runs`` rounds; tables give medians and the range of the
per-round ratios. The machine is a shared 2-core box: rerun before quoting.

Run: ``.venv/bin/python -m benchmarks.vs_vllm`` (worker, hooks, schedule, wire: a few
minutes). ``--parts e2e`` only on request: it starts five vLLM engines, three at most at once.
"""

from __future__ import annotations

import argparse

import numpy as np

from connector.config import DEFAULT_NIXL_THREADS

PARTS = ("worker", "hooks", "schedule", "wire", "e2e")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--parts", default="worker,hooks,schedule,wire",
                        help=f"comma-separated, of {', '.join(PARTS)}")  # fmt: skip
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--batch", type=int, default=64, help="requests per hooks round")
    parser.add_argument("--waiting", default="64,512", help="schedule(): waiting requests")
    parser.add_argument("--e2e-rounds", type=int, default=5, help="streamed requests per cell")
    parser.add_argument("--threads", type=int, default=None,
                        help="wire: the decode agent's UCX backend threads (default: ours, 4)")  # fmt: skip
    parser.add_argument("--check-every-ms", type=float, default=0.0,
                        help="wire: decode checks a READ this often (0: busily, one core)")  # fmt: skip
    args = parser.parse_args()
    parts = args.parts.split(",")
    unknown = sorted(set(parts) - set(PARTS))
    if unknown:
        parser.error(f"unknown parts {unknown}; choose from {', '.join(PARTS)}")
    np.seterr(all="ignore")
    if "worker" in parts:
        from benchmarks.vs_vllm_worker import sides, worker_rows

        with sides() as (vllm, ours):
            print(f"decode start_load_kv per request ({args.runs} interleaved runs)")
            print("\n".join(worker_rows(vllm, ours, args.runs, args.repeats)))
    if "hooks" in parts:
        from benchmarks.vs_vllm_scheduler import hook_rows, layer_rows

        print(f"\nscheduler hooks per request ({args.runs} interleaved runs of {args.batch})")
        print("\n".join(hook_rows(args.runs, args.batch)))
        print("\nwhere our decode hooks' time goes (same requests, medians of the runs)")
        print("\n".join(layer_rows(args.runs, args.batch)))
    if "schedule" in parts:
        from benchmarks.vs_vllm_scheduler import schedule_rows

        sizes = tuple(int(n) for n in args.waiting.split(","))
        print(f"\nvLLM's Scheduler.schedule() ({args.runs} interleaved runs)")
        print("\n".join(schedule_rows(sizes, args.runs)))
    if "wire" in parts:
        from benchmarks.vs_vllm_wire import wire_rows

        threads = args.threads or DEFAULT_NIXL_THREADS
        print(f"\nreal NIXL READs over UCX on loopback ({args.runs} interleaved runs, "
              f"{threads} backend threads)")  # fmt: skip
        step_s = args.check_every_ms / 1e3
        print("\n".join(wire_rows(args.runs, num_threads=threads, step_s=step_s)))
    if "e2e" in parts:
        from benchmarks.vs_vllm_e2e import e2e_rows

        print("\nP->D with real vLLM engines")
        print("\n".join(e2e_rows(args.e2e_rounds)))


if __name__ == "__main__":
    main()
