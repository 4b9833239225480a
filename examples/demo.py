"""The `nixl-pd demo`: prefill and decode engines, a batch through the router, checked end to end.

Real mode starts two server processes (real NIXL over UCX on loopback); ``fake_nixl`` runs
both engines in this process over FakeNixl. Either way the demo warms decode's prefix cache
if asked, sends the batch through the toy router, runs the same prompts on a single local
engine, and checks: tokens identical, prompt KV identical byte for byte (by digest), no failed
request, and no block left referenced on either engine once the transfers are done.

``turns`` > 1 runs each prompt as a conversation (each next prompt: the last one, its answer
and ``prompt_len`` new tokens) with both engines in multi-turn mode: prefill gets the params
decode returned for the turn before and pulls the history from decode (``pulled_tokens``).
Decode's holds last DEMO_HOLD_TTL_S, so the leak check after the last turn sees them end; the
single engine's answers for later turns are computed after the turns, which run back to back.
"""

from __future__ import annotations

import math
import os
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Mapping
from contextlib import ExitStack
from typing import NamedTuple

import msgspec
import numpy as np

from connector.config import ConnectorConfig
from connector.errors import UnsupportedConfiguration
from examples.engine import Engine, EngineConfig, RequestOutput
from examples.metering import StatsSnapshot
from examples.model import MAX_POSITIONS, VOCAB_SIZE, ModelKind, check_tp
from examples.router import Completion, EngineHandle, InProcessEngine, ToyRouter, run_local

Progress = Callable[[str], None]
MAX_BATCH_TOKENS = 200_000  # bounds each engine's KV pools (and the demo's run time)
DEMO_HOLD_TTL_S = 6.0  # multi-turn: decode's holds, shorter than the drain timeout


class DemoOptions(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    prefill_tp: int = 1
    decode_tp: int = 1
    prefill_block_size: int = 16
    decode_block_size: int = 16
    prefill_kernel_block_size: int | None = None  # None: the logical block size
    decode_kernel_block_size: int | None = None
    layout: str = "nhd"
    model: str = "dense"
    decode_model: str | None = None  # None: same as model (a mismatch shows the handshake check)
    decode_prefix_hit: float = 0.0  # fraction of each prompt already in decode's prefix cache
    requests: int = 8
    prompt_len: int = 64
    max_tokens: int = 8  # tokens decode generates after prefill's first token
    fake_nixl: bool = False
    staged: bool = False  # both engines: NIXL reads host mirrors of the KV (examples/staging.py)
    verify_kv: bool = False  # both engines: decode checks every load against prefill's digests
    seed: int = 0
    timeout_s: float = 120.0
    drain_timeout_s: float = 10.0  # after the batch: how long engines may take to free blocks
    turns: int = 1  # turns per conversation (multi-turn mode when > 1)


class DemoResult(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    ok: bool
    tokens_match: bool
    kv_match: bool
    requests: int
    completed_requests: int
    failed_requests: int
    leaked_blocks_prefill: int
    leaked_blocks_decode: int
    tokens_generated: int
    bytes_transferred: int
    num_reads: int
    num_descriptors: int
    transfer_gbps: float
    handshake_ms: float | None
    decode_prefix_hit_tokens: int
    wall_s: float
    mode: str
    errors: list[str]
    options: DemoOptions
    pulled_tokens: int = 0  # multi-turn: history tokens prefill pulled from decode


def _check(condition: bool, message: str) -> None:
    if not condition:
        raise UnsupportedConfiguration(message)


def validate_options(options: DemoOptions) -> None:
    """Raise UnsupportedConfiguration (one line: flag, value, what to do) for bad options."""
    kinds = [kind.value for kind in ModelKind]
    for flag, model in (("--model", options.model), ("decode model", options.decode_model)):
        _check(model is None or model in kinds, f"{flag} {model!r} is unknown; choose from {kinds}")
    _check(options.layout in ("nhd", "hnd"), f"--layout {options.layout!r}: choose nhd or hnd")
    for side in ("prefill", "decode"):
        tp = getattr(options, f"{side}_tp")
        block = getattr(options, f"{side}_block_size")
        kernel = getattr(options, f"{side}_kernel_block_size") or block
        _check(1 <= tp <= 8, f"--{side}-tp {tp}: use 1..8 ranks")
        model = options.decode_model if side == "decode" and options.decode_model else options.model
        try:
            check_tp(ModelKind(model), tp)
        except UnsupportedConfiguration as exc:
            raise UnsupportedConfiguration(f"--{side}-tp {tp}: {exc}") from None
        _check(block >= 1, f"--{side}-block-size {block}: must be >= 1")
        _check(
            kernel >= 1 and block % kernel == 0,
            f"--{side}-kernel-block-size {kernel} must divide --{side}-block-size {block}",
        )
    _check(
        0.0 <= options.decode_prefix_hit <= 1.0,
        f"--decode-prefix-hit {options.decode_prefix_hit}: give a fraction in [0, 1]",
    )
    _check(1 <= options.requests <= 1024, f"--requests {options.requests}: use 1..1024")
    _check(1 <= options.max_tokens <= 256, f"--max-tokens {options.max_tokens}: use 1..256")
    _check(1 <= options.turns <= 16, f"--turns {options.turns}: use 1..16")
    _check(
        options.turns == 1 or options.drain_timeout_s > DEMO_HOLD_TTL_S,
        f"--turns {options.turns} needs a drain timeout above decode's {DEMO_HOLD_TTL_S} s holds",
    )
    limit = MAX_POSITIONS // options.turns - options.max_tokens - 1
    _check(1 <= options.prompt_len <= limit, f"--prompt-len {options.prompt_len}: use 1..{limit}")
    _check(options.timeout_s > 0, f"--timeout {options.timeout_s}: must be positive")
    num_tokens = options.requests * options.turns * (options.prompt_len + options.max_tokens)
    _check(
        num_tokens <= MAX_BATCH_TOKENS,
        f"--requests {options.requests} x (--prompt-len {options.prompt_len} + --max-tokens "
        f"{options.max_tokens}) = {num_tokens} tokens; keep the batch within {MAX_BATCH_TOKENS}",
    )


def engine_configs(options: DemoOptions, run_id: str) -> tuple[EngineConfig, EngineConfig]:
    """The prefill and decode EngineConfigs, with pools sized for the whole batch."""
    configs = []
    for side in ("prefill", "decode"):
        block = getattr(options, f"{side}_block_size")
        per_request = _blocks_per_request(options, block)
        model = options.decode_model if side == "decode" and options.decode_model else options.model
        configs.append(
            EngineConfig(
                engine_id=f"{side}-{run_id}",
                role=side,
                model=model,
                tp_size=getattr(options, f"{side}_tp"),
                block_size=block,
                kernel_block_size=getattr(options, f"{side}_kernel_block_size"),
                num_blocks=2 * options.requests * per_request + 8,
                layout=options.layout,
                seed=options.seed,
                staged=options.staged,
            )
        )
    return configs[0], configs[1]


def _blocks_per_request(options: DemoOptions, block_size: int) -> int:
    """A conversation's last turn; with turns, decode also holds the turn before."""
    num_tokens = options.turns * (options.prompt_len + options.max_tokens + 1)
    return (1 + (options.turns > 1)) * (math.ceil(num_tokens / block_size) + 1)


def make_prompts(options: DemoOptions) -> dict[str, list[int]]:
    rng = np.random.default_rng(options.seed)
    return {
        f"cmpl-{i}": [int(t) for t in rng.integers(0, VOCAB_SIZE, options.prompt_len)]
        for i in range(options.requests)
    }


def reference_outputs(
    options: DemoOptions, prompts: Mapping[str, list[int]]
) -> dict[str, RequestOutput]:
    """The same prompts on one local engine (no connector): the expected tokens and KV."""
    engine = Engine(
        EngineConfig(
            "reference",
            model=options.model,
            seed=options.seed,
            num_blocks=options.requests * _blocks_per_request(options, 16) + 8,
        )
    )
    handle = InProcessEngine(engine)
    return run_local(handle, prompts, options.max_tokens + 1, timeout_s=options.timeout_s)


def warm_prompts(options: DemoOptions, prompts: Mapping[str, list[int]]) -> dict[str, list[int]]:
    """Prompt prefixes that put ``decode_prefix_hit`` of each prompt in decode's prefix cache."""
    num_tokens = int(options.decode_prefix_hit * options.prompt_len)
    if num_tokens == 0:
        return {}
    return {f"warm-{rid}": prompt[:num_tokens] for rid, prompt in prompts.items()}


def run_demo(options: DemoOptions, progress: Progress | None = None) -> DemoResult:
    """Run the whole demo; every engine, process and agent it starts is stopped on return."""
    validate_options(options)
    say = progress or (lambda _message: None)
    start_s = time.monotonic()
    prompts = make_prompts(options)
    prefill_config, decode_config = engine_configs(options, uuid.uuid4().hex[:6])
    with ExitStack() as stack:
        if options.fake_nixl:
            started = _start_in_process(stack, prefill_config, decode_config, options)
        else:
            started = _start_processes(stack, prefill_config, decode_config, options, say)
        prefill, decode, wait_ready, leaks = started
        say(f"reference: {options.requests} prompts on a single local engine")
        expected = reference_outputs(options, prompts)  # while the engines start
        wait_ready()
        warm = warm_prompts(options, prompts)
        if warm:
            say(f"warming decode's prefix cache with {len(warm)} prompt prefixes")
            run_local(decode, warm, 1, timeout_s=options.timeout_s)
        router = ToyRouter(prefill, decode)
        done: list[Completion] = []
        num_requests = options.requests * options.turns

        def on_done(completion: Completion) -> None:
            done.append(completion)
            status = "; ".join(completion.errors) or f"{len(completion.token_ids)} tokens"
            say(f"[{len(done)}/{num_requests}] {completion.request_id}: {status}")

        completions: dict[str, Completion] = {}
        held: dict[str, dict[str, object]] = {}
        later_prompts: dict[str, list[int]] = {}
        rng = np.random.default_rng(options.seed + 1)  # later turns' new tokens
        for turn in range(1, options.turns + 1):
            later_prompts.update(prompts if turn > 1 else {})
            completions.update(
                router.run(
                    prompts,
                    options.max_tokens,
                    timeout_s=options.timeout_s,
                    on_done=on_done,
                    held=held,
                )
            )
            prompts, held = next_turn(completions, prompts, options.prompt_len, rng, turn + 1)
        leaked_prefill, leaked_decode, snapshot = leaks(options.drain_timeout_s)
        if later_prompts:  # after the turns: between them it would outlast decode's holds
            say(f"reference: {len(later_prompts)} later turns on a single local engine")
            expected.update(reference_outputs(options, later_prompts))
    return _result(
        options,
        completions,
        expected,
        leaked_prefill,
        leaked_decode,
        snapshot,
        time.monotonic() - start_s,
    )


def next_turn(
    completions: Mapping[str, Completion],
    prompts: Mapping[str, list[int]],
    num_new_tokens: int,
    rng: np.random.Generator,
    turn: int,
) -> tuple[dict[str, list[int]], dict[str, dict[str, object]]]:
    """Turn ``turn``'s prompts (each of ``prompts``: itself, its answer, new tokens) under
    ids ``<conversation>-t<turn>``, and the params decode returned for each (they go to
    prefill). A conversation whose turn failed ends there."""
    next_prompts: dict[str, list[int]] = {}
    held: dict[str, dict[str, object]] = {}
    for request_id in prompts:
        completion = completions[request_id]
        if completion.errors or completion.decode is None:
            continue
        next_id = f"{request_id.split('-t')[0]}-t{turn}"
        new_tokens = [int(t) for t in rng.integers(0, VOCAB_SIZE, num_new_tokens)]
        next_prompts[next_id] = completion.prompt + completion.token_ids + new_tokens
        if completion.decode.kv_transfer_params:
            held[next_id] = dict(completion.decode.kv_transfer_params)
    return next_prompts, held


LeakCheck = Callable[[float], tuple[int, int, StatsSnapshot]]


class Started(NamedTuple):
    prefill: EngineHandle
    decode: EngineHandle
    wait_ready: Callable[[], None]
    leaks: LeakCheck  # drain for at most the given seconds; leaked blocks and decode's stats


def demo_connector_config(options: DemoOptions) -> ConnectorConfig:
    """The example engines' connector settings, with the demo's verify_kv."""
    from examples.server import connector_config

    config = msgspec.structs.replace(connector_config(), verify_kv=options.verify_kv)
    if options.turns == 1:
        return config
    return msgspec.structs.replace(
        config,
        bidirectional_kv_xfer=True,
        decoder_kv_blocks_ttl_s=DEMO_HOLD_TTL_S,
        kv_recompute_threshold=0,  # the demo's short turns: pull whatever decode holds
    )


def _start_in_process(
    stack: ExitStack,
    prefill_config: EngineConfig,
    decode_config: EngineConfig,
    options: DemoOptions,
) -> Started:
    from worker.fake import FakeFabric, FakeNixl

    fabric = FakeFabric()
    engines = []
    for config in (prefill_config, decode_config):
        engine = Engine(
            config,
            connector_config=demo_connector_config(options),
            agent_factory=lambda name: FakeNixl(name, fabric),
        )
        stack.callback(engine.shutdown)
        engines.append(engine)

    def leaks(timeout_s: float) -> tuple[int, int, StatsSnapshot]:
        deadline_s = time.monotonic() + timeout_s
        while any(e.has_work() for e in engines) and time.monotonic() < deadline_s:
            for engine in engines:
                engine.step()
        return (
            engines[0].num_leaked_blocks,
            engines[1].num_leaked_blocks,
            engines[1].stats.snapshot(),
        )

    return Started(InProcessEngine(engines[0]), InProcessEngine(engines[1]), lambda: None, leaks)


def _start_processes(
    stack: ExitStack,
    prefill_config: EngineConfig,
    decode_config: EngineConfig,
    options: DemoOptions,
    say: Progress,
) -> Started:
    from examples.server import ServerProcess

    env = dict(os.environ, UCX_NET_DEVICES="lo", PYTHONUNBUFFERED="1")
    log_dir = stack.enter_context(tempfile.TemporaryDirectory(prefix="nixl-pd-demo-"))
    servers = []
    for config in (prefill_config, decode_config):
        server = ServerProcess(
            config,
            env=env,
            log_path=os.path.join(log_dir, config.role),
            connector=demo_connector_config(options)
            if options.verify_kv or options.turns > 1
            else None,
        )
        stack.push(server)
        servers.append(server)

    def wait_ready() -> None:
        for server in servers:
            ready = server.wait_ready(timeout_s=min(options.timeout_s, 60.0))
            say(
                f"{server.config.role} engine up: TP {server.config.tp_size}, side channel "
                f"127.0.0.1:{ready.side_channel_port}, ready in {ready.setup_s:.2f} s"
            )

    def leaks(timeout_s: float) -> tuple[int, int, StatsSnapshot]:
        deadline_s = time.monotonic() + timeout_s
        while True:
            stats = [server.stats(timeout_s=10.0) for server in servers]
            if not any(s.busy for s in stats) or time.monotonic() > deadline_s:
                return stats[0].leaked_blocks, stats[1].leaked_blocks, stats[1].transfer
            time.sleep(0.01)

    return Started(servers[0], servers[1], wait_ready, leaks)


def _result(
    options: DemoOptions,
    completions: Mapping[str, Completion],
    expected: Mapping[str, RequestOutput],
    leaked_prefill: int,
    leaked_decode: int,
    snapshot: StatsSnapshot,
    wall_s: float,
) -> DemoResult:
    errors = [f"{rid}: {'; '.join(c.errors)}" for rid, c in completions.items() if c.errors]
    tokens_match = not errors and all(
        c.token_ids == expected[rid].token_ids for rid, c in completions.items()
    )
    kv_match = not errors and all(
        c.decode is not None
        and c.prefill is not None
        and c.decode.kv_digest == c.prefill.kv_digest == expected[rid].kv_digest
        for rid, c in completions.items()
    )
    gbps = (
        snapshot.bytes_transferred / snapshot.transfer_busy_s / 1e9
        if snapshot.transfer_busy_s > 0
        else 0.0
    )
    hit_tokens = sum(c.decode.num_cached_tokens for c in completions.values() if c.decode)
    ok = tokens_match and kv_match and leaked_prefill == 0 and leaked_decode == 0
    return DemoResult(
        ok=ok,
        tokens_match=tokens_match,
        kv_match=kv_match,
        requests=len(completions),
        completed_requests=len(completions) - len(errors),
        failed_requests=len(errors),
        leaked_blocks_prefill=leaked_prefill,
        leaked_blocks_decode=leaked_decode,
        tokens_generated=sum(len(c.token_ids) for c in completions.values()),
        bytes_transferred=snapshot.bytes_transferred,
        num_reads=snapshot.num_reads,
        num_descriptors=snapshot.num_descriptors,
        transfer_gbps=round(gbps, 3),
        handshake_ms=None if snapshot.handshake_ms is None else round(snapshot.handshake_ms, 2),
        decode_prefix_hit_tokens=hit_tokens,
        wall_s=round(wall_s, 3),
        mode="fake-nixl" if options.fake_nixl else "nixl-ucx-loopback",
        errors=errors,
        options=options,
        pulled_tokens=sum(c.prefill.num_external_tokens for c in completions.values() if c.prefill),
    )


def summary(result: DemoResult) -> str:
    """The human-readable report."""
    o = result.options
    mark = "OK" if result.ok else "FAILED"
    handshake = "n/a" if result.handshake_ms is None else f"{result.handshake_ms:.1f} ms"
    lines = [
        f"nixl-pd demo: {mark}  ({result.mode}, model {o.model}, layout {o.layout})",
        f"  prefill TP {o.prefill_tp} block {o.prefill_block_size}/"
        f"{o.prefill_kernel_block_size or o.prefill_block_size}  ->  decode TP {o.decode_tp} "
        f"block {o.decode_block_size}/{o.decode_kernel_block_size or o.decode_block_size}",
        f"  requests      {result.completed_requests}/{result.requests} completed, "
        f"{result.failed_requests} failed",
        f"  tokens        {result.tokens_generated} generated, match single engine: "
        f"{_yes(result.tokens_match)}",
        f"  KV            prompt KV identical on decode: {_yes(result.kv_match)}; "
        f"decode prefix hits {result.decode_prefix_hit_tokens} tokens",
        f"  transfer      {result.bytes_transferred:,} bytes in {result.num_reads} READs "
        f"({result.num_descriptors} descriptors), {result.transfer_gbps:.3f} GB/s",
        f"  handshake     {handshake}",
        *(
            [
                f"  multi-turn    {o.turns} turns: {result.pulled_tokens} history tokens pulled "
                "by prefill from decode"
            ]
            if o.turns > 1
            else []
        ),
        f"  leaks         prefill {result.leaked_blocks_prefill} blocks, decode "
        f"{result.leaked_blocks_decode} blocks",
        f"  wall time     {result.wall_s:.2f} s",
    ]
    lines += [f"  error: {error}" for error in result.errors[:10]]
    return "\n".join(lines)


def _yes(flag: bool) -> str:
    return "yes" if flag else "NO"


def print_progress(message: str) -> None:
    print(f"  .. {message}", file=sys.stderr, flush=True)
