"""The example engine's host-staged mode gives byte-identical KV and tokens to the direct mode.

The engine's RankBuffers stand in for device memory; with ``staged`` NIXL (FakeNixl, moving
real bytes) reads a host mirror only, filled and drained by batched block copies.
"""

from __future__ import annotations

import json
from typing import Any

import msgspec
import pytest

from connector.layout import MemoryLayout
from connector.tools.cli import main
from examples.demo import DemoOptions, engine_configs
from examples.engine import Engine, EngineConfig
from examples.kv_cache import RankBuffers, build_spec, copy_kernel_blocks
from examples.model import ModelKind
from examples.router import InProcessEngine, ToyRouter, run_local
from examples.server import connector_config
from worker.fake import FakeFabric, FakeNixl

PROMPTS = {f"r{i}": [(i * 5 + t) % 60 for t in range(20 + 7 * i)] for i in range(4)}
MAX_TOKENS = 5


def run_pair(staged: bool, **shape: Any) -> dict[str, Any]:
    """Prefill then decode PROMPTS through a router; tokens, KV digests and copy counts."""
    fabric = FakeFabric()
    prefill_tp, decode_tp = shape.pop("tp", (1, 1))
    engines = [
        Engine(
            EngineConfig(f"{role}-{staged}", role=role, staged=staged, tp_size=tp, **shape),
            connector_config=connector_config(),
            agent_factory=lambda name: FakeNixl(name, fabric),
        )
        for role, tp in (("prefill", prefill_tp), ("decode", decode_tp))
    ]
    try:
        router = ToyRouter(InProcessEngine(engines[0]), InProcessEngine(engines[1]))
        completions = router.run(PROMPTS, MAX_TOKENS, timeout_s=60.0)
        return {
            "errors": [e for c in completions.values() for e in c.errors],
            "tokens": {rid: c.token_ids for rid, c in completions.items()},
            "kv": {
                rid: (c.prefill.kv_digest if c.prefill else None, c.decode.kv_digest)
                for rid, c in completions.items()
                if c.decode is not None
            },
            "copied": [e.staging.num_kernel_blocks_copied if e.staging else 0 for e in engines],
        }
    finally:
        for engine in engines:
            engine.shutdown()


SHAPES = [
    pytest.param({}, id="dense"),
    pytest.param({"block_size": 8, "kernel_block_size": 4}, id="kernel-blocks-split"),
    pytest.param({"tp": (1, 2)}, id="prefill-tp1-decode-tp2"),
    pytest.param({"model": "hybrid-swa", "block_size": 8}, id="sliding-window"),
    pytest.param({"model": "hybrid-ssm", "block_size": 8}, id="mamba-state"),
    pytest.param({"layout": "hnd"}, id="hnd-layout"),
]


@pytest.mark.parametrize("shape", SHAPES)
def test_staged_mode_matches_the_direct_mode(shape: dict[str, Any]) -> None:
    direct = run_pair(False, **dict(shape))
    staged = run_pair(True, **dict(shape))
    assert direct["errors"] == [] and staged["errors"] == []
    assert staged["tokens"] == direct["tokens"]
    assert staged["kv"] == direct["kv"]
    for prefill_digest, decode_digest in staged["kv"].values():
        assert decode_digest == prefill_digest, "decode's prompt KV differs from prefill's"
    assert all(copied > 0 for copied in staged["copied"]), "a side never copied"
    reference = Engine(EngineConfig("reference", model=shape.get("model", "dense")))
    expected = run_local(InProcessEngine(reference), PROMPTS, MAX_TOKENS + 1, timeout_s=60.0)
    assert staged["tokens"] == {rid: out.token_ids for rid, out in expected.items()}


def test_staged_engines_register_the_host_mirror_only() -> None:
    fabric = FakeFabric()
    agents: list[FakeNixl] = []

    def factory(name: str) -> FakeNixl:
        agents.append(FakeNixl(name, fabric))
        return agents[-1]

    engine = Engine(
        EngineConfig("p", role="prefill", staged=True),
        connector_config=connector_config(),
        agent_factory=factory,
    )
    try:
        assert engine.staging is not None
        registered = {a for reg in agents[0]._registrations.values() for a, _ in reg.regions}
        assert registered == set(engine.staging.region_addresses(0))
        assert not registered & set(engine.ranks[0].region_addresses)
    finally:
        engine.shutdown()


def test_copy_kernel_blocks_moves_exactly_the_named_blocks_of_every_plane() -> None:
    import numpy as np

    spec = build_spec(
        ModelKind.DENSE, block_size=4, kernel_block_size=2, num_blocks=6,
        memory_layout=MemoryLayout.NHD,
    )  # fmt: skip
    source, target = RankBuffers(spec, 0, 1), RankBuffers(spec, 0, 1)
    for region in source.regions:
        region[:] = np.arange(len(region)) % 251 + 1
    copy_kernel_blocks(source, target, [np.array([3, 4], dtype=np.int64)])
    for source_layer, target_layer in zip(source.views[0], target.views[0], strict=True):
        for source_plane, target_plane in zip(source_layer, target_layer, strict=True):
            assert np.array_equal(target_plane[[3, 4]], source_plane[[3, 4]])
            others = [b for b in range(len(target_plane)) if b not in (3, 4)]
            assert not target_plane[others].any()


def test_the_staged_flag_reaches_both_demo_engines(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["demo", "--fake-nixl", "--staged", "--json", "--requests", "2", "--prompt-len", "20"]
    assert main(argv) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["options"]["staged"] is True
    assert result["tokens_match"] and result["kv_match"] and result["leaked_blocks_decode"] == 0
    configs = engine_configs(msgspec.convert(result["options"], DemoOptions), "run")
    assert [config.staged for config in configs] == [True, True]


def test_the_staged_flag_reaches_the_served_engine(monkeypatch: pytest.MonkeyPatch) -> None:
    import examples.serve as serve

    served: list[serve.ServeOptions] = []
    monkeypatch.setattr(serve, "stop_on_signals", lambda stop: None)
    monkeypatch.setattr(serve, "run_server", lambda options, *a, **k: served.append(options))
    assert main(["serve", "--role", "prefill", "--port", "0", "--staged"]) == 0
    assert serve.engine_config(served[0]).staged
    assert main(["serve", "--role", "prefill", "--port", "0"]) == 0
    assert not serve.engine_config(served[1]).staged
