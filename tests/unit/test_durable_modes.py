"""Files laneway writes are owner-only (0600), directories 0700, whatever the umask;
LANEWAY_GROUP_READABLE=1 relaxes both to group-readable, never world-readable."""

from __future__ import annotations

import os
import stat
from collections.abc import Iterator
from pathlib import Path

import pytest

from laneway.controller import durable


def mode(path: Path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


@pytest.fixture(autouse=True)
def loose_umask(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """A umask that takes nothing off: the modes must come from laneway itself."""
    monkeypatch.delenv(durable.GROUP_READABLE_ENV, raising=False)
    old = os.umask(0)
    try:
        yield
    finally:
        os.umask(old)


def test_write_json_creates_owner_only_files(tmp_path):
    target = tmp_path / "status.json"
    durable.write_json(target, {"a": 1})
    assert mode(target) == 0o600
    assert durable.read_json(target) == {"a": 1}


def test_replacing_a_readable_file_or_a_stale_partial_gives_owner_only(tmp_path):
    target = tmp_path / "exit.json"
    target.write_text("{}")
    target.chmod(0o644)
    partial = tmp_path / "exit.json.partial"
    partial.write_text("stale")
    partial.chmod(0o666)
    durable.write_json(target, {"b": 2})
    assert mode(target) == 0o600 and not partial.exists()
    durable.write_json(target, {"b": 3})
    assert mode(target) == 0o600 and durable.read_json(target) == {"b": 3}


def test_make_private_dir_creates_each_missing_level_0700_and_leaves_existing_ones(tmp_path):
    tmp_path.chmod(0o755)
    made = durable.make_private_dir(tmp_path / "rt" / "runs" / "1")
    assert made == tmp_path / "rt" / "runs" / "1"
    for level in ("rt", "rt/runs", "rt/runs/1"):
        assert mode(tmp_path / level) == 0o700, level
    assert mode(tmp_path) == 0o755
    durable.make_private_dir(made)  # exists already: fine
    (tmp_path / "file").write_text("x")
    with pytest.raises(OSError):
        durable.make_private_dir(tmp_path / "file" / "sub")


def test_open_private_appends_owner_only(tmp_path):
    log = tmp_path / "stdout.log"
    with durable.open_private(log) as handle:
        handle.write(b"one\n")
    log.chmod(0o644)
    with durable.open_private(log, "ab") as handle:
        handle.write(b"two\n")
    assert log.read_bytes() == b"one\ntwo\n" and mode(log) == 0o600
    with pytest.raises(ValueError, match="open_private mode: 'r' is not allowed"):
        durable.open_private(log, "r")


def test_group_readable_relaxes_to_0640_and_0750(tmp_path, monkeypatch):
    monkeypatch.setenv(durable.GROUP_READABLE_ENV, "1")
    durable.write_json(tmp_path / "a.json", {})
    directory = durable.make_private_dir(tmp_path / "d")
    with durable.open_private(tmp_path / "log") as handle:
        handle.write(b"x")
    assert mode(tmp_path / "a.json") == 0o640
    assert mode(directory) == 0o750
    assert mode(tmp_path / "log") == 0o640


def test_a_bad_setting_is_reported_in_one_line_and_writers_stay_owner_only(tmp_path, monkeypatch):
    monkeypatch.setenv(durable.GROUP_READABLE_ENV, "world")
    problem = durable.check_modes()
    assert problem == (
        "LANEWAY_GROUP_READABLE: 'world' is not allowed; set it to 1 to let the group read "
        "laneway's files, or unset it (owner only)"
    )
    durable.write_json(tmp_path / "a.json", {})
    assert mode(tmp_path / "a.json") == 0o600
    assert durable.check_modes({"LANEWAY_GROUP_READABLE": "0"}) is None
