"""Commands that wait instead of failing, and the small read commands beside them.

`status --watch` started before the ledger exists waits for it (said once) and shows the
run once `start-pipeline` creates it; a foreign database is still refused at once. A
worker started before any pipeline names its node waits (`worker_waiting`), writes
nothing meanwhile, and registers once one does; `--exit-if-unknown` keeps the old exit
2. `laneway runs` lists runs with what holds each; `laneway --version`. Real processes,
their lines read with a bounded timeout; no sleep is asserted on.
"""

from __future__ import annotations

import importlib.metadata
import json
import queue
import signal
import sqlite3
import subprocess
import sys
import threading
from pathlib import Path
from typing import IO, Any

import pytest

from laneway.controller import db
from tests.integration.test_cli import assert_clean_error, invoke
from tests.integration.test_cli_services import BOUND, spawn


class Lines:
    """A pipe of a running process, read line by line on a thread (so a read never
    hangs the test: ``next`` fails after ``BOUND`` seconds)."""

    def __init__(self, stream: IO[str] | None) -> None:
        assert stream is not None
        self.queue: queue.Queue[str | None] = queue.Queue()
        self.seen: list[str] = []
        self.thread = threading.Thread(target=self._pump, args=(stream,), daemon=True)
        self.thread.start()

    def _pump(self, stream: IO[str]) -> None:
        try:
            for line in stream:
                self.queue.put(line)
        finally:
            stream.close()
            self.queue.put(None)

    def next(self, timeout: float = BOUND) -> str | None:
        """The next line (None: the stream ended)."""
        try:
            line = self.queue.get(timeout=timeout)
        except queue.Empty:
            pytest.fail(f"no line within {timeout} s; seen so far: {self.seen[-5:]}")
        if line is not None:
            self.seen.append(line)
        return line

    def json_until(self, done: Any) -> dict[str, Any]:
        """The first JSON line ``done`` accepts (others are skipped)."""
        while True:
            line = self.next()
            if line is None:
                pytest.fail(f"the stream ended; seen: {self.seen[-5:]}")
            body = json.loads(line)
            if done(body):
                return body

    def rest(self) -> list[str]:
        """Every line left, once the process has exited."""
        lines = []
        while (line := self.next()) is not None:
            lines.append(line)
        return lines


class Running:
    """A `laneway` process with both pipes read as they come."""

    def __init__(self, *args: str) -> None:
        self.process = spawn(*args)
        self.out = Lines(self.process.stdout)
        self.err = Lines(self.process.stderr)

    def stop(self, signum: int = signal.SIGTERM) -> int:
        if self.process.poll() is None:
            self.process.send_signal(signum)
        return self.wait()

    def wait(self) -> int:
        try:
            return self.process.wait(timeout=BOUND)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
            pytest.fail(f"`laneway {self.process.args[3:]}` did not exit within {BOUND} s")

    def close(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait()
        for lines in (self.out, self.err):  # their pipes end with the process
            lines.thread.join(timeout=BOUND)


@pytest.fixture
def running():
    started: list[Running] = []

    def _start(*args: str) -> Running:
        process = Running(*args)
        started.append(process)
        return process

    yield _start
    for process in started:
        process.close()


def pipeline(tmp_path: Path, name: str, node: str, *, items: int = 2) -> Path:
    body = {
        "name": name,
        "nodes": [{"name": node, "memory_floor_mib": 0, "max_jobs": 2}],
        "lanes": [{"name": "a", "node": node}],
        "stages": [{"name": "only", "argv": [sys.executable, "-c", "pass"], "timeout_seconds": 30}],
        "items": [{"key": f"x{i}", "lane": "a"} for i in range(items)],
    }
    path = tmp_path / f"{name}.json"
    path.write_text(json.dumps(body))
    return path


def start_pipeline(config: Path, runtime: Path, *extra: str) -> None:
    result = invoke(
        "start-pipeline", str(config), "--runtime-dir", str(runtime), "--no-controller", *extra
    )
    assert result.exit_code == 0, result.output


def sql(runtime: Path, query: str) -> list[dict[str, Any]]:
    # On PostgreSQL `without_ledger` leaves no read-only role to read as.
    result = invoke(
        "sql", query, "--runtime-dir", str(runtime), "--json", "--i-know-this-is-superuser"
    )
    assert result.exit_code == 0, result.output
    rows: list[dict[str, Any]] = json.loads(result.stdout)
    return rows


def foreign_sqlite(runtime: Path) -> Path:
    runtime.mkdir(parents=True)
    path = runtime / db.LEDGER_FILENAME
    connection = sqlite3.connect(path)
    connection.execute("CREATE TABLE invoices (id INTEGER PRIMARY KEY, total REAL)")
    connection.commit()
    connection.close()
    return path


# `status --watch`


def test_status_watch_waits_for_the_ledger_then_shows_the_run(tmp_path, running, without_ledger):
    runtime = tmp_path / "rt"
    watch = running("status", "--watch", "--json", "--runtime-dir", str(runtime))
    waiting = json.loads(watch.out.next() or "null")
    assert waiting["event"] == "waiting" and waiting["waiting_for"] == "ledger"
    if without_ledger is None:
        assert waiting["ledger"] == str(runtime.resolve() / db.LEDGER_FILENAME)
        assert not runtime.exists()  # waiting creates nothing
    else:
        assert waiting["ledger"].endswith(f"/{without_ledger}")
    start_pipeline(pipeline(tmp_path, "early", "n1"), runtime)
    shown = watch.out.json_until(lambda body: "run" in body)
    assert shown["run"]["id"] == 1 and shown["run"]["state"] == "active"
    assert shown["totals"] == {"ready": 2}
    assert watch.stop(signal.SIGINT) == 130
    lines = [json.loads(line) for line in watch.out.seen]
    # The wait for the ledger was said once (a line for the run may follow it, when the
    # ledger was seen between its migration and the run's creation).
    assert [b.get("waiting_for") for b in lines if b.get("event") == "waiting"] in (
        ["ledger"],
        ["ledger", "run"],
    )
    assert "Traceback" not in "".join(watch.err.rest())


@pytest.mark.sqlite_only("an empty file is the SQLite form of a ledger about to be made")
def test_status_watch_waits_on_an_empty_file_and_says_so_once_in_words(tmp_path, running):
    runtime = tmp_path / "rt"
    runtime.mkdir()
    (runtime / db.LEDGER_FILENAME).touch()
    watch = running("status", "--watch", "--runtime-dir", str(runtime))
    said = watch.err.next() or ""
    assert said.startswith(f"laneway: waiting for a ledger at {runtime / db.LEDGER_FILENAME}")
    start_pipeline(pipeline(tmp_path, "empty", "n1"), runtime)
    assert (watch.out.next() or "").startswith("run 1: 0/2 jobs terminal")
    assert watch.stop(signal.SIGINT) == 130
    assert watch.err.rest() == []  # said once


@pytest.mark.sqlite_only("a foreign SQLite file")
@pytest.mark.parametrize("as_json", [False, True], ids=["text", "json"])
def test_status_watch_refuses_a_foreign_database_at_once(tmp_path, running, as_json):
    runtime = tmp_path / "rt"
    path = foreign_sqlite(runtime)
    before = path.read_bytes()
    watch = running(
        "status", "--watch", "--runtime-dir", str(runtime), *(["--json"] if as_json else [])
    )
    assert watch.wait() == 1  # as `status` without --watch: a ledger refused
    if as_json:
        body = json.loads("".join(watch.out.rest()))
        assert body["ok"] is False and "not a laneway ledger" in body["problems"][0]
    else:
        [line] = watch.err.rest()
        assert line.startswith("laneway: ") and "not a laneway ledger" in line
        assert "invoices" in line
    assert path.read_bytes() == before


@pytest.mark.sqlite_only("an absent or empty SQLite file")
def test_status_without_watch_still_refuses_a_missing_or_empty_ledger(tmp_path):
    runtime = tmp_path / "rt"
    for make in (lambda: None, lambda: (runtime.mkdir(), (runtime / db.LEDGER_FILENAME).touch())):
        make()
        result = invoke("status", "--runtime-dir", str(runtime))
        assert_clean_error(result, 2)
        assert len(result.stderr.splitlines()) == 1
        assert f"no ledger at {runtime.resolve() / db.LEDGER_FILENAME}" in result.stderr


# `worker` before its pipeline


def _counts(runtime: Path) -> dict[str, Any]:
    [row] = sql(
        runtime,
        "SELECT (SELECT COUNT(*) FROM workers) AS workers, "
        "(SELECT COUNT(*) FROM events) AS events, (SELECT COUNT(*) FROM runs) AS runs",
    )
    return row


def test_a_worker_started_before_any_pipeline_waits_then_registers(
    tmp_path, running, without_ledger
):
    runtime = tmp_path / "rt"
    worker = running("worker", "--node", "n1", "--runtime-dir", str(runtime), "--json")
    first = json.loads(worker.err.next() or "null")
    assert first["event"] == "worker_waiting" and first["waiting_for"] == "ledger"
    assert first["node"] == "n1"
    if without_ledger is None:
        assert first["ledger"] == str(runtime.resolve() / db.LEDGER_FILENAME)
        assert not runtime.exists()
    # A pipeline that names another node: the worker waits on, for its node now.
    start_pipeline(pipeline(tmp_path, "other", "n2"), runtime)
    second = worker.err.json_until(lambda body: True)
    assert second["event"] == "worker_waiting" and second["waiting_for"] == "node"
    assert second["known"] == ["n2"]
    assert sql(runtime, "SELECT COUNT(*) AS n FROM workers") == [{"n": 0}]
    start_pipeline(pipeline(tmp_path, "mine", "n1"), runtime)
    started = worker.err.json_until(lambda body: body["event"] != "worker_waiting")
    assert started["event"] == "worker_started" and started["slots"] == 2
    rows = sql(runtime, "SELECT id, node, state FROM workers")
    assert rows == [{"id": started["worker_id"], "node": "n1", "state": "active"}]
    assert worker.stop() == 0
    worker.err.rest()
    events = [json.loads(line)["event"] for line in worker.err.seen]
    assert events.count("worker_waiting") == 2  # once per thing waited for
    assert events[-1] == "worker_stopped"


@pytest.mark.parametrize(("signum", "code"), [(signal.SIGTERM, 0), (signal.SIGINT, 130)])
def test_a_signal_while_a_worker_waits_exits_cleanly_writing_nothing(
    tmp_path, running, signum, code
):
    runtime = tmp_path / "rt"
    start_pipeline(pipeline(tmp_path, "p", "n1"), runtime)
    before = _counts(runtime)
    worker = running("worker", "--node", "n9", "--runtime-dir", str(runtime), "--json")
    waiting = json.loads(worker.err.next() or "null")
    assert waiting["event"] == "worker_waiting" and waiting["waiting_for"] == "node"
    assert waiting["known"] == ["n1"]
    assert worker.stop(signum) == code
    last = json.loads(worker.err.rest()[-1])
    assert last["event"] == "worker_stopped" and last["registered"] is False
    assert _counts(runtime) == before
    assert worker.out.rest() == []


def test_a_worker_waiting_for_its_ledger_stops_on_sigterm_creating_nothing(
    tmp_path, running, without_ledger
):
    runtime = tmp_path / "rt"
    worker = running("worker", "--node", "n1", "--runtime-dir", str(runtime))
    said = worker.err.next() or ""
    assert said.startswith("laneway worker: no ledger at ") and "waiting" in said
    assert worker.stop() == 0
    assert "nothing was written" in "".join(worker.err.rest())
    if without_ledger is None:
        assert not runtime.exists()
    else:
        from tests.integration.conftest import tables_in

        assert tables_in(without_ledger) == []


def test_exit_if_unknown_keeps_the_old_refusals(tmp_path, running, without_ledger):
    runtime = tmp_path / "rt"
    worker = running("worker", "--node", "n1", "--runtime-dir", str(runtime), "--exit-if-unknown")
    assert worker.wait() == 2
    [line] = worker.err.rest()
    if without_ledger is None:
        assert line.startswith(f"laneway: --runtime-dir {runtime}: no ledger at ")
    else:
        assert "the database holds no laneway ledger" in line
    start_pipeline(pipeline(tmp_path, "p", "n1"), runtime)
    for slots in ([], ["--slots", "1"]):
        result = invoke(
            "worker", "--node", "nope", *slots, "--runtime-dir", str(runtime), "--exit-if-unknown"
        )
        assert_clean_error(result, 2)
        assert "node 'nope' is not in the ledger" in result.stderr
    assert sql(runtime, "SELECT COUNT(*) AS n FROM workers") == [{"n": 0}]


@pytest.mark.sqlite_only("a foreign SQLite file")
def test_a_worker_refuses_a_foreign_database_at_once(tmp_path, running):
    runtime = tmp_path / "rt"
    path = foreign_sqlite(runtime)
    before = path.read_bytes()
    worker = running("worker", "--node", "n1", "--runtime-dir", str(runtime))
    assert worker.wait() == 1  # as before: a ledger refused
    [line] = worker.err.rest()
    assert line.startswith("laneway: ") and "not a laneway ledger" in line
    assert path.read_bytes() == before


@pytest.fixture
def foreign_postgres(monkeypatch):
    """LANEWAY_DATABASE_URL names a PostgreSQL database holding another application's
    table (and no alembic_version)."""
    from tests import backends

    if not backends.POSTGRES_URL:
        pytest.skip("needs LANEWAY_TEST_POSTGRES_URL")
    name = backends.create_empty_database()
    import psycopg

    with psycopg.connect(backends.database_url(name).replace("+psycopg", "")) as connection:
        connection.execute("CREATE TABLE invoices (id int primary key)")
    monkeypatch.setenv("LANEWAY_DATABASE_URL", backends.database_url(name))
    monkeypatch.delenv("LANEWAY_READONLY_DATABASE_URL", raising=False)
    yield name
    backends.drop_database(name)


@pytest.mark.no_ledger
@pytest.mark.parametrize(
    "argv", [["status", "--watch"], ["worker", "--node", "n1"]], ids=lambda a: a[0]
)
def test_a_foreign_postgres_database_is_refused_not_waited_on(
    tmp_path, running, foreign_postgres, argv
):
    from tests.integration.conftest import tables_in

    process = running(*argv, "--runtime-dir", str(tmp_path / "rt"))
    assert process.wait() == 1
    [line] = process.err.rest()
    assert "is not a laneway ledger: it holds another application's tables" in line
    assert tables_in(foreign_postgres) == ["invoices"]


# `runs`


def test_runs_lists_runs_newest_first_with_what_holds_them(tmp_path):
    runtime = tmp_path / "rt"
    start_pipeline(pipeline(tmp_path, "first", "n1", items=3), runtime)
    start_pipeline(pipeline(tmp_path, "second", "n1"), runtime)
    paused = invoke("pause", "2", "--reason", "quota low", "--runtime-dir", str(runtime))
    assert paused.exit_code == 0, paused.output
    result = invoke("runs", "--runtime-dir", str(runtime), "--json")
    assert result.exit_code == 0, result.output
    listed = json.loads(result.stdout)
    assert [run["id"] for run in listed] == [2, 1]
    second, first = listed
    assert set(second) == {
        "id",
        "name",
        "state",
        "superseded_by",
        "created_at",
        "finished_at",
        "jobs",
        "holding",
        "holding_lane",
        "holding_words",
    }
    assert second["name"] == "second" and second["state"] == "active"
    assert second["superseded_by"] is None is first["superseded_by"]  # other pipelines
    assert second["jobs"] == {"ready": 2} and second["finished_at"] is None
    assert second["holding"] == "paused" and second["holding_lane"] == "a"
    assert "quota low" in second["holding_words"]
    # Nothing paused run 1: no worker serves its node.
    assert first["name"] == "first" and first["jobs"] == {"ready": 3}
    assert first["holding"] == "no_worker"
    assert first["created_at"] <= second["created_at"]

    limited = json.loads(
        invoke("runs", "--limit", "1", "--runtime-dir", str(runtime), "--json").stdout
    )
    assert [run["id"] for run in limited] == [2]

    text = invoke("runs", "--runtime-dir", str(runtime))
    assert text.exit_code == 0, text.output
    header, row2, row1 = text.stdout.splitlines()
    assert header.split() == ["RUN", "NAME", "STATE", "CREATED", "FINISHED", "JOBS", "HOLDING"]
    assert row2.split()[:3] == ["2", "second", "active"] and "paused (lane a)" in row2
    assert "ready 2" in row2
    assert row1.split()[:3] == ["1", "first", "active"] and "no_worker (lane a)" in row1


def test_runs_says_finished_and_no_runs_yet(tmp_path):
    runtime = tmp_path / "rt"
    assert invoke("migrate", "--runtime-dir", str(runtime)).exit_code == 0
    assert invoke("runs", "--runtime-dir", str(runtime)).stdout.startswith("no runs yet")
    assert json.loads(invoke("runs", "--runtime-dir", str(runtime), "--json").stdout) == []
    done = invoke(
        "run", str(pipeline(tmp_path, "quick", "n1", items=1)), "--runtime-dir", str(runtime)
    )
    assert done.exit_code == 0, done.output
    [run] = json.loads(invoke("runs", "--runtime-dir", str(runtime), "--json").stdout)
    assert run["state"] == "finished" and run["holding"] == "finished"
    assert run["jobs"] == {"succeeded": 1} and run["finished_at"] is not None


def test_runs_refuses_a_missing_ledger_in_one_line(tmp_path, without_ledger):
    result = invoke("runs", "--runtime-dir", str(tmp_path / "typo"))
    assert_clean_error(result, 2)
    assert len(result.stderr.splitlines()) == 1
    assert "`laneway start-pipeline` or `laneway run` creates one" in result.stderr


# `--version`


@pytest.mark.no_ledger
def test_version_prints_the_installed_version():
    result = invoke("--version")
    assert result.exit_code == 0, result.output
    assert result.stdout == f"laneway {importlib.metadata.version('laneway')}\n"
