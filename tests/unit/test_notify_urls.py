"""Webhook URLs and header values, checked when a config is loaded
(``config_models.webhook_problem`` / ``header_problem``) and again once their references
are resolved (``notify_delivery.resolved_request``), against a real local receiver:
no whitespace or control character, no ``user:password@``, no CR/LF in a header; what
is recorded (``shown_url``) never shows a netloc's credentials; a value that fails the
check is one failed try whose detail never holds it."""

from __future__ import annotations

import threading
from urllib.parse import urlsplit

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from laneway.controller.config_models import NotifyConfig
from laneway.controller.errors import ConfigError
from laneway.controller.notify import deliver, shown_url
from laneway.controller.notify_delivery import MAX_DETAIL, Lanes, clean_detail
from tests.receiver import receiver
from tests.support import make_config, wait_until

PAYLOAD = {"kind": "halt", "run": 1, "reason": "r", "next_step": None, "link": None}


@pytest.mark.parametrize(
    ("webhook", "problem"),
    [
        ("http://h/a has space", "holds whitespace"),
        ("http://h/a\r\nX-Evil: 1", "holds whitespace"),
        ("http://h/\ttab", "holds whitespace"),
        ("http://h/caf\u00e9", "non-ASCII"),
        ("http://user:hunter2pass@h/x", "holds credentials"),
        ("http://${HOOK_USER}@h/x", "holds credentials"),
        ("http://${A}:${B}@h/x", "holds credentials"),
        ("http://h:99999/x", "its port"),
        ("http:///x", "give a host"),
        ("ftp://h/x", "give an http:// or https:// URL"),
    ],
)
def test_a_webhook_url_is_refused_at_load_naming_the_problem_not_the_value(webhook, problem):
    with pytest.raises(ConfigError) as refused:
        make_config(notify={"webhook": webhook})
    [line] = refused.value.problems
    assert line.startswith("notify.webhook: ") and problem in line
    assert "hunter2pass" not in line


@pytest.mark.parametrize(
    ("name", "value", "problem"),
    [
        ("X-Note", "a\r\nX-Evil: 1", "line break"),
        ("X-Note", "a\nb", "line break"),
        ("X-Note", "bell\x07", "control character"),
        ("X-Note", "\u20ac", "Latin-1"),
        ("Host", "elsewhere.example", "laneway sets it itself"),
        ("content-length", "0", "laneway sets it itself"),
    ],
)
def test_a_header_value_with_a_line_break_is_refused_at_load(name, value, problem):
    with pytest.raises(ValidationError) as refused:
        NotifyConfig(webhook="https://h/x", headers={name: value})
    assert f"headers.{name}" in str(refused.value) and problem in str(refused.value)


def test_a_recorded_url_never_shows_credentials():
    assert shown_url("http://user:pw@h:8/") == "http://h:8/"
    assert shown_url("http://${U}:${P}@h/${PATH}") == "http://h/${PATH}"
    assert shown_url("https://u:p@h/literal/secret") == "https://h/…"


URL_TEXT = st.text(st.characters(codec="utf-8"), max_size=30)


@settings(max_examples=300, deadline=None)
@given(st.sampled_from(["http://", "https://", "HTTP://", "ftp://", ""]), URL_TEXT, URL_TEXT)
def test_any_accepted_webhook_has_no_whitespace_control_or_credentials(scheme, netloc, rest):
    url = f"{scheme}{netloc}/{rest}"
    try:
        NotifyConfig(webhook=url)
    except ValidationError:
        return
    assert all("!" <= c <= "~" for c in url)
    assert "@" not in urlsplit(url).netloc
    shown = shown_url(url)
    assert "@" not in urlsplit(shown).netloc and all("!" <= c <= "~" for c in shown.rstrip("…"))


@settings(max_examples=300, deadline=None)
@given(st.text(max_size=40))
def test_any_accepted_header_value_has_no_line_break(value):
    try:
        NotifyConfig(webhook="https://h/x", headers={"X-Note": value})
    except ValidationError:
        return
    assert "\r" not in value and "\n" not in value and "\0" not in value


def _one_try(config: NotifyConfig, environ: dict[str, str]) -> tuple[bool, str]:
    recorded: list[tuple[bool, str]] = []
    deliver(
        config,
        PAYLOAD,
        lambda _c, _t, _n, ok, detail: recorded.append((ok, detail)),
        environ=environ,
    )
    assert len(recorded) == 1  # retries=0: one try, always recorded, never raised
    return recorded[0]


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.text(st.characters(codec="utf-8", exclude_characters="\0"), min_size=4, max_size=24))
def test_a_resolved_path_or_header_is_checked_again_and_never_recorded(value):
    """Whatever a reference resolves to: one try, recorded; the value (a secret) is not
    in its detail; a value the checks refuse never reaches the receiver."""
    with receiver() as hook:
        path = NotifyConfig(webhook=hook.url + "/p/${HOOK_PATH}", retries=0)
        ok, detail = _one_try(path, {"HOOK_PATH": value})
        header = NotifyConfig(
            webhook=hook.url + "/h", headers={"X-Token": "${HOOK_TOKEN}"}, retries=0
        )
        ok_header, header_detail = _one_try(header, {"HOOK_TOKEN": value})
    for detail_of in (detail, header_detail):
        assert value not in detail_of and len(detail_of) <= MAX_DETAIL
    sent = [r.path for r in hook.requests if r.path.startswith("/p/")]
    if all("!" <= c <= "~" for c in value):
        assert ok and len(sent) == 1
    else:
        assert not ok and sent == [] and "webhook, its references resolved" in detail
    if any((c < " " and c != "\t") or c == "\x7f" or c > "\xff" for c in value):
        assert not ok_header and "headers.X-Token, its references resolved" in header_detail
    else:
        assert ok_header


def test_a_detail_is_redacted_before_it_is_cut_and_holds_no_control_character():
    secret = "sk-live-0123456789"
    text = "x" * (MAX_DETAIL - 5) + secret + "\0\x1b[2J\r\n\u2028more"
    detail = clean_detail(text, [secret])
    assert secret[:5] not in detail[-10:] and len(detail) <= MAX_DETAIL
    assert clean_detail("a\0b\x1b[31mc\r\nd \ud800 e", []) == "a b [31mc d \ufffd e"
    assert clean_detail("tok \ud800abcd end", ["\ud800abcd"]) == "tok [REDACTED] end"


def test_lanes_run_each_key_in_order_and_never_wait_for_one_another():
    lanes = Lanes(on_error=lambda exc: errors.append(exc))
    errors: list[BaseException] = []
    held = threading.Event()
    order: list[str] = []
    lanes.submit("slow", lambda: held.wait(60))
    lanes.submit("slow", lambda: order.append("slow-2"))
    for i in range(3):
        lanes.submit("fast", lambda i=i: order.append(f"fast-{i}"))
    lanes.submit("boom", lambda: 1 / 0)
    wait_until(lambda: len(order) == 3)
    assert order == ["fast-0", "fast-1", "fast-2"]  # while "slow" is still held
    held.set()
    assert lanes.wait_idle(60)
    assert order[-1] == "slow-2" and [type(e) for e in errors] == [ZeroDivisionError]
