"""The demo pipeline, run by the real CLI in a temp dir, ends as designed."""

from __future__ import annotations

import json
import os
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest

from tests import backends

ROOT = Path(__file__).resolve().parents[2]
LANEWAY = [sys.executable, "-m", "laneway"]
LEDGERS: dict[Path, str] = {}
"""runtime dir -> its PostgreSQL ledger's URL (absent: the runtime dir's SQLite file)."""

# The demo runs once per backend (the module-scoped fixture's params), not once per test.
pytestmark = pytest.mark.no_ledger


@pytest.fixture(scope="module", params=backends.backends())
def demo(request, tmp_path_factory):
    runtime = tmp_path_factory.mktemp("demo")
    paid = runtime / "paid_calls.jsonl"
    env = {**os.environ, "DEMO_API_KEY": "demo-key-for-tests-123", "DEMO_PAID_CALLS": str(paid)}
    env.pop("LANEWAY_DATABASE_URL", None)
    database = backends.create_database() if request.param == "postgres" else None
    if database is not None:
        env["LANEWAY_DATABASE_URL"] = LEDGERS[runtime] = backends.database_url(database)
    try:
        yield _run_demo(runtime, paid, env)
    finally:
        if database is not None:
            backends.drop_database(database)


def _env(runtime: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "LANEWAY_DATABASE_URL"}
    if runtime in LEDGERS:
        env["LANEWAY_DATABASE_URL"] = LEDGERS[runtime]
    return env


def _run_demo(runtime: Path, paid: Path, env: dict[str, str]):
    done = subprocess.run(
        [
            *LANEWAY,
            "run",
            str(ROOT / "configs/demo/pipeline.toml"),
            "--runtime-dir",
            str(runtime),
            "--json",
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
    )
    # The run's budget pays for 10 of its 11 paid solves: admission refuses the last, the
    # run pauses and `laneway run` ends blocked (exit 3), naming the budget.
    assert done.returncode == 3, done.stderr
    # With --json, stderr is JSON lines only: the progress, then how the run ended.
    lines = [json.loads(line) for line in done.stderr.splitlines()]
    ended = [line for line in lines if "event" in line]
    assert [line["event"] for line in ended] == ["run_blocked", "run_budget_spent"]
    blocked, spent = (line["message"] for line in ended)
    assert "nothing more fits the budget: budget (run) — cost_usd: spent 2.5" in blocked
    assert "stopped at its budget; to go on, raise `budget`" in spent
    return runtime, paid, json.loads(done.stdout)


def laneway(runtime: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """A laneway command on the demo's ledger."""
    return subprocess.run(
        [*LANEWAY, *args, "--runtime-dir", str(runtime)],
        env=_env(runtime),
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT,
    )


def query(runtime: Path, sql: str) -> list[tuple]:
    if runtime in LEDGERS:
        import psycopg

        with psycopg.connect(LEDGERS[runtime].replace("+psycopg", "")) as conn:
            return [tuple(row) for row in conn.execute(sql).fetchall()]
    with sqlite3.connect(f"file:{runtime / 'ledger.sqlite3'}?mode=ro", uri=True) as db:
        return db.execute(sql).fetchall()


def test_the_budget_stops_the_run_cleanly_before_its_last_paid_solve(demo):
    runtime, _, status = demo
    assert status["run"]["state"] == "active"
    assert status["totals"] == {
        "succeeded": 31,
        "failed": 2,
        "skipped": 1,
        "ready": 1,
        "waiting": 1,
    }
    rows = query(
        runtime,
        "SELECT item, stage, state, outcome FROM v_job_current ORDER BY item, stage",
    )
    unusual = {
        (item, stage): (state, outcome)
        for item, stage, state, outcome in rows
        if state != "succeeded"
    }
    # The solve refused is whichever paid solve came last; the lanes interleave, so it
    # is one of the late items (and never i05 or i07, which come early in lane a).
    (cut,) = {item for (item, stage), (state, _) in unusual.items() if state == "ready"}
    assert cut in {"i09", "i10", "i11", "i12"}
    assert unusual == {
        ("i07", "solve"): ("failed", "infra_failure"),
        ("i07", "judge"): ("skipped", None),
        ("i05", "judge"): ("failed", "failed"),
        (cut, "solve"): ("ready", None),
        (cut, "judge"): ("waiting", None),
    }
    assert len(rows) == 36
    # The reason is shown where the operator looks: the control, and the idle lane.
    (control,) = status["controls"]
    assert control["kind"] == "pause"
    assert control["reason"].startswith("nothing more fits the budget: budget (run) — cost_usd")
    (lane,) = [lane for lane in status["lanes"] if lane["ready"]]
    assert lane["reason"]["code"] == "paused"
    assert "nothing more fits the budget" in lane["reason"]["words"]
    refused = query(
        runtime,
        "SELECT COUNT(*) FROM decisions WHERE reason_code = 'budget' AND stage = 'solve'",
    )
    assert refused[0][0] >= 1


def test_usage_is_recorded_and_reported_with_each_nodes_low_water(demo):
    runtime, _, _ = demo
    spent = query(
        runtime,
        "SELECT j.stage, u.key, SUM(u.value), COUNT(*) FROM attempt_usage u "
        "JOIN jobs j ON j.id = u.job_id WHERE u.key IN ('cost_usd', 'calls') "
        "GROUP BY j.stage, u.key ORDER BY u.key",
    )
    # 10 paid calls at $0.25, and i07's outage reported its nothing-spent too.
    assert [(stage, key, float(total), n) for stage, key, total, n in spent] == [
        ("solve", "calls", 10.0, 11),
        ("solve", "cost_usd", 2.5, 11),
    ]
    done = laneway(runtime, "report", "1", "--json", "--yield", "useful_tokens")
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    assert report["usage"]["totals"]["cost_usd"] == 2.5
    assert report["usage"]["stages"]["solve"]["per_succeeded"]["cost_usd"] == 0.25
    local = report["node_memory"]["local"]
    assert local["memory_floor_mib"] == 256 and local["low_free_mib"] > 0
    assert local["low_at"] is not None
    # What ran when the node had least memory free: the stages of the attempts running
    # at that moment. The moment is the machine's (other processes move its free
    # memory), so it may fall between two attempts, where nothing of the run ran;
    # test_low_water.py checks the attribution with memory it controls.
    assert set(local["running"]) <= {"prepare", "solve", "judge"}
    assert all(count >= 1 for count in local["running"].values())
    # Paused at its budget with nothing in flight: the window ends at the run's last
    # settle or control, however long after the report is read.
    assert report["window"]["ends_at"] in ("last_settle", "last_control")
    assert report["window"]["held"] == "paused"
    text = laneway(runtime, "report", "1")
    assert text.returncode == 0, text.stderr
    assert "(paused), window" in text.stdout and "None" not in text.stdout
    page = Path(text.stdout.rsplit("HTML timeline: ", 1)[1].strip()).read_text()
    assert "(paused), window" in page and "None" not in page


def test_one_paid_call_line_per_succeeded_paid_attempt(demo):
    runtime, paid, _ = demo
    keys = [json.loads(line)["idempotency_key"] for line in paid.read_text().splitlines()]
    succeeded = {
        key
        for (key,) in query(
            runtime,
            "SELECT a.idempotency_key FROM attempts a JOIN jobs j ON j.id = a.job_id "
            "WHERE j.stage = 'solve' AND a.outcome = 'succeeded'",
        )
    }
    assert len(keys) == len(set(keys)) == 10
    assert set(keys) == succeeded


def test_events_are_in_order_for_every_attempt(demo):
    runtime, _, _ = demo
    events = query(runtime, "SELECT id, kind, attempt_id FROM events ORDER BY id")
    ids = [e[0] for e in events]
    assert ids == sorted(set(ids))
    per_attempt: dict[int, list[str]] = {}
    for _, kind, attempt_id in events:
        if attempt_id is not None:
            per_attempt.setdefault(attempt_id, []).append(kind)
    assert len(per_attempt) == 12 + 11 + 10
    for kinds in per_attempt.values():
        assert kinds == ["attempt_intent", "attempt_running", "attempt_settled"]
    run_events = [
        kind for (kind,) in query(runtime, "SELECT kind FROM events WHERE run_id = 1 ORDER BY id")
    ]
    assert run_events[0] == "run_created" and run_events[-1] == "control_pause"
    assert "run_finished" not in run_events


def test_evidence_files_for_every_attempt(demo):
    runtime, _, _ = demo
    for (directory,) in query(runtime, "SELECT attempt_dir FROM attempts"):
        path = Path(directory)
        for name in ("receipt.json", "exit.json", "stdout.log", "stderr.log", "result.json"):
            assert (path / name).is_file(), path / name
        assert (path / "workspace").is_dir()
    infra = runtime / "runs/1/jobs/i07.solve/attempt-1"
    assert json.loads((infra / "exit.json").read_text())["exit_code"] == 75
    assert "503" in (infra / "stderr.log").read_text()


def test_status_cli_reads_the_paused_run(demo):
    runtime, _, _ = demo
    done = laneway(runtime, "status")
    assert done.returncode == 0, done.stderr
    assert "— active" in done.stdout and "lanes:" in done.stdout
    assert "paused (run) — nothing more fits the budget: budget (run)" in done.stdout
    assert "demo-key-for-tests-123" not in done.stdout


def test_the_api_key_the_jobs_print_is_stored_nowhere(demo):
    runtime, _, status = demo
    key = b"demo-key-for-tests-123"
    solve_logs = list(runtime.glob("runs/1/jobs/*.solve/attempt-1/stderr.log"))
    assert any(b"Authorization: Bearer [REDACTED]" in p.read_bytes() for p in solve_logs)
    for path in runtime.rglob("*"):
        if path.is_file():
            assert key not in path.read_bytes(), path
    assert key.decode() not in json.dumps(status)
    if runtime in LEDGERS:  # the ledger is not a file here: look in every table's rows
        tables = query(runtime, "SELECT tablename FROM pg_tables WHERE schemaname = 'public'")
        assert len(tables) > 10
        for (table,) in tables:
            found = query(
                runtime, f"SELECT count(*) FROM {table} t WHERE t::text LIKE '%{key.decode()}%'"
            )
            assert found == [(0,)], table


def test_stages_hand_their_files_on_through_verified_artifacts(demo):
    runtime, _, _ = demo
    stored = query(runtime, "SELECT stage, COUNT(*) FROM artifacts GROUP BY stage ORDER BY stage")
    # Every succeeded prepare stored its packet, every succeeded solve its answer.
    assert stored == [("prepare", 12), ("solve", 10)]
    # Every solve and judge attempt was given its own item's file from the stage it
    # needs, with the sha256 its producer recorded.
    lineage = query(
        runtime,
        "SELECT l.item, l.stage, l.input_stage, l.input_name, l.sha256, a.sha256, p.item "
        "FROM v_lineage l JOIN v_artifacts a ON a.attempt_id = l.producing_attempt_id "
        "AND a.name = l.input_name JOIN v_artifacts p ON p.attempt_id = a.attempt_id",
    )
    assert len(lineage) == 11 + 10  # 11 solve attempts (i07's too), 10 judge attempts
    for item, stage, input_stage, name, given, recorded, producer_item in lineage:
        assert (stage, input_stage, name) in {
            ("solve", "prepare", "packet.json"),
            ("judge", "solve", "answer.json"),
        }
        assert given == recorded and producer_item == item


def test_every_view_of_the_demos_budget_stop_gives_its_one_step(demo, tmp_path):
    """The demo ends at its budget with nothing in flight and its controller stopped
    cleanly: `status` (text and --json), `status --watch`, `explain` of the refused
    solve (i12's), the report, the metrics, the web API and the page in Chromium each
    give one step (raise the budget, then the new run's command with the reuse count,
    runnable as printed) and none says the controller is gone or that a worker must be
    started."""
    import signal
    import urllib.request

    from tests.integration.test_web import browser_or_skip, browser_page, serving_url

    runtime, _, _ = demo
    config = ROOT / "configs/demo/pipeline.toml"
    command = f"laneway run {config} --new --runtime-dir {runtime}"
    wrong = ("gone", "GONE", "start a worker", "start one", "laneway worker", "--continue")

    def one_step(step: dict) -> None:
        assert step["code"] == "budget", step
        assert step["command"] == command, step
        assert "raise `budget`" in step["words"] and "31 succeeded job(s)" in step["words"]

    status = json.loads(laneway(runtime, "status", "--json").stdout)
    one_step(status["next_step"])
    assert status["controller"]["state"] == "stopped", status["controller"]
    # One lane is done (which one depends on the order the budget ran out in), and it is
    # not "needs you"; the other holds the budget's step.
    lanes = {lane["lane"]: lane["next_step"]["code"] for lane in status["lanes"]}
    assert sorted(lanes.values()) == ["budget", "done"], lanes
    (done,) = [name for name, code in lanes.items() if code == "done"]

    text = laneway(runtime, "status").stdout
    assert "next step: the run stopped at its budget; raise `budget`" in text
    assert command in text
    assert not [w for w in wrong if w in text], text

    # The solve the budget refused (i12's, the last one, unless the lanes' timing put
    # another last).
    ((refused,),) = query(
        runtime,
        "SELECT i.key FROM jobs j JOIN items i ON i.id = j.item_id "
        "WHERE j.stage = 'solve' AND j.state = 'ready'",
    )
    explained = json.loads(laneway(runtime, "explain", f"{refused}.solve", "--json").stdout)
    one_step(explained["next_step"])
    words = laneway(runtime, "explain", f"{refused}.solve").stdout
    assert words.splitlines()[1] == f"next step: {explained['next_step']['words']}: {command}"
    assert not [w for w in wrong if w in words], words

    report = json.loads(laneway(runtime, "report", "1", "--json").stdout)
    one_step(report["next_step"])

    watching = subprocess.Popen(
        [*LANEWAY, "status", "--watch", "--runtime-dir", str(runtime)],
        env=_env(runtime),
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert watching.stdout is not None
        lines = []
        while not any("lane b" in line for line in lines):
            lines.append(watching.stdout.readline())
            assert lines[-1], watching.stderr.read() if watching.stderr else ""
    finally:
        watching.send_signal(signal.SIGINT)
        watching.communicate(timeout=60)
    watched = "".join(lines)
    assert command in watched and f"lane {done}: done" in watched
    assert not [w for w in wrong if w in watched], watched

    web = subprocess.Popen(
        [*LANEWAY, "web", "--bind", "127.0.0.1:0", "--runtime-dir", str(runtime)],
        env=_env(runtime),
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        url = serving_url(web)
        with urllib.request.urlopen(url + "api/state", timeout=60) as answer:
            one_step(json.loads(answer.read())["next_step"])
        with urllib.request.urlopen(url + "metrics", timeout=60) as answer:
            metrics = answer.read().decode()
        assert 'laneway_run_next_step{code="budget",run="1"} 1.0' in metrics, metrics
        playwright_api = browser_or_skip()
        with browser_page(playwright_api, url) as (page, errors):
            page.wait_for_selector("#next-step", timeout=30_000)
            page.wait_for_function(
                "document.getElementById('next-step').textContent.length > 0", timeout=30_000
            )
            assert page.locator("#next-step").inner_text() == command
            assert "raise `budget`" in page.locator("#next-words").inner_text()
            needs = page.locator("#needs-list tr").all_inner_texts()
            (held,) = set(lanes) - {done}
            assert [row.split("\t")[0] for row in needs[1:]] == [held], needs  # not the done one
            body = page.locator("main").inner_text()
            assert not [w for w in wrong if w in body], body
            page.screenshot(path=str(tmp_path / "demo-budget-stop.png"), full_page=True)
            assert errors == []
    finally:
        web.send_signal(signal.SIGTERM)
        web.communicate(timeout=60)
