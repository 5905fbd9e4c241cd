"""Notifications at the edges (controller/notify_delivery.py, controller/notify_command.py),
on both backends, with real receivers and real processes: a try that ends (a receiver
that drips or hangs is given up on at a wall-clock deadline) and delays no other
receiver's notification; a redirect is a recorded failure and its host gets nothing;
whatever a try meets (a URL that cannot be sent, a garbage answer, a NUL in an answer
or in stderr) is one recorded, redacted try, never a pending row with none; a command
that backgrounds a child is delivered once and leaves nothing running; a ``laneway run``
whose webhook resolves to a URL with a space logs its secret nowhere."""

from __future__ import annotations

import json
import os
import resource
import sys
from pathlib import Path
from typing import Any

import psutil
import pytest
from sqlalchemy import select, text

from laneway.controller import db, ledger
from laneway.controller.config_models import NotifyConfig
from laneway.controller.models import Notification, NotificationDelivery
from laneway.controller.notify import Notifier, deliver
from laneway.controller.notify_delivery import MAX_DETAIL
from laneway.controller.states import ControlKind
from tests.integration.test_cli_services import config_file, finish, spawn
from tests.receiver import receiver
from tests.support import control_run, make_config, wait_until

TOKEN = "tok-5ecret-98765"


def notifications(factory) -> list[tuple[int | None, str]]:
    with factory() as session:
        rows = session.scalars(select(Notification).order_by(Notification.id))
        return [(n.run_id, n.state.value) for n in rows]


def tries(factory) -> list[tuple[str, int, bool, str]]:
    with factory() as session:
        rows = session.scalars(select(NotificationDelivery).order_by(NotificationDelivery.id))
        return [(d.channel, d.try_number, d.ok, d.detail) for d in rows]


def notifier_of(engine, clock, option: NotifyConfig | None, **kwargs: Any) -> Notifier:
    """A controller's notifier following the event log from now."""
    notifier = Notifier(
        engine, actor="controller", option=option, clock=clock, backoff_seconds=0.01, **kwargs
    )
    with db.reader(engine)() as session:
        notifier.follow(ledger.latest_event_id(session))
    return notifier


def halt(factory, clock, run_id: int) -> None:
    with db.transaction(factory) as session:
        control_run(
            session, ControlKind.HALT, run_id, reason="fatal", actor="controller", now=clock.now()
        )


def not_running(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def test_a_dripping_receiver_delays_no_other_channels_notification(
    engine, factory, make_run, clock
):
    with receiver(drip=0.05) as drip, receiver() as good:
        slow = make_run(
            make_config(notify={"webhook": drip.url + "/slow", "retries": 0, "timeout_seconds": 60})
        )
        other = make_run(make_config(notify={"webhook": good.url + "/other"}))
        seen_dripping: list[bool] = []
        good.on_arrival.append(lambda: seen_dripping.append(drip.dripping.is_set()))
        notifier = notifier_of(engine, clock, None)
        halt(factory, clock, slow)  # first: one thread delivering in order would drip on
        notifier.start()
        try:
            # A handshake, not a race: the other run's halt happens once the first one's
            # answer has begun to drip (each receiver's thread starts on its own).
            wait_until(drip.dripping.is_set)
            halt(factory, clock, other)
            wait_until(lambda: good.requests)
            # The other run's halt arrived while the first one's answer was dripping.
            assert seen_dripping == [True]
            assert wait_until(lambda: dict(notifications(factory)).get(other) == "delivered")
        finally:
            drip.done.set()  # the drip ends: the server closes, the try ends
            notifier.stop()
    # The dripping one ended too, either way (its 204 status line came whole; whether the
    # header block's cut end is read as its end depends on when the close lands).
    ended = dict(notifications(factory))
    assert ended[other] == "delivered" and ended[slow] in ("failed", "delivered"), ended


@pytest.mark.parametrize("hostile", [{"drip": 0.02}, {"hang": True}])
def test_a_try_has_a_wall_clock_deadline_not_a_per_read_one(
    engine, factory, make_run, clock, hostile
):
    with receiver(**hostile) as slow:
        run_id = make_run(make_config(items=1))
        option = NotifyConfig(webhook=slow.url + "/x", retries=0, timeout_seconds=1)
        notifier = notifier_of(engine, clock, option)
        halt(factory, clock, run_id)
        notifier.poll()  # returns once the try ended: at its deadline
        assert notifications(factory) == [(run_id, "failed")]
        assert tries(factory) == [("webhook", 1, False, "no answer within 1 s")]
        if "drip" in hostile:
            assert slow.dripped > 2  # many reads, each answered in time: the try still ended


@pytest.mark.parametrize("code", [301, 302, 303, 307, 308])
def test_a_redirect_is_a_recorded_failure_and_the_token_reaches_no_other_host(
    engine, factory, make_run, clock, code
):
    with receiver(host="127.0.0.2") as elsewhere:
        with receiver([code], location=elsewhere.url + "/landed") as hook:
            run_id = make_run(make_config(items=1))
            option = NotifyConfig(
                webhook=hook.url + "/hook", headers={"Authorization": "Bearer ${HOOK_TOKEN}"}
            )
            notifier = notifier_of(engine, clock, option, environ={"HOOK_TOKEN": TOKEN})
            halt(factory, clock, run_id)
            notifier.poll()
    assert len(hook.requests) == 1 and hook.requests[0].headers["Authorization"].endswith(TOKEN)
    assert elsewhere.requests == []
    assert notifications(factory) == [(run_id, "failed")]
    [(channel, number, ok, detail)] = tries(factory)  # not tried again
    assert (channel, number, ok) == ("webhook", 1, False)
    assert detail.startswith(f"HTTP {code} Scripted: a redirect, not followed")


def test_a_redirect_to_another_scheme_is_not_followed_either():
    recorded: list[tuple[bool, str]] = []
    with receiver([302], location="ftp://127.0.0.1:9/x") as hook:
        ok = deliver(
            NotifyConfig(webhook=hook.url),
            {"kind": "halt"},
            lambda _c, _t, _n, good, detail: recorded.append((good, detail)),
            environ={},
        )
    assert ok is False and len(recorded) == 1 and "not followed" in recorded[0][1]


def test_a_reference_that_resolves_to_a_space_is_a_failed_try_and_no_log_holds_it(
    engine, factory, make_run, clock
):
    secret = "has space pathSECRET4711"
    errors: list[str] = []
    with receiver() as hook:
        run_id = make_run(make_config(items=1))
        option = NotifyConfig(webhook=hook.url + "/a/${HOOK_PATH}")
        notifier = notifier_of(engine, clock, option, environ={"HOOK_PATH": secret})
        notifier.on_error = errors.append
        halt(factory, clock, run_id)
        notifier.poll()
    assert hook.requests == []
    assert notifications(factory) == [(run_id, "failed")]  # not pending: a try was recorded
    [(_, _, ok, detail)] = tries(factory)  # refused, not tried again
    assert not ok
    assert detail == (
        "webhook, its references resolved: holds whitespace, a control or a non-ASCII "
        "character; percent-encode it (a space is %20) (check the value of ${HOOK_PATH})"
    )
    assert errors == []


@pytest.mark.parametrize(
    ("hostile", "starts"),
    [
        ({"raw": b"SPAM\r\n\r\n"}, "BadStatusLine: "),
        ({"raw": b"HTTP/1.1 200 OK\r\nX-Long: " + b"a" * 70000 + b"\r\n\r\n"}, "LineTooLong: "),
        ({"answers": [500, 500], "reason": f"no\x00way\x1b[2J\r {TOKEN}"}, "HTTP 500 no way [2J"),
    ],
)
def test_whatever_an_answer_holds_is_one_recorded_redacted_try_on_both_backends(
    engine, factory, make_run, clock, hostile, starts
):
    with receiver(**hostile) as hook:
        run_id = make_run(make_config(items=1))
        option = NotifyConfig(webhook=hook.url, headers={"X-Token": "${HOOK_TOKEN}"}, retries=1)
        notifier = notifier_of(engine, clock, option, environ={"HOOK_TOKEN": TOKEN})
        halt(factory, clock, run_id)
        notifier.poll()
    assert notifications(factory) == [(run_id, "failed")]
    recorded = tries(factory)
    assert [(n, ok) for _, n, ok, _ in recorded] == [(1, False), (2, False)]
    for _, _, _, detail in recorded:
        assert detail.startswith(starts), detail
        assert TOKEN not in detail and len(detail) <= MAX_DETAIL
        assert not any(c < " " or c in "\x7f\u2028" for c in detail)


def test_an_answer_whose_body_never_ends_is_delivered_without_reading_it(
    engine, factory, make_run, clock
):
    with receiver([200], huge_body=True) as hook:
        run_id = make_run(make_config(items=1))
        notifier = notifier_of(engine, clock, NotifyConfig(webhook=hook.url, timeout_seconds=30))
        halt(factory, clock, run_id)
        notifier.poll()
    assert notifications(factory) == [(run_id, "delivered")]
    assert tries(factory) == [("webhook", 1, True, "HTTP 200")]


def _command(tmp_path: Path, code: str, **section: Any) -> NotifyConfig:
    script = tmp_path / "notify_cmd.py"
    script.write_text(code)
    return NotifyConfig(command=[sys.executable, str(script)], **section)


def test_a_command_that_backgrounds_a_child_is_delivered_once_and_leaves_nothing_running(
    engine, factory, make_run, clock, tmp_path
):
    got, pid_file = tmp_path / "got.jsonl", tmp_path / "child.pid"
    option = _command(
        tmp_path,
        "import subprocess, sys\n"
        # The child inherits stderr and outlives the command: it holds the pipe open.
        "child = subprocess.Popen(['sleep', '45'])\n"
        f"open({str(pid_file)!r}, 'w').write(str(child.pid))\n"
        f"open({str(got)!r}, 'a').write(sys.stdin.read() + chr(10))\n",
        timeout_seconds=30,
    )
    run_id = make_run(make_config(items=1))
    notifier = notifier_of(engine, clock, option)
    halt(factory, clock, run_id)
    notifier.poll()
    assert notifications(factory) == [(run_id, "delivered")]
    assert tries(factory) == [("command", 1, True, "exit 0")]
    assert [json.loads(line)["kind"] for line in got.read_text().splitlines()] == ["halt"]
    assert not_running(int(pid_file.read_text()))


def test_a_command_past_its_deadline_has_its_whole_group_stopped(
    engine, factory, make_run, clock, tmp_path
):
    pid_file = tmp_path / "child.pid"
    option = _command(
        tmp_path,
        "import os, subprocess, sys\n"
        "child = subprocess.Popen(['sleep', '45'])\n"
        f"open({str(pid_file)!r}, 'w').write(f'{{os.getpid()}} {{child.pid}}')\n"
        "child.wait()\n",
        timeout_seconds=1,
        retries=0,
    )
    run_id = make_run(make_config(items=1))
    notifier = notifier_of(engine, clock, option)
    halt(factory, clock, run_id)
    notifier.poll()
    assert notifications(factory) == [(run_id, "failed")]
    assert tries(factory) == [
        ("command", 1, False, "timed out after 1 s (its process group was stopped)")
    ]
    assert all(not_running(int(pid)) for pid in pid_file.read_text().split())


def test_a_commands_stderr_is_read_with_a_bound_and_a_nul_in_it_recorded(
    engine, factory, make_run, clock, tmp_path
):
    big = 300 << 20
    option = _command(
        tmp_path,
        "import os, sys\n"
        "chunk = b'x' * (1 << 20) + b'\\n'\n"
        f"for _ in range({big >> 20}): sys.stderr.buffer.write(chunk)\n"
        "sys.stderr.buffer.write(b'no route\\x00 for ' + os.environ['HOOK_TOKEN'].encode()"
        " + b' \\x1b[31m\\n')\n"
        "sys.exit(3)\n",
        pass_env=["HOOK_TOKEN"],
        retries=0,
    )
    run_id = make_run(make_config(items=1))
    notifier = notifier_of(engine, clock, option, environ={"HOOK_TOKEN": TOKEN})
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    halt(factory, clock, run_id)
    notifier.poll()
    grew_mib = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) / 1024
    assert grew_mib < 100  # 300 MiB of stderr went through, a few KiB of it kept
    assert notifications(factory) == [(run_id, "failed")]  # recorded, on PostgreSQL too
    assert tries(factory) == [("command", 1, False, "exit 3: no route for [REDACTED] [31m")]


def test_with_no_one_to_tell_an_outage_is_not_a_notify_error_and_one_names_its_reason(
    tmp_path,
):
    away = db.make_engine(f"sqlite:///{tmp_path / 'no-such-dir' / 'ledger.db'}")
    told: list[str] = []
    quiet = Notifier(away, actor="w1")
    quiet.on_error = told.append
    loud = Notifier(away, actor="w2", option=NotifyConfig(webhook="http://127.0.0.1:9/"))
    loud.on_error = told.append
    for notifier in (quiet, loud):
        notifier.start()
    try:
        wait_until(lambda: quiet.last_error and loud.last_error)
    finally:
        for notifier in (quiet, loud):
            notifier.stop(0.0)
        away.dispose()
    [line] = told  # the loud one's only: the quiet one has no one to tell
    assert line.startswith("notifier: OperationalError: ") and "unable to open" in line


def test_laneway_run_with_a_webhook_that_resolves_to_a_space_logs_its_secret_nowhere(tmp_path):
    secret = "has space pathSECRET4711"
    with receiver() as hook:
        notify = {"webhook": hook.url + "/a/${HOOK_PATH}", "retries": 0}
        runtime = tmp_path / "rt"
        env = {**os.environ, "HOOK_PATH": secret}
        done = spawn(
            "run",
            str(config_file(tmp_path, items=1, notify=notify)),
            "--runtime-dir",
            str(runtime),
            "--json",
            env=env,
        )
        code, out, err = finish(done)
    assert code == 0, err
    assert hook.requests == []
    for where, words in [("stdout", out), ("stderr", err)] + [
        (str(path), path.read_bytes().decode("utf-8", "replace"))
        for path in runtime.rglob("*")
        if path.is_file()
    ]:
        assert "SECRET4711" not in words, where
    from laneway.controller import ledger_open

    engine = ledger_open.open_existing_ledger(runtime)
    try:
        with engine.connect() as connection:
            rows = connection.execute(
                text("SELECT ok, detail FROM notification_deliveries ORDER BY id")
            ).all()
            states = connection.execute(text("SELECT state FROM notifications")).scalars().all()
    finally:
        engine.dispose()
    assert states == ["failed"]
    assert [tuple(r) for r in rows] == [
        (
            False,
            "webhook, its references resolved: holds whitespace, a control or a non-ASCII "
            "character; percent-encode it (a space is %20) (check the value of ${HOOK_PATH})",
        )
    ]
