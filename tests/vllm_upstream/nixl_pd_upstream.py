"""pytest plugin: run vLLM 0.33's own connector unit tests with NixlPDConnector as the default.

vLLM's tests (tests/v1/kv_connector/unit of its source distribution) build every engine config
through ``create_vllm_config`` in that folder's utils.py, whose default connector is vLLM's
NixlConnector and whose default model is the hub id facebook/opt-125m. This plugin wraps that
one function, without editing vLLM's files, so that:

- a config that asks for the default connector (none given, or "NixlConnector") gets ours:
  ``kv_connector="NixlPDConnector"``, ``kv_connector_module_path="connector.vllm"``;
  a config naming any other connector (their test doubles) is left alone;
- the hub model id becomes the local copy of its config.json next to this file (no hub here);
- the platform says it supports vLLM's hybrid KV cache manager. vLLM installed without its
  CUDA dependencies detects no platform ("unspecified"), which refuses HMA, and a few
  scheduler tests ask for HMA explicitly. They never run a kernel: the same kind of stand-in
  as their own conftest's CPU kernel block sizes.

Tests listed in EXPECTED_FAILURES next to this file (each with its reason: they check
NixlConnector's private classes, or a limit of ours) are marked strict xfail: they still run,
and one that starts passing fails the run until its line is removed. ``ray`` (imported at the
top of test_nixl_connector.py, used by one test we do not run) gets an empty stand-in module
when it is not installed.

``--upstream-connector=vllm`` keeps vLLM's own connector (and ignores the list): the same run
then proves the harness.

Load it with ``-p nixl_pd_upstream`` and this directory on PYTHONPATH
(scripts/vllm_upstream_tests.sh does both).
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import inspect
import sys
import types
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

HERE = Path(__file__).resolve().parent
HUB_MODEL = "facebook/opt-125m"
LOCAL_MODEL = HERE / "opt-125m"  # config.json only: the unit tests never load weights
UPSTREAM_UTILS = "tests.v1.kv_connector.unit.utils"
UPSTREAM_DIR = "tests/v1/kv_connector/unit/"
EXPECTED_FAILURES = HERE / "EXPECTED_FAILURES"
VLLM_CONNECTOR = "NixlConnector"
OUR_CONNECTOR = "NixlPDConnector"
OUR_MODULE = "connector.vllm"


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("nixl-pd upstream")
    group.addoption(
        "--upstream-connector",
        choices=("ours", "vllm"),
        default="ours",
        help="which connector vLLM's default config uses (vllm: prove the harness)",
    )


def pytest_configure(config: pytest.Config) -> None:
    for marker in ("cpu_test", "skip_global_cleanup"):
        config.addinivalue_line("markers", f"{marker}: one of vLLM's own test markers")
    # vLLM's test files import their utils as tests.v1...: the extracted tree's root must be
    # importable before their modules load, so the wrapper is in place when they import it.
    root = str(config.rootpath)
    if root not in sys.path:
        sys.path.insert(0, root)
    if importlib.util.find_spec("ray") is None:
        sys.modules["ray"] = types.ModuleType("ray", "stand-in: ray is not installed")
    utils = importlib.import_module(UPSTREAM_UTILS)
    ours = config.getoption("--upstream-connector") == "ours"
    utils.create_vllm_config = substitute_defaults(utils.create_vllm_config, ours=ours)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if config.getoption("--upstream-connector") != "ours":
        return
    expected = read_expected_failures(EXPECTED_FAILURES.read_text())
    matched: set[str] = set()
    for item in items:
        test_id = item.nodeid.removeprefix(UPSTREAM_DIR)
        for listed, reason in expected.items():
            if test_id == listed or test_id.startswith(listed + "["):
                item.add_marker(pytest.mark.xfail(reason=reason, strict=True))
                matched.add(listed)
    collected_files = {item.nodeid.removeprefix(UPSTREAM_DIR).split("::")[0] for item in items}
    stale = [t for t in expected if t not in matched and t.split("::")[0] in collected_files]
    if stale:
        raise pytest.UsageError(
            f"{EXPECTED_FAILURES.name} lists tests that were not collected: {', '.join(stale)}; "
            "fix or remove those lines"
        )


def read_expected_failures(text: str) -> dict[str, str]:
    """``test_file.py::test_name | reason`` lines (``#`` comments) -> {test id: reason}."""
    expected: dict[str, str] = {}
    for number, raw in enumerate(text.splitlines(), start=1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        test_id, sep, reason = (part.strip() for part in line.partition("|"))
        if not sep or not test_id or not reason:
            raise pytest.UsageError(
                f"{EXPECTED_FAILURES.name} line {number}: {raw!r} is not "
                "'test_file.py::test_name | reason'"
            )
        expected[test_id] = reason
    return expected


@pytest.fixture(autouse=True)
def _platform_allows_hma(monkeypatch: pytest.MonkeyPatch) -> None:
    from vllm.platforms import current_platform

    if not current_platform.support_hybrid_kv_cache():
        monkeypatch.setattr(type(current_platform), "support_hybrid_kv_cache", classmethod(_yes))


def _yes(cls: type) -> bool:
    return True


def substitute_defaults(
    create_vllm_config: Callable[..., Any], *, ours: bool
) -> Callable[..., Any]:
    """Wrap vLLM's create_vllm_config: our connector by default, the local model copy."""
    signature = inspect.signature(create_vllm_config)

    @functools.wraps(create_vllm_config)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        bound = signature.bind(*args, **kwargs)
        bound.apply_defaults()
        arguments = bound.arguments
        if arguments["model"] == HUB_MODEL:
            arguments["model"] = str(LOCAL_MODEL)
        if ours and arguments["kv_connector"] == VLLM_CONNECTOR:
            arguments["kv_connector"] = OUR_CONNECTOR
            arguments["kv_connector_module_path"] = OUR_MODULE
        return create_vllm_config(*bound.args, **bound.kwargs)

    return wrapper
