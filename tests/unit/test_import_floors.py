"""The floors of docs/architecture.md ("Floors") are kept: every module of controller/,
workers/ and cli/ has one row there (its floor, its purpose), and no import points up a
floor. Every import counts: at module level, inside a function, and type-only ones under
``if TYPE_CHECKING:`` (a type-only import still says the lower module knows the upper
one). Beside the floors: floor 0 and the supervisor import only the standard library
and floor 0 (the supervisor starts once per attempt), and nothing below the services
imports workers/, not even its floor-0 re-exports."""

from __future__ import annotations

import ast
import re
import sys
from collections.abc import Collection
from pathlib import Path

import pytest

pytestmark = pytest.mark.no_ledger

ROOT = Path(__file__).resolve().parents[2]
ROOMS = ("controller", "workers", "cli")
BARE = {*ROOMS, "migrations"}
IN_A_STRING = re.compile(
    r"(?:^|[;:\s])(?:from|import) ((?:controller|workers|cli|migrations)\b[\w.]*)"
)
ROW = re.compile(r"^\| `((?:controller|workers|cli)/[\w/]+\.py)` \| (\d) [^|]*\|", re.M)
SUPERVISOR = "laneway.workers.supervisor"
SERVICES = 5
STDLIB = sys.stdlib_module_names | {"__future__"}

EXCEPTIONS: dict[tuple[str, str], str] = {}
"""(importer, imported) pairs allowed to point up, each with its reason. None today."""


def dotted(path: str) -> str:
    """``controller/ledger/claim.py`` → ``laneway.controller.ledger.claim``: the name it is
    imported by (the checkout is the ``laneway`` package)."""
    parts = ("laneway", *Path(path).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def floors() -> dict[str, int]:
    """Module → floor, from the Floors section of docs/architecture.md."""
    text = (ROOT / "docs" / "architecture.md").read_text(encoding="utf-8")
    section = text.split("\n## Floors\n", 1)[1].split("\n## ", 1)[0]
    return {dotted(path): int(floor) for path, floor in ROW.findall(section)}


def modules() -> dict[str, Path]:
    found = {}
    for room in ROOMS:
        for path in sorted((ROOT / room).rglob("*.py")):
            found[dotted(path.relative_to(ROOT).as_posix())] = path
    return found


def imports(module: str, source: str, known: Collection[str]) -> list[tuple[int, str]]:
    """(line, name) of every import in ``source``, wherever it is: a laneway module as
    the module it names (``from laneway.controller import ledger`` is
    ``laneway.controller.ledger``), anything else as its top-level name."""
    package = module.split(".")  # where a relative import starts: a package, or the
    if not any(name.startswith(f"{module}.") for name in known):  # module's parent
        package.pop()
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                here = package[: len(package) - node.level + 1]
                base = ".".join([*here, base] if base else here)
            names = [
                f"{base}.{alias.name}" if f"{base}.{alias.name}" in known else base
                for alias in node.names
            ]
        else:
            continue
        for name in names:
            target = name
            while target not in known and "." in target:
                target = target.rpartition(".")[0]
            found.append((node.lineno, target if target in known else name.split(".")[0]))
    return sorted(found)


def upward(module: str, source: str, floor_of: dict[str, int]) -> list[str]:
    """Each import in ``source`` (the text of ``module``) that points up a floor."""
    mine = floor_of[module]
    return [
        f"{module}:{line} (floor {mine}) imports {name} (floor {floor_of[name]})"
        for line, name in imports(module, source, floor_of)
        if floor_of.get(name, -1) > mine and (module, name) not in EXCEPTIONS
    ]


def test_every_module_has_one_floor_and_every_row_a_module():
    text = (ROOT / "docs" / "architecture.md").read_text(encoding="utf-8")
    section = text.split("\n## Floors\n", 1)[1].split("\n## ", 1)[0]
    rows = [dotted(path) for path, _ in ROW.findall(section)]
    assert len(rows) == len(set(rows)), "a module has two rows in the Floors table"
    unplaced = sorted(set(modules()) - set(rows))
    assert not unplaced, f"no row in docs/architecture.md's Floors table for {unplaced}"
    assert not sorted(set(rows) - set(modules())), "a Floors row names no module"


def test_no_import_points_up_a_floor():
    floor_of = floors()
    found = [
        problem
        for module, path in modules().items()
        if module in floor_of  # a module without a row fails the test above
        for problem in upward(module, path.read_text(encoding="utf-8"), floor_of)
    ]
    assert found == []


def test_floor_0_and_the_supervisor_import_only_the_standard_library_and_floor_0():
    floor_of = floors()
    bottom = [m for m, floor in floor_of.items() if floor == 0]
    found = [
        f"{module}:{line} imports {name}"
        for module in [*bottom, SUPERVISOR]
        for line, name in imports(module, modules()[module].read_text(encoding="utf-8"), floor_of)
        if floor_of.get(name, 0) != 0 or (name not in floor_of and name not in STDLIB)
    ]
    assert found == []


def test_nothing_below_the_services_imports_workers():
    floor_of = floors()
    found = [
        f"{module}:{line} imports {name}"
        for module, path in modules().items()
        if floor_of.get(module, SERVICES) < SERVICES
        for line, name in imports(module, path.read_text(encoding="utf-8"), floor_of)
        if name == "laneway.workers" or name.startswith("laneway.workers.")
    ]
    assert found == []


PLANTED = """\
from laneway.controller import durable, ledger
from .ledger import claim

if TYPE_CHECKING:
    import laneway.cli.main


def later():
    from laneway.controller.daemon import Controller
"""


def test_the_check_fails_on_a_planted_upward_import():
    """Planted in floor 0's clock: every form of an upward import is found, at its line;
    the same source on floor 6 points nowhere up."""
    floor_of = floors()
    assert upward("laneway.controller.clock", PLANTED, floor_of) == [
        "laneway.controller.clock:1 (floor 0) imports laneway.controller.ledger (floor 3)",
        "laneway.controller.clock:2 (floor 0) imports laneway.controller.ledger.claim (floor 3)",
        "laneway.controller.clock:5 (floor 0) imports laneway.cli.main (floor 6)",
        "laneway.controller.clock:9 (floor 0) imports laneway.controller.daemon (floor 5)",
    ]
    assert upward("laneway.cli.main", PLANTED, floor_of) == []


def bare_names(source: str) -> list[tuple[int, str]]:
    """(line, name) of each absolute import of a room by its bare name (``controller``,
    not ``laneway.controller``)."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom) and node.level == 0:
            names = [node.module or ""]
        elif isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        else:
            continue
        found += [(node.lineno, name) for name in names if name.split(".")[0] in BARE]
    for node in ast.walk(ast.parse(source)):  # code run by ``python -c`` / ``-m`` strings
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            found += [(node.lineno, name) for name in IN_A_STRING.findall(node.value)]
            if node.value in {f"{room}.main" for room in BARE} | {"workers.supervisor"}:
                found.append((node.lineno, node.value))  # a ``"-m", "cli.main"`` argument
    return sorted(found)


def test_every_import_of_laneway_names_the_laneway_namespace():
    """``from controller.db import ...`` would load a second copy of every module (with
    its own enums and state) where the checkout is on ``sys.path``; each package's
    ``__init__`` refuses it at run time, this finds it before."""
    found = [
        f"{path.relative_to(ROOT)}:{line} imports {name}"
        for path in sorted(ROOT.glob("**/*.py"))
        if not {".venv", ".git", "build"} & set(path.relative_to(ROOT).parts)
        and path != Path(__file__).resolve()  # this file plants them
        for line, name in bare_names(path.read_text(encoding="utf-8"))
    ]
    assert found == []
    assert bare_names(PLANTED.replace("laneway.", "")) == [
        (1, "controller"),
        (5, "cli.main"),
        (9, "controller.daemon"),
    ]
    in_strings = (
        'CODE = "import sys; from cli.main import main; main()"\nARGV = ["-m", "cli.main"]\n'
    )
    assert bare_names(in_strings) == [(1, "cli.main"), (2, "cli.main")]
