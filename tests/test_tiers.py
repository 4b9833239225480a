"""The tier tables of tests/conftest.py against what each test module's source uses.

A module that starts real NIXL agents or real vLLM engines but is not in a real tier would run
in `scripts/test.sh --quick` (the unit tier) and make it slow or flaky; a table entry for a
module that is gone or uses nothing real would hide that. Read from the source, not from names.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests import conftest

TESTS = Path(__file__).resolve().parent

# What in a module's source means it uses real NIXL (directly or through a process it starts).
REAL_NIXL_SIGNS = {
    r"from worker\.nixl_real import": "a RealNixlAgent",
    r"\bPeerProcess\b": "a real NIXL peer process (tests/nixl_peer_proc.py)",
    r"\bServerProcess\b": "an example-engine server process",
    r"\bdrill_servers\b": "example-engine servers (tests/drill_servers.py)",
    r"\"-m\", \"connector\.tools\.cli\"": "nixl-pd serve/doctor run as a process",
    r"\bdoctor_loopback\b": "doctor's real loopback READ",
    r"from tests\.netns import|from tests import netns": "network namespaces",
}
# What means it uses real vLLM engines or .venv-vllm.
REAL_VLLM_SIGNS = {
    r"\breal_vllm_harness\b": "real `vllm serve` engines",
    r"\.venv-vllm": "a process in .venv-vllm",
}
# What means it imports .venv's vLLM in-process.
VLLM_SIGNS = {
    r"^\s*(from vllm[ .]|import vllm\b)": "imports vllm",
    r"\bvllm_harness\b": "tests/vllm_harness.py",
    r"find_spec\(\"vllm\"\)": "needs vllm installed",
}
PER_TEST_REAL_NIXL = r"pytest\.mark\.real_nixl"
PER_TEST_VLLM = r"pytest\.mark\.vllm\b"


def module_names() -> list[str]:
    """Every test module but this one (whose patterns would match themselves)."""
    return sorted(path.stem for path in TESTS.glob("test_*.py") if path.stem != "test_tiers")


def source(module: str) -> str:
    return (TESTS / f"{module}.py").read_text()


def signs(module: str, table: dict[str, str]) -> list[str]:
    text = source(module)
    return [why for pattern, why in table.items() if re.search(pattern, text, re.MULTILINE)]


ALL_TABLES = {
    "REAL_VLLM_MODULES": set(conftest.REAL_VLLM_MODULES),
    "REAL_NIXL_MODULES": set(conftest.REAL_NIXL_MODULES),
    "MIXED_NIXL_MODULES": set(conftest.MIXED_NIXL_MODULES),
    "VLLM_MODULES": conftest.VLLM_MODULES,
    "NETNS_MODULES": conftest.NETNS_MODULES,
    "SLOW_MODULES_FIRST": set(conftest.SLOW_MODULES_FIRST),
}


@pytest.mark.parametrize("table", ALL_TABLES)
def test_every_module_a_table_names_exists(table: str) -> None:
    missing = sorted(ALL_TABLES[table] - set(module_names()))
    assert missing == [], f"{table} in tests/conftest.py names modules that do not exist"


def test_no_module_is_in_two_exclusive_tables() -> None:
    vllm, nixl = set(conftest.REAL_VLLM_MODULES), set(conftest.REAL_NIXL_MODULES)
    mixed = set(conftest.MIXED_NIXL_MODULES)
    assert vllm & nixl == set() and vllm & mixed == set() and nixl & mixed == set()


def test_every_module_that_uses_real_nixl_or_engines_is_in_a_real_tier() -> None:
    """A module in no real table is unit: it must show no sign of real NIXL or real engines."""
    real = (
        set(conftest.REAL_VLLM_MODULES)
        | set(conftest.REAL_NIXL_MODULES)
        | set(conftest.MIXED_NIXL_MODULES)
    )
    untiered = {
        module: signs(module, REAL_NIXL_SIGNS) + signs(module, REAL_VLLM_SIGNS)
        for module in module_names()
        if module not in real
    }
    assert {module: why for module, why in untiered.items() if why} == {}, (
        "these modules use real NIXL or real engines but are in no real tier: add each to "
        "REAL_NIXL_MODULES, REAL_VLLM_MODULES or MIXED_NIXL_MODULES in tests/conftest.py"
    )


@pytest.mark.parametrize(
    ("table", "sign_table"),
    [
        (conftest.REAL_VLLM_MODULES, REAL_VLLM_SIGNS),
        (conftest.REAL_NIXL_MODULES, REAL_NIXL_SIGNS),
        (conftest.MIXED_NIXL_MODULES, REAL_NIXL_SIGNS),
    ],
    ids=["real_vllm", "real_nixl", "mixed"],
)
def test_every_module_in_a_real_tier_uses_something_real(
    table: dict[str, str], sign_table: dict[str, str]
) -> None:
    stale = sorted(m for m in table if (TESTS / f"{m}.py").exists() and not signs(m, sign_table))
    assert stale == [], "listed in a real tier but their source shows nothing real"


def test_mixed_modules_mark_their_real_tests_and_only_they_do() -> None:
    marked = {m for m in module_names() if re.search(PER_TEST_REAL_NIXL, source(m))}
    whole = set(conftest.REAL_NIXL_MODULES)
    assert marked - whole == set(conftest.MIXED_NIXL_MODULES)


def test_vllm_tag_follows_the_source() -> None:
    """Whole modules that import vLLM are tagged by table; others tag their own tests."""
    real_vllm = set(conftest.REAL_VLLM_MODULES)
    uses_vllm = {m for m in module_names() if m not in real_vllm and signs(m, VLLM_SIGNS)}
    per_test = {m for m in uses_vllm if re.search(PER_TEST_VLLM, source(m))}
    module_wide = {
        m for m in per_test if re.search(r"pytestmark = .*pytest\.mark\.vllm", source(m))
    }
    assert uses_vllm - (per_test - module_wide) == conftest.VLLM_MODULES


def test_netns_tag_follows_the_source() -> None:
    uses = {m for m in module_names() if re.search(r"\bnetns\b", source(m))}
    assert uses == conftest.NETNS_MODULES


@pytest.mark.parametrize(
    ("module", "marked", "tier"),
    [
        ("test_real_vllm", set(), "real_vllm"),
        ("test_e2e_real", set(), "real_nixl"),
        ("test_nixl_contract", {"real_nixl"}, "real_nixl"),
        ("test_nixl_contract", set(), "unit"),
        ("test_planner", set(), "unit"),
    ],
)
def test_tier_of_a_test(module: str, marked: set[str], tier: str) -> None:
    assert conftest.tier_of(module, marked) == tier


@pytest.mark.parametrize(
    ("marked", "table"), [({"real_nixl"}, "MIXED_NIXL_MODULES"), ({"real_vllm"}, "REAL_VLLM")]
)
def test_a_real_mark_outside_the_tables_stops_the_run(marked: set[str], table: str) -> None:
    with pytest.raises(pytest.UsageError, match=table):
        conftest.tier_of("test_planner", marked)


def test_every_real_vllm_module_runs_in_exactly_one_stream() -> None:
    streams = conftest.real_vllm_streams()
    placed = [module for modules in streams.values() for module in modules]
    assert sorted(placed) == sorted(conftest.REAL_VLLM_MODULES)
    assert set(conftest.REAL_VLLM_MODULES) >= conftest.OWN_ENGINES_STREAM


def test_the_shared_pair_is_started_by_one_stream_only() -> None:
    """A module asking for the session's shared pair in the other stream would start a second
    one there: three more engine starts, unseen."""
    own = set(conftest.real_vllm_streams()["own-engines"])
    users = {
        path.stem
        for path in TESTS.glob("test_*.py")
        if re.search(r"real_vllm\.pair\(", path.read_text())
    }
    assert users, "no module uses the shared pair: the check reads the wrong thing"
    assert not users & own, f"in the own-engines stream but using the shared pair: {users & own}"
