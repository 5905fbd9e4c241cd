"""No paid re-run without a yes: before `run` or `start-pipeline` creates a run (with
or without ``--new``), the plan of it (``controller.run_plan``) is asked about on a
terminal, and refused off one or with --json, when it would run a paid stage's jobs
that ran before again. Used by cli/commands_run.py.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import typer

from laneway.cli import common, render
from laneway.controller import db, ledger_open
from laneway.controller.errors import UsageError


def reuse_plan(
    config: Path,
    runtime_dir: Path,
    rerun: list[str] | None,
    reuse_despite: list[str] | None = None,
    as_json: bool = False,
) -> tuple[list[str], Any]:
    """Preflight's reasons and the ``RunPlan`` of a new run of ``config`` on the ledger
    of ``runtime_dir`` (every job new when it has none yet)."""
    from laneway.controller import config as config_module
    from laneway.controller import pipeline
    from laneway.controller import reuse_despite as despite
    from laneway.controller.errors import NoLedgerYet
    from laneway.controller.run_plan import build_plan

    with common.refusals(as_json):
        parsed = config_module.load_config(config)
        pipeline.check_rerun(parsed, rerun or [])
        despite.check(parsed, reuse_despite or [], rerun or [])
        reasons, hashes = pipeline.preflight(parsed)
        try:
            engine = ledger_open.open_existing_ledger(runtime_dir)
        except NoLedgerYet:
            engine = None
        try:
            return reasons, build_plan(engine, parsed, hashes, rerun or [], reuse_despite)
        finally:
            if engine is not None:
                engine.dispose()


def confirm_plan(
    config: Path,
    runtime_dir: Path,
    rerun: list[str] | None,
    reuse_despite: list[str] | None,
    *,
    new: bool,
    yes: bool,
    as_json: bool,
    quiet: bool,
) -> None:
    """Before any command creates a run: unless ``yes``, a plan that runs paid stages'
    work again (``RunPlan.paid_reruns``) is asked about on a terminal and refused off
    one or with --json, as ``retry`` refuses (exit 2, nothing created; the words name
    the stages, counts, changed files and expected spend). With ``new`` the plan is
    printed on stderr first (one JSON line with --json; none with ``quiet``); without
    it only when it is asked about, and not computed at all for a pipeline's first run
    or one the start refuses as unfinished (``plan_matters``). Preflight's refusals
    are left to the start, which says them."""
    from laneway.cli import plan_text

    if not new and (yes or not plan_matters(config, runtime_dir, as_json)):
        return
    reasons, found = reuse_plan(config, runtime_dir, rerun, reuse_despite, as_json)
    if reasons or not (new or found.reruns_paid_work):
        return
    if quiet:
        pass
    elif as_json:
        common.Log(True)("plan", "plan", **found.as_dict())
    else:
        for line in plan_text.reuse_plan_lines(found):
            typer.echo(line, err=True)
    if yes or not found.reruns_paid_work:
        return
    words = plan_text.paid_rerun_words(found)
    if as_json or not (sys.stdin.isatty() and sys.stderr.isatty()):
        common.fail(
            UsageError(
                f"not started, nothing was created: {words}; pass --yes to pay for it, or "
                "--reuse-despite STAGE to keep a stage's earlier results (an edit that "
                "changes nothing it computes)"
            ),
            as_json,
        )
    typer.echo(render.clean(words), err=True)
    if not typer.confirm("start it?", err=True):
        common.fail(UsageError("not started: nothing was created (--yes starts without asking)"))


def plan_matters(config: Path, runtime_dir: Path, as_json: bool) -> bool:
    """Whether a start without ``--new`` could re-run work: the ledger holds runs of
    the pipeline, all finished (none: its first run; an unfinished one: the start
    refuses). One read of the runs table, before the plan's cost (hashes, reuse)."""
    from laneway.controller import config as config_module
    from laneway.controller import ledger
    from laneway.controller.errors import NoLedgerYet
    from laneway.controller.states import RunState

    with common.refusals(as_json):
        name = config_module.load_config(config).name
        try:
            engine = ledger_open.open_existing_ledger(runtime_dir)
        except NoLedgerYet:
            return False
        try:
            with db.one_read(engine) as session:
                states = [state for _run, state in ledger.pipeline_runs(session, name)]
        finally:
            engine.dispose()
    return bool(states) and RunState.ACTIVE not in states
