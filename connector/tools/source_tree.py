"""Find the example engine in the source checkout this package was installed from (editable).

The wheel installs connector, scheduler and worker only: a top-level ``examples`` in
site-packages would claim a generic name another distribution may own. The engine therefore
lives in the clone, next to this package, and is imported from there by path, never from
whatever ``examples`` happens to be importable.
"""

from __future__ import annotations

import importlib
import os
import sys
from pathlib import Path
from types import ModuleType

from connector.errors import UnsupportedConfiguration


class ExampleEngineMissing(UnsupportedConfiguration):
    """demo/serve/route need the example engine, which only a source checkout has."""


def find_root() -> Path | None:
    """The clone this package was installed from (editable), or None for a wheel install."""
    root = Path(__file__).resolve().parents[2]  # the clone: <root>/connector/tools/this file
    has_engine = (root / "examples" / "__init__.py").is_file()
    return root if has_engine and (root / "pyproject.toml").is_file() else None


def import_example(name: str) -> ModuleType:
    """Import ``examples.<name>`` from the source tree, for this process and the engines it starts."""
    root = find_root()
    if root is None:
        raise ExampleEngineMissing(
            "this command runs the example engine, which is not part of the installed wheel; "
            "clone the repository and run scripts/setup.sh (an editable install), then run "
            "nixl-pd from that environment"
        )
    if str(root) not in sys.path:
        sys.path.insert(0, str(root))
    # Engine subprocesses (python -m examples.server) inherit the path through the environment.
    paths = os.environ.get("PYTHONPATH", "").split(os.pathsep)
    if str(root) not in paths:
        os.environ["PYTHONPATH"] = os.pathsep.join([str(root), *filter(None, paths)])
    package = importlib.import_module("examples")
    if not Path(package.__file__ or "").resolve().is_relative_to(root / "examples"):
        raise ExampleEngineMissing(
            f"'examples' resolves to {package.__file__}, another package of that name, not the "
            f"example engine in {root / 'examples'}; uninstall that package or run from a "
            "fresh environment"
        )
    return importlib.import_module(f"examples.{name}")
