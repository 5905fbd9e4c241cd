"""Fast wake-ups: ``ChangeWatch`` reports every committed event; on PostgreSQL it hears
them as notifications (no query of its own), wakes a waiting loop, and survives the
loss of its LISTEN connection without missing a wake-up. An idle worker waiting on it
picks up a new run. (Bounded waits only, never a measured time: bench/bench_wakeup.py
measures the latency.)"""

from __future__ import annotations

import itertools
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator

import pytest
from sqlalchemy import select

from laneway.controller import db, ledger, ledger_open
from laneway.controller.daemon import Controller
from laneway.controller.models import Attempt
from laneway.controller.states import EventKind
from laneway.controller.watch import CHANNEL, ChangeWatch
from laneway.workers.service import WorkerService
from tests import backends
from tests.support import FixedClock, make_config, py_stage, statements, wait_until

PLENTY = (64_000.0, 128_000.0)
FOREVER = 3600.0
"""A wait no test may sit out: only a wake-up ends it within the bounded join."""


def append(factory, clock) -> None:
    with db.transaction(factory) as session:
        ledger.append_event(session, EventKind.CONTROL_PAUSE_CLEARED, actor="test", now=clock.now())


@pytest.fixture
def watch(runtime) -> Iterator[ChangeWatch]:
    """A watch on an engine of its own, so its statements are told from the writer's."""
    engine = ledger_open.open_ledger(runtime, migrate=False)
    watch = ChangeWatch(engine)
    yield watch
    watch.close()
    engine.dispose()


def in_thread(target: Callable[[], object]) -> threading.Thread:
    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    return thread


def joined(thread: threading.Thread) -> bool:
    thread.join(timeout=30)
    return not thread.is_alive()


def listener_query(pid: int) -> str | None:
    with backends.admin() as conn:
        row = conn.execute("SELECT query FROM pg_stat_activity WHERE pid = %s", (pid,)).fetchone()
    return None if row is None else str(row[0])


def terminate(pid: int) -> None:
    with backends.admin() as conn:
        conn.execute("SELECT pg_terminate_backend(%s)", (pid,))
    wait_until(lambda: listener_query(pid) is None, timeout=30)


def only_postgres(on_postgres: bool) -> None:
    if not on_postgres:
        pytest.skip("SQLite has no notifications: its watch stats the ledger files")


def test_a_committed_event_is_reported_once(engine, factory, clock, watch):
    assert watch.changed()  # the first call always says so
    assert not watch.changed()
    append(factory, clock)
    wait_until(watch.changed, timeout=30)
    assert not watch.changed()


def test_postgres_hears_commits_without_querying_the_ledger(
    on_postgres, engine, factory, clock, watch
):
    only_postgres(on_postgres)
    assert watch.changed()
    with statements(watch.engine) as counted:
        for _ in range(200):
            assert not watch.changed()
        append(factory, clock)
        wait_until(watch.changed, timeout=30)
    assert counted == Counter()
    pid = watch.listener_pid()
    assert pid is not None
    assert listener_query(pid) == f"LISTEN {CHANNEL}"  # its last (and only) statement


def test_postgres_wait_wakes_on_the_notification(on_postgres, engine, factory, clock, watch):
    only_postgres(on_postgres)
    assert watch.changed()
    waiting = in_thread(lambda: watch.wait(FOREVER))
    append(factory, clock)
    assert joined(waiting), "wait() slept through the notification"
    assert watch.changed()


def test_a_dropped_listen_connection_is_replaced_and_no_wake_up_is_lost(
    on_postgres, engine, factory, clock, watch
):
    only_postgres(on_postgres)
    assert watch.changed()
    first = watch.listener_pid()
    assert first is not None
    terminate(first)
    append(factory, clock)  # its notification went nowhere: the listener is gone
    wait_until(watch.changed, timeout=30)
    assert watch.lost == 1
    second = watch.listener_pid()
    assert second not in (None, first)
    assert not watch.changed()
    append(factory, clock)  # and the new connection hears the next one
    wait_until(watch.changed, timeout=30)


def test_a_wait_on_a_dropped_listen_connection_returns(on_postgres, engine, factory, clock, watch):
    only_postgres(on_postgres)
    assert watch.changed()
    pid = watch.listener_pid()
    assert pid is not None

    def wait_until_lost() -> None:
        while watch.lost == 0:
            watch.wait(FOREVER)

    waiting = in_thread(wait_until_lost)
    terminate(pid)
    assert joined(waiting), "wait() slept on a dead LISTEN connection"
    append(factory, clock)
    wait_until(watch.changed, timeout=30)


def test_an_unreachable_ledger_means_changed_every_time(on_postgres):
    only_postgres(on_postgres)
    engine = db.make_engine(backends.database_url("laneway_nowhere").replace(":5432", ":1"))
    watch = ChangeWatch(engine)
    assert watch.changed()
    assert watch.changed()  # no LISTEN connection: the caller has to look itself
    assert watch.listener_pid() is None
    engine.dispose()


def test_an_idle_worker_is_woken_by_a_new_run(on_postgres, engine, factory, make_run):
    """On PostgreSQL the worker waits an hour between ticks: only the notification of the
    second run can wake it in time. (SQLite: its usual poll of the ledger files.)"""
    config = make_config([py_stage("only", "pass")])
    runs = [make_run(config)]  # the first one also puts node n1 in the ledger
    service = WorkerService(engine, node="n1", slots=1, memory_probe=lambda: PLENTY, launch=False)
    service.start()
    ticks = []
    tick = service.tick

    def counted_tick():
        ticks.append(tick())
        return ticks[-1]

    service.tick = counted_tick
    stop = threading.Event()
    poll = FOREVER if on_postgres else 0.05
    serving = in_thread(lambda: service.serve(stop.is_set, poll_seconds=poll))

    def settled() -> bool:
        with factory() as session:
            states = session.scalars(select(Attempt.state).where(Attempt.run_id == runs[-1]))
            return list(states) == ["settled"]

    wait_until(settled, timeout=60)
    # Once the tick that settled it is over, the worker is idle until something wakes it.
    wait_until(lambda: any(t.settled for t in ticks), timeout=60)
    # A changed stage, so the new run's job is not reused from the first run's.
    runs.append(make_run(make_config([py_stage("only", "x = 2")])))
    wait_until(settled, timeout=60)
    stop.set()
    append(factory, FixedClock())  # wakes it to see the stop
    assert joined(serving)
    service.stop()


def test_a_stream_of_commits_ticks_the_controller_at_most_once_per_interval(engine, factory, clock):
    """On PostgreSQL each commit's notification wakes the controller at once; a stream of
    short jobs must not cost a tick per commit. Ticks start at least ``interval`` apart
    (a lower bound the serve loop keeps by sleeping, so load can only widen it), and the
    commits made meanwhile are read by the next tick, none missed."""
    controller = Controller(engine)
    starts: list[float] = []
    tick = controller.tick

    def timed_tick(now=None):
        starts.append(time.monotonic())
        return tick(now)

    controller.tick = timed_tick
    interval = 0.2
    stop = threading.Event()
    serving = in_thread(lambda: controller.serve(stop.is_set, interval=interval))
    try:
        wait_until(lambda: starts)
        for _ in range(40):  # one commit, so one notification, every 10 ms or so
            append(factory, clock)
            time.sleep(0.01)
        last_commit = time.monotonic()
        with factory() as session:
            newest = ledger.latest_event_id(session)
        # The commits of the stream were read, by a tick that began after the last one.
        wait_until(lambda: starts[-1] > last_commit and controller._cursor == newest)
    finally:
        stop.set()
        append(factory, clock)  # wakes it to see the stop
        assert joined(serving)
        controller.close()
    gaps = [later - earlier for earlier, later in itertools.pairwise(starts)]
    assert len(starts) >= 3
    # The wrapper reads the clock a moment after the loop does: a millisecond of slack.
    assert min(gaps) >= interval - 0.001, gaps
