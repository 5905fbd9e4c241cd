"""Read-only commands import only what they need: what a `laneway` call costs is mostly
imports, so `status`, `runs`, `sql`, `explain`, `--help` and `--version` must not load
the worker service, psutil, alembic, the controller daemon (nor, for all but `explain`,
SQLAlchemy and the pydantic config models). A test on what is imported, not on time."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from alembic.script import ScriptDirectory
from typer.testing import CliRunner

from laneway.cli.main import app
from laneway.controller import ledger_open
from tests.integration.test_cli import GOOD

ROOT = Path(__file__).resolve().parents[2]
NEVER = {
    "laneway.workers.service",
    "psutil",
    "alembic",
    "laneway.controller.daemon",
    "laneway.controller.report",
    "laneway.controller.report_html",
    "rich",
}
"""Never imported by a read-only command."""
FAST = NEVER | {
    "sqlalchemy",
    "laneway.controller.models",
    "laneway.controller.config",
    "laneway.controller.ledger",
    "pydantic",
}
"""Not imported by `status`, `sql` or `--help` either (plain sqlite3 is enough; typer
below 0.29 parses parameters without pydantic)."""


pytestmark = pytest.mark.sqlite_only(
    "the quick read-only path is the standard library's sqlite3; on PostgreSQL a read-only "
    "command needs SQLAlchemy and the driver"
)


@pytest.fixture(scope="module")
def runtime(tmp_path_factory: pytest.TempPathFactory) -> Path:
    base = tmp_path_factory.mktemp("imports")
    config = base / "good.toml"
    config.write_text(GOOD)
    runtime = base / "rt"
    result = CliRunner().invoke(
        app, ["start-pipeline", str(config), "--runtime-dir", str(runtime), "--no-controller"]
    )
    assert result.exit_code == 0, result.output
    return runtime


def imported(*args: str) -> tuple[set[str], subprocess.CompletedProcess[str]]:
    """The modules a `laneway ARGS` process imports (from ``-X importtime``)."""
    done = subprocess.run(
        [sys.executable, "-X", "importtime", "-m", "laneway", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    names = {
        line.rsplit("|", 1)[1].strip()
        for line in done.stderr.splitlines()
        if line.startswith("import time:") and line.count("|") == 2
    }
    return names, done


def heavy(names: set[str], forbidden: set[str]) -> set[str]:
    return {n for n in names if n in forbidden or any(n.startswith(f + ".") for f in forbidden)}


@pytest.mark.parametrize(
    "args",
    [
        ["--help"],
        ["status", "--help"],
        ["status"],
        ["status", "--json"],
        ["runs"],
        ["runs", "--json"],
        ["sql", "SELECT COUNT(*) AS n FROM jobs", "--json"],
        ["--version"],
    ],
)
def test_status_sql_and_help_import_no_heavy_module(runtime, args):
    extra = [] if "--help" in args or args == ["--version"] else ["--runtime-dir", str(runtime)]
    names, done = imported(*args, *extra)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "typer" in names  # the command line was parsed
    assert heavy(names, FAST) == set()
    if args[:2] == ["sql", "SELECT COUNT(*) AS n FROM jobs"]:
        assert json.loads(done.stdout) == [{"n": 2}]
    if args == ["runs", "--json"]:
        assert [run["id"] for run in json.loads(done.stdout)] == [1]


def test_explain_imports_no_service_daemon_or_alembic(runtime):
    names, done = imported("explain", "1", "--runtime-dir", str(runtime), "--json")
    assert done.returncode == 0, done.stderr[-2000:]
    assert json.loads(done.stdout)["job_id"] == 1
    assert heavy(names, NEVER) == set()


def test_known_revisions_agree_with_alembic():
    """The read-only revision check reads migrations/versions without alembic; it must
    know exactly what alembic knows, and the same head."""
    script = ScriptDirectory.from_config(ledger_open.alembic_config())
    known, head = ledger_open.known_revisions()
    assert set(known) == {rev.revision for rev in script.walk_revisions()}
    assert head == script.get_current_head()
