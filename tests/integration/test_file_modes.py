"""Files laneway writes are readable by their owner only: the runtime dir, the ledger
and its WAL, the write lock, an attempt's directory, logs, receipt, exit record and
status snapshot (docs/security.md)."""

from __future__ import annotations

import os
import stat
import sys

from typer.testing import CliRunner

from laneway.cli.main import app

CONFIG = f"""
name = "modes"

[[nodes]]
name = "box"
memory_floor_mib = 0
max_jobs = 1

[[lanes]]
name = "main"
node = "box"

[[stages]]
name = "hello"
argv = ["{sys.executable}", "-c", "print('hi')"]
timeout_seconds = 30

[[items]]
key = "one"
lane = "main"
"""


def test_everything_laneway_writes_is_owner_only(tmp_path, monkeypatch, ledger_backend):
    monkeypatch.delenv("LANEWAY_GROUP_READABLE", raising=False)
    old = os.umask(0o022)  # a typical, permissive umask
    try:
        config = tmp_path / "pipeline.toml"
        config.write_text(CONFIG)
        runtime = tmp_path / "rt"
        shown = CliRunner().invoke(app, ["run", str(config), "--runtime-dir", str(runtime)])
    finally:
        os.umask(old)
    assert shown.exit_code == 0, shown.output
    checked = 0
    for path in [runtime, *runtime.rglob("*")]:
        if path.is_symlink():
            continue
        mode = stat.S_IMODE(path.stat().st_mode)
        assert mode & 0o077 == 0, f"{path.relative_to(tmp_path)} is {oct(mode)}"
        checked += 1
    names = {p.name for p in runtime.rglob("*")}
    expected = {"stdout.log", "receipt.json", "exit.json", "status.json"}
    if ledger_backend == "sqlite":
        expected.add("ledger.sqlite3")
    assert expected <= names
    assert checked > 10
