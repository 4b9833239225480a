"""The scheduler side by side with vLLM 0.33's NixlConnector: every hook per request, and schedule().

Hooks: both scheduler-side connectors in this process, fed the same fresh vLLM ``Request``s.
A decode round takes ``batch`` requests carrying prefill's params (2,048 prompt tokens, 128
remote block ids) through the hooks in the order vLLM's Scheduler calls them:
get_num_new_matched_tokens (first call, then again as vLLM asks while a request waits),
update_state_after_alloc (128 blocks), build_connector_meta (the batch's loads, per request),
request_finished; then the engine reports the loads done (untimed), so no state piles up.
A prefill round times request_finished on finished ``do_remote_decode`` requests.

schedule(): vLLM's real Scheduler with each connector and N requests waiting, each carrying
prefill's params: the first schedule() admits all N (every hook runs, each request parks
waiting for its KV), the next ones find all N parked (steady state until loads end).
"""

from __future__ import annotations

import gc
import statistics
import time
from collections.abc import Callable
from typing import Any

from benchmarks.vs_vllm_common import (
    BLOCK_SIZE,
    SIDES,
    kv_cache_config,
    reserve_side_channel_port,
    vllm_config,
)

PROMPT_TOKENS = 2048
PROMPT_BLOCKS = PROMPT_TOKENS // BLOCK_SIZE
DECODE_HOOKS = (
    "decode get_num_new_matched_tokens, first call",
    "decode get_num_new_matched_tokens, later call",
    "decode update_state_after_alloc",
    "decode build_connector_meta, per request",
    "decode request_finished",
)
PREFILL_HOOK = "prefill request_finished"


class Requests:
    """Fresh vLLM requests with unique ids (shared by both sides, never by one request)."""

    def __init__(self) -> None:
        self._serial = 0

    def make(self, params: dict[str, Any] | None, *, block_hasher: Any = None) -> Any:
        from vllm import SamplingParams
        from vllm.v1.request import Request

        self._serial += 1
        request = Request(
            request_id=f"s{self._serial}", prompt_token_ids=list(range(PROMPT_TOKENS)),
            sampling_params=SamplingParams(max_tokens=4, ignore_eos=True), pooling_params=None,
            block_hasher=block_hasher,
        )  # fmt: skip
        request.kv_transfer_params = params
        return request

    def from_prefill(self, *, block_hasher: Any = None) -> Any:
        """A decode request as the router sends it: prefill's returned params."""
        params = {
            "do_remote_prefill": True, "do_remote_decode": False,
            "remote_engine_id": "prefill", "remote_request_id": f"p{self._serial}",
            "remote_block_ids": [list(range(PROMPT_BLOCKS))], "remote_host": "127.0.0.1",
            "remote_port": 5600, "tp_size": 1, "remote_num_tokens": PROMPT_TOKENS,
        }  # fmt: skip
        return self.make(params, block_hasher=block_hasher)


class HookBench:
    def __init__(self) -> None:
        from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
        from vllm.distributed.kv_transfer.kv_connector.v1.nixl.connector import (
            NixlPullConnector,
        )
        from vllm.v1.core.kv_cache_manager import KVCacheBlocks
        from vllm.v1.core.kv_cache_utils import KVCacheBlock

        from connector.vllm import NixlPDConnector

        reserve_side_channel_port()
        cache = kv_cache_config()
        role = KVConnectorRole.SCHEDULER
        self.sides: dict[str, Any] = {
            "vLLM": NixlPullConnector(vllm_config("vLLM"), role, cache),
            "ours": NixlPDConnector(vllm_config("ours"), role, cache),
        }
        self.requests = Requests()
        self._blocks = KVCacheBlocks(([KVCacheBlock(i) for i in range(PROMPT_BLOCKS)],))
        self._step = _empty_step()

    def decode_round(self, side: str, batch: int) -> dict[str, float]:
        """Median µs per request of each decode hook over ``batch`` fresh requests."""
        from vllm.v1.outputs import KVConnectorOutput

        connector = self.sides[side]
        requests = [self.requests.from_prefill() for _ in range(batch)]
        samples: dict[str, list[float]] = {hook: [] for hook in DECODE_HOOKS}
        first, later, alloc, meta, finished = DECODE_HOOKS
        block_ids = [list(range(PROMPT_BLOCKS))]
        for request in requests:
            samples[first].append(_timed(connector.get_num_new_matched_tokens, request, 0))
        for request in requests:
            samples[later].append(_timed(connector.get_num_new_matched_tokens, request, 0))
        for request in requests:
            samples[alloc].append(
                _timed(connector.update_state_after_alloc, request, self._blocks, PROMPT_TOKENS)
            )
        samples[meta].append(_timed(connector.build_connector_meta, self._step) / batch)
        for request in requests:
            samples[finished].append(_timed(connector.request_finished, request, block_ids[0]))
        done = {request.request_id for request in requests}
        connector.update_connector_output(KVConnectorOutput(finished_recving=done))
        return {hook: statistics.median(values) * 1e6 for hook, values in samples.items()}

    def prefill_round(self, side: str, batch: int) -> float:
        """Median µs of request_finished on ``batch`` finished do_remote_decode requests."""
        from vllm.v1.request import RequestStatus

        connector = self.sides[side]
        samples = []
        for _ in range(batch):
            request = self.requests.make({"do_remote_decode": True})
            request.status = RequestStatus.FINISHED_LENGTH_CAPPED
            samples.append(_timed(connector.request_finished, request, list(range(PROMPT_BLOCKS))))
        connector.build_connector_meta(self._step)  # hand the leases over; not timed
        return statistics.median(samples) * 1e6

    def close(self) -> None:
        for connector in self.sides.values():
            connector.shutdown()


def _empty_step() -> Any:
    """A SchedulerOutput that scheduled nothing (vLLM's connector reads it for host buffers)."""
    from vllm.v1.core.sched.output import CachedRequestData, SchedulerOutput

    return SchedulerOutput(
        scheduled_new_reqs=[], scheduled_cached_reqs=CachedRequestData.make_empty(),
        num_scheduled_tokens={}, total_num_scheduled_tokens=0, scheduled_spec_decode_tokens={},
        scheduled_encoder_inputs={}, finished_req_ids=set(), free_encoder_mm_hashes=[],
    )  # fmt: skip


def _timed(call: Callable[..., Any], *args: Any) -> float:
    started = time.perf_counter()
    call(*args)
    return time.perf_counter() - started


def hook_rows(runs: int, batch: int) -> list[str]:
    """The hooks table: ``runs`` interleaved rounds per side, ratio ranges across rounds."""
    bench = HookBench()
    try:
        for side in SIDES:  # warm-up: imports, first-call caches
            bench.decode_round(side, batch)
            bench.prefill_round(side, batch)
        rounds: dict[str, list[tuple[float, float]]] = {
            h: [] for h in (*DECODE_HOOKS, PREFILL_HOOK)
        }
        for run in range(runs):
            order = SIDES if run % 2 == 0 else SIDES[::-1]  # neither side always goes first
            decode = {side: bench.decode_round(side, batch) for side in order}
            for hook in DECODE_HOOKS:
                rounds[hook].append((decode["vLLM"][hook], decode["ours"][hook]))
            rounds[PREFILL_HOOK].append(
                (bench.prefill_round("vLLM", batch), bench.prefill_round("ours", batch))
            )
    finally:
        bench.close()
    return ratio_table("hook, per request", rounds, "µs", "{:,.2f}")


def ratio_table(
    title: str, rounds: dict[str, list[tuple[float, float]]], unit: str, number: str
) -> list[str]:
    """Rows of (vLLM, ours) pairs per round: medians, and vLLM / ours with its range."""
    lines = [
        f"| {title} | vLLM {unit} | ours {unit} | vLLM / ours [range] |",
        "|---|---:|---:|---:|",
    ]
    for name, pairs in rounds.items():
        ratios = [v / o for v, o in pairs]
        lines.append(
            f"| {name} | {number.format(statistics.median(v for v, _ in pairs))} | "
            f"{number.format(statistics.median(o for _, o in pairs))} | "
            f"{statistics.median(ratios):.2f} [{min(ratios):.2f}-{max(ratios):.2f}] |"
        )
    return lines


# --- where our hook time goes ------------------------------------------------------------------


class OurLayers:
    """Our decode hooks one layer down: SchedulerConnector (the engine-agnostic API, given
    RequestInfo records and block-id tuples) and parse_kv_transfer_params alone. The vLLM
    adapter's share is the hook through vLLM's interface minus the SchedulerConnector calls
    it makes inside that hook (layer_rows says which)."""

    def __init__(self, bench: HookBench) -> None:
        from connector.config import ConnectorConfig
        from scheduler.connector import SchedulerConnector
        from scheduler.requests import Role

        spec = bench.sides["ours"].kv_cache_spec()
        self.connector = SchedulerConnector(
            ConnectorConfig(), engine_id="layers", role=Role.BOTH, spec=spec, tp_size=1,
        )  # fmt: skip
        self.requests = bench.requests

    def decode_round(self, batch: int) -> dict[str, float]:
        from connector.params import parse_kv_transfer_params
        from scheduler.requests import RequestInfo

        infos = [
            RequestInfo(r.request_id, r.num_prompt_tokens, r.kv_transfer_params)
            for r in (self.requests.from_prefill() for _ in range(batch))
        ]
        block_ids = (tuple(range(PROMPT_BLOCKS)),)
        first, later, alloc, _, finished = DECODE_HOOKS
        samples: dict[str, list[float]] = {first: [], later: [], alloc: [], finished: [],
                                           "parse": []}  # fmt: skip
        connector = self.connector
        for request in (self.requests.from_prefill() for _ in range(batch)):
            samples["parse"].append(_timed(parse_kv_transfer_params, request.kv_transfer_params))
        for info in infos:
            samples[first].append(_timed(connector.get_num_new_matched_tokens, info, 0))
        for info in infos:
            samples[later].append(_timed(connector.get_num_new_matched_tokens, info, 0))
        for info in infos:
            samples[alloc].append(
                _timed(connector.update_state_after_alloc, info, block_ids, PROMPT_TOKENS)
            )
        connector.build_connector_meta()
        for info in infos:
            samples[finished].append(_timed(connector.request_finished, info, block_ids))
        connector.on_engine_outcomes([info.request_id for info in infos], [])
        connector.take_finished()
        return {name: statistics.median(values) * 1e6 for name, values in samples.items()}

    def close(self) -> None:
        self.connector.shutdown()


def layer_rows(runs: int, batch: int) -> list[str]:
    """Our decode hooks split: parse, SchedulerConnector (parse + request state), adapter."""
    bench = HookBench()
    layers = OurLayers(bench)
    try:
        bench.decode_round("ours", batch)
        layers.decode_round(batch)
        through_vllm: list[dict[str, float]] = []
        ours_only: list[dict[str, float]] = []
        for _ in range(runs):
            through_vllm.append(bench.decode_round("ours", batch))
            ours_only.append(layers.decode_round(batch))
    finally:
        layers.close()
        bench.close()
    lines = [
        "| our decode hook | through vLLM's interface µs | SchedulerConnector µs "
        "| of which params parse µs | vLLM adapter µs (the difference) |",
        "|---|---:|---:|---:|---:|",
    ]
    alloc = DECODE_HOOKS[2]
    # The adapter calls SchedulerConnector in each hook; the first ask only claims the tokens
    # and the params are parsed at allocation.
    for hook in DECODE_HOOKS:
        if hook not in ours_only[0]:
            continue
        whole = statistics.median(r[hook] for r in through_vllm)
        core = statistics.median(r[hook] for r in ours_only)
        parse = statistics.median(r["parse"] for r in ours_only) if hook == alloc else 0.0
        lines.append(
            f"| {hook} | {whole:,.2f} | {core:,.2f} | {parse:,.2f} | {whole - core:,.2f} |"
        )
    return lines


# --- schedule() -------------------------------------------------------------------------------


def _scheduler(side: str, num_requests: int) -> Any:
    """vLLM's real Scheduler with ``side``'s connector and room for every request's blocks."""
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.structured_output import StructuredOutputManager

    config = vllm_config(side, max_num_seqs=1024, max_num_batched_tokens=8192)
    cache = kv_cache_config(num_requests * (PROMPT_BLOCKS + 1) + 64)
    config.cache_config.num_gpu_blocks = cache.num_blocks
    return Scheduler(
        vllm_config=config, kv_cache_config=cache,
        structured_output_manager=StructuredOutputManager(config), block_size=BLOCK_SIZE,
    )  # fmt: skip


SCHEDULER_HOOKS = ("get_num_new_matched_tokens", "update_state_after_alloc",
                   "build_connector_meta", "request_finished")  # fmt: skip


def _time_hooks(connector: Any) -> list[float]:
    """Wrap the connector's scheduler hooks; returns the list their seconds accumulate in."""
    spent = [0.0]
    for name in SCHEDULER_HOOKS:
        hook = getattr(connector, name)

        def timed(*args: Any, _hook: Any = hook, **kwargs: Any) -> Any:
            started = time.perf_counter()
            try:
                return _hook(*args, **kwargs)
            finally:
                spent[0] += time.perf_counter() - started

        setattr(connector, name, timed)  # the instance attribute shadows the method
    return spent


def schedule_once(side: str, num_requests: int, steady_calls: int) -> tuple[float, float, float]:
    """ms of: the schedule() that admits ``num_requests``, the connector hooks inside it, and
    the next schedule() calls (median)."""
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash

    init_none_hash(sha256)
    hasher = get_request_block_hasher(BLOCK_SIZE, sha256)
    scheduler = _scheduler(side, num_requests)
    in_hooks = _time_hooks(scheduler.connector)
    requests = Requests()
    try:
        for _ in range(num_requests):
            scheduler.add_request(requests.from_prefill(block_hasher=hasher))
        gc.collect()  # the other side's garbage is not this side's cost
        admit_s = _timed(scheduler.schedule)
        hooks_s = in_hooks[0]
        queued = (*scheduler.waiting, *scheduler.kv_holding_waiting)
        parked = sum(1 for r in queued if r.status.name == "WAITING_FOR_REMOTE_KVS")
        if parked < num_requests:
            raise RuntimeError(f"{side}: {parked} of {num_requests} requests parked for a load")
        steady = [_timed(scheduler.schedule) for _ in range(steady_calls)]
    finally:
        if scheduler.connector is not None:
            scheduler.connector.shutdown()
    return admit_s * 1e3, hooks_s * 1e3, statistics.median(steady) * 1e3


def schedule_rows(sizes: tuple[int, ...], runs: int, steady_calls: int = 5) -> list[str]:
    reserve_side_channel_port()
    for side in SIDES:  # warm-up: the first Scheduler of a process pays imports and first calls
        schedule_once(side, min(sizes), steady_calls)
    rounds: dict[str, list[tuple[float, float]]] = {}
    for num_requests in sizes:
        names = (f"N={num_requests}: schedule() admitting all N",
                 f"N={num_requests}: connector hooks inside it",
                 f"N={num_requests}: schedule() with all N parked")  # fmt: skip
        for name in names:
            rounds[name] = []
        for run in range(runs):
            order = SIDES if run % 2 == 0 else SIDES[::-1]  # neither side always goes first
            figures = {side: schedule_once(side, num_requests, steady_calls) for side in order}
            for index, name in enumerate(names):
                rounds[name].append((figures["vLLM"][index], figures["ours"][index]))
    return ratio_table("vLLM Scheduler, decode requests waiting", rounds, "ms", "{:,.2f}")
