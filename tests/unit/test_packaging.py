"""The distribution is one ``laneway`` namespace and ships every module of the source
tree: a package missing from ``[tool.setuptools] packages`` imports fine from a checkout
or an editable install and fails only once laneway is installed from its wheel, and a
top-level ``controller`` or ``cli`` in site-packages collides with any other distribution
that installs one."""

from __future__ import annotations

import shutil
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

import pytest

from laneway.workers.supervisor import PACKAGE

pytestmark = pytest.mark.no_ledger

ROOT = Path(__file__).resolve().parents[2]
ROOMS = ("controller", "workers", "cli", "migrations")
SHIPPED_FILES = ("pyproject.toml", "README.md", "alembic.ini", "__main__.py")
QUIET = ("--quiet", "--disable-pip-version-check", "--no-deps")


def test_every_package_directory_is_listed_in_pyproject():
    listed = set(
        tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]
    )
    found = {"laneway"} | {
        ".".join(("laneway", *init.parent.relative_to(ROOT).parts))
        for top in ROOMS
        for init in (ROOT / top).rglob("__init__.py")
    }
    assert found == listed


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The wheel, built offline from a copy of the source tree (the build writes
    ``build/`` and ``*.egg-info`` beside its sources)."""
    base = tmp_path_factory.mktemp("wheel")
    source = base / "source"
    source.mkdir()
    for name in SHIPPED_FILES:
        shutil.copy(ROOT / name, source / name)
    for room in ROOMS:
        shutil.copytree(ROOT / room, source / room, ignore=shutil.ignore_patterns("__pycache__"))
    built = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            *QUIET,
            "--no-build-isolation",
            "--wheel-dir",
            str(base / "dist"),
            str(source),
        ],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert built.returncode == 0, built.stderr[-3000:]
    (found,) = (base / "dist").glob("laneway-*.whl")
    return found


def test_the_wheel_installs_nothing_at_its_top_level_but_laneway(wheel: Path):
    names = zipfile.ZipFile(wheel).namelist()
    top = {name.split("/", 1)[0] for name in names}
    assert {name for name in top if not name.endswith(".dist-info")} == {"laneway"}
    sources = {
        f"laneway/{path.relative_to(ROOT).as_posix()}"
        for room in ROOMS
        for path in (ROOT / room).rglob("*")
        if path.suffix in {".py", ".mako"} and "__pycache__" not in path.parts
    }
    assert sources - set(names) == set()  # every module ships, under laneway/
    assert {"laneway/__main__.py", "laneway/alembic.ini"} <= set(names)
    (entry_points,) = [name for name in names if name.endswith("entry_points.txt")]
    text = zipfile.ZipFile(wheel).read(entry_points).decode()
    assert "laneway = laneway.cli.main:main" in text


def test_laneway_installed_from_its_wheel_opens_a_ledger_and_starts_a_supervisor(
    wheel: Path, tmp_path: Path
):
    """Installed (not the checkout): the migrations and alembic.ini ship with the code,
    ``python -m laneway`` runs, and the supervisor's lean command line (no site-packages)
    finds the installed modules."""
    target = tmp_path / "site"
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            *QUIET,
            "--no-index",
            "--target",
            str(target),
            str(wheel),
        ],
        capture_output=True,
        timeout=300,
        check=True,
    )
    code = (
        f"import sys; sys.path.insert(0, {str(target)!r}); "
        "from laneway.controller import ledger_open; import laneway.cli.main; "
        f"ledger_open.open_ledger({str(tmp_path / 'rt')!r}).dispose(); "
        "print(ledger_open.__file__, ledger_open.head_revision())"
    )
    opened = subprocess.run(
        [sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, check=False
    )
    assert opened.returncode == 0, opened.stderr[-3000:]
    where, revision = opened.stdout.split()
    assert Path(where).is_relative_to(target) and revision
    assert (tmp_path / "rt" / "ledger.sqlite3").is_file()

    bootstrap = PACKAGE + "import laneway.workers.supervisor as s; print(s.__file__)"
    lean = subprocess.run(
        [sys.executable, "-I", "-S", "-c", bootstrap, "-", str(target / "laneway")],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        check=False,
    )
    assert lean.returncode == 0, lean.stderr[-3000:]
    assert Path(lean.stdout.strip()).is_relative_to(target)
