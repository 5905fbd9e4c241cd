"""Eight processes writing the ledger at once never see "database is locked"."""

from __future__ import annotations

import subprocess
import sys

from sqlalchemy import func, select

from laneway.controller.models import Event

WRITER = """
import sys
from laneway.controller import db, ledger
from laneway.controller.clock import SystemClock
engine = db.make_engine(db.ledger_url(sys.argv[1]))
factory = db.session_factory(engine)
print("ready", flush=True)
sys.stdin.readline()
for n in range(int(sys.argv[2])):
    with db.transaction(factory) as session:
        ledger.append_event(session, "contention", actor=sys.argv[3], now=SystemClock().now(), n=n)
"""


def test_eight_concurrent_writers_all_commit_without_lock_errors(runtime, factory):
    writers = [
        subprocess.Popen(
            [sys.executable, "-c", WRITER, str(runtime), "25", f"w{i}"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for i in range(8)
    ]
    for writer in writers:
        assert writer.stdout.readline().strip() == "ready"
    for writer in writers:  # all start together
        writer.stdin.write("go\n")
        writer.stdin.flush()
    for writer in writers:
        _, err = writer.communicate(timeout=300)
        assert writer.returncode == 0, err
        assert "locked" not in err
    with factory() as session:
        count = session.scalar(
            select(func.count()).select_from(Event).where(Event.kind == "contention")
        )
    assert count == 8 * 25
