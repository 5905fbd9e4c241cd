"""Continue, never repeat: running the same command again after an interruption
continues the unfinished run instead of executing its succeeded work a second time.

Real `laneway run` processes; every job appends its item to a file, so a second
execution of anything shows up as a repeated line.
"""

from __future__ import annotations

import json
import shlex
import signal
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import select

from laneway.controller import db, ledger
from laneway.controller.models import Item, Job
from tests.integration.test_cli import invoke
from tests.integration.test_cli_services import BOUND, LANEWAY, ROOT
from tests.support import GATE_BOUND, claim_on_n1, make_config, wait_for_file, wait_until

JOB = """
import os, sys
item, stage, count, gate = sys.argv[1:5]
with open(count, 'a') as handle:
    handle.write(stage + ' ' + item + chr(10))
if os.path.exists(gate + '.fail.' + item):
    sys.exit(1)
if item == 'x3':
""" + textwrap.indent(wait_for_file("gate"), "    ")
"""Each job appends its stage and item to the count file; item x``n`` fails while the
file ``gate.fail.x<n>`` exists; x3 holds until the test opens the gate (a handshake:
however long the test takes on a loaded machine)."""


def write_config(
    tmp_path: Path,
    *,
    items: int = 6,
    stages: list[dict[str, Any]] | None = None,
    name: str = "cont",
    **extra: Any,
) -> Path:
    count, gate = tmp_path / "count.txt", tmp_path / "gate"
    stages = stages or [{"name": "work"}]
    body = {
        "name": name,
        "nodes": [{"name": "n1", "memory_floor_mib": 0, "max_jobs": 1}],
        "lanes": [{"name": "a", "node": "n1"}],
        "stages": [
            {
                "argv": [sys.executable, "-c", JOB, "{item}", stage["name"], str(count), str(gate)],
                "timeout_seconds": GATE_BOUND,
                **stage,
            }
            for stage in stages
        ],
        "items": [{"key": f"x{i}", "lane": "a"} for i in range(1, items + 1)],
        **extra,
    }
    path = tmp_path / "pipeline.json"
    path.write_text(json.dumps(body))
    return path


def executions(tmp_path: Path) -> list[str]:
    path = tmp_path / "count.txt"
    return path.read_text().splitlines() if path.exists() else []


def test_interrupted_run_continues_without_repeating_succeeded_items(tmp_path):
    config = write_config(tmp_path)
    runtime = tmp_path / "rt"
    err_path = tmp_path / "first.err"
    with err_path.open("w") as err_file:
        first = subprocess.Popen(
            [*LANEWAY, "run", str(config), "--runtime-dir", str(runtime), "--quiet"],
            cwd=ROOT,
            stdout=subprocess.DEVNULL,
            stderr=err_file,
            text=True,
        )
        try:
            # x1 and x2 succeeded, x3 is running (held at its gate): interrupt half-way.
            wait_until(lambda: "work x3" in executions(tmp_path), BOUND)
            first.send_signal(signal.SIGINT)
            wait_until(lambda: "stopping" in err_path.read_text(), BOUND)
            (tmp_path / "gate").touch()
            code = first.wait(timeout=BOUND)
        finally:
            if first.poll() is None:
                first.kill()
                first.wait()
    err = err_path.read_text()
    assert code == 130, err[-2000:]
    assert executions(tmp_path) == ["work x1", "work x2", "work x3"]
    hint = [line for line in err.splitlines() if "continue it with: " in line]
    assert hint, err[-2000:]
    command = shlex.split(hint[-1].split("continue it with: ", 1)[1])
    assert command[:4] == ["laneway", "run", "--continue", "1"]

    # The same command again refuses, creates nothing, and names both ways on.
    again = invoke("run", str(config), "--runtime-dir", str(runtime))
    assert again.exit_code == 1, again.output
    assert "laneway run --continue 1" in again.stderr and "--new" in again.stderr
    assert "Traceback" not in again.output
    refused = invoke("start-pipeline", str(config), "--runtime-dir", str(runtime), "--json")
    assert refused.exit_code == 1
    assert json.loads(refused.stdout)["error"] == "UnfinishedRun"

    # The printed command continues the same run: nothing is re-created, and no item
    # that succeeded runs again.
    finished = subprocess.run(
        [*LANEWAY, *command[1:], "--json"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=BOUND,
    )
    assert finished.returncode == 0, finished.stderr[-2000:]
    status = json.loads(finished.stdout)
    assert status["run"]["id"] == 1 and status["run"]["state"] == "finished"
    assert status["totals"] == {"succeeded": 6}
    assert sorted(executions(tmp_path)) == [f"work x{i}" for i in range(1, 7)]


def test_continue_refuses_what_cannot_be_continued(tmp_path):
    config = write_config(tmp_path, items=1)
    runtime = tmp_path / "rt"
    done = invoke("run", str(config), "--runtime-dir", str(runtime), "--quiet")
    assert done.exit_code == 0, done.output
    finished_run = invoke("run", "--continue", "1", "--runtime-dir", str(runtime))
    assert finished_run.exit_code == 2 and "run 1 is finished" in finished_run.stderr
    nothing = invoke("run", "--continue", "--runtime-dir", str(runtime))
    assert nothing.exit_code == 2 and "no unfinished run" in nothing.stderr
    both = invoke("run", str(config), "--continue", "--new", "--runtime-dir", str(runtime))
    assert both.exit_code == 2 and "choose one" in both.stderr
    # A finished run is no obstacle: the same command starts a new run.
    second = invoke("run", str(config), "--runtime-dir", str(runtime), "--json")
    assert second.exit_code == 0, second.output
    assert json.loads(second.stdout)["run"]["id"] == 2


def run_once(config: Path, runtime: Path, *extra: str) -> dict[str, Any]:
    result = invoke("run", str(config), "--runtime-dir", str(runtime), "--json", *extra)
    assert result.exit_code == 0, result.output
    status: dict[str, Any] = json.loads(result.stdout)
    assert status["run"]["state"] == "finished"
    return status


def sql(runtime: Path, query: str) -> list[dict[str, Any]]:
    result = invoke("sql", query, "--runtime-dir", str(runtime), "--json")
    assert result.exit_code == 0, result.output
    rows: list[dict[str, Any]] = json.loads(result.stdout)
    return rows


TWO_STAGES = [{"name": "prep"}, {"name": "judge", "needs": ["prep"]}]


def test_new_run_of_unchanged_config_reuses_everything_and_runs_nothing(tmp_path):
    (tmp_path / "gate").touch()
    config = write_config(tmp_path, items=3, stages=TWO_STAGES)
    runtime = tmp_path / "rt"
    run_once(config, runtime)
    assert len(executions(tmp_path)) == 6

    second = run_once(config, runtime)
    assert second["run"]["id"] == 2
    assert len(executions(tmp_path)) == 6  # nothing executed again
    assert second["totals"] == {"succeeded": 6}
    assert second["reused"] == {"prep": 3, "judge": 3}
    assert sql(runtime, "SELECT COUNT(*) AS n FROM attempts WHERE run_id = 2") == [{"n": 0}]
    # Linked, not copied: each reused job names run 1's succeeded attempt of its twin.
    rows = sql(
        runtime,
        "SELECT r.item, r.stage, r.reused_run_id, a.outcome, j.item_id <> r2.item_id AS other "
        "FROM v_reused_jobs r JOIN attempts a ON a.id = r.reused_attempt_id "
        "JOIN jobs j ON j.id = a.job_id JOIN jobs r2 ON r2.id = r.job_id "
        "WHERE r.run_id = 2 ORDER BY r.item, r.stage",
    )
    assert len(rows) == 6
    assert {(row["reused_run_id"], row["outcome"]) for row in rows} == {(1, "succeeded")}
    text = invoke("status", "2", "--runtime-dir", str(runtime))
    assert "reused from earlier runs" in text.stdout
    report = invoke("report", "2", "--json", "--runtime-dir", str(runtime))
    assert report.exit_code == 0, report.output
    assert json.loads(report.stdout)["reused"] == {
        "total": 6,
        "by_stage": {"judge": 3, "prep": 3},
        "by_lane": {"a": 6},
        "from_runs": {"1": 6},
    }
    text = invoke("report", "2", "--runtime-dir", str(runtime))
    assert (
        "reused from earlier runs (linked, not run): 6 jobs; per stage: judge 3, prep 3; "
        "from run 1: 6"
    ) in text.stdout

    # A third run reuses through the second (which never ran anything): still run 1's.
    run_once(config, runtime)
    assert sql(runtime, "SELECT DISTINCT reused_run_id FROM v_reused_jobs WHERE run_id = 3") == [
        {"reused_run_id": 1}
    ]
    assert len(executions(tmp_path)) == 6


def test_changes_rerun_exactly_the_affected_jobs(tmp_path):
    (tmp_path / "gate").touch()
    a, b = tmp_path / "a.py", tmp_path / "b.py"
    a.write_text("A = 1\n")
    b.write_text("B = 1\n")
    stages = [
        {"name": "prep", "sources": ["a.py"]},
        {"name": "judge", "needs": ["prep"], "sources": ["b.py"]},
    ]
    config = write_config(tmp_path, items=3, stages=stages, sources=["a.py", "b.py"])
    runtime = tmp_path / "rt"

    def new_runs(*extra: str) -> list[str]:
        before = len(executions(tmp_path))
        run_once(config, runtime, *extra)
        return sorted(executions(tmp_path)[before:])

    assert len(new_runs()) == 6
    assert new_runs() == []
    # One source file that only judge depends on: judge re-runs, prep is reused.
    b.write_text("B = 2\n")
    assert new_runs() == ["judge x1", "judge x2", "judge x3"]
    # One item's field: that item's jobs, nothing else.
    body = json.loads(config.read_text())
    body["items"][1]["level"] = 2
    config.write_text(json.dumps(body))
    assert new_runs() == ["judge x2", "prep x2"]
    # A source prep depends on: prep re-runs, and everything downstream of it.
    a.write_text("A = 2\n")
    assert len(new_runs()) == 6
    # --rerun names a stage: it runs again; its upstream is still reused.
    assert new_runs("--rerun", "judge") == ["judge x1", "judge x2", "judge x3"]
    assert len(new_runs("--rerun", "all")) == 6
    bad = invoke("run", str(config), "--runtime-dir", str(runtime), "--rerun", "nope")
    assert bad.exit_code == 2 and "--rerun: 'nope' is not a stage" in bad.stderr
    # A stage that opts out always runs; what needs it runs again too.
    body["stages"][0]["reuse"] = False
    config.write_text(json.dumps(body))
    assert len(new_runs()) == 6


def test_only_succeeded_work_is_reused(tmp_path):
    (tmp_path / "gate").touch()
    failing = tmp_path / "gate.fail.x2"
    failing.touch()
    config = write_config(tmp_path, items=3, stages=TWO_STAGES)
    runtime = tmp_path / "rt"
    first = run_once(config, runtime)
    assert first["jobs"] == {
        "prep": {"succeeded": 2, "failed": 1},
        "judge": {"succeeded": 2, "skipped": 1},
    }
    failing.unlink()
    before = len(executions(tmp_path))
    second = run_once(config, runtime)
    assert sorted(executions(tmp_path)[before:]) == ["judge x2", "prep x2"]
    assert second["reused"] == {"prep": 2, "judge": 2}


HANDS_ON = """
import os, sys, uuid
item, stage, count, gate = sys.argv[1:5]
with open(count, 'a') as handle:
    handle.write(stage + ' ' + item + chr(10))
if stage == 'prep':
    open('out.txt', 'w').write(uuid.uuid4().hex)  # other bytes every time it runs
else:
    data = open(os.path.join(sys.argv[5], 'out.txt')).read()
    open('verdict.txt', 'w').write(data)
    sys.exit(1 if os.path.exists(gate + '.fail.' + item) else 0)
"""


def test_a_job_is_reused_only_with_the_inputs_it_read(tmp_path):
    """The reuse key names what the needed jobs were, not the bytes they wrote: a job is
    taken over only when its earlier attempt read exactly (by sha256) what the needed
    jobs hand on in the new run."""
    count, gate = tmp_path / "count.txt", tmp_path / "gate"
    argv = [sys.executable, "-c", HANDS_ON, "{item}", "{stage}", str(count), str(gate)]
    stages = [
        {
            "name": "prep",
            "argv": [a.replace("{stage}", "prep") for a in argv],
            "outputs": ["out.txt"],
        },
        {
            "name": "judge",
            "needs": ["prep"],
            "outputs": ["verdict.txt"],
            "argv": [a.replace("{stage}", "judge") for a in argv] + ["{inputs.prep}"],
        },
    ]
    config = write_config(tmp_path, items=1, stages=stages)
    runtime = tmp_path / "rt"

    def new_runs(*extra: str) -> list[str]:
        before = len(executions(tmp_path))
        run_once(config, runtime, *extra)
        return sorted(executions(tmp_path)[before:])

    assert new_runs() == ["judge x1", "prep x1"]  # run 1: judge read prep's first bytes
    failing = tmp_path / "gate.fail.x1"
    failing.touch()
    # Run 2: prep runs again and writes other bytes; judge reads them and fails.
    assert new_runs("--rerun", "prep") == ["judge x1", "prep x1"]
    failing.unlink()
    # Run 3: prep is reused from run 2. Run 1's judge has the same key, but it read run
    # 1's bytes: it is not taken over; judge runs on what prep hands on now.
    assert new_runs() == ["judge x1"]
    reused = sql(runtime, "SELECT stage, reused_run_id FROM v_reused_jobs WHERE run_id = 3")
    assert reused == [{"stage": "prep", "reused_run_id": 2}]
    verdicts = sql(
        runtime,
        "SELECT a.run_id, ar.sha256 FROM artifacts ar JOIN attempts a ON a.id = ar.attempt_id "
        "WHERE ar.name = 'verdict.txt' ORDER BY a.run_id",
    )
    outs = sql(
        runtime,
        "SELECT a.run_id, ar.sha256 FROM artifacts ar JOIN attempts a ON a.id = ar.attempt_id "
        "WHERE ar.name = 'out.txt' ORDER BY a.run_id",
    )
    assert [v["run_id"] for v in verdicts] == [1, 3] and [o["run_id"] for o in outs] == [1, 2]
    # judge copies its input: run 3's verdict is run 2's prep output, not run 1's.
    assert verdicts[1]["sha256"] == outs[1]["sha256"] != outs[0]["sha256"]
    # Run 4: nothing changed since run 3, whose judge read what prep hands on: all reused.
    assert new_runs() == []
    reused = sql(runtime, "SELECT stage, reused_run_id FROM v_reused_jobs WHERE run_id = 4")
    assert sorted((r["stage"], r["reused_run_id"]) for r in reused) == [
        ("judge", 3),
        ("prep", 2),
    ]


def test_an_attempt_reconciled_by_hand_is_reused_only_as_succeeded(
    factory, make_run, register_worker, clock
):
    """An operator's reconcile decides: reconciled succeeded, the job is reused by the
    next run; reconciled failed or not-run, it runs again."""
    config = make_config(items=3)
    make_run(config)
    worker = register_worker()
    claims = claim_on_n1(factory, worker, clock, slots=3)
    verdicts = {"item0": "succeeded", "item1": "failed", "item2": "not-run"}
    assert sorted(c.item for c in claims) == sorted(verdicts)
    for claim in claims:
        with db.transaction(factory) as session:
            ledger.mark_unknown(
                session, claim.attempt_id, reason="worker lost", actor="test", now=clock.now()
            )
            ledger.reconcile_attempt(
                session,
                claim.attempt_id,
                verdict=verdicts[claim.item],
                reason="checked by hand",
                actor="operator",
                now=clock.now(),
            )
    attempt_of = {c.item: c.attempt_id for c in claims}

    second = make_run(config)
    with factory() as session:
        jobs = {
            key: (state, reused_from)
            for key, state, reused_from in session.execute(
                select(Item.key, Job.state, Job.reused_from)
                .join(Item, Item.id == Job.item_id)
                .where(Job.run_id == second)
            )
        }
    assert jobs == {
        "item0": ("succeeded", attempt_of["item0"]),
        "item1": ("ready", None),
        "item2": ("ready", None),
    }


def script_stages(tmp_path: Path, **judge: Any) -> list[dict[str, Any]]:
    """Two stages run as scripts their argv names, ``prep.py`` and ``judge.py`` (judge
    needs prep; ``judge``: more of its definition), both importing ``lib.py``, each
    appending ``STAGE ITEM`` to count.txt (``executions``)."""
    (tmp_path / "gate").touch()
    count = tmp_path / "count.txt"
    (tmp_path / "lib.py").write_text("X = 1\n")
    for name in ("prep", "judge"):
        (tmp_path / f"{name}.py").write_text(
            "import sys\nimport lib\n"
            f"open(sys.argv[2], 'a').write('{name} ' + sys.argv[1] + chr(10))\n"
        )
    return [
        {"name": "prep", "argv": [sys.executable, "prep.py", "{item}", str(count)], "cwd": "."},
        {
            "name": "judge",
            "needs": ["prep"],
            "argv": [sys.executable, "judge.py", "{item}", str(count)],
            "cwd": ".",
            **judge,
        },
    ]


def test_a_stage_depends_on_the_scripts_its_argv_names_and_the_sources_it_lists(tmp_path):
    """Issue 'Never re-pay for an unrelated change': a comment in judge.py re-runs judge
    only; a shared module re-runs the stages that list it; ``sources_scope = "all"``
    restores the old rule; a typo'd script name is refused at preflight."""
    stages = script_stages(tmp_path, sources=["lib.py"])
    lib = tmp_path / "lib.py"
    config = write_config(
        tmp_path, items=2, stages=stages, sources=["prep.py", "judge.py", "lib.py"]
    )
    runtime = tmp_path / "rt"

    def new_runs() -> list[str]:
        before = len(executions(tmp_path))
        run_once(config, runtime)
        return sorted(executions(tmp_path)[before:])

    assert len(new_runs()) == 4
    assert new_runs() == []
    (tmp_path / "judge.py").write_text((tmp_path / "judge.py").read_text() + "# a comment\n")
    assert new_runs() == ["judge x1", "judge x2"]
    lib.write_text("X = 2\n")  # only judge lists it
    assert new_runs() == ["judge x1", "judge x2"]
    (tmp_path / "prep.py").write_text((tmp_path / "prep.py").read_text() + "# a comment\n")
    assert len(new_runs()) == 4  # prep, and judge, which needs it
    body = json.loads(config.read_text())
    body["sources_scope"] = "all"  # every stage depends on every top-level source
    config.write_text(json.dumps(body))
    assert len(new_runs()) == 4
    assert new_runs() == []
    body["stages"][0]["argv"][1] = "prepp.py"
    config.write_text(json.dumps(body))
    refused = invoke("run", str(config), "--runtime-dir", str(runtime))
    assert refused.exit_code == 1
    assert f"stages.prep.argv[1]: prepp.py is not a file in {tmp_path}" in refused.output


def test_plan_says_what_a_new_run_would_reuse_run_and_why_before_anything_is_created(tmp_path):
    stages = script_stages(tmp_path, expected_usage={"cost_usd": 0.25})
    config = write_config(tmp_path, items=3, stages=stages, budget={"cost_usd": 10})
    runtime = tmp_path / "rt"

    def plan() -> dict[str, Any]:
        result = invoke("plan", str(config), "--runtime-dir", str(runtime), "--json")
        assert result.exit_code == 0, result.output
        return {s["stage"]: s for s in json.loads(result.stdout)["stages"]}

    # No ledger yet: everything is new, nothing is created.
    assert {name: (s["run"], s["why"]) for name, s in plan().items()} == {
        "prep": (3, {"new: never run": 3}),
        "judge": (3, {"new: never run": 3}),
    }
    assert not runtime.exists()
    run_once(config, runtime)
    (tmp_path / "judge.py").write_text((tmp_path / "judge.py").read_text() + "# a comment\n")
    body = json.loads(config.read_text())
    body["items"][2]["level"] = 2  # one item's field: its two jobs
    config.write_text(json.dumps(body))
    before = len(executions(tmp_path))
    planned = plan()
    assert planned["prep"]["reuse"] == 2 and planned["prep"]["reuse_from"] == {"1": 2}
    assert planned["prep"]["why"] == {"item fields changed": 1}
    assert planned["judge"]["run"] == 3 and planned["judge"]["paid"] is True
    assert planned["judge"]["why"] == {"judge.py changed": 2, "prep runs again": 1}
    text = invoke("plan", str(config), "--runtime-dir", str(runtime))
    assert "  judge  run 3 paid (2 judge.py changed; 1 prep runs again)" in text.stdout
    assert "budget (run) cost_usd: judge 3 x 0.25 = 0.75 of 10 — fits" in text.stdout
    assert len(executions(tmp_path)) == before  # the plan ran nothing

    # `run --new` says the same plan first; it runs paid judge again, so off a terminal
    # it refuses, creating nothing (tests/integration/test_paid_rerun.py); with --yes it
    # runs exactly that.
    refused = invoke("run", str(config), "--runtime-dir", str(runtime), "--new", "--quiet")
    assert refused.exit_code == 2 and "judge: 3 ran before" in refused.stderr
    result = invoke("run", str(config), "--runtime-dir", str(runtime), "--new", "--quiet", "--yes")
    assert result.exit_code == 0, result.output
    dry = invoke("dry-run", str(config), "--runtime-dir", str(runtime), "--json")
    assert json.loads(dry.stdout)["reuse_plan"]["stages"][0]["reuse"] == 3
    ran = sorted(executions(tmp_path)[before:])
    assert ran == ["judge x1", "judge x2", "judge x3", "prep x3"]
    shown = invoke("run", str(config), "--runtime-dir", str(runtime), "--new")
    assert "plan of a new run of cont:" in shown.stderr
    assert "  prep   reuse 3 (from run 1, run 2)" in shown.stderr


CHAIN = """
import os, sys
item, stage, count, gate = sys.argv[1:5]
with open(count, 'a') as handle:
    handle.write(stage + ' ' + item + chr(10))
given = sys.argv[5] if len(sys.argv) > 5 else None
data = open(os.path.join(given, 'out.txt')).read() if given else item
open('out.txt', 'w').write(data + '>' + stage)
sys.exit(1 if os.path.exists(gate + '.fail.' + stage) else 0)
"""


@pytest.mark.parametrize("which", [["x1.judge"], ["--run", "1"]], ids=["job", "bulk"])
def test_retry_of_a_consumer_whose_input_left_the_store_re_runs_its_producers(tmp_path, which):
    """Issue 'Never re-pay ... reuse trusts only the store': judge failed; since then the
    outputs prep and solve stored were deleted from the store. Retrying judge alone would
    fail the same way (its input is not there): the retry names the producers that must
    run again, asks once (refused off a terminal without --yes, nothing changed), and
    with --yes re-runs solve and, for it, prep; `run --continue` then runs the chain."""
    count, gate = tmp_path / "count.txt", tmp_path / "gate"
    argv = [sys.executable, "-c", CHAIN, "{item}", "{stage}", str(count), str(gate)]

    def stage(name: str, need: str | None) -> dict[str, Any]:
        return {
            "name": name,
            "argv": [a.replace("{stage}", name) for a in argv]
            + ([f"{{inputs.{need}}}"] if need else []),
            "outputs": ["out.txt"],
            "needs": [need] if need else [],
            "retry": {"max_attempts": 1},
        }

    stages = [stage("prep", None), stage("solve", "prep"), stage("judge", "solve")]
    config = write_config(tmp_path, items=1, stages=stages)
    runtime = tmp_path / "rt"
    rt = ["--runtime-dir", str(runtime)]
    (tmp_path / "gate.fail.judge").touch()
    first = invoke("run", str(config), *rt, "--json")
    assert first.exit_code == 0, first.output
    assert json.loads(first.stdout)["jobs"]["judge"] == {"failed": 1}
    (tmp_path / "gate.fail.judge").unlink()
    stored = {
        row["stage"]: (row["job_id"], Path(row["location"].removeprefix("file://")))
        for row in sql(
            runtime,
            "SELECT j.stage, j.id AS job_id, ar.location FROM artifacts ar "
            "JOIN attempts a ON a.id = ar.attempt_id JOIN jobs j ON j.id = a.job_id",
        )
    }
    for name in ("prep", "solve"):
        stored[name][1].unlink()

    def states() -> dict[str, str]:
        rows = sql(runtime, "SELECT stage, state, reused_from FROM jobs ORDER BY id")
        return {r["stage"]: r["state"] for r in rows}

    before = states()
    asked = invoke("retry", *which, "--reason", "store pruned by mistake", *rt)
    assert asked.exit_code == 2, asked.output
    solve_job = stored["solve"][0]
    assert f"job {solve_job} (x1.solve) succeeded, but output out.txt of attempt" in asked.stderr
    assert "is no longer in the store" in asked.stderr and "pass --yes" in asked.stderr
    assert states() == before == {"prep": "succeeded", "solve": "succeeded", "judge": "failed"}

    why = "store pruned by mistake"
    done = invoke("retry", *which, "--reason", why, "--yes", *rt, "--json")
    judge_job = json.loads(done.stdout).get("job_id") or json.loads(done.stdout)["retried"][0]
    assert done.exit_code == 0, done.output
    rerun = json.loads(done.stdout)["rerun"]
    assert [(r["job"], r["for_job"]) for r in rerun] == [
        ("x1.solve", judge_job),
        ("x1.prep", solve_job),
    ]
    assert states() == {"prep": "ready", "solve": "waiting", "judge": "waiting"}
    events = sql(runtime, "SELECT job_id, detail FROM events WHERE kind = 'job_retry' ORDER BY id")
    details = [
        json.loads(e["detail"]) if isinstance(e["detail"], str) else e["detail"] for e in events
    ]
    reasons = [
        (e["job_id"], d["reason"].split(" (")[0]) for e, d in zip(events, details, strict=True)
    ]
    retried = judge_job
    assert sorted(reasons) == sorted(
        [(stored["prep"][0], why), (stored["solve"][0], why), (retried, why)]
    )

    before_runs = len(executions(tmp_path))
    again = invoke("run", "--continue", "1", *rt, "--json")
    assert again.exit_code == 0, again.output
    assert executions(tmp_path)[before_runs:] == ["prep x1", "solve x1", "judge x1"]
    assert states() == {"prep": "succeeded", "solve": "succeeded", "judge": "succeeded"}
    attempts_made = sql(runtime, "SELECT j.stage, j.attempt_count FROM jobs j ORDER BY j.id")
    assert [a["attempt_count"] for a in attempts_made] == [2, 2, 2]
