"""A runtime dir or ledger URL laneway cannot use is one line naming it, in every
command: a symlink loop, a URL that does not parse, a read-only runtime dir for a
command that writes (never a traceback)."""

from __future__ import annotations

import shutil
import subprocess
import sys

import pytest

from tests.integration.test_cli import invoke
from tests.integration.test_cli_services import BOUND, ROOT

pytestmark = pytest.mark.no_ledger

COMMANDS = [
    ["status"],
    ["sql", "SELECT 1"],
    ["pause", "1", "--reason", "x"],
    ["retry", "1", "--reason", "x"],
    ["logs", "1"],
    ["migrate"],
    ["worker", "--node", "n1"],
    ["controller"],
    ["run", "--continue", "1"],
    ["report", "1"],
    ["explain", "1"],
]


@pytest.mark.parametrize("argv", COMMANDS, ids=lambda a: a[0])
def test_a_runtime_dir_that_is_a_symlink_loop_is_refused_in_one_line(tmp_path, argv):
    (tmp_path / "a").symlink_to(tmp_path / "b")
    (tmp_path / "b").symlink_to(tmp_path / "a")
    result = invoke(*argv, "--runtime-dir", str(tmp_path / "a"))
    assert result.exit_code == 2, result.output
    assert "Traceback" not in result.output
    assert "--runtime-dir" in result.output and "does not resolve" in result.output
    assert len(result.stderr.strip().splitlines()) == 1, result.stderr


@pytest.mark.parametrize("url", ["postgresql://[::1", "postgresql://h:port/db", "mysql://h/db"])
@pytest.mark.parametrize("argv", COMMANDS[:4], ids=lambda a: a[0])
def test_a_database_url_that_does_not_parse_is_refused_in_one_line(
    tmp_path, monkeypatch, argv, url
):
    monkeypatch.setenv("LANEWAY_DATABASE_URL", url)
    result = invoke(*argv, "--runtime-dir", str(tmp_path))
    assert result.exit_code == 2, result.output
    assert "Traceback" not in result.output
    assert "LANEWAY_DATABASE_URL" in result.output
    assert "postgresql://USER@HOST" in result.output
    assert len(result.stderr.strip().splitlines()) == 1, result.stderr
    assert not list(tmp_path.iterdir())  # nothing was created


def _read_only_mount_works() -> bool:
    if shutil.which("unshare") is None:
        return False
    probe = subprocess.run(
        ["unshare", "-m", "sh", "-c", "mount --bind / /mnt && mount -o remount,ro,bind /mnt"],
        capture_output=True,
    )
    return probe.returncode == 0


@pytest.mark.parametrize(
    "argv,words",
    [
        (["worker", "--node", "n1"], "runtime dir it can write"),
        (["controller"], "runtime dir it can write"),
        (["pause", "1", "--reason", "x"], "runtime dir it can write"),
        # A read-only command: it answers when SQLite can read the ledger without its
        # write-ahead log's shared memory, and is refused in one line when it cannot.
        (["status"], None),
    ],
    ids=lambda a: a[0] if isinstance(a, list) else "",
)
def test_a_read_only_runtime_dir_is_refused_in_one_line(tmp_path, argv, words):
    if not _read_only_mount_works():
        pytest.skip("needs a mount namespace (root and unshare) for a read-only bind mount")
    config = tmp_path / "p.json"
    config.write_text(
        '{"name": "p", "nodes": [{"name": "n1", "memory_floor_mib": 0, "max_jobs": 1}],'
        ' "lanes": [{"name": "a", "node": "n1"}],'
        ' "stages": [{"name": "s", "argv": ["true"], "timeout_seconds": 10}],'
        ' "items": [{"key": "x", "lane": "a"}]}'
    )
    runtime = tmp_path / "rt"
    made = invoke("start-pipeline", str(config), "--runtime-dir", str(runtime), "--no-controller")
    assert made.exit_code == 0, made.output
    (runtime / "ledger.sqlite3.writelock").unlink()  # as on a copy taken elsewhere
    (runtime / "controller.lock").unlink(missing_ok=True)
    before = sorted(p.name for p in runtime.iterdir())
    command = " ".join(
        [sys.executable, "-m", "laneway", *argv, "--runtime-dir", str(runtime)]
    ).replace("--reason x", "--reason 'read only'")
    script = (
        f"mount --bind {runtime} {runtime} && mount -o remount,ro,bind {runtime} && "
        f"timeout {BOUND} {command}"
    )
    result = subprocess.run(
        ["unshare", "-m", "sh", "-c", script], cwd=ROOT, capture_output=True, text=True
    )
    assert "Traceback" not in result.stderr, result.stderr
    if words is None and result.returncode == 0:
        assert "run 1 (p)" in result.stdout, result.stdout
    else:
        assert result.returncode in (1, 2), result.stderr
        assert (words or "runtime dir it can write") in result.stderr, result.stderr
    assert sorted(p.name for p in runtime.iterdir()) == before
