"""How long the engine thread is inside NIXL per 8k-token request, for three designs, on real NIXL.

Two processes on loopback (the child of benchmarks/transfer_peer.py holds the prefill KV;
UCX_NET_DEVICES=lo), model of benchmarks/transfer_bench.py (32 layers, 8 KV heads, head_dim
128, bf16, 16-token blocks: an 8k-token request is 1 GiB). Per request, contiguous and
fragmented block ids, the engine thread polls once per 1 ms step:

- inline (the worker before issue 10, and vLLM): plan, make_read, post and check on the engine
  thread. "in NIXL" is the time inside post() and check(); "GIL ticks" counts loop turns of
  another Python thread during post(): more than a few means the binding released the GIL.
- cut READs: the same plan cut into 256 KiB descriptors, so post() returns before the copy.
- transfer thread (the worker since issue 10): WorkerConnector with a RealNixlAgent;
  "in NIXL" is 0 by construction (the engine thread makes no NIXL call), and "engine thread"
  is the time inside start_load_kv and every get_finished until the request is reported.

Run: ``.venv/bin/python -m benchmarks.engine_thread_bench`` (about a minute).
"""

from __future__ import annotations

import argparse
import os
import statistics
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass

os.environ.setdefault("UCX_NET_DEVICES", "lo")

from benchmarks.transfer_bench import (  # noqa: E402
    BLOCK_SIZE,
    POOL_BLOCKS,
    WAIT_S,
    Decode,
    _block_ids,
    _layout,
    split_reads,
)
from benchmarks.transfer_peer import PeerChild  # noqa: E402
from connector.config import ConnectorConfig  # noqa: E402
from connector.metadata import ConnectorMetadata, LoadSpec, RemoteSource  # noqa: E402
from connector.protocol import PROTOCOL_VERSION, WorkerHandshake  # noqa: E402
from worker.connector import WorkerConnector  # noqa: E402
from worker.handshake import fingerprint  # noqa: E402
from worker.nixl_api import TransferState  # noqa: E402
from worker.nixl_real import RealNixlAgent  # noqa: E402
from worker.plan.exact_runs import ByteRuns  # noqa: E402
from worker.plan.recipe import TransferRequest, peer_plan, plan_request  # noqa: E402

NUM_TOKENS = 8192
SPLIT_BYTES = 256 << 10
STEP_S = 0.001


@dataclass(frozen=True)
class Sample:
    engine_thread_s: float  # every connector or NIXL call the engine thread made
    in_nixl_s: float  # the part of it inside NIXL
    done_s: float  # from the first call until the request is done
    gil_ticks: int  # another Python thread's loop turns during post() (inline designs)


class Ticker:
    """A Python thread counting loop turns: it only advances while it can take the GIL."""

    def __init__(self) -> None:
        self.turns = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.turns += 1
            time.sleep(0)

    def __enter__(self) -> Ticker:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


def inline(decode: Decode, reads: Callable[[], ByteRuns]) -> Sample:
    started = time.perf_counter()
    transfer = decode.agent.make_read(decode.remote, *decode.descriptors(reads()))
    prepare_s = time.perf_counter() - started
    with Ticker() as ticker:
        before = ticker.turns
        call = time.perf_counter()
        done = decode.agent.post(transfer) is TransferState.DONE
        in_nixl = time.perf_counter() - call
        ticks = ticker.turns - before
    while not done:
        if time.perf_counter() - started > WAIT_S:
            raise TimeoutError("READ not done in time")
        time.sleep(STEP_S)
        call = time.perf_counter()
        done = decode.agent.check(transfer) is TransferState.DONE
        in_nixl += time.perf_counter() - call
    done_s = time.perf_counter() - started
    decode.agent.release(transfer)
    return Sample(prepare_s + in_nixl, in_nixl, done_s, ticks)


class Threaded:
    """A WorkerConnector reading from the child through its own RealNixlAgent."""

    def __init__(self, decode: Decode, metadata: bytes) -> None:
        layout = _layout()
        spec = _spec_of_layout()
        digest, facts = fingerprint(spec)
        self._handshake = WorkerHandshake(
            PROTOCOL_VERSION, "prefill", 0, 1, decode.remote, metadata,
            decode.remote_addresses, layout, digest, dict(facts),
        )  # fmt: skip
        self.agent = RealNixlAgent(f"bench-threaded-{uuid.uuid4().hex[:8]}")
        self.worker = WorkerConnector(
            ConnectorConfig(), engine_id="decode", tp_rank=0, tp_size=1, spec=spec,
            agent=self.agent, fetch=lambda host, port, rank: self._handshake,
            lease_check=lambda remote: True,  # no prefill scheduler here: every lease holds
        )  # fmt: skip
        self.worker.register_kv_caches(list(decode.addresses))
        self._serial = 0

    def load(self, local: list[int], remote: list[int]) -> Sample:
        self._serial += 1
        request_id = f"d{self._serial}"
        source = RemoteSource(
            "prefill", "127.0.0.1", 1, 1, f"p{self._serial}", (tuple(remote),), boot_id="bench",
            lease_id=f"l{self._serial}",
        )  # fmt: skip
        spec = LoadSpec(request_id, (tuple(local),), NUM_TOKENS, 0, source)
        started = time.perf_counter()
        self.worker.start_load_kv(ConnectorMetadata(loads=(spec,)))
        engine_s = time.perf_counter() - started
        while True:
            if time.perf_counter() - started > WAIT_S:
                raise TimeoutError("request not reported in time")
            time.sleep(STEP_S)
            call = time.perf_counter()
            report = self.worker.get_finished()
            engine_s += time.perf_counter() - call
            if request_id in report.failed_recving:
                raise RuntimeError(report.failed_recving[request_id])
            if request_id in report.finished_recving:
                return Sample(engine_s, 0.0, time.perf_counter() - started, 0)

    def close(self) -> None:
        self.worker.shutdown()
        self.agent.close()


def _spec_of_layout() -> object:
    from benchmarks.transfer_bench import DTYPE_BYTES, HEAD_DIM, NUM_KV_HEADS, NUM_LAYERS
    from connector.layout import GroupKind, GroupSpec, KVCacheSpec, LayerSpec

    layer = LayerSpec(
        name="l", num_kv_heads=NUM_KV_HEADS, head_dim=HEAD_DIM, dtype_bytes=DTYPE_BYTES
    )
    group = GroupSpec(
        kind=GroupKind.FULL, block_size=BLOCK_SIZE, kernel_block_size=BLOCK_SIZE,
        num_blocks=POOL_BLOCKS, layers=(layer,) * NUM_LAYERS,
    )  # fmt: skip
    return KVCacheSpec(model="bench", dtype="bfloat16", cache_dtype="bfloat16", groups=(group,))


def _row(name: str, samples: list[Sample]) -> str:
    def rng(values: list[float], scale: float = 1e3) -> str:
        return f"{statistics.median(values) * scale:,.2f} [{min(values) * scale:,.2f}-{max(values) * scale:,.2f}]"

    ticks = [s.gil_ticks for s in samples]
    return (
        f"| {name} | {rng([s.in_nixl_s for s in samples])} | "
        f"{rng([s.engine_thread_s for s in samples])} | {rng([s.done_s for s in samples])} | "
        f"{min(ticks)}-{max(ticks)} |"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    layout = _layout()
    peer = peer_plan(layout, layout)
    num_blocks = NUM_TOKENS // BLOCK_SIZE
    with PeerChild(layout.region_bytes, lifetime_s=600.0) as child:
        metadata, remote_addresses = child.wait_ready(timeout_s=120.0)
        decode = Decode(layout, metadata, remote_addresses)
        threaded = Threaded(decode, metadata)
        rows = []
        try:
            for fragmented in (False, True):
                local = _block_ids(num_blocks, fragmented, 1)
                remote = _block_ids(num_blocks, fragmented, 2)

                def plan(local: list[int] = local, remote: list[int] = remote) -> ByteRuns:
                    request = TransferRequest((local,), (remote,), NUM_TOKENS, 0)
                    runs = plan_request(peer, request).reads[0].ranges
                    assert runs is not None  # no prepared rows: byte ranges only
                    return runs

                samples: dict[str, list[Sample]] = {"inline": [], "cut": [], "thread": []}
                for _ in range(args.repeats):  # interleaved
                    samples["inline"].append(inline(decode, plan))
                    samples["cut"].append(
                        inline(decode, lambda p=plan: split_reads(p(), SPLIT_BYTES))
                    )
                    samples["thread"].append(threaded.load(local, remote))
                ids = "fragmented" if fragmented else "contiguous"
                rows.append(_row(f"{ids}, inline post (before)", samples["inline"]))
                rows.append(_row(f"{ids}, READs cut at 256 KiB", samples["cut"]))
                rows.append(_row(f"{ids}, transfer thread (kept)", samples["thread"]))
        finally:
            threaded.close()
            decode.agent.close()
    print(f"8k-token request (1 GiB), engine thread stepping every {STEP_S * 1e3:.0f} ms; "
          f"ms, median [min-max] of {args.repeats}")  # fmt: skip
    print("| design | engine thread in NIXL ms | engine thread in connector + NIXL ms "
          "| done ms | GIL ticks during post |")  # fmt: skip
    print("|---|---:|---:|---:|---:|")
    print("\n".join(rows))


if __name__ == "__main__":
    main()
