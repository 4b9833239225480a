"""The import layers of docs/architecture.md, read from the source with ast (nothing imported).

    top        connector/vllm/ (the adapter)   connector/cli.py   connector/doctor*.py   examples/
    middle     scheduler/ (control plane)              worker/ (data plane)
    bottom     the contracts: CONTRACTS below, importable by every layer

An arrow may only point down (or sideways inside one package of the middle or top). The
CLI wires products together (the example engine, the doctor), so it sits on top; it lives in
connector/ only because the `nixl-pd` entry point is `connector.cli:main`, and it imports the
example engine inside the commands that run it, never at module level.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PRODUCT_PACKAGES = ("connector", "scheduler", "worker", "examples")

# The contract modules: shared by every layer, so they import nothing above themselves.
# A new connector/*.py must be added here or to TOP_IN_CONNECTOR (a conscious choice).
CONTRACTS = frozenset(
    f"connector.{name}"
    for name in (
        "config",
        "errors",
        "geometry",
        "layout",
        "lifecycle",
        "memory",
        "metadata",
        "metrics",
        "metrics_prometheus",
        "params",
        "params_json",
        "protocol",
        "ratelimit",
        "side_channel_client",
        "staging",
        "trace",
    )
) | {"connector"}
TOP_IN_CONNECTOR = frozenset(
    {"connector.cli", "connector.source_tree"}
    | {f"connector.{name}" for name in ("doctor", "doctor_checks", "doctor_env")}
    | {f"connector.{name}" for name in ("doctor_loopback", "doctor_peer", "doctor_ucx")}
    | {f"connector.{name}" for name in ("doctor_hosts", "doctor_remote")}
)


@dataclass(frozen=True)
class Import:
    importer: str  # dotted module name of the file
    target: str  # dotted name it imports (a package, module or module attribute path)
    line: int
    module_level: bool  # outside every function body


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[: len(parts) - 1] if parts[len(parts) - 1] == "__init__" else parts)


def _resolve(importer: str, is_package: bool, node: ast.ImportFrom) -> str:
    """Absolute name of ``from <module> import ...``, relative forms included."""
    if node.level == 0:
        return node.module or ""
    package = importer.split(".")
    keep = len(package) - node.level + (1 if is_package else 0)
    base = package[:keep]
    return ".".join([*base, node.module] if node.module else base)


class _Collector(ast.NodeVisitor):
    def __init__(self, importer: str, is_package: bool) -> None:
        self.importer = importer
        self.is_package = is_package
        self.depth = 0  # function nesting: imports inside a function run only when it is called
        self.found: list[Import] = []

    def _function(self, node: ast.FunctionDef | ast.AsyncFunctionDef) -> None:
        self.depth += 1
        self.generic_visit(node)
        self.depth -= 1

    visit_FunctionDef = _function
    visit_AsyncFunctionDef = _function

    def visit_Import(self, node: ast.Import) -> None:
        for alias in node.names:
            self._add(alias.name, node.lineno)

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        module = _resolve(self.importer, self.is_package, node)
        for alias in node.names:  # `from connector import vllm` imports connector.vllm
            self._add(f"{module}.{alias.name}" if module else alias.name, node.lineno)

    def _add(self, target: str, line: int) -> None:
        self.found.append(Import(self.importer, target, line, self.depth == 0))


def _imports_of(path: Path) -> list[Import]:
    collector = _Collector(_module_name(path), path.name == "__init__.py")
    collector.visit(ast.parse(path.read_text(), filename=str(path)))
    return collector.found


def all_imports() -> list[Import]:
    files = sorted(p for package in PRODUCT_PACKAGES for p in (ROOT / package).rglob("*.py"))
    return [found for path in files for found in _imports_of(path)]


def _within(name: str, package: str) -> bool:
    return name == package or name.startswith(package + ".")


def _is_contract(target: str) -> bool:
    """Whether ``target`` names a contract module or something inside one."""
    return target == "connector" or any(
        _within(target, module) for module in CONTRACTS if module != "connector"
    )


def _describe(found: list[Import]) -> str:
    return "; ".join(f"{i.importer} line {i.line} imports {i.target}" for i in found)


IMPORTS = all_imports()
CONNECTOR_MODULES = {
    _module_name(path) for path in (ROOT / "connector").glob("*.py") if path.name != "__init__.py"
}


def test_every_connector_module_has_a_layer() -> None:
    """A new connector/*.py is either a contract or a top-layer tool; the test makes you say."""
    unplaced = CONNECTOR_MODULES - CONTRACTS - TOP_IN_CONNECTOR
    assert not unplaced, (
        f"add to CONTRACTS or TOP_IN_CONNECTOR in {Path(__file__).name}: {unplaced}"
    )
    gone = (CONTRACTS | TOP_IN_CONNECTOR) - CONNECTOR_MODULES - {"connector"}
    assert not gone, f"listed but no longer in connector/: {gone}"


def test_contracts_import_only_contracts() -> None:
    upward = [
        i
        for i in IMPORTS
        if i.importer in CONTRACTS
        and i.target.split(".")[0] in PRODUCT_PACKAGES + ("vllm",)
        and not _is_contract(i.target)
    ]
    assert not upward, f"a contract module imports from above the contracts: {_describe(upward)}"


@pytest.mark.parametrize(
    ("package", "forbidden"),
    [
        pytest.param("scheduler", ("worker", "examples", "vllm"), id="scheduler-not-worker"),
        pytest.param("worker", ("scheduler", "examples", "vllm"), id="worker-not-scheduler"),
    ],
)
def test_control_and_data_plane_stay_apart(package: str, forbidden: tuple[str, ...]) -> None:
    """scheduler/ and worker/ import the contracts, themselves, and nothing above."""
    bad = [
        i
        for i in IMPORTS
        if _within(i.importer, package)
        and (
            i.target.split(".")[0] in forbidden
            or (_within(i.target, "connector") and not _is_contract(i.target))
        )
    ]
    assert not bad, _describe(bad)


def test_only_the_adapter_imports_vllm() -> None:
    bad = [
        i
        for i in IMPORTS
        if _within(i.target, "vllm") and not _within(i.importer, "connector.vllm")
    ]
    assert not bad, _describe(bad)


@pytest.mark.parametrize(
    ("importer", "forbidden"),
    [
        pytest.param("connector.vllm", ("examples", "connector.cli", "connector.doctor"), id="adapter"),
        pytest.param("examples", ("connector.vllm", "connector.cli", "connector.doctor"), id="examples"),
        pytest.param("connector.doctor", ("examples", "connector.vllm", "connector.cli"), id="doctor"),
    ],
)  # fmt: skip
def test_top_layer_parts_do_not_import_each_other(
    importer: str, forbidden: tuple[str, ...]
) -> None:
    """The adapter, the example engine and the doctor each stand on the layers below only."""
    bad = [
        i
        for i in IMPORTS
        if i.importer.startswith(importer)
        and any(i.target.startswith(name) for name in forbidden)
        and not i.target.startswith(importer)
    ]
    assert not bad, _describe(bad)


def test_cli_imports_the_example_engine_only_inside_commands() -> None:
    """At load the CLI and its source-tree finder import contracts only (and each other)."""
    cli = ("connector.cli", "connector.source_tree")
    at_load = [
        i
        for i in IMPORTS
        if i.importer in cli
        and i.module_level
        and i.target.split(".")[0] in PRODUCT_PACKAGES
        and not _is_contract(i.target)
        and not any(_within(i.target, name) for name in cli)
    ]
    assert not at_load, _describe(at_load)


def test_importing_the_cli_loads_no_engine_and_no_adapter() -> None:
    """`nixl-pd --help` and `nixl-pd doctor` must not need the example engine (or torch)."""
    probe = (
        "import sys, connector.cli\n"
        "print(sorted({m.split('.')[0] for m in sys.modules} & "
        "{'examples', 'scheduler', 'worker', 'torch', 'vllm'}))\n"
    )
    loaded = subprocess.run(
        [sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True, timeout=60
    )
    assert loaded.returncode == 0, loaded.stderr
    assert loaded.stdout.strip() == "[]"


def test_the_collector_sees_relative_and_function_level_imports() -> None:
    """The checks above are only as good as the parser: prove it on a known file."""
    source = (
        "from . import sibling\nfrom ..worker import planner\ndef f():\n    import examples.demo\n"
    )
    collector = _Collector("connector.vllm.facade", is_package=False)
    collector.visit(ast.parse(source))
    assert [(i.target, i.module_level) for i in collector.found] == [
        ("connector.vllm.sibling", True),
        ("connector.worker.planner", True),
        ("examples.demo", False),
    ]
