"""The import layers of docs/architecture.md, per folder, read from the source with ast.

    tools          connector/tools/   nixl-pd, its source-tree finder, the doctor: may import
                                      every folder (not vllm or torch); nothing imports it
    top            connector/vllm/    the adapter (the only importer of vllm and torch)
                   examples/          the example engine, toy router, demo
    planes         scheduler/         control plane    }  never import each other
                   worker/            data plane       }
    planner        worker/plan/       which bytes go where: pure, imports only the contracts
                                      and itself (worker/topology.py, the TP mapping the
                                      DESIGN contract names at that path, belongs to it)
    shared I/O     connector/net/     the side-channel client both planes call
    observability  connector/observability/  metrics, Prometheus exposition, traces, rate-limited log
    contracts      connector/*.py     config, params, protocol, layout, errors ...: import only
                                      each other

A module's folder is the longest prefix of its dotted name in FOLDERS; what a folder may import
is MAY_IMPORT. Nothing here lists files: a new module obeys its folder's rule, and a new
subpackage of connector/ fails until it is given a folder and a rule.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PRODUCT_PACKAGES = ("connector", "scheduler", "worker", "examples")

# Dotted-name prefix -> folder. connector/ itself is the contracts: every subpackage is named.
FOLDERS = {
    "connector": "contracts",
    "connector.observability": "observability",
    "connector.net": "net",
    "scheduler": "scheduler",
    "worker": "worker",
    "worker.plan": "planner",
    "worker.topology": "planner",  # pure TP mapping, kept at the path DESIGN.md's contract names
    "connector.vllm": "adapter",
    "examples": "examples",
    "connector.tools": "tools",
}
# Libraries only some folders may import: heavy ones (torch, vllm, nixl) and network edges.
LIBRARIES = ("vllm", "torch", "nixl", "zmq", "prometheus_client")

_BELOW_PLANES = {"contracts", "observability", "net"}
MAY_IMPORT: dict[str, frozenset[str]] = {
    "contracts": frozenset({"contracts"}),
    "observability": frozenset({"contracts", "observability", "prometheus_client"}),
    "net": frozenset({"contracts", "observability", "net", "zmq"}),
    "scheduler": frozenset(_BELOW_PLANES | {"scheduler", "zmq"}),
    "planner": frozenset({"contracts", "planner"}),
    "worker": frozenset(_BELOW_PLANES | {"planner", "worker", "nixl"}),
    "adapter": frozenset(
        _BELOW_PLANES
        | {"scheduler", "planner", "worker", "adapter", "vllm", "torch", "prometheus_client"}
    ),
    "examples": frozenset(_BELOW_PLANES | {"scheduler", "planner", "worker", "examples", "zmq"}),
    "tools": frozenset(set(FOLDERS.values()) | {"nixl", "zmq", "prometheus_client"}),
}


@dataclass(frozen=True)
class Import:
    importer: str  # dotted module name of the file
    target: str  # dotted name it imports (a package, module or module attribute path)
    line: int


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
        self.found: list[Import] = []

    def visit_Import(self, node: ast.Import) -> None:
        for alias in node.names:
            self._add(alias.name, node.lineno)

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        module = _resolve(self.importer, self.is_package, node)
        for alias in node.names:  # `from connector import vllm` imports connector.vllm
            self._add(f"{module}.{alias.name}" if module else alias.name, node.lineno)

    def _add(self, target: str, line: int) -> None:
        self.found.append(Import(self.importer, target, line))


def _imports_of(path: Path) -> list[Import]:
    collector = _Collector(_module_name(path), path.name == "__init__.py")
    collector.visit(ast.parse(path.read_text(), filename=str(path)))
    return collector.found


def _product_files() -> list[Path]:
    return sorted(p for package in PRODUCT_PACKAGES for p in (ROOT / package).rglob("*.py"))


def all_imports() -> list[Import]:
    return [found for path in _product_files() for found in _imports_of(path)]


def _within(name: str, package: str) -> bool:
    return name == package or name.startswith(package + ".")


def folder_of(name: str) -> str | None:
    """The folder (or restricted library) ``name`` belongs to; None for anything unrestricted."""
    top = name.split(".")[0]
    if top in LIBRARIES:
        return top
    owners = [prefix for prefix in FOLDERS if _within(name, prefix)]
    return FOLDERS[max(owners, key=len)] if owners else None


def violations(imports: Iterable[Import]) -> list[str]:
    """Every import whose target's folder the importer's folder may not import, described."""
    found = []
    for i in imports:
        importer, target = folder_of(i.importer), folder_of(i.target)
        if importer is None or importer in LIBRARIES:
            found.append(f"{i.importer} is in no folder of FOLDERS")
        elif target is not None and target not in MAY_IMPORT[importer]:
            found.append(f"{i.importer} ({importer}) line {i.line} imports {i.target} ({target})")
    return found


IMPORTS = all_imports()


def test_every_import_follows_its_folders_rule() -> None:
    bad = violations(IMPORTS)
    assert bad == [], "an import the layers do not allow:\n" + "\n".join(bad)


def test_every_subpackage_of_connector_has_a_folder() -> None:
    """A new connector/<pkg>/ must be placed in FOLDERS and MAY_IMPORT: a conscious choice."""
    subpackages = {_module_name(init) for init in (ROOT / "connector").glob("*/__init__.py")}
    named = {prefix for prefix in FOLDERS if prefix.startswith("connector.")}
    assert subpackages == named
    assert set(MAY_IMPORT) == set(FOLDERS.values())


PLANTED = [  # (importer, target, allowed by the rules)
    ("connector.params", "connector.errors", True),
    ("connector.params", "connector.observability.metrics", False),
    ("connector.protocol", "zmq", False),
    ("connector.layout", "torch", False),
    ("connector.observability.trace", "connector.metadata", True),
    ("connector.observability.metrics", "connector.net.side_channel_client", False),
    ("connector.net.side_channel_client", "zmq", True),
    ("connector.net.side_channel_client", "scheduler.leases", False),
    ("scheduler.heartbeats", "connector.net.side_channel_client", True),
    ("scheduler.connector", "worker.blocks", False),
    ("worker.loads", "scheduler.leases", False),
    ("worker.peers", "connector.vllm.facade", False),
    ("worker.plan.segments", "torch", False),
    ("worker.plan.pairing", "worker.topology", True),
    ("worker.plan.recipe", "worker.loads", False),
    ("worker.plan.pairing", "connector.observability.metrics", False),
    ("worker.loads", "worker.plan.recipe", True),
    ("scheduler.connector", "worker.plan.recipe", False),
    ("worker.nixl_real", "nixl._api", True),
    ("scheduler.side_channel", "connector.tools.doctor", False),
    ("connector.vllm.facade", "worker.connector", True),
    ("connector.vllm.facade", "vllm.config", True),
    ("connector.vllm.facade", "connector.tools.cli", False),
    ("connector.vllm.facade", "examples.engine", False),
    ("examples.engine", "connector.vllm", False),
    ("examples.engine", "vllm", False),
    ("connector.tools.doctor", "worker.nixl_real", True),
    ("connector.tools.cli", "examples.demo", True),
    ("connector.tools.cli", "torch", False),
    ("connector", "connector.vllm", False),
]  # fmt: skip


@pytest.mark.parametrize(
    ("importer", "target", "allowed"),
    [pytest.param(*case, id=f"{case[0]}->{case[1]}") for case in PLANTED],
)
def test_the_checker_catches_a_planted_violation(importer: str, target: str, allowed: bool) -> None:
    """Run the rules on a synthetic import map: each planted import is judged as the layers say."""
    assert (violations([Import(importer, target, 1)]) == []) is allowed


def test_the_checker_finds_a_violation_planted_in_source() -> None:
    """End to end on parsed source: a worker module reaching into scheduler/ is reported."""
    collector = _Collector("worker.loads", is_package=False)
    collector.visit(ast.parse("from connector.errors import X\nfrom ..scheduler import leases\n"))
    assert violations(collector.found) == [
        "worker.loads (worker) line 2 imports scheduler.leases (scheduler)"
    ]


def test_a_module_outside_every_folder_is_reported() -> None:
    assert violations([Import("benchmarks.vs_vllm", "worker.blocks", 3)]) == [
        "benchmarks.vs_vllm is in no folder of FOLDERS"
    ]


def _loaded_after_importing(modules: list[str], watched: set[str]) -> list[str]:
    probe = (
        "import importlib, sys\n"
        f"for name in {modules!r}:\n"
        "    importlib.import_module(name)\n"
        f"print(sorted({{m.split('.')[0] for m in sys.modules}} & {watched!r}))\n"
    )
    loaded = subprocess.run(
        [sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert loaded.returncode == 0, loaded.stderr
    return list(ast.literal_eval(loaded.stdout.strip()))


def test_core_modules_load_without_torch_nixl_or_vllm() -> None:
    """Contracts, observability, net, scheduler/ and every worker/ module but the NIXL edge
    (the ones whose own imports name nixl) import without torch, nixl or vllm (DESIGN.md)."""
    nixl_edges = {i.importer for i in IMPORTS if folder_of(i.target) == "nixl"}
    core = {"contracts", "observability", "net", "scheduler", "planner", "worker"}
    modules = sorted(
        name
        for name in map(_module_name, _product_files())
        if folder_of(name) in core and name not in nixl_edges
    )
    assert "worker.blocks" in modules and "connector.params" in modules
    assert _loaded_after_importing(modules, {"torch", "nixl", "vllm"}) == []


def test_importing_the_cli_loads_no_engine_and_no_adapter() -> None:
    """`nixl-pd --help` and `nixl-pd doctor` must not need the example engine (or torch)."""
    watched = {"examples", "scheduler", "worker", "torch", "vllm"}
    assert _loaded_after_importing(["connector.tools.cli"], watched) == []


def test_the_collector_sees_relative_and_function_level_imports() -> None:
    """The rules are only as good as the parser: an import inside a function counts too."""
    source = (
        "from . import sibling\nfrom ..worker import planner\ndef f():\n    import examples.demo\n"
    )
    collector = _Collector("connector.vllm.facade", is_package=False)
    collector.visit(ast.parse(source))
    assert [(i.target, i.line) for i in collector.found] == [
        ("connector.vllm.sibling", 1),
        ("connector.worker.planner", 2),
        ("examples.demo", 4),
    ]
