"""Tell the operator (controller/notify.py), on both backends, with a real local HTTP
receiver: one notification per new attention state, made from the event log (halt,
unknown outcome, budget stop, breaker pause, lost worker, finished run) or, for a lost
controller, by a worker's notifier; never twice (another notifier, a restart); every
try recorded in the ledger with the secret redacted; dispatch goes on while a receiver
hangs; and real ``laneway run`` processes deliver what their run ended in before they
exit, through the webhook and the command of the config's ``[notify]`` section."""

from __future__ import annotations

import json
import sys
from datetime import timedelta
from typing import Any

from sqlalchemy import select, text, update

from laneway.controller import db, ledger
from laneway.controller.config_models import NotifyConfig
from laneway.controller.daemon import Controller
from laneway.controller.ledger.tables import controllers
from laneway.controller.models import Notification, NotificationDelivery
from laneway.controller.notify import Notifier
from laneway.controller.states import ControlKind, Outcome
from laneway.controller.usage import BUDGET_SPENT
from tests.integration.test_cli_services import config_file, finish, spawn
from tests.receiver import receiver
from tests.support import (
    claim_on_n1,
    control_run,
    make_config,
    mark_unknown_one,
    py_stage,
    settle_one,
)


def notifications(factory) -> list[tuple[str, str, str]]:
    with factory() as session:
        return [
            (n.kind.value, n.state.value, n.key)
            for n in session.scalars(select(Notification).order_by(Notification.id))
        ]


def deliveries(factory) -> list[NotificationDelivery]:
    with factory() as session:
        return list(session.scalars(select(NotificationDelivery).order_by(NotificationDelivery.id)))


def following(engine, clock, option: NotifyConfig, **kwargs: Any) -> Notifier:
    """A controller's notifier that follows the event log from its start."""
    notifier = Notifier(
        engine, actor="controller", option=option, clock=clock, backoff_seconds=0.01, **kwargs
    )
    with db.reader(engine)() as session:
        notifier.follow(ledger.latest_event_id(session))
    return notifier


def test_one_notification_per_attention_state_each_try_recorded_never_twice(
    engine, factory, make_run, register_worker, clock
):
    run_id = make_run(make_config(items=3))
    other = make_run(make_config(items=1))
    worker = register_worker()
    with receiver([500]) as hook:  # the first try fails: it is tried again
        notifier = following(engine, clock, NotifyConfig(webhook=hook.url + "/hook"))
        first, second = claim_on_n1(factory, worker, clock, slots=2)
        mark_unknown_one(factory, first, clock, "lease expired", fence=first.fence)
        mark_unknown_one(factory, second, clock, "lease expired", fence=second.fence)
        with db.transaction(factory) as session:
            control_run(
                session,
                ControlKind.HALT,
                run_id,
                reason="fatal",
                actor="controller",
                now=clock.now(),
            )
            control_run(  # an operator's own pause is not news to them
                session, ControlKind.PAUSE, run_id, reason="lunch", actor="ann@box", now=clock.now()
            )
            control_run(
                session,
                ControlKind.PAUSE,
                other,
                reason=f"{BUDGET_SPENT}: cost_usd 2.5 + 0.25 > 2.6",
                actor="w1",
                now=clock.now(),
            )
        notifier.poll()
        kinds = [(b["kind"], b["run"]) for b in hook.bodies()]
        assert kinds == [
            ("halt", run_id),
            ("halt", run_id),  # its first try answered 500; the second took it
            ("budget_stop", other),
            ("unknown_outcome", run_id),
        ]
        assert [kind for kind, state, _ in notifications(factory)] == [
            "halt",
            "budget_stop",
            "unknown_outcome",
        ]
        assert {state for _, state, _ in notifications(factory)} == {"delivered"}
        tried = deliveries(factory)
        assert [(d.try_number, d.ok, d.detail) for d in tried] == [
            (1, False, "HTTP 500 Scripted"),
            (2, True, "HTTP 204"),
            (1, True, "HTTP 204"),
            (1, True, "HTTP 204"),
        ]
        unknown = hook.bodies()[3]
        ids = f"{first.attempt_id}, {second.attempt_id}"
        assert unknown["reason"] == f"outcome unknown of attempts {ids}: lease expired"
        # The next step is the one every view shows: reconcile the first unknown attempt.
        assert unknown["next_step"]["code"] == "unknown_outcome"
        assert unknown["next_step"]["command"].startswith(f"laneway reconcile {first.attempt_id} ")
        budget = hook.bodies()[2]
        assert budget["next_step"]["code"] == "budget"

        # Nothing new: nothing sent. A second notifier from an older cursor (a restart
        # after a crash) finds each occurrence told already.
        notifier.poll()
        again = Notifier(engine, actor="controller", option=NotifyConfig(webhook=hook.url))
        again.follow(0)
        again.poll()
        assert len(hook.requests) == 4 and len(notifications(factory)) == 3

        # A lost worker and a finished run.
        with db.transaction(factory) as session:
            ledger.mark_worker_lost(
                session, worker, reason="no heartbeat", actor="c", now=clock.now()
            )
        with db.transaction(factory) as session:
            ledger.clear_controls(
                session,
                (ControlKind.PAUSE,),
                run_id=other,
                reason="ok",
                actor="a@b",
                now=clock.now(),
            )
        fresh = register_worker()
        (claim,) = claim_on_n1(factory, fresh, clock)
        settle_one(factory, claim, fresh, clock, Outcome.SUCCEEDED)
        Controller(engine, clock=clock).tick()  # closes the other run
        notifier.poll()
    later = hook.bodies()[4:]
    assert (later[-1]["kind"], later[-1]["run"]) == ("run_finished", other)
    assert later[-1]["next_step"]["code"] == "done"
    lost = [b["reason"] for b in later if b["kind"] == "worker_lost"]
    # On PostgreSQL the tick (the server's clock) judges the fresh worker lost too.
    assert lost[0] == f"worker {worker} lost: no heartbeat" and len(lost) == len(set(lost))
    assert len(later) == len(lost) + 1


def test_a_receiver_that_hangs_never_holds_up_dispatch(
    engine, factory, make_run, register_worker, clock
):
    halted = make_run(make_config(items=1))
    busy = make_run(make_config(items=2))
    worker = register_worker()
    with receiver(hang=True) as hook:
        notifier = following(engine, clock, NotifyConfig(webhook=hook.url, timeout_seconds=60))
        notifier.start()
        try:
            with db.transaction(factory) as session:
                control_run(
                    session,
                    ControlKind.HALT,
                    halted,
                    reason="fatal",
                    actor="controller",
                    now=clock.now(),
                )
            assert hook.arrived.wait(30)  # the notifier is inside its POST, held
            claims = claim_on_n1(factory, worker, clock, slots=4)
            assert sorted(c.run_id for c in claims) == [busy, busy]
            for claim in claims:
                settle_one(factory, claim, worker, clock, Outcome.SUCCEEDED)
            report = Controller(engine, clock=clock).tick()
            assert report.closed == [busy]
            assert notifications(factory)[0][:2] == ("halt", "pending")
        finally:
            hook.release()
            notifier.stop()
    assert notifications(factory)[0][:2] == ("halt", "delivered")


def test_a_worker_tells_once_that_the_controller_is_lost(engine, factory, make_run, clock):
    make_run(make_config(items=1, notify={"webhook": "http://127.0.0.1:9/unused"}))
    controller = Controller(engine, clock=clock)
    controller.beat()
    controller.notifier.stop()
    with receiver() as hook:
        option = NotifyConfig(webhook=hook.url, on=["controller_lost"])
        workers = [
            Notifier(
                engine,
                actor=f"w{i}",
                option=option,
                clock=clock,
                watch_controller=True,
                backoff_seconds=0.01,  # the run's unreachable URL fails its retries at once
            )
            for i in range(2)
        ]
        for notifier in workers:
            notifier.poll()  # a live controller: nothing to tell
        assert hook.requests == []
        with db.transaction(factory) as session:
            old = db.ledger_now(session, clock) - timedelta(seconds=40)
            session.execute(update(controllers).values(heartbeat_at=old))
        for notifier in workers:
            notifier.poll()
            notifier.poll()
    [body] = hook.bodies()
    assert body["kind"] == "controller_lost"
    assert body["reason"].startswith(f"controller {controller.controller_id} (pid ")
    assert "no heartbeat for 4" in body["reason"]
    # The run's own section (an unreachable URL) was tried too, and recorded as failed.
    assert [kind for kind, _, _ in notifications(factory)] == ["controller_lost"]
    assert notifications(factory)[0][1] == "failed"
    # A literal path is not recorded (a hook's URL is often its secret).
    assert {d.target for d in deliveries(factory)} == {hook.url, "http://127.0.0.1:9/…"}


def test_laneway_run_delivers_what_its_run_ended_in_before_it_exits(tmp_path):
    got = tmp_path / "command.jsonl"
    append = f"import sys; open({str(got)!r}, 'a').write(sys.stdin.read().strip() + chr(10))"
    with receiver() as hook:
        notify = {
            "webhook": hook.url + "/hook/${HOOK_TOKEN}",
            "command": [sys.executable, "-c", append],
        }
        env = {"HOOK_TOKEN": "tok-98765", "LANEWAY_WEB_URL": "http://dash.example:8470"}
        runtime = tmp_path / "rt"
        finished = spawn(
            "run",
            str(config_file(tmp_path, items=2, notify=notify)),
            "--runtime-dir",
            str(runtime),
            env=_env(env),
        )
        code, _out, err = finish(finished)
        assert code == 0, err
        [body] = hook.bodies()
        assert body["kind"] == "run_finished" and body["link"] == "http://dash.example:8470/runs/1"
        assert hook.requests[0].path == "/hook/tok-98765"

        fatal = config_file(
            tmp_path,
            items=2,
            max_jobs=1,  # the second job waits, and the halt holds it
            notify=notify,
            stages=[py_stage("only", "import sys; sys.exit(70)", exit_codes={"70": "fatal"})],
        )
        halted = spawn("run", str(fatal), "--runtime-dir", str(runtime), env=_env(env))
        code, _out, err = finish(halted)
        assert code == 3, err
        kinds = [b["kind"] for b in hook.bodies()]
        assert kinds == ["run_finished", "halt"]
    halt = hook.bodies()[1]
    assert halt["run"] == 2
    assert halt["next_step"]["code"] == "halted"
    assert halt["next_step"]["command"].startswith("laneway clear-halt 2 ")
    lines = [json.loads(line) for line in got.read_text().splitlines()]
    assert [line["kind"] for line in lines] == ["run_finished", "halt"]
    # The ledger recorded every try; the token is in none of its rows.
    from laneway.controller import ledger_open

    engine = ledger_open.open_existing_ledger(runtime)
    try:
        with engine.connect() as connection:
            dumped = json.dumps(
                [
                    [str(v) for v in row]
                    for table in ("notifications", "notification_deliveries")
                    for row in connection.execute(text(f"SELECT * FROM {table}"))
                ]
            )
            channels = connection.execute(
                text("SELECT channel, ok FROM notification_deliveries ORDER BY id")
            ).all()
    finally:
        engine.dispose()
    assert "tok-98765" not in dumped
    assert [tuple(c) for c in channels] == [
        ("webhook", True),
        ("command", True),
        ("webhook", True),
        ("command", True),
    ]


def _env(extra: dict[str, str]) -> dict[str, str]:
    import os

    return {**os.environ, **extra}


DASHBOARD = "http://dash.example:8470"


def test_every_kind_carries_its_next_step_with_a_command_and_a_specific_link(
    engine, factory, make_run, register_worker, clock
):
    """Each of the seven kinds, made the real way and received by a real receiver: a next
    step with its command, and a link to the affected run, attempt or workers section
    (never the dashboard's front page); a finished run's reason counts its outcomes."""
    halted = make_run(make_config(items=1))
    broken = make_run(make_config(items=1))
    unknown_run = make_run(make_config(items=2))
    worker = register_worker()
    environ = {"LANEWAY_WEB_URL": DASHBOARD}
    with receiver() as hook:
        option = NotifyConfig(webhook=hook.url + "/hook")
        notifier = following(engine, clock, option, environ=environ)
        with db.transaction(factory) as session:
            control_run(
                session,
                ControlKind.HALT,
                halted,
                reason="fatal",
                actor="controller",
                now=clock.now(),
            )
            control_run(
                session,
                ControlKind.PAUSE,
                broken,
                reason="infrastructure failures of 3 distinct items in a row",
                actor="controller",
                now=clock.now(),
            )
        claims = claim_on_n1(factory, worker, clock, slots=8)
        by_run = {c.run_id: c for c in claims}
        first = by_run[unknown_run]
        mark_unknown_one(factory, first, clock, "lease expired", fence=first.fence)
        with db.transaction(factory) as session:
            ledger.mark_worker_lost(
                session, worker, reason="no heartbeat", actor="c", now=clock.now()
            )
        notifier.poll()
        # A run whose last job fails: finished, with 1 failed among its counts.
        finished = make_run(make_config(items=1))
        fresh = register_worker()
        for claim in claim_on_n1(factory, fresh, clock, slots=8):
            if claim.run_id == finished:
                settle_one(factory, claim, fresh, clock, Outcome.FAILED)
        controller = Controller(engine, clock=clock)
        controller.tick()
        controller.beat()
        controller.notifier.stop()
        notifier.poll()
        # A lost controller, told by a worker's notifier.
        watcher = Notifier(
            engine,
            actor="w9",
            option=NotifyConfig(webhook=hook.url + "/hook", on=["controller_lost"]),
            clock=clock,
            watch_controller=True,
            environ=environ,
            backoff_seconds=0.01,
        )
        with db.transaction(factory) as session:
            old = db.ledger_now(session, clock) - timedelta(seconds=40)
            session.execute(update(controllers).values(heartbeat_at=old))
        watcher.poll()
        notifier.stop()
        watcher.stop()
    bodies = hook.bodies()
    seen: dict[str, Any] = {}
    for body in bodies:  # the first of each kind (on PostgreSQL the tick adds more)
        seen.setdefault(body["kind"], body)
    assert set(seen) == {
        "halt",
        "breaker_pause",
        "unknown_outcome",
        "worker_lost",
        "run_finished",
        "controller_lost",
    } | ({"budget_stop"} & set(seen))
    for body in bodies:
        step = body["next_step"]
        assert step is not None and step["command"], body
        assert body["link"].startswith(DASHBOARD + "/"), body
        assert body["link"] != DASHBOARD + "/", body  # a specific page, not the newest run
    assert seen["halt"]["next_step"]["command"].startswith(f"laneway clear-halt {halted} ")
    assert seen["halt"]["link"] == f"{DASHBOARD}/runs/{halted}"
    assert seen["breaker_pause"]["next_step"]["code"] == "breaker"
    assert seen["breaker_pause"]["next_step"]["command"].startswith(f"laneway resume {broken} ")
    unknown = seen["unknown_outcome"]
    assert unknown["reason"] == f"outcome unknown of attempt {first.attempt_id}: lease expired"
    assert unknown["next_step"]["command"].startswith(f"laneway reconcile {first.attempt_id} ")
    assert unknown["link"] == f"{DASHBOARD}/attempts/{first.attempt_id}"
    lost = seen["worker_lost"]
    assert lost["next_step"]["command"].startswith("laneway worker --node n1 --runtime-dir ")
    assert lost["link"].endswith("#workers") and "/runs/" in lost["link"]
    done = [b for b in bodies if b["kind"] == "run_finished" and b["run"] == finished]
    assert done and done[0]["reason"] == f"run {finished} finished: 1 failed"
    assert done[0]["next_step"]["command"].startswith(f"laneway report {finished} ")
    controller = seen["controller_lost"]
    assert controller["next_step"]["command"].startswith("laneway controller --runtime-dir ")
    assert "/runs/" in controller["link"]
