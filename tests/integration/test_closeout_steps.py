"""Closeout steps: templates are checked when the config is loaded; a step that cannot
be rendered or started is that step's recorded failure and never raises out of
advance(); argv[0] and cwd resolve like a stage's, and preflight checks them."""

from __future__ import annotations

import base64
import json
import os
import sys
import textwrap
from pathlib import Path

import pytest
from sqlalchemy import select

from laneway.controller import closeout, db, environment, ledger
from laneway.controller.config import config_from_frozen, load_config
from laneway.controller.errors import ConfigError
from laneway.controller.models import Event
from laneway.controller.pipeline import preflight
from tests.support import escape, make_config, py_stage, wait_until


def drive(engine, run_id: int, clock) -> closeout.Closeout:
    """Advance a run's closeout until it is done, as the controller's tick does."""
    factory = db.session_factory(engine)
    state: list[closeout.Closeout] = []

    def record(rows: list[dict]) -> None:
        with db.transaction(factory) as session:
            ledger.append_events(session, rows)

    def step() -> bool:
        with factory() as session:
            run = ledger.get_run(session, run_id)
            if not state:
                state.append(closeout.load(session, run))
        closeout.advance(state[0], run, now=clock.now(), record=record)
        return state[0].done

    wait_until(step)
    return state[0]


def finished_events(engine, run_id: int) -> dict[str, dict]:
    with db.session_factory(engine)() as session:
        rows = session.scalars(
            select(Event).where(Event.run_id == run_id, Event.kind == "closeout_step_finished")
        ).all()
    return {row.detail["step"]: row.detail for row in rows}


@pytest.mark.parametrize(
    ("argv", "fragment"),
    [
        (["python3", "-c", 'print({"k": 1})'], "closeout.0.argv.2: bad template"),
        (["tool", "{item}"], "closeout.0.argv.1: bad template '{item}': unknown placeholder"),
        (["tool", "{run"], "closeout.0.argv.1: bad template '{run'"),
    ],
)
def test_a_bad_closeout_template_is_refused_when_the_config_is_loaded(argv, fragment):
    with pytest.raises(ConfigError) as caught:
        make_config(closeout=[{"name": "agg", "argv": argv}])
    assert any(line.startswith(fragment) for line in caught.value.problems), caught.value
    assert all("{{" in line for line in caught.value.problems)  # says how to fix it


def test_bad_cwd_template_is_refused_and_escaped_braces_are_fine():
    with pytest.raises(ConfigError) as caught:
        make_config(closeout=[{"name": "agg", "argv": ["tool"], "cwd": "/tmp/{x}"}])
    assert caught.value.problems[0].startswith("closeout.0.cwd: bad template")
    make_config(closeout=[{"name": "agg", "argv": ["python3", "-c", 'print({{"k": 1}})']}])


def test_a_failing_step_is_recorded_and_the_next_still_runs(
    engine, runtime, make_run, clock, tmp_path, monkeypatch
):
    mark = tmp_path / "mark"
    good = make_config(
        closeout=[
            {"name": "badtemplate", "argv": ["python3", "-c", "print(1)"]},
            {"name": "missing", "argv": [str(tmp_path / "no-such-tool")]},
            {"name": "boom", "argv": ["true"]},
            {"name": "last", "argv": [sys.executable, "-c", f"open({str(mark)!r}, 'w')"]},
        ]
    )
    # As if frozen by a laneway that did not check closeout templates yet.
    frozen = good.canonical_json().replace('"print(1)"', '"print({\\"k\\": 1})"')
    run_id = make_run(config_from_frozen(frozen))
    (runtime / "runs" / str(run_id)).mkdir(parents=True, exist_ok=True)
    real = closeout.render_closeout

    def render(step, **kwargs):
        if step.name == "boom":
            raise RuntimeError("something unexpected")
        return real(step, **kwargs)

    monkeypatch.setattr(closeout, "render_closeout", render)
    state = drive(engine, run_id, clock)
    assert [(s["name"], s["state"]) for s in state.steps] == [
        ("badtemplate", "failed"),
        ("missing", "failed"),
        ("boom", "failed"),
        ("last", "succeeded"),
    ]
    assert mark.exists()
    events = finished_events(engine, run_id)
    assert events["badtemplate"]["error"].startswith("could not render its argv: KeyError")
    assert events["missing"]["error"].startswith("could not start: No such file or directory")
    assert events["boom"]["error"] == "could not start: RuntimeError: something unexpected"
    closeout.write_progress(state)
    progress = json.loads((runtime / "runs" / str(run_id) / "closeout_progress.json").read_text())
    assert progress["done"] is True and progress["steps"][2]["error"].endswith("unexpected")


def write_tool(path: Path, body: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("#!/bin/sh\n" + body + "\n")
    path.chmod(0o755)


def test_closeout_paths_resolve_like_a_stage_and_run_from_the_run_dir(
    engine, runtime, make_run, clock, tmp_path, monkeypatch
):
    config_dir = tmp_path / "project"
    write_tool(
        config_dir / "bin" / "agg.sh", 'echo "run $1 in $(pwd)" > "$LANEWAY_RUN_DIR/agg.txt"'
    )
    (config_dir / "out").mkdir()
    config_path = config_dir / "pipeline.json"
    raw = json.loads(make_config().model_dump_json())
    raw["closeout"] = [
        {"name": "agg", "argv": ["./bin/agg.sh", "{run}"]},
        {"name": "inout", "argv": ["sh", "-c", "pwd > ../marker"], "cwd": "out"},
        {
            "name": "inrun",
            "argv": ["sh", "-c", "pwd > {runtime_dir}/inrun.txt"],
            "cwd": "{runtime_dir}/runs/{run}",
        },
    ]
    config_path.write_text(json.dumps(raw))
    monkeypatch.chdir(tmp_path)  # not the config's directory: paths must not depend on it
    config = load_config(config_path)
    assert config.closeout[0].argv[0] == str(config_dir / "bin" / "agg.sh")
    assert config.closeout[1].cwd == str(config_dir / "out")
    assert config.closeout[2].cwd == "{runtime_dir}/runs/{run}"
    run_id = make_run(config)
    run_dir = runtime / "runs" / str(run_id)
    run_dir.mkdir(parents=True, exist_ok=True)
    state = drive(engine, run_id, clock)
    assert [s["state"] for s in state.steps] == ["succeeded"] * 3, finished_events(engine, run_id)
    assert (run_dir / "agg.txt").read_text() == f"run {run_id} in {run_dir}\n"
    assert (config_dir / "marker").read_text() == f"{config_dir / 'out'}\n"
    assert (runtime / "inrun.txt").read_text() == f"{run_dir}\n"


def test_preflight_checks_closeout_executables_and_cwds(tmp_path):
    write_tool(tmp_path / "ok.sh", "true")
    (tmp_path / "plain.sh").write_text("true\n")
    config = make_config(
        base_dir=tmp_path,
        closeout=[
            {"name": "ok", "argv": ["./ok.sh"]},
            {"name": "gone", "argv": ["./missing.sh"]},
            {"name": "noexec", "argv": ["./plain.sh"], "cwd": "nowhere"},
            {"name": "nopath", "argv": ["no-such-program-laneway"]},
            {"name": "later", "argv": ["{runtime_dir}/made-by-the-run.sh"]},
            {"name": "nocwd", "argv": ["python3", "aggregate.py", "{run}"]},
            {"name": "typo", "argv": ["python3", "agregate.py"], "cwd": "."},
            {"name": "fine", "argv": ["python3", "aggregate.py"], "cwd": "."},
        ],
    )
    (tmp_path / "aggregate.py").write_text("print(1)\n")
    reasons, _ = preflight(config, environ={})
    closeout_reasons = [r for r in reasons if r.startswith("closeout")]
    assert closeout_reasons == [
        f"closeout.1.argv.0: {tmp_path / 'missing.sh'} does not exist (step gone)",
        f"closeout.2.cwd: {tmp_path / 'nowhere'} is not a directory (step noexec)",
        f"closeout.2.argv.0: {tmp_path / 'plain.sh'} is not executable (chmod +x) (step noexec)",
        "closeout.3.argv.0: 'no-such-program-laneway' is not on PATH (step nopath)",
        "closeout.5.argv.1: aggregate.py is relative, and the step has no cwd, so it would be "
        'looked for in runs/<run>/ (step nocwd); set cwd (e.g. cwd = ".", the config\'s '
        "directory) or give an absolute path",
        f"closeout.6.argv.1: agregate.py is not a file in {tmp_path} (step typo)",
    ]


def test_closeout_logs_and_run_dirs_are_owner_only(engine, runtime, make_run, clock, tmp_path):
    import stat

    from laneway.controller import pipeline

    run_id, _ = pipeline.start_run(
        make_config(closeout=[{"name": "agg", "argv": ["sh", "-c", "echo hi"]}]),
        runtime_dir=runtime,
        actor="test",
        clock=clock,
        engine=engine,
    )
    run_dir = runtime / "runs" / str(run_id)
    state = drive(engine, run_id, clock)
    closeout.write_progress(state)

    def mode(path):
        return stat.S_IMODE(path.stat().st_mode)

    assert mode(run_dir) == 0o700 and mode(run_dir / "closeout") == 0o700
    assert (run_dir / "closeout" / "agg.log").read_text() == "hi\n"
    assert mode(run_dir / "closeout" / "agg.log") == 0o600
    assert mode(run_dir / "closeout_progress.json") == 0o600


ENV_AND_SECRET = textwrap.dedent(
    """
    import base64, json, os, sys
    with open(os.path.join(os.environ["LANEWAY_RUN_DIR"], "env.json"), "w") as f:
        json.dump(dict(os.environ), f)
    for secret in open(sys.argv[1]).read().split():
        print("found", secret, base64.b64encode(secret.encode()).decode(), flush=True)
        print("on stderr", secret, file=sys.stderr, flush=True)
    """
)


def test_a_step_gets_a_clean_environment_and_its_log_is_redacted(
    engine, runtime, make_run, clock, tmp_path, monkeypatch
):
    token, password = "closeout-token-5a7b9c", "pw-controller-3e1f0d"
    monkeypatch.setenv("MY_TOKEN", token)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "aws-unreferenced-8c2e")
    monkeypatch.setenv("LANEWAY_READONLY_DATABASE_URL", f"postgresql://r:{password}@h/db")
    monkeypatch.setenv("LANEWAY_FAULTS", "no_such_site:1:EIO")
    # What a step could find: a job's output holding the stage's secret, a leaked URL.
    found = tmp_path / "found.txt"
    found.write_text(f"{token}\n{password}\n")
    stage = {**py_stage("use", "pass"), "env": {"API_KEY": "${MY_TOKEN}"}}
    config = make_config(
        [stage],
        closeout=[
            {"name": "dump", "argv": [sys.executable, "-c", escape(ENV_AND_SECRET), str(found)]}
        ],
    )
    run_id = make_run(config)
    run_dir = runtime / "runs" / str(run_id)
    run_dir.mkdir(parents=True, exist_ok=True)
    state = drive(engine, run_id, clock)
    assert [s["state"] for s in state.steps] == ["succeeded"], finished_events(engine, run_id)
    given = json.loads((run_dir / "env.json").read_text())
    allowed = set(environment.BASE_ENV) | {"LANEWAY_RUN_ID", "LANEWAY_RUN_DIR"}
    assert {n for n in given if not n.startswith("LC_")} <= allowed, sorted(given)
    assert given["LANEWAY_RUN_ID"] == str(run_id) and given["LANEWAY_RUN_DIR"] == str(run_dir)
    assert "PATH" in given
    log = (run_dir / "closeout" / "dump.log").read_text()
    assert log.count("[REDACTED]") >= 6, log  # each secret, raw and base64, both streams
    for secret in (token, password):
        assert secret not in log
        assert base64.b64encode(secret.encode()).decode() not in log


STUBBORN = textwrap.dedent(
    """
    import os, signal, subprocess, sys, time
    if sys.argv[2] == "leader":
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # and so its child, through exec
    child = subprocess.Popen(
        [sys.executable, "-c",
         "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
         "print('ready', flush=True); time.sleep(600)"],
        stdout=subprocess.PIPE,
    )
    child.stdout.readline()  # the child ignores TERM from here on
    with open(sys.argv[1] + ".partial", "w") as f:
        f.write(f"{os.getpid()} {child.pid}")
    os.replace(sys.argv[1] + ".partial", sys.argv[1])
    if sys.argv[2] != "leaves":
        time.sleep(600)
    """
)


def gone(pid: int) -> bool:
    """Exited (a zombie waiting for a reaper has exited too)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as handle:
            return handle.read().rsplit(b")", 1)[1].split()[0] == b"Z"
    except FileNotFoundError:
        return True


def test_a_step_that_ignores_term_is_killed_with_its_group_and_recorded(
    engine, runtime, make_run, clock, tmp_path, monkeypatch
):
    monkeypatch.setattr(closeout, "GRACE_SECONDS", 0.5)
    pids = {name: tmp_path / f"{name}.pids" for name in ("leader", "child", "leaves")}
    steps = [
        {
            "name": name,
            "argv": [sys.executable, "-c", escape(STUBBORN), str(path), name],
            "timeout_seconds": 1 if name != "leaves" else 60,
        }
        for name, path in pids.items()
    ]
    run_id = make_run(make_config(closeout=steps))
    (runtime / "runs" / str(run_id)).mkdir(parents=True, exist_ok=True)
    try:
        state = drive(engine, run_id, clock)
        # Recorded only once every process of the step's group is gone.
        for name, path in pids.items():
            for pid in map(int, path.read_text().split()):
                assert gone(pid), (name, pid)
    finally:
        for path in pids.values():
            written = path.read_text().split() if path.exists() else []
            for pid in map(int, written):
                if not gone(pid):
                    os.kill(pid, 9)
    events = finished_events(engine, run_id)
    # It ignored TERM (so did its child): KILL, to the group, after the grace.
    assert (events["leader"]["state"], events["leader"]["exit_code"]) == ("timed_out", -9)
    # It obeyed TERM, its child did not: the child is killed before the step is recorded.
    assert (events["child"]["state"], events["child"]["exit_code"]) == ("timed_out", -15)
    # It exited, leaving a child that ignores TERM: stopped as a job's leftovers are.
    assert (events["leaves"]["state"], events["leaves"]["exit_code"]) == ("succeeded", 0)
    assert "outlived it" in events["leaves"]["error"]
    assert [s["state"] for s in state.steps] == ["timed_out", "timed_out", "succeeded"]
