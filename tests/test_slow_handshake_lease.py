"""A first handshake slower than prefill's lease does not cost the request (issue 31).

Issue 31's first suspect: NIXL's ``add_remote_agent`` once took 30 s on the TP 2 prefill's
first handshake, past the 30 s lease, and the request failed "lease expired". Here the example
engines run on FakeNixl in real time with a short lease, and decode's ``add_remote_agent``
blocks (releasing the GIL, as the real binding does) for twice the lease on decode's transfer
thread. Decode's heartbeat thread must keep prefill's lease alive throughout, so the load
succeeds: a slow wire-up alone does not expire a lease. What did expire them on the CI machine
was decode's whole process stopping (docs/metrics.md, "Frozen processes").
"""

from __future__ import annotations

import time

from connector.config import ConnectorConfig
from examples.engine import Engine, EngineConfig, EngineRequest, RequestOutput
from worker.fake import FakeFabric, FakeNixl

LEASE_S = 3.0
HEARTBEAT_S = 0.25
WIRE_UP_S = 2 * LEASE_S


class SlowWireUpNixl(FakeNixl):
    """FakeNixl whose ``add_remote_agent`` takes ``WIRE_UP_S`` (sleeping: the GIL is free)."""

    def __init__(self, name: str, fabric: FakeFabric) -> None:
        super().__init__(name, fabric)
        self.wire_up_s: list[float] = []

    def add_remote_agent(self, metadata: bytes) -> str:
        started_s = time.monotonic()
        time.sleep(WIRE_UP_S)
        self.wire_up_s.append(time.monotonic() - started_s)
        return super().add_remote_agent(metadata)


def run_until(engines: list[Engine], request_id: str, timeout_s: float = 30.0) -> RequestOutput:
    deadline_s = time.monotonic() + timeout_s
    while time.monotonic() < deadline_s:
        for engine in engines:
            for output in engine.step():
                if output.request_id == request_id:
                    return output
        time.sleep(0.002)
    raise AssertionError(f"request {request_id} unfinished after {timeout_s} s")


def test_a_handshake_twice_as_long_as_the_lease_keeps_the_lease_by_heartbeats() -> None:
    fabric = FakeFabric()
    config = ConnectorConfig(
        side_channel_port=0,
        kv_lease_duration_s=LEASE_S,
        heartbeat_interval_s=HEARTBEAT_S,
        handshake_timeout_s=5.0,
        handshake_retries=1,
    )
    decode_agents: list[SlowWireUpNixl] = []

    def decode_agent(name: str) -> FakeNixl:
        decode_agents.append(SlowWireUpNixl(name, fabric))
        return decode_agents[-1]

    prefill = Engine(
        EngineConfig("prefill", role="prefill", model="dense", num_blocks=32),
        connector_config=config,
        agent_factory=lambda name: FakeNixl(name, fabric),
    )
    decode = Engine(
        EngineConfig("decode", role="decode", model="dense", num_blocks=32),
        connector_config=config,
        agent_factory=decode_agent,
    )
    try:
        prompt = list(range(20))
        prefill.add_request(EngineRequest("p", prompt, 1, {"do_remote_decode": True}))
        first = run_until([prefill], "p")
        assert first.kv_transfer_params is not None
        decode.add_request(
            EngineRequest("d", prompt + first.token_ids, 3, first.kv_transfer_params)
        )

        output = run_until([prefill, decode], "d")

        assert [round(s, 1) for agent in decode_agents for s in agent.wire_up_s] == [WIRE_UP_S]
        assert output.error is None, output.error
        assert len(output.token_ids) == 3
    finally:
        prefill.shutdown()
        decode.shutdown()
