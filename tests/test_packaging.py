"""What the wheel installs: connector, scheduler and worker, and the `nixl-pd` command.

The example engine (examples/) stays in the source tree: a wheel that carried a top-level
`examples` overwrote another distribution's package of that name, and uninstalling ours
deleted it. The wheel is built from a copy of the tree, so the working tree gets no build/ or
egg-info litter.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
INSTALLED = {"connector", "scheduler", "worker"}


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    source = tmp_path_factory.mktemp("source")
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, source / name)
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc")
    for package in (*sorted(INSTALLED), "examples"):  # examples too: the build must leave it out
        shutil.copytree(ROOT / package, source / package, ignore=ignore)
    out = tmp_path_factory.mktemp("wheel")
    built = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
         "--disable-pip-version-check", "--quiet", "-w", str(out), str(source)],
        capture_output=True, text=True, timeout=240,
    )  # fmt: skip
    assert built.returncode == 0, built.stderr
    (path,) = out.glob("nixl_pd_connector-*.whl")
    return path


def _names(wheel: Path) -> list[str]:
    with zipfile.ZipFile(wheel) as archive:
        return archive.namelist()


def test_wheel_installs_only_project_packages(wheel: Path) -> None:
    top_level = {name.split("/")[0] for name in _names(wheel)}
    assert {name for name in top_level if not name.endswith(".dist-info")} == INSTALLED


def test_wheel_carries_every_module_of_the_installed_packages(wheel: Path) -> None:
    """Subpackages too (connector/vllm/ is what vLLM loads)."""
    in_tree = {
        path.relative_to(ROOT).as_posix()
        for package in INSTALLED
        for path in (ROOT / package).rglob("*.py")
    }
    assert in_tree - set(_names(wheel)) == set()


def test_wheel_declares_the_nixl_pd_command(wheel: Path) -> None:
    with zipfile.ZipFile(wheel) as archive:
        (entry_points,) = [n for n in archive.namelist() if n.endswith("entry_points.txt")]
        text = archive.read(entry_points).decode()
    assert "nixl-pd = connector.tools.cli:main" in text


def test_installed_wheel_leaves_a_foreign_examples_alone_and_says_what_to_do(
    wheel: Path, tmp_path: Path
) -> None:
    """From a wheel, `nixl-pd demo` exits 2 with the fix and never imports another `examples`."""
    site = tmp_path / "site"
    with zipfile.ZipFile(wheel) as archive:
        archive.extractall(site)
    stand_in = site / "examples"
    stand_in.mkdir()
    (stand_in / "__init__.py").write_text("raise SystemExit('the stand-in was imported')\n")
    probe = (
        "import sys\n"
        f"sys.path.insert(0, {str(site)!r})\n"
        "from connector.tools import cli\n"
        f"assert cli.__file__.startswith({str(site)!r}), cli.__file__\n"
        "sys.exit(cli.main(['demo', '--fake-nixl']))\n"
    )
    ran = subprocess.run(
        [sys.executable, "-c", probe], cwd=tmp_path, capture_output=True, text=True, timeout=60
    )
    assert ran.returncode == 2, ran.stdout + ran.stderr
    assert ran.stderr.startswith(
        "nixl-pd demo: error: this command runs the example engine, which is not part of the "
        "installed wheel; clone the repository and run scripts/setup.sh"
    ), ran.stderr
    assert (stand_in / "__init__.py").is_file()


def test_a_foreign_examples_loaded_first_is_refused_by_name(tmp_path: Path) -> None:
    """In a clone, an `examples` imported from elsewhere is named, never used as the engine."""
    foreign = tmp_path / "examples"
    foreign.mkdir()
    (foreign / "__init__.py").write_text("")
    probe = (
        "import sys\n"
        f"sys.path.insert(0, {str(tmp_path)!r})\n"
        # this clone's packages, last (as an editable install finds them), not the clone the
        # venv's editable install happens to point at
        f"sys.path.append({str(ROOT)!r})\n"
        "import examples\n"
        "from connector.tools.cli import main\n"
        "sys.exit(main(['route', '--prefill', '127.0.0.1:1', '--decode', '127.0.0.1:2']))\n"
    )
    ran = subprocess.run(
        [sys.executable, "-c", probe], cwd=tmp_path, capture_output=True, text=True, timeout=60
    )
    assert ran.returncode == 2, ran.stdout + ran.stderr
    assert ran.stderr.startswith(
        f"nixl-pd route: error: 'examples' resolves to {foreign / '__init__.py'}, another "
        "package of that name"
    ), ran.stderr
