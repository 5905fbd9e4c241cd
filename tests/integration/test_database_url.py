"""``--database-url`` / ``LANEWAY_DATABASE_URL`` select the ledger; a password in the URL
is never printed, logged or stored."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from laneway.controller import db, ledger_open
from tests import backends
from tests.integration.test_cli import GOOD

ROOT = Path(__file__).resolve().parents[2]
LANEWAY = [sys.executable, "-m", "laneway"]
PASSWORD = "pw-never-shown-8d1f"


def run(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*LANEWAY, *args], env=env, cwd=ROOT, capture_output=True, text=True, timeout=120
    )


def with_password(url: str, port: int | None = None) -> str:
    from sqlalchemy.engine import make_url

    parsed = make_url(url).set(password=PASSWORD)
    if port is not None:
        parsed = parsed.set(port=port)
    return parsed.render_as_string(hide_password=False)


def test_a_password_in_the_url_appears_nowhere(tmp_path, ledger_backend):
    if ledger_backend != "postgres":
        pytest.skip("PostgreSQL only: a SQLite URL has no password")
    url = with_password(os.environ["LANEWAY_DATABASE_URL"])  # trust auth ignores it
    env = {k: v for k, v in os.environ.items() if k != "LANEWAY_DATABASE_URL"}
    config = tmp_path / "good.toml"
    config.write_text(GOOD)
    runtime = str(tmp_path / "rt")
    seen = [
        run(
            "start-pipeline",
            str(config),
            "--runtime-dir",
            runtime,
            "--no-controller",
            "--database-url",
            url,
            env=env,
        ),
        run("status", "--json", "--runtime-dir", runtime, "--database-url", url, env=env),
        run("report", "--runtime-dir", runtime, "--database-url", url, env=env),
        # Unreachable (nothing listens on port 1) and a database that does not exist:
        run("status", "--runtime-dir", runtime, "--database-url", with_password(url, 1), env=env),
        run(
            "worker",
            "--node",
            "n1",
            "--runtime-dir",
            runtime,
            "--database-url",
            url.rsplit("/", 1)[0] + "/no_such_database_x",
            env=env,
        ),
    ]
    assert seen[0].returncode == 0, seen[0].stderr
    assert json.loads(seen[1].stdout)["run"]["state"] == "active"
    for done in seen[3:]:
        assert done.returncode != 0 and len(done.stderr.strip().splitlines()) == 1, done.stderr
        assert "Traceback" not in done.stderr
    # A worker's log, while it runs.
    log = tmp_path / "worker.log"
    with log.open("wb") as out:
        worker = subprocess.Popen(
            [*LANEWAY, "worker", "--node", "n1", "--runtime-dir", runtime, "--json"],
            env={**env, "LANEWAY_DATABASE_URL": url},
            cwd=ROOT,
            stdout=out,
            stderr=out,
        )
    try:
        from tests.support import wait_until

        wait_until(lambda: b"worker_started" in log.read_bytes())
    finally:
        worker.send_signal(signal.SIGTERM)
        worker.wait(timeout=60)
    for done in seen:
        assert PASSWORD not in done.stdout + done.stderr
    assert PASSWORD not in log.read_text()
    for path in Path(runtime).rglob("*"):
        if path.is_file():
            assert PASSWORD.encode() not in path.read_bytes(), path
    name = db.make_engine(url).url.database
    assert name is not None
    with backends.admin_on(name) as conn:
        tables = [
            r[0]
            for r in conn.execute("SELECT tablename FROM pg_tables WHERE schemaname = 'public'")
        ]
        for table in tables:
            hits = conn.execute(
                f"SELECT count(*) FROM {table} t WHERE t::text LIKE %s", (f"%{PASSWORD}%",)
            ).fetchone()
            assert hits == (0,), table


@pytest.mark.no_ledger
def test_the_option_wins_over_the_environment(tmp_path, ledger_backend):
    config = tmp_path / "good.toml"
    config.write_text(GOOD)
    chosen = tmp_path / "chosen" / db.LEDGER_FILENAME
    chosen.parent.mkdir()
    env = {**os.environ, "LANEWAY_DATABASE_URL": f"sqlite:///{tmp_path / 'elsewhere.sqlite3'}"}
    runtime = str(tmp_path / "rt")
    made = run(
        "start-pipeline",
        str(config),
        "--runtime-dir",
        runtime,
        "--no-controller",
        "--database-url",
        f"sqlite:///{chosen}",
        env=env,
    )
    assert made.returncode == 0, made.stderr
    assert chosen.is_file() and not (tmp_path / "elsewhere.sqlite3").exists()
    shown = run(
        "status",
        "--json",
        "--runtime-dir",
        runtime,
        "--database-url",
        f"sqlite:///{chosen}",
        env=env,
    )
    assert json.loads(shown.stdout)["run"]["id"] == 1


@pytest.mark.no_ledger
def test_an_unknown_backend_is_one_line(tmp_path, ledger_backend):
    done = run(
        "status",
        "--runtime-dir",
        str(tmp_path),
        "--database-url",
        "mysql://x@h/db",
        env=dict(os.environ),
    )
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert "is not a ledger backend" in done.stderr and len(done.stderr.splitlines()) == 1


def test_migrate_creates_or_upgrades_the_ledger_and_says_its_revision(tmp_path, without_ledger):
    env = dict(os.environ)
    runtime = str(tmp_path / "rt")
    for _ in range(2):  # creating, then finding it at head already
        done = run("migrate", "--runtime-dir", runtime, "--json", env=env)
        assert done.returncode == 0, done.stderr
        body = json.loads(done.stdout)
        assert body["revision"] == body["head"] == ledger_open.head_revision()
    status = run("status", "--runtime-dir", runtime, env=env)
    assert status.returncode == 2 and "no runs yet" in status.stderr  # a ledger, empty
