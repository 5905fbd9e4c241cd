"""controller/process_group.py: one look at a process group, its zombie rule a parameter.
The supervisor counts a zombie member (it reaps its own); the controller, watching a
closeout step, does not (a zombie it will never reap holds nothing open)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from laneway.controller.process_group import group_alive
from tests.support import wait_until

pytestmark = [
    pytest.mark.no_ledger,
    pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="needs /proc"),
]


def _state(pid: int) -> str:
    return Path(f"/proc/{pid}/stat").read_bytes().rsplit(b")", 1)[1].split()[0].decode()


def test_a_zombie_counts_only_where_asked():
    # A group of one: a child in a session of its own that exits and is not reaped yet.
    child = subprocess.Popen([sys.executable, "-c", ""], start_new_session=True)
    try:
        wait_until(lambda: _state(child.pid) == "Z")
        assert group_alive(child.pid, zombies_count=True)
        assert not group_alive(child.pid, zombies_count=False)
    finally:
        child.wait()
    assert not group_alive(child.pid, zombies_count=True)
    assert not group_alive(child.pid, zombies_count=False)


def test_a_running_member_is_alive_either_way():
    child = subprocess.Popen(
        [sys.executable, "-c", "import sys; sys.stdin.read()"],
        stdin=subprocess.PIPE,
        start_new_session=True,
    )
    try:
        assert group_alive(child.pid, zombies_count=True)
        assert group_alive(child.pid, zombies_count=False)
    finally:
        assert child.stdin is not None
        child.stdin.close()
        child.wait()
    assert not group_alive(child.pid, zombies_count=False)
