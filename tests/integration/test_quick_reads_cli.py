"""`laneway --help` and `laneway status` import only what they need (issue 22 item 5):
cli/main.py builds a command only when it runs. The lazy group must say exactly what the
eagerly built one says."""

from __future__ import annotations

import inspect
import subprocess
import sys
from pathlib import Path

import pytest
import typer
import typer.core
import typer.main
from typer.testing import CliRunner

from laneway.cli import main as cli_main
from laneway.cli.main import COMMANDS, app, build_command
from tests.integration.test_cli import GOOD

pytestmark = pytest.mark.sqlite_only("the quick path is the standard library's sqlite3")

ROOT = Path(__file__).resolve().parents[2]
HEAVY = (
    "sqlalchemy",
    "alembic",
    "psutil",
    "rich",
    "pydantic",
    "laneway.controller.admission",
    "laneway.cli.commands_operator",
)
"""pydantic among them: typer 0.29 coerces every parameter through it (about 300 ms of each
call), which is why pyproject.toml keeps typer below 0.29; this fails on a typer that
does. Admission's dataclasses cost about 10 ms: status words refusals with
controller/refusal_words.py."""


@pytest.fixture(scope="module")
def runtime(tmp_path_factory: pytest.TempPathFactory) -> Path:
    base = tmp_path_factory.mktemp("quick")
    config = base / "good.toml"
    config.write_text(GOOD)
    runtime = base / "rt"
    result = CliRunner().invoke(
        app, ["start-pipeline", str(config), "--runtime-dir", str(runtime), "--no-controller"]
    )
    assert result.exit_code == 0, result.output
    return runtime


def loaded(*args: str) -> tuple[set[str], subprocess.CompletedProcess[str]]:
    """The modules a ``laneway ARGS`` process has loaded when it exits."""
    code = (
        "import atexit, sys\n"
        "atexit.register(lambda: sys.__stderr__.write('\\nMODULES ' + ' '.join(sys.modules)))\n"
        "from laneway.cli.main import main\n"
        f"sys.argv = ['laneway', *{list(args)!r}]\n"
        "main()\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    names = set(done.stderr.rsplit("MODULES ", 1)[-1].split())
    return names, done


def heavy(names: set[str]) -> set[str]:
    return {n for n in names if any(n == h or n.startswith(f"{h}.") for h in HEAVY)}


@pytest.mark.parametrize(
    "args", [["--help"], ["status", "--help"], ["status"], ["status", "1", "--json"]]
)
def test_help_and_status_load_no_heavy_module(runtime, args):
    extra = [] if "--help" in args else ["--runtime-dir", str(runtime)]
    names, done = loaded(*args, *extra)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "typer" in names
    assert heavy(names) == set()
    if args == ["--help"]:  # no command module at all
        assert not {n for n in names if n.startswith("laneway.cli.commands_")}


def test_a_bad_value_is_still_typers_error(runtime):
    """A bad value gets typer's own words (its coercion is untouched)."""
    for value, words in [("0", "not in the range 1<=x<="), ("x", "is not a valid int")]:
        result = CliRunner().invoke(app, ["status", value, "--runtime-dir", str(runtime)])
        assert result.exit_code == 2, result.output
        assert words in result.output


def eager_group() -> typer.core.TyperGroup:
    """The group as typer builds it with every command registered up front."""
    eager = typer.Typer(
        name="laneway",
        help=app.info.help,
        no_args_is_help=True,
        pretty_exceptions_enable=False,
        add_completion=True,
        rich_markup_mode=None,
    )
    eager.callback()(cli_main._options)
    for name in COMMANDS:
        command = build_command(name)
        eager.command(name, context_settings=command.context_settings)(command.callback)
    group = typer.main.get_command(eager)
    assert isinstance(group, typer.core.TyperGroup)
    return group


def test_each_summary_is_its_docstrings_first_paragraph():
    for name, (_module, _function, summary) in COMMANDS.items():
        command = build_command(name)
        first = inspect.cleandoc(command.help or "").split("\n\n")[0]
        assert " ".join(first.split()) == summary, name


@pytest.mark.parametrize("width", [60, 80, 120])
def test_help_lists_what_the_eager_group_lists(width):
    lazy = typer.main.get_command(app)
    eager = eager_group()
    assert list(lazy.commands) == list(eager.commands)
    shown = [
        group.get_help(
            group.context_class(
                group, info_name="laneway", terminal_width=width, max_content_width=width
            )
        )
        for group in (lazy, eager)
    ]
    assert shown[0] == shown[1]
    assert "status" in shown[0] and "Commands" in shown[0]
