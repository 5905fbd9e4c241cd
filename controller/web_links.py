"""The dashboard's addresses: one path per run, job, attempt and explain, built here for
the page (``web.py`` serves the page at each, ``route`` reads one back) and for the CLI
(``laneway status``, ``explain`` and ``logs`` print ``link: URL`` when ``LANEWAY_WEB_URL``
names the dashboard).

The scheme (each name part URL-quoted, so any item key survives a paste)::

    /runs/RUN                      the run
    /runs/RUN/jobs/ITEM.STAGE      a job (or /runs/RUN/jobs/JOB_ID)
    /runs/RUN/explain/ITEM.STAGE   what blocks that job (the same page, explain named)
    /attempts/ATTEMPT              an attempt: its details and log tails

A stage name has no dot, so ``ITEM.STAGE`` splits at its last dot; a segment of digits
only is a job id. Standard library only (and ``errors``, floor 0): ``status`` imports it.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from urllib.parse import quote, unquote, urlsplit

from laneway.controller.errors import UsageError

ENV = "LANEWAY_WEB_URL"
"""The environment variable naming the dashboard's address, e.g. ``http://host:8470``."""

_ID = re.compile(r"\A[1-9][0-9]{0,18}\Z")


def _part(value: str) -> str:
    return quote(value, safe="")


def _job(item: str, stage: str) -> str:
    return f"{_part(item)}.{_part(stage)}"


def run_path(run_id: int) -> str:
    return f"/runs/{int(run_id)}"


def job_path(run_id: int, item: str, stage: str) -> str:
    return f"{run_path(run_id)}/jobs/{_job(item, stage)}"


def explain_path(run_id: int, item: str, stage: str) -> str:
    return f"{run_path(run_id)}/explain/{_job(item, stage)}"


def attempt_path(attempt_id: int) -> str:
    return f"/attempts/{int(attempt_id)}"


@dataclass(frozen=True)
class Route:
    """What a page path names: ``kind`` is ``run``, ``job``, ``explain`` or ``attempt``;
    ``job`` is ``ITEM.STAGE`` (unquoted) or a job id's digits."""

    kind: str
    run_id: int | None = None
    job: str | None = None
    attempt_id: int | None = None


def route(path: str) -> Route | None:
    """The thing a request path (as sent: quoted, no query) names, or None when the path
    is not one of the scheme's (the server answers 404)."""
    parts = path.split("/")
    if parts[0] != "" or any(p == "" for p in parts[1:]):
        return None
    parts = parts[1:]
    if len(parts) == 2 and parts[0] == "attempts" and _ID.match(parts[1]):
        return Route("attempt", attempt_id=int(parts[1]))
    if len(parts) < 2 or parts[0] != "runs" or not _ID.match(parts[1]):
        return None
    run_id = int(parts[1])
    if len(parts) == 2:
        return Route("run", run_id=run_id)
    if len(parts) == 4 and parts[2] in ("jobs", "explain"):
        try:
            job = unquote(parts[3], errors="strict")
        except UnicodeDecodeError:
            return None
        item, dot, stage = job.rpartition(".")
        if _ID.match(job) or (dot and item and stage):
            return Route("job" if parts[2] == "jobs" else "explain", run_id=run_id, job=job)
    return None


def base_url(environ: Mapping[str, str] | None = None) -> str | None:
    """The dashboard's address from ``LANEWAY_WEB_URL`` (no trailing slash), None when it
    is unset or empty; UsageError (one line, naming the variable) when it is not an
    ``http(s)://HOST[:PORT]`` address."""
    value = (os.environ if environ is None else environ).get(ENV, "").strip()
    if not value:
        return None
    fix = f"{ENV}={value!r}: give the dashboard's address, e.g. http://host:8470"
    try:
        parts = urlsplit(value)
        parts.port  # noqa: B018 - raises ValueError on a port that is no number
    except ValueError:
        raise UsageError(fix) from None
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise UsageError(fix)
    if parts.path not in ("", "/") or parts.query or parts.fragment:
        raise UsageError(fix + " (the dashboard serves from /: no path, query or fragment)")
    return f"{parts.scheme}://{parts.netloc}"


def link(path: str, environ: Mapping[str, str] | None = None) -> str | None:
    """``path`` on the dashboard named by ``LANEWAY_WEB_URL``; None when it is unset."""
    base = base_url(environ)
    return None if base is None else base + path
