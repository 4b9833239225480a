"""The planning recipe's shape (issue 22 item 1), read from the source with ast (nothing imported).

worker/plan/recipe.py is the recipe; the stage modules beside it in worker/plan/ compute and
never call back up; they are pure (no clocks, threads, logging, sockets, NIXL or torch); and the run-time import chain
from the worker connector stays short, so a newcomer following a request does not wander
through a dozen modules (it was 11 deep before the recipe).
"""

from __future__ import annotations

import ast
import functools
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
WORKER = ROOT / "worker"

STAGES = (  # the recipe's stage modules, handshake then request, as worker/plan/recipe.py lists them
    "plan.pairing",
    "plan.segments",
    "plan.whole_blocks",
    "plan.exact_runs",
)
RECIPE = "plan.recipe"
ABOVE_THE_STAGES = ("worker.plan.recipe", "worker.loads", "worker.peers", "worker.reads")
IMPURE = ("threading", "time", "logging", "socket", "zmq", "nixl", "torch", "worker.nixl_real")
MAX_RUN_TIME_DEPTH = 7  # worker.connector -> loads -> plan -> ... (modules on the chain)


def _imports(module: str, *, run_time: bool) -> set[str]:
    """Absolute names ``module`` (dotted, under worker/) imports; with ``run_time``, not those
    under TYPE_CHECKING."""
    tree = ast.parse((WORKER / f"{module.replace('.', '/')}.py").read_text())
    skipped: set[int] = set()
    if run_time:
        for node in ast.walk(tree):
            if isinstance(node, ast.If) and getattr(node.test, "id", "") == "TYPE_CHECKING":
                skipped |= {id(inner) for inner in ast.walk(node)}
    found: set[str] = set()
    for node in ast.walk(tree):
        if id(node) in skipped:
            continue
        if isinstance(node, ast.ImportFrom) and node.module:
            found.add(node.module)
        elif isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
    return found


def _within(name: str, roots: tuple[str, ...]) -> bool:
    return any(name == root or name.startswith(root + ".") for root in roots)


@pytest.mark.parametrize("stage", STAGES)
def test_a_stage_never_imports_the_recipe_or_its_callers(stage: str) -> None:
    upward = sorted(n for n in _imports(stage, run_time=False) if _within(n, ABOVE_THE_STAGES))
    assert upward == [], f"worker.{stage} imports {upward}: stages sit below the recipe"


@pytest.mark.parametrize("module", (RECIPE, *STAGES))
def test_planning_modules_are_pure(module: str) -> None:
    impure = sorted(n for n in _imports(module, run_time=False) if _within(n, IMPURE))
    assert impure == [], f"worker.{module} imports {impure}; planning takes ints and arrays"


def test_the_recipe_imports_every_stage_it_names() -> None:
    imported = {n.removeprefix("worker.") for n in _imports(RECIPE, run_time=True)}
    missing = sorted(set(STAGES) - imported)
    assert missing == [], f"worker/plan/recipe.py does not call stages {missing} itself"


def _longest_chain(start: str) -> tuple[str, ...]:
    modules = {
        path.relative_to(WORKER).with_suffix("").as_posix().replace("/", ".")
        for path in WORKER.rglob("*.py")
    }

    @functools.cache
    def longest(module: str) -> tuple[str, ...]:
        best: tuple[str, ...] = (module,)
        for name in _imports(module, run_time=True):
            child = name.removeprefix("worker.")
            if name.startswith("worker.") and child in modules:
                chain = (module, *longest(child))
                best = chain if len(chain) > len(best) else best
        return best

    return longest(start)


def test_the_run_time_import_chain_from_the_worker_connector_is_short() -> None:
    chain = _longest_chain("connector")
    assert len(chain) <= MAX_RUN_TIME_DEPTH, " -> ".join(chain)
