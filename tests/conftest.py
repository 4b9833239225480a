"""Test-wide settings: UCX on loopback, hypothesis within the CI time budget, test tiers, and
the order modules are collected in (slowest first, for xdist's two workers).

Every test gets exactly one tier marker, assigned here by module (docs/testing.md):

- ``unit``: no real NIXL agent, no real vLLM engine (FakeNixl, the recorded ``nixl._api``
  stand-in, and vLLM's real Scheduler in-process are all unit);
- ``real_nixl``: real NIXL/UCX agents, in this process or in example-engine processes;
- ``real_vllm``: real vLLM CPU engines or ops from .venv-vllm.

Two tags come on top of the tier: ``vllm`` (imports .venv's vLLM in-process; still unit) and
``netns`` (two hosts in network namespaces; needs root). tests/test_tiers.py fails when a
module's source uses real NIXL or real engines but the tables below do not say so, or when a
table names a module that does not exist.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import TYPE_CHECKING

import pytest
from hypothesis import HealthCheck, settings

# UCX opens lanes on every interface unless told otherwise; tests stay on loopback.
os.environ.setdefault("UCX_NET_DEVICES", "lo")

if TYPE_CHECKING:
    from tests.real_vllm_workspace import Workspace

settings.register_profile(
    "ci", deadline=None, suppress_health_check=[HealthCheck.too_slow], print_blob=True
)
settings.load_profile("ci")

TIERS = ("unit", "real_nixl", "real_vllm")

# Modules whose every test starts real vLLM engines or runs vLLM's CPU ops in .venv-vllm.
REAL_VLLM_MODULES = {
    "test_cpu_attn_op": "vLLM's CPU cache-write op, run in .venv-vllm",
    "test_real_vllm": "real `vllm serve` engines (tests/real_vllm_harness.py)",
    "test_real_vllm_drills": "real `vllm serve` engines",
    "test_real_vllm_configs": "real `vllm serve` engines: the configuration tier",
    "test_real_vllm_fp8": "real `vllm serve` engines",
    "test_real_vllm_hybrid": "real `vllm serve` engines",
    "test_real_vllm_mla": "real `vllm serve` engines: MLA against vLLM's connector",
    "test_real_vllm_multiturn": "real `vllm serve` engines",
    "test_real_vllm_overlap": "real `vllm serve` engines behind proxy.py --overlap",
    "test_real_vllm_router": "real `vllm serve` engines behind vllm-router",
    "test_real_vllm_two_hosts": "real `vllm serve` engines in two network namespaces",
}

# scripts/test.sh runs the real-vLLM tier as two pytest processes side by side, one per
# stream: the modules that use the session's shared single engine and pair
# (tests/real_vllm_workspace.py) in one, so that those start once, and modules with engines of
# their own in the other, about as long (docs/testing.md, "CI and its time"): MLA, with its
# own engines, runs in the shared stream, which was the shorter. Two processes,
# not xdist: pytest-xdist 3.8's `--dist loadgroup` split one group over both workers here.
OWN_ENGINES_STREAM = {
    "test_cpu_attn_op",
    "test_real_vllm_drills",
    "test_real_vllm_fp8",
    "test_real_vllm_hybrid",
    "test_real_vllm_multiturn",  # its single engine is this stream's own start of the shared one
}


def real_vllm_streams() -> dict[str, list[str]]:
    """The real-vLLM modules of each stream, ``shared-engines`` and ``own-engines``."""
    own = sorted(m for m in REAL_VLLM_MODULES if m in OWN_ENGINES_STREAM)
    return {"shared-engines": sorted(set(REAL_VLLM_MODULES) - set(own)), "own-engines": own}


# Modules whose every test uses real NIXL agents (here, or in processes it starts).
REAL_NIXL_MODULES = {
    "test_doctor_real": "nixl-pd doctor: real READs over UCX, against served engines",
    "test_drill": "example-engine servers on real NIXL (tests/drill_servers.py)",
    "test_e2e_real": "the demo's two server processes over real NIXL",
    "test_e2e_real_failures": "example-engine server processes over real NIXL",
    "test_e2e_two_boots": "nixl-pd serve processes over real NIXL",
    "test_metrics_serve": "nixl-pd serve processes over real NIXL",
    "test_nixl_aliased_regions": "a RealNixlAgent in a child process",
    "test_real_quarantine": "a RealNixlAgent reading from a real peer process",
    "test_serve_by_hand": "nixl-pd serve processes over real NIXL",
    "test_two_hosts": "nixl-pd serve and doctor across two network namespaces",
}

# Unit modules with a few real-NIXL tests; those carry @pytest.mark.real_nixl (or a param
# mark) in the file, and only they join the real_nixl tier.
MIXED_NIXL_MODULES = {
    "test_lifecycle": "test_full_lifecycle_over_real_nixl",
    "test_nixl_contract": "the 'real' agent parameter and the test_real_* tests",
    "test_vllm_block_major": "test_hybrid_rows_over_real_nixl",
}

# Modules that import .venv's vLLM in-process (its Scheduler, configs, types): unit, tagged.
VLLM_MODULES = {
    "test_metrics_vllm",
    "test_staging_devices",
    "test_vllm_block_binding",
    "test_vllm_block_major",
    "test_vllm_changed_params",
    "test_vllm_chunk_tracker",
    "test_vllm_chunked_pull",
    "test_vllm_connector",
    "test_vllm_failed_load_cache",
    "test_vllm_layout",
    "test_vllm_multiturn",
    "test_vllm_no_reload",
    "test_vllm_overlap",
    "test_vllm_semantics",
    "test_vllm_siblings",
    "test_vllm_staging",
    "test_vllm_token_binding",
    "test_vllm_tracking",
}

# Modules that build two hosts out of network namespaces (root, iproute2).
NETNS_MODULES = {"test_two_hosts", "test_real_vllm_two_hosts"}

# The slowest modules, slowest first (measured, docs/testing.md "CI and its time"): collected
# first, so that xdist's workers (`--dist loadfile --no-loadscope-reorder`, scripts/test.sh)
# start them first and end on the short ones. Left to xdist's order (most tests first), the
# few-test modules that start processes and wait out leases came last, one worker running them
# while the other could idle. The order only shapes the run's time; the rest follow these.
SLOW_MODULES_FIRST = (
    "test_e2e_real_failures",
    "test_doctor_real",
    "test_planner_properties",
    "test_e2e_real",
    "test_e2e_fake",
    "test_verify_kv",
    "test_two_hosts",
    "test_serve_by_hand",
    "test_prepped",
    "test_vllm_connector",
    "test_worker_lifecycles",
    "test_drill",
    "test_e2e_two_boots",
    "test_vllm_layout",
    "test_real_quarantine",
    "test_params_fast",
    "test_example_server_input",
    "test_planner_block_pairing",
    "test_planner_block_major",
)


def tier_of(module: str, marked: set[str]) -> str:
    """The one tier of a test in ``module`` whose own markers are ``marked``."""
    if module in REAL_VLLM_MODULES:
        return "real_vllm"
    if module in REAL_NIXL_MODULES:
        return "real_nixl"
    if "real_vllm" in marked:
        raise pytest.UsageError(
            f"{module} has tests marked real_vllm but is not in REAL_VLLM_MODULES "
            "(tests/conftest.py): add it there"
        )
    if "real_nixl" in marked:
        if module not in MIXED_NIXL_MODULES:
            raise pytest.UsageError(
                f"{module} has tests marked real_nixl but is in neither REAL_NIXL_MODULES nor "
                "MIXED_NIXL_MODULES (tests/conftest.py): add it to one of them"
            )
        return "real_nixl"
    return "unit"


@pytest.hookimpl(tryfirst=True)  # before `-m` deselects by these markers
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        module = item.path.stem
        marked = {mark.name for mark in item.iter_markers()}
        item.add_marker(tier_of(module, marked))
        if module in VLLM_MODULES:
            item.add_marker("vllm")
        if module in NETNS_MODULES:
            item.add_marker("netns")
    rank = {module: position for position, module in enumerate(SLOW_MODULES_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.stem, len(rank)))  # stable: the rest keep order


@pytest.fixture(scope="session")
def real_vllm(request: pytest.FixtureRequest) -> Iterator[Workspace]:
    """The real-vLLM tier's shared models, single engine and log folders for this session
    (tests/real_vllm_workspace.py); built on the first module that asks."""
    from tests.real_vllm_workspace import Workspace  # imported here: only real-vLLM uses it

    with Workspace.open(request.session) as workspace:
        yield workspace
