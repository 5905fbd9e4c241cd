"""`laneway dry-run` shows what would run: each stage's argv for the first item, with
item values quoted where they land in a shell script, each stage's retry policy and the
closeout steps, and writes nothing."""

from __future__ import annotations

import json

from typer.testing import CliRunner

from laneway.cli.main import app

CONFIG = """
name = "preview"

[[nodes]]
name = "box"
memory_floor_mib = 0
max_jobs = 1

[[lanes]]
name = "main"
node = "box"

[[stages]]
name = "greet"
argv = ["sh", "-c", "echo {who}"]

[[items]]
key = "first"
lane = "main"
who = "$(touch pwned)"
"""


def test_dry_run_prints_the_rendered_argv_of_the_first_item(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    config = tmp_path / "pipeline.toml"
    config.write_text(CONFIG)
    shown = CliRunner().invoke(app, ["dry-run", str(config)])
    assert shown.exit_code == 0, shown.output
    assert "argv of the first item (first) per stage:" in shown.output
    assert "greet: sh -c " in shown.output and "$(touch pwned)" in shown.output
    as_json = CliRunner().invoke(app, ["dry-run", str(config), "--json"])
    (argv,) = json.loads(as_json.output)["argv_preview"].values()
    assert argv == ["sh", "-c", "echo '$(touch pwned)'"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["pipeline.toml"]  # wrote nothing


def test_dry_run_prints_the_budget_arithmetic_for_the_whole_run(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    config = tmp_path / "pipeline.toml"
    budgeted = CONFIG.replace(
        'name = "preview"\n', 'name = "preview"\nbudget = { cost_usd = 1.5, calls = 10 }\n'
    ).replace(
        'argv = ["sh", "-c", "echo {who}"]',
        'argv = ["sh", "-c", "echo {who}"]\nexpected_usage = { cost_usd = 0.75 }',
    )
    budgeted += '\n[[items]]\nkey = "second"\nlane = "main"\nwho = "x"\n'
    budgeted += '\n[[items]]\nkey = "third"\nlane = "main"\nwho = "y"\n'
    config.write_text(budgeted)
    shown = CliRunner().invoke(app, ["dry-run", str(config)])
    assert shown.exit_code == 0, shown.output
    assert "budget (run) cost_usd: greet 3 x 0.75 = 2.25 of 1.5 — passes it" in shown.output
    assert (
        "budget (run) calls: nothing estimated = 0 of 10 — fits; no expected_usage for greet"
        in (shown.output)
    )
    plan = json.loads(CliRunner().invoke(app, ["dry-run", str(config), "--json"]).output)
    assert [(b["key"], b["projected"], b["fits"]) for b in plan["budgets"]] == [
        ("calls", 0.0, True),
        ("cost_usd", 2.25, False),
    ]


HANDOFF = """
name = "handoff"
nodes = [
  { name = "a", memory_floor_mib = 0, max_jobs = 1 },
  { name = "b", memory_floor_mib = 0, max_jobs = 1 },
]
lanes = [{ name = "main", node = "a" }]
items = [{ key = "q1", lane = "main" }]

[[stages]]
name = "solve"
argv = ["true"]
outputs = ["answer.json"]

[[stages]]
name = "review"
argv = ["cat", "{inputs.solve}/answer.json"]
needs = ["solve"]
nodes = ["b"]
"""


def test_dry_run_shows_the_hand_offs_and_warns_of_a_per_machine_store(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    config = tmp_path / "pipeline.toml"
    config.write_text(HANDOFF)
    shown = CliRunner().invoke(app, ["dry-run", str(config)])
    assert shown.exit_code == 0, shown.output
    assert "solve -> review: answer.json" in shown.output
    assert "warning: stage review may run on b, where solve does not" in shown.output
    plan = json.loads(CliRunner().invoke(app, ["dry-run", str(config), "--json"]).output)
    assert plan["artifacts"]["handoffs"] == [
        {"from": "solve", "to": "review", "outputs": ["answer.json"]}
    ]
    assert plan["argv_preview"]["review"] == ["cat", "<attempt_dir>/inputs/solve/answer.json"]
    # A shared store: the same hand-off, no warning.
    config.write_text('artifact_store = "s3://bucket/prefix"\n' + HANDOFF)
    plan = json.loads(CliRunner().invoke(app, ["dry-run", str(config), "--json"]).output)
    assert plan["artifacts"]["store"] == "s3://bucket/prefix"
    assert plan["artifacts"]["warnings"] == []


def test_dry_run_shows_each_stages_retry_policy_and_the_closeout_steps(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    config = tmp_path / "pipeline.toml"
    retried = CONFIG.replace(
        'argv = ["sh", "-c", "echo {who}"]',
        'argv = ["sh", "-c", "echo {who}"]\n'
        'retry = { max_attempts = 3, on = ["failed", "timed_out"], backoff_seconds = 30, '
        "backoff_max_seconds = 600 }",
    )
    retried += (
        '\n[[stages]]\nname = "check"\nargv = ["true"]\nneeds = ["greet"]\n'
        '\n[[closeout]]\nname = "aggregate"\nargv = ["sh", "-c", "ls {runtime_dir}/runs/{run}"]\n'
        "timeout_seconds = 120\n"
    )
    config.write_text(retried)
    shown = CliRunner().invoke(app, ["dry-run", str(config)])
    assert shown.exit_code == 0, shown.output
    lines = shown.output.splitlines()
    start = lines.index("retry:")
    assert lines[start : start + 7] == [
        "retry:",
        "  greet: up to 3 attempts, retried on failed or timed_out; the first retry waits "
        "30 s, x2 each time, at most 10 m 00 s",
        "  check: no automatic retry (max_attempts 1): a failed job waits for `laneway retry`",
        "",
        "closeout (once the run finishes, or is stopped and drained), in order:",
        "  aggregate: sh -c 'ls {runtime_dir}/runs/{run}' (timeout 2 m 00 s)",
        "",
    ]
    plan = json.loads(CliRunner().invoke(app, ["dry-run", str(config), "--json"]).output)
    assert plan["closeout"] == [
        {
            "name": "aggregate",
            "argv": ["sh", "-c", "ls {runtime_dir}/runs/{run}"],
            "cwd": None,
            "timeout_seconds": 120,
        }
    ]
    assert [s["retry"]["max_attempts"] for s in plan["stages"]] == [3, 1]
    plain = tmp_path / "plain.toml"
    plain.write_text(CONFIG)
    assert "\ncloseout: none\n" in CliRunner().invoke(app, ["dry-run", str(plain)]).output
