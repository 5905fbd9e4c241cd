"""Telling the operator: the ``notify`` table (a webhook and/or a command) and the checks
its URL and headers get, here when a config is loaded and again once their references are
resolved (controller/notify_delivery.py)."""

from __future__ import annotations

import re
from typing import Annotated
from urllib.parse import urlsplit

from pydantic import AfterValidator, Field, model_validator

from laneway.controller.config_fields import (
    ENV_NAME_PATTERN,
    ENV_REF,
    SECRET_LITERAL,
    SECRET_NAME,
    Finite,
    LedgerInt,
    Strict,
    Text,
    check_text,
)
from laneway.controller.states import Attention

RESERVED_HEADERS = frozenset({"host", "content-length", "transfer-encoding", "connection"})
"""Headers laneway sets itself on a webhook's POST: a config cannot replace them."""


def webhook_problem(url: str) -> str | None:
    """What is wrong with a webhook URL as it is sent (its references resolved), None
    if nothing: an http(s) URL of printable ASCII (no whitespace or control character),
    with a host, a numeric port if any, and no ``user:password@`` (credentials go in a
    header, ``Authorization = "Bearer ${TOKEN}"``, where they are redacted)."""
    if not all("!" <= c <= "~" for c in url):
        return (
            "holds whitespace, a control or a non-ASCII character; percent-encode it "
            "(a space is %20)"
        )
    match = re.match(r"\A([A-Za-z][A-Za-z0-9+.-]*)://([^/?#]*)", url)
    if match is None or match.group(1).lower() not in ("http", "https"):
        return "give an http:// or https:// URL"
    netloc = match.group(2)
    try:
        urlsplit(url)
    except ValueError:
        return "its host does not parse: give a name, an IPv4 address or [an IPv6 address]"
    if "@" in netloc:
        return (
            "holds credentials (user:password@host); send them in a header instead, "
            'e.g. headers.Authorization = "Bearer ${HOOK_TOKEN}"'
        )
    host, port = netloc, ""
    if ":" in netloc and not netloc.endswith("]"):
        host, _, port = netloc.rpartition(":")
    if not host:
        return "give a host after http(s)://"
    if port and not ENV_REF.search(netloc) and not (port.isdigit() and 0 < int(port) < 65536):
        return "its port: give a number from 1 to 65535"
    return None


def header_problem(value: str) -> str | None:
    """What is wrong with a header value as it is sent, None if nothing: no line break or
    other control character (a CR/LF would start a header of its own), Latin-1 text."""
    if any((c < " " and c != "\t") or c == "\x7f" for c in value):
        return "holds a line break or a control character; remove it"
    if any(c > "\xff" for c in value):
        return "holds a character outside Latin-1, which a header cannot carry"
    return None


def _webhook(value: str) -> str:
    """An http(s) URL (``webhook_problem``); ``${NAME}`` references (a token in the
    path) are resolved by the notifying process from its environment, and checked again
    once resolved (controller/notify_delivery.py)."""
    check_text(value)
    problem = webhook_problem(ENV_REF.sub("x", value))  # a reference stands for a word
    if problem:
        raise ValueError(problem)
    if SECRET_LITERAL.search(value):
        raise ValueError("holds a literal credential; reference it as ${ENV_NAME}")
    return value


class NotifyConfig(Strict):
    """Tell the operator when the run needs them (controller/notify.py): a webhook and/or a
    command, called once per new attention state with the reason, the next step and a
    dashboard link. Secrets only as ``${NAME}`` references in ``webhook`` and ``headers``,
    resolved from the notifying process's environment and redacted wherever recorded."""

    webhook: Annotated[str, AfterValidator(_webhook)] | None = Field(
        None, description="POSTed one JSON object per notification (2xx = delivered)."
    )
    headers: dict[Annotated[str, Field(pattern=r"^[A-Za-z0-9-]{1,64}$")], Text] = Field(
        default_factory=dict,
        description='Extra request headers, e.g. Authorization = "Bearer ${HOOK_TOKEN}".',
    )
    command: list[Text] | None = Field(
        None,
        min_length=1,
        description="argv run without a shell, the notification as JSON on stdin and in "
        "LANEWAY_NOTIFY_* variables (exit 0 = delivered).",
    )
    pass_env: list[Annotated[str, Field(pattern=ENV_NAME_PATTERN)]] = Field(
        default_factory=list,
        description="Variables the command gets from the notifier's environment.",
    )
    on: list[Attention] = Field(
        default_factory=lambda: list(Attention), description="Which attention states to tell."
    )
    retries: LedgerInt = Field(4, ge=0, le=10, description="Tries after the first, with backoff.")
    timeout_seconds: Finite = Field(10.0, gt=0, le=120, description="Per try.")

    @model_validator(mode="after")
    def _check(self) -> NotifyConfig:
        problems = []
        if self.webhook is None and self.command is None:
            problems.append("give a webhook URL, a command, or both")
        for name, value in self.headers.items():
            if name.lower() in RESERVED_HEADERS:
                problems.append(f"headers.{name}: laneway sets it itself; remove it")
            problem = header_problem(value)
            if problem:
                problems.append(f"headers.{name}: {problem}")
            if SECRET_NAME.search(name.replace("-", "_")) or SECRET_LITERAL.search(value):
                if not ENV_REF.search(value) or SECRET_LITERAL.search(value):
                    problems.append(
                        f"headers.{name}: looks like a credential; reference it as "
                        "${ENV_NAME} from the notifying process's environment"
                    )
        for i, value in enumerate(self.command or []):
            if ENV_REF.search(value) or SECRET_LITERAL.search(value):
                problems.append(
                    f"command.{i}: no secrets or ${{...}} in argv (visible in the process "
                    "list); pass them with pass_env"
                )
        if problems:
            raise ValueError("\n".join(problems))
        return self
