"""`nixl-pd route`: the toy router as a client of two `nixl-pd serve` engines, with an optional check.

Each prompt goes to prefill with ``{"do_remote_decode": true}`` and ``max_tokens=1``; prompt +
first token + the returned ``kv_transfer_params`` go to decode (``examples.router.ToyRouter``).
``examples.engine_client.EngineClient`` is the router's handle to one server's request
socket; a server that dies or stops answering fails its pending requests with that reason
(and a warning in the summary) instead of a timeout. With ``check`` the
same prompts also run on a single local engine (the prefill server's model and seed) and the
tokens must match; the prompt KV decode loaded must always equal what prefill computed.

``turns`` > 1 makes each prompt a conversation: turn k+1's prompt is turn k's prompt, its
answer and ``prompt_len`` new tokens, sent to prefill with the ``kv_transfer_params`` decode
returned for turn k. Engines served with ``--bidirectional`` then pull the history from
decode (each result's ``num_pulled_tokens``); without it prefill computes it (0 pulled).
"""

from __future__ import annotations

import math
import time
import uuid
from collections.abc import Mapping
from contextlib import ExitStack

import msgspec
import numpy as np

from connector.errors import UnsupportedConfiguration
from examples.engine import Engine, EngineConfig, RequestOutput
from examples.engine_client import EngineClient
from examples.engine_loop import Info
from examples.model import MAX_POSITIONS, VOCAB_SIZE
from examples.router import Completion, InProcessEngine, ToyRouter, run_local

__all__ = ["EngineClient", "RouteOptions", "RouteResult", "report", "run_route"]

CONNECT_TIMEOUT_S = 5.0  # how long each server may take to answer GetInfo


class RouteOptions(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    prefill: str  # HOST:PORT of a `nixl-pd serve --role prefill`
    decode: str  # HOST:PORT of a `nixl-pd serve --role decode`
    prompt_len: int = 64
    requests: int = 8
    max_tokens: int = 8  # tokens decode generates after prefill's first token
    seed: int = 0  # prompts' seed (the model's seed is the servers')
    timeout_s: float = 60.0
    check: bool = False
    turns: int = 1  # turns per conversation


class RequestResult(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    request_id: str
    turn: int  # 1-based turn of its conversation
    num_pulled_tokens: int  # prompt tokens prefill pulled from decode (an earlier turn's KV)
    token_ids: list[int]  # prefill's first token, then decode's
    num_external_tokens: int  # prompt tokens whose KV decode READ from prefill
    num_cached_tokens: int  # prompt tokens decode found in its own prefix cache
    ttft_ms: float | None  # submit -> prefill's first token
    latency_ms: float | None  # submit -> decode done
    kv_match: bool  # the prompt KV decode loaded hashes to what prefill computed
    tokens_match: bool | None  # None without --check
    error: str | None


class RouteResult(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    ok: bool
    prefill_engine: str
    decode_engine: str
    requests: int
    completed_requests: int
    failed_requests: int
    tokens_generated: int
    kv_match: bool
    tokens_match: bool | None  # None without --check
    mean_ttft_ms: float | None
    pulled_tokens: int  # prompt tokens prefill pulled from decode, over every later turn
    wall_s: float
    results: list[RequestResult]
    warnings: list[str]


def parse_address(flag: str, value: str) -> tuple[str, int]:
    """``HOST:PORT`` (IPv6 as ``[::1]:PORT``) -> (host, port); UnsupportedConfiguration if not."""
    host, _, port = value.rpartition(":")
    host = host.removeprefix("[").removesuffix("]")
    if not host or not port.isdigit() or not 1 <= int(port) <= 65535:
        raise UnsupportedConfiguration(
            f"{flag} {value!r}: expected HOST:PORT with a port in 1..65535, e.g. 127.0.0.1:8100"
        )
    return host, int(port)


def validate_options(options: RouteOptions) -> None:
    """Raise UnsupportedConfiguration (flag, value, what to do) for bad options."""
    parse_address("--prefill", options.prefill)
    parse_address("--decode", options.decode)
    limit = MAX_POSITIONS // max(options.turns, 1) - options.max_tokens - 1
    checks = (
        (1 <= options.turns <= 16, f"--turns {options.turns}: use 1..16"),
        (1 <= options.requests <= 1024, f"--requests {options.requests}: use 1..1024"),
        (1 <= options.max_tokens <= 256, f"--max-tokens {options.max_tokens}: use 1..256"),
        (1 <= options.prompt_len <= limit, f"--prompt-len {options.prompt_len}: use 1..{limit}"),
        (options.timeout_s > 0, f"--timeout {options.timeout_s}: must be positive"),
    )
    for ok, message in checks:
        if not ok:
            raise UnsupportedConfiguration(message)


def make_prompts(options: RouteOptions) -> dict[str, list[int]]:
    """Seeded prompts under fresh ids (servers refuse an id that is still in flight)."""
    rng = np.random.default_rng(options.seed)
    run_id = uuid.uuid4().hex[:4]
    return {
        f"cmpl-{run_id}-{i}": [int(t) for t in rng.integers(0, VOCAB_SIZE, options.prompt_len)]
        for i in range(options.requests)
    }


def run_route(options: RouteOptions) -> RouteResult:
    """Route the batch through the two servers (and, with ``check``, a local engine), for
    ``options.turns`` turns of each conversation."""
    validate_options(options)
    rng = np.random.default_rng(options.seed + 1)  # the new messages of later turns
    results: list[RequestResult] = []
    with ExitStack() as stack:
        prefill = stack.enter_context(EngineClient(*parse_address("--prefill", options.prefill)))
        decode = stack.enter_context(EngineClient(*parse_address("--decode", options.decode)))
        connect_timeout_s = min(CONNECT_TIMEOUT_S, options.timeout_s)
        infos = (prefill.info(connect_timeout_s), decode.info(connect_timeout_s))
        warnings = _check_pair(options, *infos)
        prompts = make_prompts(options)
        held: dict[str, dict[str, object]] = {}
        router = ToyRouter(prefill, decode)
        start_s = time.monotonic()
        for turn in range(1, options.turns + 1):
            expected = _reference(options, infos[0].config, prompts) if options.check else None
            completions = router.run(
                prompts, options.max_tokens, timeout_s=options.timeout_s, held=held
            )
            results += [
                _request_result(c, None if expected is None else expected[rid], turn)
                for rid, c in completions.items()
            ]
            prompts, held = _next_turn(completions, options.prompt_len, rng, turn + 1)
            if not prompts:
                break
        wall_s = time.monotonic() - start_s
    warnings += [f"{role}: {problem}" for role, problem in router.problems.items()]
    return _result(infos[0], infos[1], results, wall_s, warnings)


def _next_turn(
    completions: Mapping[str, Completion],
    num_new_tokens: int,
    rng: np.random.Generator,
    turn: int,
) -> tuple[dict[str, list[int]], dict[str, dict[str, object]]]:
    """The next turn's prompts (this prompt, its answer, new tokens) under fresh ids, and the
    params decode returned for each, which go to prefill with it. Failed ones end here."""
    prompts: dict[str, list[int]] = {}
    held: dict[str, dict[str, object]] = {}
    for request_id, c in completions.items():
        if c.errors or c.decode is None:
            continue
        next_id = f"{request_id.rsplit('-t', 1)[0]}-t{turn}"
        new_tokens = [int(t) for t in rng.integers(0, VOCAB_SIZE, num_new_tokens)]
        prompts[next_id] = c.prompt + c.token_ids + new_tokens
        if c.decode.kv_transfer_params:
            held[next_id] = dict(c.decode.kv_transfer_params)
    return prompts, held


def _check_pair(options: RouteOptions, prefill: Info, decode: Info) -> list[str]:
    """Refuse swapped roles; warn about pairings whose tokens cannot match."""
    for flag, info, role in (("--prefill", prefill, "prefill"), ("--decode", decode, "decode")):
        if info.config.role != role:
            address = getattr(options, flag.removeprefix("--"))
            raise UnsupportedConfiguration(
                f"{flag} {address} serves a {info.config.role} engine ({info.config.engine_id}); "
                f"pass a `nixl-pd serve --role {role}` address"
            )
    p, d = prefill.config, decode.config
    if (p.model, p.seed) != (d.model, d.seed):
        return [
            f"prefill serves model {p.model} seed {p.seed}, decode model {d.model} seed {d.seed}"
        ]
    return []


def _reference(
    options: RouteOptions, served: EngineConfig, prompts: Mapping[str, list[int]]
) -> dict[str, RequestOutput]:
    """The prompts on one local engine with the prefill server's model and seed."""
    longest = max(len(prompt) for prompt in prompts.values())
    blocks_per_request = math.ceil((longest + options.max_tokens + 1) / 16) + 1
    config = EngineConfig(
        "reference",
        model=served.model,
        seed=served.seed,
        num_blocks=options.requests * blocks_per_request + 8,
    )
    engine = Engine(config)
    return run_local(
        InProcessEngine(engine), prompts, options.max_tokens + 1, timeout_s=options.timeout_s
    )


def _request_result(
    completion: Completion, expected: RequestOutput | None, turn: int = 1
) -> RequestResult:
    c = completion
    kv_match = bool(c.prefill and c.decode and c.prefill.kv_digest == c.decode.kv_digest)
    if expected is not None and c.decode is not None:
        kv_match = kv_match and c.decode.kv_digest == expected.kv_digest
    return RequestResult(
        request_id=c.request_id,
        turn=turn,
        num_pulled_tokens=c.prefill.num_external_tokens if c.prefill else 0,
        token_ids=c.token_ids,
        num_external_tokens=c.decode.num_external_tokens if c.decode else 0,
        num_cached_tokens=c.decode.num_cached_tokens if c.decode else 0,
        ttft_ms=_ms(c.first_token_s, c.submitted_s),
        latency_ms=_ms(c.done_s, c.submitted_s),
        kv_match=kv_match and not c.errors,
        tokens_match=None if expected is None else c.token_ids == expected.token_ids,
        error="; ".join(c.errors) or None,
    )


def _ms(end_s: float | None, start_s: float) -> float | None:
    return None if end_s is None else round((end_s - start_s) * 1000, 2)


def _result(
    prefill: Info,
    decode: Info,
    results: list[RequestResult],
    wall_s: float,
    warnings: list[str],
) -> RouteResult:
    failed = sum(r.error is not None for r in results)
    kv_match = all(r.kv_match for r in results)
    checked = [r.tokens_match for r in results if r.tokens_match is not None]
    tokens_match = all(checked) if checked else None
    ttfts = [r.ttft_ms for r in results if r.ttft_ms is not None]
    return RouteResult(
        ok=failed == 0 and kv_match and tokens_match is not False,
        prefill_engine=prefill.config.engine_id,
        decode_engine=decode.config.engine_id,
        requests=len(results),
        completed_requests=len(results) - failed,
        failed_requests=failed,
        tokens_generated=sum(len(r.token_ids) for r in results),
        kv_match=kv_match,
        tokens_match=tokens_match,
        mean_ttft_ms=round(sum(ttfts) / len(ttfts), 2) if ttfts else None,
        pulled_tokens=sum(r.num_pulled_tokens for r in results),
        wall_s=round(wall_s, 3),
        results=results,
        warnings=warnings,
    )


def report(result: RouteResult, options: RouteOptions) -> str:
    """One line per request, then the summary."""
    lines = [_request_line(r) for r in result.results]
    match = "not checked (add --check)"
    if result.tokens_match is not None:
        match = "yes" if result.tokens_match else "NO"
    lines += [
        f"nixl-pd route: {'OK' if result.ok else 'FAILED'}  (prefill {result.prefill_engine} at "
        f"{options.prefill} -> decode {result.decode_engine} at {options.decode})",
        f"  requests      {result.completed_requests}/{result.requests} completed, "
        f"{result.failed_requests} failed",
        f"  tokens        {result.tokens_generated} generated, match single engine: {match}",
        f"  multi-turn    {result.pulled_tokens} history tokens pulled by prefill from decode",
        f"  KV            prompt KV identical on decode: {'yes' if result.kv_match else 'NO'}",
        f"  latency       mean time to first token {result.mean_ttft_ms} ms",
        f"  wall time     {result.wall_s:.2f} s",
    ]
    lines += [f"  warning: {warning}" for warning in result.warnings]
    return "\n".join(lines)


def _request_line(r: RequestResult) -> str:
    if r.error is not None:
        return f"{r.request_id}  FAILED: {r.error}"
    first, rest = r.token_ids[:1], r.token_ids[1:]
    tokens = " ".join(map(str, first)) + " | " + " ".join(map(str, rest))
    match = "" if r.tokens_match is None else ("  match" if r.tokens_match else "  MISMATCH")
    pulled = f"{r.num_pulled_tokens} pulled by prefill from decode, " if r.turn > 1 else ""
    return (
        f"{r.request_id}  {tokens}  (KV: {pulled}{r.num_external_tokens} tokens READ from "
        f"prefill, {r.num_cached_tokens} cached on decode; ttft {r.ttft_ms} ms, total "
        f"{r.latency_ms} ms)"
        f"{match}"
    )
