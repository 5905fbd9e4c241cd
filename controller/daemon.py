"""The controller daemon. ``Controller.tick(now)`` is the loop body; ``serve`` the loop.

Each tick runs named steps, each in its own short transaction and only when it has
something to do (each first looks with a read-only session, which takes no write lock):

- ``lost_workers``: active workers whose heartbeat stopped become lost;
- ``expired_leases``: an expired lease's attempt is settled from its exit record (read
  before the write transaction), or marked unknown;
- ``promotion``: the safety net behind in-transaction promotion. It follows the event
  log from a cursor, so it looks only at what changed since the last tick; the first
  tick of a controller makes one full pass;
- ``closing``: runs whose jobs changed are closed when every job is terminal;
- ``closeouts``: closeout steps of finished or stopped runs are started and polled.

A serving controller (``serve``, and ``laneway run``'s loop) also ``beat``s: its
``controllers`` row, registered on the first beat and renewed every
``HEARTBEAT_SECONDS``, tells every view (and the workers, which notify the operator when
it stops) that it is alive; its notifier (controller/notify.py), a thread of its own,
follows the event log from where the previous controller's stopped. ``close`` marks the
row stopped. A bare ``tick()`` does neither.

Then the derived ``runs/<run>/status.json`` snapshot (and ``SUMMARY.json`` at close) is
written. ``serve`` ticks when the ledger file changed (``controller.watch``) or a
periodic step is due, so an idle controller does almost nothing.
"""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

from sqlalchemy import Engine
from sqlalchemy.orm import Session

from laneway.controller import closeout, db, identity, ledger, pipeline
from laneway.controller.attempt import Delivery, ExitRules, Judged, judge_attempt
from laneway.controller.clock import Clock, SystemClock
from laneway.controller.config_models import NotifyConfig
from laneway.controller.crashpoints import crash_point
from laneway.controller.durable import make_private_dir, write_json
from laneway.controller.errors import CommitOutcomeUnknown, LedgerUnavailable
from laneway.controller.models import Attempt, Job
from laneway.controller.notify import Notifier
from laneway.controller.states import AttemptState, EventKind
from laneway.controller.status import build_status
from laneway.controller.status_nodes import LOST_AFTER_SECONDS
from laneway.controller.watch import ChangeWatch

ACTOR = "controller"
LOCK_CHECK_SECONDS = 5.0
"""How often a serving controller makes sure it still holds the ledger's lock."""
HEARTBEAT_SECONDS = 2.0
"""How often a serving controller renews its ``controllers`` row (as often as a
worker: ``status_nodes.worker_liveness`` judges both)."""
LOCK_WAIT_GRACE_SECONDS = 1.0
"""A write that waited this long for the ledger's write lock means every writer was
held up: heartbeats could not land, so no worker is judged by them for a while."""


@dataclass
class ControllerReport:
    promoted: int = 0
    closed: list[int] = field(default_factory=list)
    active: list[int] = field(default_factory=list)
    lost: list[str] = field(default_factory=list)
    expired: list[int] = field(default_factory=list)


class Controller:
    def __init__(
        self,
        engine: Engine,
        *,
        clock: Clock | None = None,
        snapshot_seconds: float = 1.0,
        lost_after_seconds: float = LOST_AFTER_SECONDS,
        recovery_seconds: float = 1.0,
        notify: NotifyConfig | None = None,
    ) -> None:
        self.engine = engine
        self.lost_after_seconds = lost_after_seconds
        self.recovery_seconds = recovery_seconds
        """How often the lost-worker and expired-lease steps look (they depend on time
        passing, not on a change in the ledger)."""
        self.factory = db.session_factory(engine)
        self.reader = db.reader(engine)
        self._tick_reads: Session | None = None
        """On PostgreSQL, the read session of the tick under way (``_reads``)."""
        self.clock = clock or SystemClock()
        self.snapshot_seconds = snapshot_seconds
        self.watch = ChangeWatch(engine)
        self.notifier = Notifier(engine, actor=ACTOR, option=notify, clock=self.clock)
        self.controller_id: int | None = None
        """This controller's ``controllers`` row, from its first ``beat``."""
        self._last_beat = float("-inf")
        self._cursor: int | None = None
        self._retry_look = True
        """Read the earliest retry backoff again: a job became ready since the last look
        (only a settle starts a backoff, and it makes the job ready), or backoffs were
        released and later ones may remain."""
        self._next_retry: datetime | None = None
        """The earliest retry backoff's end at the last look (None: none)."""
        self._active: set[int] = set()
        self._needs: dict[int, bool] = {}
        """Per run: does a stage need another (``_has_needs``)."""
        self._last_snapshot: dict[int, tuple[int, float]] = {}
        self._snapshot_errors: dict[int, str] = {}
        self._snapshot_owed: set[int] = set()
        self._closeouts: dict[int, closeout.Closeout] = {}
        self._closeout_runs: list[int] | None = None
        self._closeout_seen: set[int] = set()
        """The runs the last look for closeouts found (finished or stopped, with steps not
        finished), whether or not one was due: their jobs' changes make it look again."""
        self._run_level = False
        """The promotion step saw a run created, finished or reopened, or a control set
        or cleared, since the closeouts were last looked for."""
        self._last_recovery = float("-inf")
        self._last_recovery_at: datetime | None = None
        """The ledger's clock at the last look for lost workers and expired leases."""
        self.last_ledger_error: str | None = None
        self.lost_lock = False
        """``serve`` stopped because this controller no longer holds the ledger's lock."""
        self.on_ledger_error: Callable[[str], None] | None = None
        """Called with one line when the ledger stops answering (the CLI logs it)."""
        self.on_ledger_back: Callable[[int], None] | None = None
        self._ledger_away = False
        self._judge_after = float("-inf")
        """Monotonic time before which no worker is judged lost and no lease expired:
        the ledger was away, or its write lock was held for long, until
        ``lost_after_seconds`` before it, so heartbeats could not land."""

    def ledger_away(self) -> None:
        """The ledger did not answer (a failed tick or lock check): once it answers
        again, live workers get ``lost_after_seconds`` to heartbeat before anyone is
        judged by their heartbeats or leases (docs/invariants.md, 4)."""
        self._ledger_away = True

    def _hold_judgement(self) -> None:
        self._judge_after = time.monotonic() + self.lost_after_seconds

    def tick(self, now: datetime | None = None) -> ControllerReport:
        try:
            return self._tick(now)
        except Exception as exc:
            if db.is_transient(exc) or isinstance(exc, (CommitOutcomeUnknown, LedgerUnavailable)):
                self.ledger_away()
            raise

    def _tick(self, now: datetime | None) -> ControllerReport:
        reads: AbstractContextManager[Session | None] = (
            nullcontext() if db.is_sqlite(self.engine) else self.reader()
        )
        with reads as session:
            self._tick_reads = session
            try:
                return self._steps(now)
            finally:
                self._tick_reads = None

    @contextmanager
    def _reads(self) -> Iterator[Session]:
        """A session for one of a tick's reads. On PostgreSQL the tick's one session: its
        reads run in autocommit (``db.reader``), each statement seeing what was committed
        before it, so the steps share a connection instead of each checking one out. On
        SQLite, and outside a tick, a session of its own: one there reads a single
        snapshot until it ends, and a step must see what the steps before it wrote."""
        if self._tick_reads is not None:
            yield self._tick_reads
            return
        with self.reader() as session:
            yield session

    def _steps(self, now: datetime | None) -> ControllerReport:
        if now is None:
            # The ledger's clock: the server's on PostgreSQL (db.ledger_now), so lease
            # and heartbeat judgements do not depend on this host's clock.
            with self._reads() as session:
                now = db.ledger_now(session, self.clock)
        if self._ledger_away:
            self._ledger_away = False
            self._hold_judgement()
        report = ControllerReport()
        if self._recovery_due(now):
            self._recovery_step(now, report)
        touched = self._promotion_step(now, report)
        self._retry_step(now, report)
        self._closing_step(touched, now, report)
        for run_id in sorted(self._active | set(report.closed)):
            self.write_snapshots(run_id, now=now, final=run_id in report.closed)
        self._active -= set(report.closed)
        report.active = sorted(self._active)
        changed = bool(report.closed) or self._run_level or bool(touched & self._closeout_seen)
        self._advance_closeouts(now, changed=changed)
        self._run_level = False  # kept when the look failed (the ledger away): look again
        return report

    # -- steps -----------------------------------------------------------------

    def _recovery_due(self, now: datetime) -> bool:
        """Lost workers and expired leases are judged by time, so on their own schedule:
        every ``recovery_seconds`` of this process's clock or of the ledger's (a caller
        may hand ``tick`` a later ``now``). A busy ledger ticks on every change (each
        settle); judging each time found nothing new and cost two reads per tick."""
        if time.monotonic() - self._last_recovery >= self.recovery_seconds:
            return True
        last = self._last_recovery_at
        return last is None or abs((now - last).total_seconds()) >= self.recovery_seconds

    def _recovery_step(self, now: datetime, report: ControllerReport) -> None:
        """Lost workers, then expired leases: only the live rows are looked at.

        Time the ledger could not be written never counts against a worker: after an
        outage, or a write that waited long for the lock (so heartbeats queued behind
        it), nothing is judged until live workers had ``lost_after_seconds`` to beat."""
        self._last_recovery = time.monotonic()
        self._last_recovery_at = now
        if time.monotonic() < self._judge_after:
            return
        with self.reader() as session:
            stale = ledger.stale_workers(session, now=now, lost_after=self.lost_after_seconds)
            expired = ledger.expired_leases(session, now=now)
        if stale:
            with db.transaction(self.factory) as session:
                if self._waited_long(session):
                    return
                report.lost = ledger.mark_lost_workers(
                    session, now=now, lost_after=self.lost_after_seconds, actor=ACTOR
                )
        if expired:
            # Exit records are read here, outside the write lock; the settle re-checks
            # every fence inside it.
            records = {
                row.attempt_id: _read_exit_record(self.reader, row.attempt_id) for row in expired
            }
            with db.transaction(self.factory) as session:
                if self._waited_long(session):
                    return
                report.expired = ledger.expire_leases(
                    session,
                    now=now,
                    actor=ACTOR,
                    settle=lambda s, attempt, when: _settle_from_exit_record(
                        s, attempt, when, records.get(attempt.id)
                    ),
                    only=set(records),
                )

    def _waited_long(self, session: Session) -> bool:
        """Did this write wait so long for the lock that heartbeats were held up too?
        Then hold judgement (the transaction ends having written nothing)."""
        if db.lock_wait(session) < LOCK_WAIT_GRACE_SECONDS:
            return False
        self._hold_judgement()
        return True

    def _retry_step(self, now: datetime, report: ControllerReport) -> None:
        """Retried jobs whose backoff has passed become claimable. Only a settle that
        makes a job ready again can start a backoff, so the ledger is asked again only
        after a ``job_ready`` event or once the earliest known backoff has passed: a
        tick that saw other events (a job that succeeded) or none reads nothing here."""
        if not self._retry_look and (self._next_retry is None or now < self._next_retry):
            return
        self._retry_look = False
        with self._reads() as session:
            self._next_retry = ledger.next_retry_at(session)
        if self._next_retry is not None and self._next_retry <= now:
            with db.transaction(self.factory) as session:
                report.promoted += ledger.release_due_retries(session, now=now, actor=ACTOR)
            self._retry_look = True  # look again: later backoffs may remain

    def _promotion_step(self, now: datetime, report: ControllerReport) -> set[int]:
        """Promote what the events since the cursor made possible; returns the runs
        touched. The first call makes one full pass (a restarted controller catches up
        on whatever happened while it was away)."""
        if self._cursor is None:
            with self.reader() as session:
                cursor = ledger.latest_event_id(session)
                active = set(ledger.active_run_ids(session))
            if active:
                with db.transaction(self.factory) as session:
                    for run_id in sorted(active):
                        report.promoted += ledger.promote_run(session, run_id, now=now, actor=ACTOR)
            self._cursor = cursor
            self._active = active
            return set(active)
        touched: set[int] = set()
        items: set[int] = set()
        more = True
        while more:
            with self._reads() as session:
                changes = ledger.changes_after(session, self._cursor)
                # Only a stage that needs another has jobs that wait: the items of runs
                # with none (one stage, or none that needs another) are not asked about.
                may_wait = {
                    item
                    for item, run_id in changes.item_runs.items()
                    if self._has_needs(session, run_id)
                }
                waiting = ledger.items_with_waiting(session, may_wait)
            touched |= changes.runs
            items.update(waiting)
            self._retry_look = self._retry_look or changes.backoffs
            self._run_level = self._run_level or changes.run_level
            self._cursor, more = changes.cursor, changes.more
        if items:
            with db.transaction(self.factory) as session:
                for item_id in sorted(items):
                    report.promoted += ledger.promote_item(session, item_id, now=now, actor=ACTOR)
        self._active |= touched
        return touched

    def _has_needs(self, session: Session, run_id: int) -> bool:
        """Does a stage of the run need another (so its jobs may wait)? From its frozen
        config, read once per run: a run's config never changes."""
        known = self._needs.get(run_id)
        if known is None:
            config = ledger.run_config(ledger.get_run(session, run_id))
            known = self._needs[run_id] = any(stage.needs for stage in config.stages)
        return known

    def _closing_step(self, touched: set[int], now: datetime, report: ControllerReport) -> None:
        """Close runs whose jobs changed and are all terminal now."""
        with self._reads() as session:
            candidates = [
                run_id
                for run_id in sorted(touched)
                if not ledger.run_has_open_jobs(session, run_id)
                and ledger.get_run(session, run_id).state == "active"
            ]
        for run_id in candidates:
            with db.transaction(self.factory) as session:
                if not ledger.close_run_if_done(session, run_id, now=now, actor=ACTOR):
                    continue
                crash_point("controller_mid_tick")  # inside the transaction: rolls back
                report.closed.append(run_id)
                # Invariant 12 "and at the end": a change during the run is recorded.
                drift = pipeline.source_drift(ledger.get_run(session, run_id).source_hashes)
                if drift:
                    ledger.append_event(
                        session,
                        EventKind.SOURCES_CHANGED,
                        actor=ACTOR,
                        now=now,
                        run_id=run_id,
                        problems=drift,
                    )

    def closeout_pending(self, run_id: int) -> bool:
        """Is the run's closeout started and not yet finished, or due?"""
        if run_id in self._closeouts:
            return True
        with self.reader() as session:
            run = ledger.get_run(session, run_id)
            return closeout.needs_closeout(session, run)

    def _advance_closeouts(self, now: datetime, *, changed: bool) -> None:
        """Start, poll and record closeout steps of finished or stopped runs. The list of
        candidates is read again only when it may have changed (a run finished, a run-level
        event, a change to a candidate's jobs: a stopped run is due once drained), or
        while a step is running.
        Steps are started and polled outside any write transaction; each change is
        written in its own short one (``closeout.advance`` says how)."""
        if self._closeout_runs is None or changed or self._closeouts:
            with self.reader() as session:
                candidates = ledger.closeout_candidates(session)
                self._closeout_seen = {run.id for run in candidates}
                self._closeout_runs = [
                    run.id
                    for run in candidates
                    if run.id in self._closeouts or closeout.needs_closeout(session, run)
                ]
        for run_id in list(self._closeout_runs):
            with self.reader() as session:
                run = ledger.get_run(session, run_id)
                if run_id not in self._closeouts:
                    if not closeout.needs_closeout(session, run):
                        self._closeout_runs.remove(run_id)
                        continue
                    self._closeouts[run_id] = closeout.load(session, run)
            state = self._closeouts[run_id]

            def record(rows: list[dict[str, Any]], run_id: int = run_id) -> None:
                with db.transaction(self.factory) as session:
                    ledger.append_events(session, rows)
                    if any(row["kind"] == EventKind.CLOSEOUT_FINISHED for row in rows):
                        ledger.mark_closeout_finished(session, run_id, now=now)

            if closeout.advance(state, run, now=now, record=record):
                try:
                    closeout.write_progress(state)
                except OSError as exc:
                    record(
                        [
                            ledger.event_row(
                                EventKind.SNAPSHOT_FAILED,
                                actor=ACTOR,
                                now=now,
                                run_id=run_id,
                                error=f"{exc.strerror or exc}",
                                file="closeout_progress.json",
                            )
                        ]
                    )
            if state.done:
                del self._closeouts[run_id]
                self._closeout_runs.remove(run_id)

    def beat(self) -> None:
        """Register this controller (first call) or renew its heartbeat when one is due,
        with the notifier's cursor. The first call starts the notifier after the
        previous controller's cursor (the ledger's newest event for the first
        controller ever: what happened before any notifier is not news)."""
        if time.monotonic() - self._last_beat < HEARTBEAT_SECONDS:
            return
        with db.transaction(self.factory) as session:
            now = db.ledger_now(session, self.clock)
            if self.controller_id is None:
                self.controller_id, cursor = ledger.register_controller(
                    session,
                    host=socket.gethostname(),
                    pid=os.getpid(),
                    boot_id=identity.boot_id(),
                    now=now,
                )
                if cursor is None:
                    cursor = ledger.latest_event_id(session)
            else:
                cursor = None
                ledger.controller_heartbeat(
                    session, self.controller_id, now=now, notify_cursor=self.notifier.cursor
                )
        self._last_beat = time.monotonic()
        if cursor is not None:
            self.notifier.follow(cursor)
            self.notifier.start()

    def close(self) -> None:
        """A clean stop: the notifier finishes what it holds (bounded), and the
        controller's row is marked stopped (not lost), with the notifier's cursor."""
        self.notifier.stop()
        if self.controller_id is None:
            return
        with db.transaction(self.factory) as session:
            ledger.controller_heartbeat(
                session,
                self.controller_id,
                now=db.ledger_now(session, self.clock),
                notify_cursor=self.notifier.cursor,
                stopped=True,
            )

    def write_snapshots(self, run_id: int, *, now: datetime, final: bool = False) -> None:
        """Write status.json (and SUMMARY.json when ``final``) if the ledger changed."""
        with self._reads() as session:
            # The newest event this tick's promotion step read: a snapshot built from a
            # later read is at least that new (one the tick wrote itself is seen, and
            # snapshotted, by the next tick). Outside a tick, the ledger's newest.
            latest = self._cursor if self._cursor is not None else ledger.latest_event_id(session)
            seen, at = self._last_snapshot.get(run_id, (-1, float("-inf")))
            if latest == seen and not final:
                self._snapshot_owed.discard(run_id)
                return
            if time.monotonic() - at < self.snapshot_seconds and not final:
                self._snapshot_owed.add(run_id)  # written by a later tick
                return
            run = ledger.get_run(session, run_id)
            status = build_status(session, run, now=now)
        directory = Path(run.runtime_dir) / "runs" / str(run_id)
        try:
            make_private_dir(directory)
            write_json(directory / "status.json", status.as_dict())
            if final:
                write_json(directory / "SUMMARY.json", status.summary())
        except OSError as exc:
            # A derived snapshot failing is its own diagnostic: it never stops the tick
            # and never touches an outcome. Recorded once per distinct error.
            message = f"{exc.strerror or exc}"
            if self._snapshot_errors.get(run_id) != message:
                self._snapshot_errors[run_id] = message
                with db.transaction(self.factory) as session:
                    ledger.append_event(
                        session,
                        EventKind.SNAPSHOT_FAILED,
                        actor=ACTOR,
                        now=now,
                        run_id=run_id,
                        error=message,
                        final=final,
                    )
            return
        self._snapshot_errors.pop(run_id, None)
        self._snapshot_owed.discard(run_id)
        self._last_snapshot[run_id] = (latest, time.monotonic())

    def due(self) -> bool:
        """Is a tick worth running now? The ledger changed, a periodic step is due, a
        closeout step is running, or a snapshot is still owed."""
        if self._cursor is None or self._closeouts:
            return True
        if time.monotonic() - self._last_recovery >= self.recovery_seconds:
            return True
        if self.watch.changed():
            return True
        return any(
            time.monotonic() - self._last_snapshot.get(run_id, (-1, float("-inf")))[1]
            >= self.snapshot_seconds
            for run_id in self._snapshot_owed
        )

    def serve(
        self,
        should_stop: Callable[[], bool],
        interval: float = 0.05,
        keep_lock: Callable[[], bool] | None = None,
    ) -> None:
        """Tick whenever ``due()``; in between, an idle controller waits up to
        ``interval`` seconds for the ledger to change (``ChangeWatch``: a stat of the
        ledger files, or a notification on PostgreSQL)."""
        outage = db.Outage()
        checked = time.monotonic()
        ticked = float("-inf")
        while not should_stop():
            if keep_lock is not None and time.monotonic() - checked >= LOCK_CHECK_SECONDS:
                try:
                    held = keep_lock()
                except LedgerUnavailable as exc:
                    # Unreachable is not lost: wait for the server, then look again.
                    self.ledger_away()
                    pause = outage.failed(exc, self.on_ledger_error)
                    assert pause is not None  # failed() rides LedgerUnavailable out
                    self.last_ledger_error = outage.last_error
                    time.sleep(pause)
                    continue
                checked = time.monotonic()
                if not held:
                    # Its lock's connection was lost and another controller took the
                    # ledger meanwhile: one controller per ledger.
                    self.lost_lock = True
                    return
            try:
                self.beat()
                if self.due():
                    # At most one tick per ``interval``, from start to start: on
                    # PostgreSQL each commit's notification wakes the watch at once, and
                    # a stream of short jobs would cost a tick (the ledger's clock, the
                    # changes, the closing look) per commit. What commits meanwhile is
                    # read by the next tick. SQLite's watch sleeps ``interval`` anyway.
                    spacing = interval - (time.monotonic() - ticked)
                    if spacing > 0:
                        time.sleep(spacing)
                    ticked = time.monotonic()
                    self.tick()
            except Exception as exc:
                # The ledger is unreachable, locked past its timeout or refusing writes:
                # a transient failure rolled the tick's transaction back, and every step
                # re-reads what it acts on, so the next try starts over (with backoff).
                pause = outage.failed(exc, self.on_ledger_error)
                if pause is None:
                    raise
                self.last_ledger_error = outage.last_error
                time.sleep(pause)
                continue
            outage.back(self.on_ledger_back)
            self.watch.wait(interval)


def _read_exit_record(reader: Callable[[], Session], attempt_id: int) -> Judged | None:
    """Judge an expired attempt's exit record (file reads, no write lock)."""
    with reader() as session:
        attempt = session.get(Attempt, attempt_id)
        if attempt is None:
            return None
        job = session.get(Job, attempt.job_id)
        assert job is not None
        run = ledger.get_run(session, attempt.run_id)
        config = ledger.run_config(run)
        stage = config.stage(job.stage)
        store_url = ledger.artifact_store_url(config.artifact_store, run.runtime_dir)
    # Redacted with the secrets as this process resolves them (on one machine the
    # controller shares the workers' environment; elsewhere it may not know them). A
    # succeeded attempt's outputs are stored as its worker would have (content-
    # addressed: one its worker stored already is found and verified, not rewritten).
    return judge_attempt(
        attempt.attempt_dir,
        ExitRules.of_stage(stage, job_id=attempt.job_id, missing_exit="no exit.json"),
        Delivery.of_stage(stage, store_url),
    )


def _settle_from_exit_record(
    session: Session, attempt: Attempt, now: datetime, judged: Judged | None
) -> bool:
    """For an attempt whose lease expired: settle it if its exit record (judged before
    the transaction) establishes the outcome (the process finished; only the settle was
    lost). True if settled."""
    if judged is None or judged.verdict.outcome is None:
        return False
    ledger.settle_judged(
        session,
        attempt.id,
        judged,
        ledger.Fenced(
            attempt.fence,
            # Its identity was waiting for the settle its worker never wrote.
            identity_from_exit=attempt.state == AttemptState.INTENT,
            revoke=True,
            reason_suffix=" (settled by the controller after its lease expired)",
        ),
        actor=ACTOR,
        now=now,
        node=attempt.node,
    )
    return True
