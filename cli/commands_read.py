"""Commands that read the ledger: `status`, `runs`, `explain`, `report`, `artifacts`,
`logs`, `sql`.

Each parses, calls one read function below the CLI and renders; none writes the ledger.
`status`, `sql` and `--help` must not import SQLAlchemy, so heavy modules are imported
inside the commands (tests/integration/test_cli_imports.py). Registered in order by
cli/main.py.
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any

import typer

from laneway.cli import common, complete, render
from laneway.cli import runtime_dir as runtime_dir_module
from laneway.cli.common import DEFAULT_RUNTIME, MAX_ID, DatabaseUrl, JsonFlag, RuntimeDir
from laneway.controller import db, readonly, web_links
from laneway.controller.clock import SystemClock
from laneway.controller.errors import LanewayError, NoLedgerYet, UsageError
from laneway.controller.sqlguard import MAX_QUERY_TIMEOUT_S

NewestRun = Annotated[
    int | None,
    typer.Argument(
        help="Run id (default: the newest).", min=1, max=MAX_ID, autocompletion=complete.runs
    ),
]

SQL_SETTINGS = {
    # A query may start with "--" (an SQL comment): an argument that is no option of
    # sql's is the query, not an error (``laneway sql -- QUERY`` works too).
    "ignore_unknown_options": True,
}
"""The context settings cli/main.py registers `sql` with."""

WATCH_SECONDS = 2.0
"""How often `status --watch` refreshes, and looks again for a ledger or run not there yet."""


def status(
    run: NewestRun = None,
    runtime_dir: RuntimeDir = DEFAULT_RUNTIME,
    database_url: DatabaseUrl = None,
    as_json: JsonFlag = False,
    watch: Annotated[
        bool,
        typer.Option(
            "--watch",
            help="Refresh every 2 s: a live display on a terminal; elsewhere (or with "
            "--json) one line per change.",
        ),
    ] = False,
) -> None:
    """Show a run: controls, unknowns, jobs, running attempts, workers, lanes and why they idle.

    A lane whose node no live worker serves says `no_worker`, with the `laneway worker`
    command that starts one. Reads the ledger only (SQLite opened read-only). With
    --watch, a ledger (or a run) that is not there yet is waited for, said once; another
    application's database is refused at once. With LANEWAY_WEB_URL (the dashboard's
    address) set, a last line `link: URL` gives the run's page (`"link"` in --json).
    """
    from laneway.controller.status import status_report

    progress = None
    waiting = _Waiting(as_json)
    try:
        if watch:
            source = _ledger_when_there(runtime_dir, waiting)
        else:
            source = readonly.ReadOnlyLedger(runtime_dir)
        with source:
            if watch:
                from laneway.cli import live

                progress = live.Progress(run, as_json=as_json, stream=sys.stdout)
            while True:
                with source.snapshot():
                    if progress is not None and not _has_runs(source):
                        # The ledger was just made (or only migrated): its run comes next.
                        waiting.say("run", f"waiting for a run in the ledger at {source.where}")
                        report = None
                    else:
                        report = status_report(source, run, now=source.now())
                        if progress is not None:
                            progress.show(report, source)
                if progress is None:
                    assert report is not None
                    if report.unknown:
                        from laneway.controller import evidence

                        evidence.mark_conclusive(source, report)
                    link = web_links.link(web_links.run_path(report.run.id))
                    _emit_linked(report, as_json, render.status_text, link)
                    return
                time.sleep(WATCH_SECONDS)
    except LanewayError as error:
        common.fail(error, as_json)
    except KeyboardInterrupt:
        raise typer.Exit(130) from None
    finally:
        if progress is not None:
            progress.close()


def _emit_linked(
    data: Any, as_json: bool, text_form: Callable[[Any], str], link: str | None
) -> None:
    """``common.emit`` plus the dashboard's address of what ``data`` shows
    (``web_links``, when ``LANEWAY_WEB_URL`` is set): a last line ``link: URL``, or with
    --json a ``"link"`` key; exactly ``common.emit`` when ``link`` is None."""
    if link is None:
        common.emit(data, as_json, text_form)
    elif as_json:
        body = data.as_dict() if hasattr(data, "as_dict") else dict(data)
        typer.echo(render.as_json({**body, "link": link}))
    else:
        typer.echo(f"{text_form(data)}\nlink: {link}")


class _Waiting:
    """`status --watch`'s word that it waits, once per thing it waits for: a line on
    stderr, or with --json one JSON line on stdout (in the stream of status lines)."""

    def __init__(self, as_json: bool) -> None:
        self.as_json = as_json
        self.said: set[str] = set()

    def say(self, what: str, words: str, **fields: str) -> None:
        if what in self.said:
            return
        self.said.add(what)
        if self.as_json:
            from laneway.controller.clock import iso

            body = {"event": "waiting", "waiting_for": what, **fields}
            body |= {"poll_seconds": WATCH_SECONDS, "at": iso(SystemClock().now())}
            typer.echo(json.dumps(body))
        else:
            typer.echo(
                f"laneway: {words} (checking every {WATCH_SECONDS:g} s; Ctrl-C stops)", err=True
            )


def _ledger_when_there(runtime_dir: Path, waiting: _Waiting) -> readonly.ReadOnlyLedger:
    """The read-only ledger of ``runtime_dir``, waited for while nothing is there yet
    (``NoLedgerYet``); anything else that is not a ledger raises at once."""
    while True:
        try:
            return readonly.ReadOnlyLedger(runtime_dir)
        except NoLedgerYet as error:
            refusal = runtime_dir_module.never_there(error)
            if refusal is not None:
                raise refusal from None
            waiting.say(
                "ledger",
                f"waiting for a ledger at {error.where}: none there yet, `laneway "
                "start-pipeline` or `laneway run` creates it",
                ledger=error.where,
            )
        time.sleep(WATCH_SECONDS)


def _has_runs(source: readonly.ReadOnlyLedger) -> bool:
    from laneway.controller import queries

    return bool(source.rows(queries.NEWEST_RUN_ID))


def runs(
    limit: Annotated[
        int, typer.Option("--limit", min=1, max=MAX_ID, help="List at most this many runs.")
    ] = 20,
    runtime_dir: RuntimeDir = DEFAULT_RUNTIME,
    database_url: DatabaseUrl = None,
    as_json: Annotated[
        bool, typer.Option("--json", help="Print machine-readable JSON (a list of runs).")
    ] = False,
) -> None:
    """List the runs, newest first: state, times, jobs by state, and what holds each.

    `holding` is what keeps a run from progressing: its first held lane's reason, as
    `status` gives it (`paused`, `halted`, `unknown_outcome`, `no_worker`, `budget`,
    ...), else `running`, `done` (every job terminal) or `finished`. An unfinished run
    that a later run of the same pipeline followed (`laneway run CONFIG --new`) shows as
    `superseded (by run N)` (`superseded_by` in --json; its `state` stays the ledger's).
    Reads the ledger only (SQLite opened read-only).
    """
    from laneway.cli import run_list

    with common.refusals(as_json):
        with readonly.ReadOnlyLedger(runtime_dir) as source:
            with source.snapshot():
                listed = run_list.listing(source, limit=limit, now=source.now())
    common.emit(listed, as_json, run_list.runs_text)


def explain(
    job: Annotated[
        str,
        typer.Argument(
            help="The job: its id (see `status`/`sql`), or ITEM.STAGE (in --run, default "
            "the newest run).",
            autocompletion=complete.jobs,
        ),
    ],
    run: Annotated[
        int | None,
        typer.Option("--run", min=1, max=MAX_ID, help="The run an ITEM.STAGE is in."),
    ] = None,
    runtime_dir: RuntimeDir = DEFAULT_RUNTIME,
    database_url: DatabaseUrl = None,
    as_json: JsonFlag = False,
) -> None:
    """List everything that blocks one job now, with the capacity arithmetic.

    First, if no live worker serves the job's node, that, with the command that starts
    one. For a failed, cancelled or skipped job: its last attempt's outcome, exit code or
    signal, directory, the last lines of its stderr.log, and the `laneway retry` command.
    With LANEWAY_WEB_URL (the dashboard's address) set, a last line `link: URL` gives
    the job's explain page (`"link"` in --json).
    """
    from laneway.controller.explain import explain_job

    with common.refusals(as_json):
        engine = common.reader(runtime_dir)
        job_id = common.job_id(engine, job, run)
        with db.session_factory(engine)() as session:
            report = explain_job(session, job_id, now=db.ledger_now(session, SystemClock()))
        where = web_links.explain_path(report["run_id"], report["item"], report["stage"])
        link = web_links.link(where)
    _emit_linked(report, as_json, render.explain_text, link)


def report(
    run: Annotated[
        int | None, typer.Argument(help="Run id (default: the newest).", min=1, max=MAX_ID)
    ] = None,
    html_path: Annotated[
        Path | None,
        typer.Option("--html", help="Where to write the HTML (default runs/RUN/report.html)."),
    ] = None,
    idle_min_seconds: Annotated[
        float,
        typer.Option(
            "--idle-min-seconds",
            min=0,
            callback=common.finite,
            help="Shortest idle period listed.",
        ),
    ] = 1.0,
    yield_keys: Annotated[
        list[str] | None,
        typer.Option(
            "--yield",
            help="A usage key whose output per hour is reported (repeatable; default: all).",
            show_default=False,
        ),
    ] = None,
    runtime_dir: RuntimeDir = DEFAULT_RUNTIME,
    database_url: DatabaseUrl = None,
    as_json: JsonFlag = False,
) -> None:
    """Where a run's hours went, per lane, with an HTML lane-occupancy timeline.

    Start intervals, share of time with every slot idle, throughput, stage duration
    percentiles, queue wait, failures by class, idle periods with their recorded reasons.
    Writes the HTML atomically; reads the ledger only.
    """
    from laneway.controller import durable, ledger, report_html
    from laneway.controller import report as report_module

    with common.refusals(as_json):
        engine = common.reader(runtime_dir)
        with db.session_factory(engine)() as session:
            run_row = ledger.get_run(session, run)
            body = report_module.build_report(
                session,
                run_row,
                now=db.ledger_now(session, SystemClock()),
                idle_min_seconds=idle_min_seconds,
                yield_keys=tuple(yield_keys or ()),
            )
        target = html_path or Path(run_row.runtime_dir) / "runs" / str(run_row.id) / "report.html"
        try:
            durable.write_bytes(target, report_html.render_html(body).encode())
        except OSError as exc:
            raise UsageError(f"--html {target}: cannot write it ({exc.strerror or exc})") from None
        body["html"] = str(target)
    common.emit(body, as_json, render.report_text)


def artifacts(
    run: NewestRun = None,
    item: Annotated[
        str | None,
        typer.Option(
            "--item", metavar="KEY", help="Only the item with this key.", show_default=False
        ),
    ] = None,
    stage: Annotated[
        str | None,
        typer.Option("--stage", metavar="NAME", help="Only this stage.", show_default=False),
    ] = None,
    runtime_dir: RuntimeDir = DEFAULT_RUNTIME,
    database_url: DatabaseUrl = None,
    as_json: JsonFlag = False,
) -> None:
    """List a run's artifacts: the outputs its succeeded attempts stored.

    Per artifact: item, stage, attempt, name, size, sha256 (the first 12 hex digits;
    --json has all 64), the node that stored it and where it is (its URL in the run's
    artifact store). A job reused from an earlier run lists that run's artifacts, marked
    as reused. Reads the ledger only.
    """
    from laneway.cli import artifact_list, artifacts_text

    with common.refusals(as_json):
        engine = common.reader(runtime_dir)
        with db.session_factory(engine)() as session:
            listing = artifact_list.listing(session, run, item=item, stage=stage)
    common.emit(listing, as_json, artifacts_text.artifacts_text)


def logs(
    target: Annotated[
        str,
        typer.Argument(
            help="An attempt id; or a job: its id with --job, or ITEM.STAGE (newest attempt).",
            show_default=False,
            autocompletion=complete.attempts,
        ),
    ],
    job: Annotated[
        bool,
        typer.Option("--job", help="TARGET is a job (its id, or ITEM.STAGE): its newest attempt."),
    ] = False,
    run: Annotated[
        int | None,
        typer.Option(
            "--run", help="For ITEM.STAGE: the run (default: the newest).", min=1, max=MAX_ID
        ),
    ] = None,
    stderr: Annotated[
        bool, typer.Option("--stderr", help="stderr.log instead of stdout.log.")
    ] = False,
    follow: Annotated[
        bool, typer.Option("--follow", "-f", help="Keep printing until the attempt settles.")
    ] = False,
    tail: Annotated[
        int | None, typer.Option("--tail", "-n", min=0, help="Only the last N lines first.")
    ] = None,
    runtime_dir: RuntimeDir = DEFAULT_RUNTIME,
    database_url: DatabaseUrl = None,
    as_json: Annotated[
        bool,
        typer.Option("--json", help="One JSON object (with --follow: one per chunk, a line each)."),
    ] = False,
) -> None:
    """Print an attempt's output (redacted as it was written), or follow it.

    Reads the ledger read-only and the attempt's stdout.log / stderr.log under its
    directory. When that directory is on another machine (workers on several machines,
    PostgreSQL), says on which node and host it is. With --follow, prints what the
    attempt appends until it settles (or becomes unknown). With LANEWAY_WEB_URL (the
    dashboard's address) set, `link: URL` (the attempt's page) comes first on stderr
    (`"link"` in --json).
    """
    from laneway.cli import logs as logs_cli

    try:
        logs_cli.show(
            target,
            runtime_dir=runtime_dir,
            job=job,
            run=run,
            stream="stderr" if stderr else "stdout",
            follow=follow,
            tail=tail,
            as_json=as_json,
        )
    except LanewayError as error:
        common.fail(error, as_json)
    except KeyboardInterrupt:
        raise typer.Exit(130) from None


def _query_timeout(value: float) -> float:
    """`sql --timeout`'s callback: a finite number of seconds, at most the bound."""
    common.finite(value)
    if value > MAX_QUERY_TIMEOUT_S:
        raise typer.BadParameter(
            f"at most {MAX_QUERY_TIMEOUT_S:g} s (a longer query holds back the cleanup of "
            "the ledger's rows); give a smaller --timeout"
        )
    return value


def sql(
    query: Annotated[str, typer.Argument(help="A read-only SQL query.")],
    runtime_dir: RuntimeDir = DEFAULT_RUNTIME,
    database_url: DatabaseUrl = None,
    readonly_url: Annotated[
        str | None,
        typer.Option(
            "--readonly-url",
            envvar="LANEWAY_READONLY_DATABASE_URL",
            show_default=False,
            help=(
                "PostgreSQL: connect as a role that can only read laneway's tables "
                "(postgresql://ROLE@HOST/DB; docs/deploy.md gives its grants) instead of "
                "the ledger's own URL (env LANEWAY_READONLY_DATABASE_URL)."
            ),
        ),
    ] = None,
    superuser_ok: Annotated[
        bool,
        typer.Option(
            "--i-know-this-is-superuser",
            help=(
                "PostgreSQL: run even when the role is a superuser (or may read or write "
                "the server's files). Still read-only, one statement, no COPY."
            ),
        ),
    ] = False,
    timeout: Annotated[
        float,
        typer.Option(
            "--timeout",
            min=0.001,
            callback=_query_timeout,
            help=f"Stop the query after this many seconds (at most {MAX_QUERY_TIMEOUT_S:g}).",
        ),
    ] = readonly.QUERY_TIMEOUT_S,
    as_json: JsonFlag = False,
) -> None:
    """Run one read-only SQL query against the ledger.

    SQLite is opened read-only, with PRAGMA query_only and an authorizer that allows
    reads only: writes, ATTACH/DETACH, VACUUM (INTO), PRAGMAs that write and
    load_extension are refused before they run, and nothing is created. On PostgreSQL
    the query runs in a READ ONLY transaction with a statement timeout, as one statement
    that returns rows (COPY, SET, DO and several statements are refused unrun), and as a
    role that is not a superuser (--readonly-url; --i-know-this-is-superuser overrides);
    advisory locks and the functions that run SQL text (query_to_xml, ts_stat, dblink,
    ...) are refused for every role, and `laneway sql-role create` makes a role the
    database itself refuses them.
    A refused, invalid or timed-out query exits 2 with one line. Tables and views are
    documented in docs/ledger.md. A query starting with -- (a comment) is taken as it
    is; `laneway sql [OPTIONS] -- QUERY` also works.
    """
    with common.refusals(as_json):
        if readonly_url and not readonly_url.startswith("postgresql"):
            raise UsageError(
                "--readonly-url must name a PostgreSQL database (postgresql://ROLE@HOST/DB); "
                "a SQLite ledger is read from --runtime-dir, opened read-only"
            )
        with readonly.ReadOnlyLedger(runtime_dir, url=readonly_url or None) as source:
            headers, rows = source.query(query, timeout_s=timeout, allow_privileged=superuser_ok)
    if as_json:
        typer.echo(render.as_json([dict(zip(headers, row, strict=True)) for row in rows]))
    else:
        typer.echo(render.table(headers, [list(row) for row in rows]))
