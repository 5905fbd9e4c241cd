"""Telling the operator, without a ledger: which events begin an attention state
(``notices_from``), the ``notify`` config section's checks, and one delivery (bounded
retries, what each try recorded, secrets redacted) against a real local HTTP receiver
and a real command."""

from __future__ import annotations

import json
import sys
from datetime import datetime
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from laneway.controller.config_models import NotifyConfig
from laneway.controller.notify import deliver, notices_from
from laneway.controller.states import Attention
from laneway.controller.usage import BUDGET_SPENT
from tests.receiver import receiver

AT = datetime(2026, 1, 1)


def event(event_id: int, kind: str, *, actor: str = "controller", run_id: int | None = 1, **d):
    attempt_id = d.pop("attempt_id", None)
    return SimpleNamespace(
        id=event_id, at=AT, run_id=run_id, attempt_id=attempt_id, kind=kind, actor=actor, detail=d
    )


def test_each_attention_state_begins_with_its_event_and_an_operators_own_control_is_no_news():
    rows = [
        event(1, "control_halt", reason="frozen sources changed: a.py"),
        event(2, "control_halt", actor="ann@box", reason="looking"),
        event(3, "control_pause", reason=f"{BUDGET_SPENT}: cost_usd 2.5 of 2.6"),
        event(4, "control_pause", reason="infrastructure failures of 3 distinct items"),
        event(5, "control_pause", actor="ann@box", reason="lunch"),
        event(6, "attempt_unknown", attempt_id=7, reason="lease expired"),
        event(7, "job_succeeded"),
        event(8, "attempt_unknown", attempt_id=9, reason="lease expired"),
        event(9, "worker_lost", run_id=None, worker="n1-1-ab", reason="no heartbeat"),
        event(10, "run_finished"),
        event(11, "attempt_unknown", run_id=2, attempt_id=12, reason="supervisor gone"),
    ]
    notices = notices_from(rows)
    assert [(n.kind, n.key, n.run_id) for n in notices] == [
        (Attention.HALT, "halt:event:1", 1),
        (Attention.BUDGET_STOP, "budget_stop:event:3", 1),
        (Attention.BREAKER_PAUSE, "breaker_pause:event:4", 1),
        (Attention.WORKER_LOST, "worker_lost:event:9", None),
        (Attention.RUN_FINISHED, "run_finished:event:10", 1),
        # One per run and batch, naming every unknown attempt, linked to the first.
        (Attention.UNKNOWN_OUTCOME, "unknown_outcome:event:6", 1),
        (Attention.UNKNOWN_OUTCOME, "unknown_outcome:event:11", 2),
    ]
    assert notices[5].reason == "outcome unknown of attempts 7, 9: lease expired"
    assert notices[5].attempt_id == 7
    assert notices[3].reason == "worker n1-1-ab lost: no heartbeat"


@pytest.mark.parametrize(
    ("section", "problem"),
    [
        ({}, "give a webhook URL, a command, or both"),
        ({"webhook": "ftp://x/y"}, "give an http:// or https:// URL"),
        ({"webhook": "https://h/x?token=sk-abcdefghijklmnopqrstu"}, "literal credential"),
        (
            {"webhook": "https://h/x", "headers": {"Authorization": "Bearer abcdefgh12345678"}},
            "headers.Authorization: looks like a credential",
        ),
        ({"webhook": "https://h/x", "headers": {"X-Api-Key": "abc123"}}, "headers.X-Api-Key"),
        ({"command": ["notify-send", "${TOKEN}"]}, "command.1: no secrets"),
        ({"webhook": "https://h/x", "on": ["lunch"]}, "on.0"),
        ({"webhook": "https://h/x", "retries": 11}, "retries"),
    ],
)
def test_a_bad_notify_section_is_refused_naming_the_field(section, problem):
    with pytest.raises(ValidationError) as refused:
        NotifyConfig.model_validate(section)
    assert problem in str(refused.value)


def test_a_good_notify_section_references_its_secrets():
    config = NotifyConfig.model_validate(
        {
            "webhook": "https://hooks.example/${HOOK_PATH}",
            "headers": {"Authorization": "Bearer ${HOOK_TOKEN}"},
            "command": ["notify-send", "laneway"],
            "on": ["halt", "run_finished"],
        }
    )
    assert config.on == [Attention.HALT, Attention.RUN_FINISHED]
    assert config.retries == 4


@settings(max_examples=200, deadline=None)
@given(st.dictionaries(st.text(max_size=20), st.text(max_size=40), max_size=4), st.text())
def test_any_headers_and_url_are_taken_or_refused_never_crash(headers, url):
    try:
        NotifyConfig.model_validate({"webhook": url, "headers": headers})
    except ValidationError:
        pass  # refused with its field's message: the property is "no other exception"


def tries() -> tuple[list[tuple[str, int, bool, str]], Any]:
    recorded: list[tuple[str, int, bool, str]] = []

    def record(channel: str, target: str, number: int, ok: bool, detail: str) -> None:
        recorded.append((channel, number, ok, detail))

    return recorded, record


PAYLOAD = {"kind": "halt", "run": 1, "reason": "r", "next_step": None, "link": None}


def test_transient_answers_are_tried_again_each_try_recorded_and_the_secret_never_shown():
    token = "s3cr3t-t0ken-value"
    with receiver([500, 503], reason=f"busy {token}") as hook:
        config = NotifyConfig(
            webhook=hook.url + "/hook/${HOOK_TOKEN}",
            headers={"Authorization": "Bearer ${HOOK_TOKEN}"},
        )
        recorded, record = tries()
        ok = deliver(config, PAYLOAD, record, environ={"HOOK_TOKEN": token}, sleep=lambda _s: None)
    assert ok is True
    assert [(c, n, good) for c, n, good, _ in recorded] == [
        ("webhook", 1, False),
        ("webhook", 2, False),
        ("webhook", 3, True),
    ]
    assert recorded[0][3] == "HTTP 500 busy [REDACTED]"  # the answer echoed the token
    assert recorded[2][3] == "HTTP 204"
    assert [r.path for r in hook.requests] == [f"/hook/{token}"] * 3
    assert hook.requests[0].headers["Authorization"] == f"Bearer {token}"
    assert hook.requests[0].body == PAYLOAD


def test_a_refusal_is_not_tried_again_and_the_retries_are_bounded():
    with receiver([400]) as hook:
        recorded, record = tries()
        ok = deliver(NotifyConfig(webhook=hook.url), PAYLOAD, record, environ={})
    assert ok is False and [(n, good) for _, n, good, _ in recorded] == [(1, False)]
    with receiver([500] * 10) as hook:
        recorded, record = tries()
        config = NotifyConfig(webhook=hook.url, retries=2)
        ok = deliver(config, PAYLOAD, record, environ={}, sleep=lambda _s: None)
    assert ok is False and len(recorded) == 3 and len(hook.requests) == 3


def test_an_unset_reference_and_an_unreachable_receiver_are_recorded_not_raised():
    recorded, record = tries()
    config = NotifyConfig(webhook="http://127.0.0.1:9/${MISSING_TOKEN}", retries=1)
    assert deliver(config, PAYLOAD, record, environ={}, sleep=lambda _s: None) is False
    assert recorded == [
        (
            "webhook",
            1,
            False,
            "${MISSING_TOKEN} is not set in the notifying process's environment; set it "
            "where laneway controller / laneway run / laneway worker starts",
        )
    ]
    recorded, record = tries()
    config = NotifyConfig(webhook="http://127.0.0.1:9/", retries=1)
    assert deliver(config, PAYLOAD, record, environ={}, sleep=lambda _s: None) is False
    assert [(n, good) for _, n, good, _ in recorded] == [(1, False), (2, False)]
    assert "refused" in recorded[0][3].lower()


def test_the_command_gets_the_notification_on_stdin_and_a_clean_environment(tmp_path: Path):
    out = tmp_path / "got.json"
    code = (
        "import json, os, sys; "
        f"open({str(out)!r}, 'w').write(json.dumps({{'stdin': json.load(sys.stdin), "
        "'env': {k: v for k, v in os.environ.items() if k.startswith(('LANEWAY', 'HOOK', 'X'))}}))"
    )
    config = NotifyConfig(command=[sys.executable, "-c", code], pass_env=["HOOK_TOKEN"])
    recorded, record = tries()
    environ = {"PATH": "/usr/bin:/bin", "HOOK_TOKEN": "tok-12345", "X_UNRELATED": "no"}
    payload = {**PAYLOAD, "next_step": {"command": "laneway clear-halt 1"}}
    assert deliver(config, payload, record, environ=environ) is True
    got = json.loads(out.read_text())
    assert got["stdin"] == payload
    assert got["env"] == {
        "HOOK_TOKEN": "tok-12345",
        "LANEWAY_NOTIFY_KIND": "halt",
        "LANEWAY_NOTIFY_RUN": "1",
        "LANEWAY_NOTIFY_REASON": "r",
        "LANEWAY_NOTIFY_COMMAND": "laneway clear-halt 1",
        "LANEWAY_NOTIFY_LINK": "",
    }
    assert recorded == [("command", 1, True, "exit 0")]


def test_a_failing_command_is_retried_and_its_stderr_redacted():
    code = "import os, sys; sys.exit('no route for ' + os.environ['HOOK_TOKEN'])"
    config = NotifyConfig(command=[sys.executable, "-c", code], pass_env=["HOOK_TOKEN"], retries=1)
    recorded, record = tries()
    environ = {"HOOK_TOKEN": "tok-12345"}
    assert deliver(config, PAYLOAD, record, environ=environ, sleep=lambda _s: None) is False
    assert recorded == [
        ("command", 1, False, "exit 1: no route for [REDACTED]"),
        ("command", 2, False, "exit 1: no route for [REDACTED]"),
    ]
    recorded, record = tries()
    missing = NotifyConfig(command=["/nonexistent/notify"], retries=3)
    assert deliver(missing, PAYLOAD, record, environ={}) is False
    assert [(n, good) for _, n, good, _ in recorded] == [(1, False)]  # not retried


def test_a_webhook_is_recorded_without_a_literal_path_which_may_be_its_secret():
    from laneway.controller.notify import shown_url

    assert shown_url("https://hooks.example") == "https://hooks.example"
    assert shown_url("https://hooks.example/${HOOK_PATH}") == "https://hooks.example/${HOOK_PATH}"
    assert shown_url("https://hooks.example/services/T0/B0/XyZ") == "https://hooks.example/…"
    assert shown_url("http://h:8/x?token=abc") == "http://h:8/…"
