"""The example engine refuses overlapped dispatch (docs/overlap.md) with a typed error.

Its decode request ends with prefill's first output token (examples/engine_api.py), which an
overlapped router does not have when it sends decode the request. Both roles refuse a
``transfer_key`` at once, naming it and the sequential flow to use, and serve on.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from examples.engine import Engine, EngineConfig, EngineRequest
from examples.router import InProcessEngine, ToyRouter
from examples.server import connector_config
from worker.fake import FakeFabric, FakeNixl

PROMPT = list(range(3, 40))


@pytest.fixture
def pair() -> Iterator[tuple[Engine, Engine]]:
    fabric = FakeFabric()
    engines = [
        Engine(
            EngineConfig(f"{role}-overlap", role=role),
            connector_config=connector_config(),
            agent_factory=lambda name: FakeNixl(name, fabric),
        )
        for role in ("prefill", "decode")
    ]
    try:
        yield engines[0], engines[1]
    finally:
        for engine in engines:
            engine.shutdown()


def test_both_roles_refuse_a_transfer_key_and_serve_on(pair: tuple[Engine, Engine]) -> None:
    prefill, decode = pair
    port = prefill.scheduler.side_channel_port
    overlapped = {
        prefill: {"do_remote_decode": True, "transfer_key": "k1"},
        decode: {
            "do_remote_prefill": True,
            "transfer_key": "k1",
            "remote_host": "127.0.0.1",
            "remote_port": port,
        },
    }
    for engine, params in overlapped.items():
        refused = engine.add_request(EngineRequest("r1", PROMPT, 4, kv_transfer_params=params))
        assert refused is not None and refused.token_ids == []
        assert refused.error_kind == "params"
        assert refused.error is not None
        assert refused.error.startswith("InvalidTransferParams: kv_transfer_params['transfer_key']")
        assert "send the request to prefill first" in refused.error
        assert not engine.has_work() and engine.num_leaked_blocks == 0

    router = ToyRouter(InProcessEngine(prefill), InProcessEngine(decode))
    completions = router.run({"r2": PROMPT}, 4, timeout_s=60.0)
    served = completions["r2"]  # the sequential flow: decode loads prefill's KV
    assert served.errors == [] and served.token_ids
    assert served.decode is not None and served.decode.num_external_tokens == len(PROMPT)
