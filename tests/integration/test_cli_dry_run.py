"""`laneway dry-run` shows what would run: each stage's argv for the first item, with
item values quoted where they land in a shell script, and writes nothing."""

from __future__ import annotations

import json

from typer.testing import CliRunner

from cli.main import app

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
