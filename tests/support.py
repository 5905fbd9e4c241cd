"""Shared test helpers: bounded waiting (no fixed sleeps), configs, clocks."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any, TypeVar

from laneway.controller.config import PipelineConfig, parse_config

T = TypeVar("T")
PY = sys.executable


def wait_until(predicate: Callable[[], T], timeout: float = 60.0, interval: float = 0.01) -> T:
    """Poll ``predicate`` until it returns something truthy; fail after ``timeout``
    (``LANEWAY_TEST_WAIT_CAP`` seconds at most, when set: a quick look at what fails)."""
    timeout = min(timeout, float(os.environ.get("LANEWAY_TEST_WAIT_CAP", timeout)))
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"condition not met within {timeout} s: {predicate}")
        time.sleep(interval)


GATE_BOUND = 600
"""Seconds a gated job waits for its gate at most (pytest-timeout's limit on one test):
long enough for any loaded machine, short enough that a job whose test failed before
opening its gate cannot outlive the suite by much. Gated stages' timeouts are this too,
so no supervisor times a job out while it waits for the test."""


def wait_for(condition: str, what: str, *, bound: float = GATE_BOUND) -> str:
    """Python statements (they import ``os``, ``sys`` and ``time``) that block until
    ``condition`` (a Python expression over those, evaluated each time round) holds;
    after ``bound`` s the job exits 1 with ``what`` (an expression too, a ``str``) and
    "not within BOUND s", so it never hangs forever. A handshake, not a race: the test
    acts, then makes the condition true, however long acting took on a loaded machine.
    No braces of their own: in an argv template they need ``escape`` only for what the
    expressions bring."""
    return (
        "import os, sys, time\n"
        f"_until = time.monotonic() + {bound!r}\n"
        f"while not ({condition}):\n"
        "    if time.monotonic() > _until:\n"
        f"        sys.exit(({what}) + ' not within {bound!r} s')\n"
        "    time.sleep(0.02)\n"
    )


def wait_for_file(path: str, *, bound: float = GATE_BOUND) -> str:
    """``wait_for`` the file at ``path`` (a Python expression: ``repr(str(gate))``,
    ``"sys.argv[2]"``) to exist: the job's side of a gate the test opens
    (``gate.touch()``)."""
    return wait_for(f"os.path.exists({path})", f"'gate ' + str({path}) + ' opened'", bound=bound)


def gated_argv(gate: Path) -> list[str]:
    """A job's argv that waits for ``gate`` to exist (``wait_for_file``), then exits 0."""
    return [PY, "-c", wait_for_file(repr(str(gate)))]


def gated_stage(name: str, gate: Path, then: str = "", **extra: Any) -> dict[str, Any]:
    """``py_stage`` whose job waits for ``gate`` (``wait_for_file``), then runs ``then``;
    its timeout is ``GATE_BOUND`` unless ``extra`` names one."""
    code = wait_for_file(repr(str(gate))) + then
    return py_stage(name, code, **{"timeout_seconds": GATE_BOUND, **extra})


class FixedClock:
    """A clock tests move by hand."""

    def __init__(self, start: datetime | None = None) -> None:
        self.moment = start or datetime(2026, 1, 1, 12, 0, 0)

    def now(self) -> datetime:
        return self.moment

    def advance(self, seconds: float) -> None:
        self.moment += timedelta(seconds=seconds)


def py_stage(name: str, code: str, **extra: Any) -> dict[str, Any]:
    """A stage running ``python -c CODE {item}`` (braces in CODE are escaped, so they
    reach Python as written)."""
    return {
        "name": name,
        "argv": [PY, "-c", escape(code), "{item}"],
        "timeout_seconds": 30,
        **extra,
    }


def escape(code: str) -> str:
    """Escape template braces in an argv element."""
    return code.replace("{", "{{").replace("}", "}}")


def make_config(
    stages: list[dict[str, Any]] | None = None,
    items: list[dict[str, Any]] | int = 1,
    *,
    base_dir: Path | None = None,
    max_jobs: int = 4,
    lanes: list[dict[str, Any]] | None = None,
    **extra: Any,
) -> PipelineConfig:
    """A small valid config; override any part."""
    if isinstance(items, int):
        items = [{"key": f"item{i}", "lane": "a"} for i in range(items)]
    raw: dict[str, Any] = {
        "name": "t",
        "nodes": [{"name": "n1", "memory_floor_mib": 0, "max_jobs": max_jobs}],
        "lanes": lanes or [{"name": "a", "node": "n1"}],
        "stages": stages or [py_stage("only", "pass")],
        "items": items,
        **extra,
    }
    return parse_config(raw, base_dir or Path.cwd())


def claim_on_n1(
    factory: Any, worker: str, clock: Any, *, slots: int = 1, mem: float = 64_000, **kwargs: Any
) -> list[Any]:
    """One claim transaction on node n1 (tests' usual arrangement)."""
    from laneway.controller import db

    with db.transaction(factory) as session:
        return claim_in(session, worker, clock, slots=slots, mem=mem, **kwargs)


def claim_in(
    session: Any, worker: str, clock: Any, *, slots: int, mem: float, **kwargs: Any
) -> list[Any]:
    """``ledger.claim_jobs`` on node n1 in ``session`` (a transaction of the caller's)."""
    from laneway.controller import ledger

    return ledger.claim_jobs(
        session,
        worker_id=worker,
        node="n1",
        free_slots=slots,
        mem_available_mib=mem,
        now=clock.now(),
        **kwargs,
    )


def settle_one(
    factory: Any, claimed: Any, worker: str, clock: Any, outcome: Any, **kwargs: Any
) -> Any:
    """Settle one claimed attempt in its own transaction."""
    from laneway.controller import db

    with db.transaction(factory) as session:
        return settle_in(session, claimed, worker, clock, outcome, **kwargs)


def settle_in(
    session: Any, claimed: Any, worker: str, clock: Any, outcome: Any, **kwargs: Any
) -> Any:
    """``ledger.settle_attempt`` of ``claimed`` in ``session`` (a transaction of the
    caller's); its job's new state."""
    from laneway.controller import ledger

    return ledger.settle_attempt(
        session,
        claimed.attempt_id,
        fence=claimed.fence,
        outcome=outcome,
        actor=worker,
        now=clock.now(),
        **kwargs,
    )


def heartbeat(
    factory: Any,
    worker: str,
    clock: Any,
    free: float,
    *,
    total: float = 64_000,
    lease_seconds: float = 60,
    **kwargs: Any,
) -> int:
    """One heartbeat of ``worker`` reporting ``free`` MiB of ``total``, in its own
    transaction (``kwargs``: the rest of ``ledger.heartbeat``'s)."""
    from laneway.controller import db, ledger

    with db.transaction(factory) as session:
        return ledger.heartbeat(
            session,
            worker,
            now=clock.now(),
            lease_seconds=lease_seconds,
            mem_available_mib=free,
            mem_total_mib=total,
            **kwargs,
        )


def record_spawn(
    session: Any, claim: Any, worker: str, now: Any, supervisor: tuple[str, int, int | None]
) -> None:
    """In ``session``: ``claim``'s supervisor recorded as spawned (intent -> running),
    ``supervisor`` being (boot id, its pid, its start time); no child yet."""
    from laneway.controller import ledger

    boot_id, pid, start_time = supervisor
    ledger.record_spawn(
        session,
        claim.attempt_id,
        fence=claim.fence,
        actor=worker,
        now=now,
        boot_id=boot_id,
        supervisor_pid=pid,
        supervisor_start_time=start_time,
        child_pid=None,
        child_start_time=None,
    )


def claim_one_on_n1(
    factory: Any,
    worker: str,
    clock: Any,
    *,
    slots: int = 1,
    mem: float = 64_000,
    spawn: tuple[str, int, int | None] | None = None,
    settle: Any = None,
    unknown: str | None = None,
    **kwargs: Any,
) -> Any:
    """Claim exactly one attempt on n1 (it fails unless the claim returns just one) and, in
    the same transaction, in this order: record its spawn (``spawn``: boot id, supervisor
    pid, supervisor start time), settle it with outcome ``settle``, mark it unknown with
    reason ``unknown``. ``kwargs``: the rest of ``ledger.claim_jobs``'s. Returns the claim."""
    from laneway.controller import db, ledger

    with db.transaction(factory) as session:
        (claim,) = claim_in(session, worker, clock, slots=slots, mem=mem, **kwargs)
        if spawn is not None:
            record_spawn(session, claim, worker, clock.now(), spawn)
        if settle is not None:
            settle_in(session, claim, worker, clock, settle)
        if unknown is not None:
            ledger.mark_unknown(
                session, claim.attempt_id, reason=unknown, actor="t", now=clock.now()
            )
    return claim


def mark_unknown_one(
    factory: Any, claimed: Any, clock: Any, reason: str, *, actor: str = "test", **kwargs: Any
) -> None:
    """``ledger.mark_unknown`` of ``claimed`` in its own transaction (``kwargs``: its
    ``fence``, ``result``)."""
    from laneway.controller import db, ledger

    with db.transaction(factory) as session:
        ledger.mark_unknown(
            session, claimed.attempt_id, reason=reason, actor=actor, now=clock.now(), **kwargs
        )


def reconcile_one(
    factory: Any,
    claimed: Any,
    clock: Any,
    verdict: str,
    reason: str,
    *,
    actor: str = "op",
    **kwargs: Any,
) -> Any:
    """``ledger.reconcile_attempt`` of ``claimed`` with ``verdict`` in its own transaction
    (``kwargs``: its ``result``); the job's new state."""
    from laneway.controller import db, ledger

    with db.transaction(factory) as session:
        return ledger.reconcile_attempt(
            session,
            claimed.attempt_id,
            verdict=verdict,
            reason=reason,
            actor=actor,
            now=clock.now(),
            **kwargs,
        )


def control_run(session: Any, kind: Any, run_id: int, *, reason: str, actor: str, now: Any) -> None:
    """In ``session``: ``ledger.set_control`` of ``kind`` on run ``run_id`` alone."""
    from laneway.controller import ledger
    from laneway.controller.states import ControlScope

    ledger.set_control(
        session, kind, scope=ControlScope.RUN, run_id=run_id, reason=reason, actor=actor, now=now
    )


def clear_run_control(
    session: Any, kind: Any, run_id: int, *, reason: str, actor: str, now: Any
) -> None:
    """In ``session``: ``ledger.clear_controls`` of ``kind`` on run ``run_id``."""
    from laneway.controller import ledger

    ledger.clear_controls(session, (kind,), run_id=run_id, reason=reason, actor=actor, now=now)


def supervisor_argv(
    tmp_path: Path,
    argv: list[str],
    *,
    attempt_id: int = 1,
    timeout: float = 30.0,
    grace: float = 5.0,
    secret_env: Any = (),
    **extra: Any,
) -> list[str]:
    """``python -m laneway.workers.supervisor SPEC_JSON`` for attempt ``attempt_id`` in
    tmp_path/attempt (the caller makes it) running ``argv`` in tmp_path; ``extra``: more
    of the spec (``log_cap_bytes``)."""
    spec = {
        "attempt_id": attempt_id,
        "attempt_dir": str(tmp_path / "attempt"),
        "argv": argv,
        "cwd": str(tmp_path),
        "timeout_seconds": timeout,
        "grace_seconds": grace,
        "secret_env": list(secret_env),
        **extra,
    }
    return [PY, "-m", "laneway.workers.supervisor", json.dumps(spec)]


def launch_supervisor(
    tmp_path: Path, argv: list[str], *, env: dict[str, str] | None = None, **spec: Any
) -> tuple[subprocess.Popen[bytes], dict[str, Any]]:
    """Start a supervisor (``supervisor_argv(tmp_path, argv, **spec)``) the way the worker
    does, in its own session (``env``: added to this process's environment), and read the
    report it prints first; returns the supervisor and that report."""
    proc = subprocess.Popen(
        supervisor_argv(tmp_path, argv, **spec),
        stdout=subprocess.PIPE,
        start_new_session=True,
        env={**os.environ, **(env or {})},
    )
    assert proc.stdout is not None
    report: dict[str, Any] = json.loads(proc.stdout.readline())
    proc.stdout.close()
    return proc, report


@contextmanager
def statements(engine: Any) -> Iterator[Counter[str]]:
    """Count the SQL statements run inside the block, by their text (white space folded):
    on ``engine`` and on what ``db.reader`` reads through (the daemons' reads)."""
    from sqlalchemy import event

    from laneway.controller import db

    counted: Counter[str] = Counter()
    # SQLite's reader is an engine of its own; PostgreSQL's is ``engine`` in autocommit,
    # whose statements ``engine``'s listeners already see.
    engines = {engine, db.reader(engine).kw["bind"]} if db.is_sqlite(engine) else {engine}

    def count(_conn: Any, _cursor: Any, statement: str, *_: Any) -> None:
        counted[" ".join(statement.split())] += 1

    for each in engines:
        event.listen(each, "before_cursor_execute", count)
    try:
        yield counted
    finally:
        for each in engines:
            event.remove(each, "before_cursor_execute", count)


@contextmanager
def controller_serving(runtime: Path) -> Iterator[None]:
    """As if a controller served ``runtime``: this process holds its controller lock and
    pidfile (``controller_lock.hold_controller_lock``), so ``status`` names the
    controller ``running`` (not ``gone``) while the test ticks a ``Controller`` itself."""
    from laneway.controller import controller_lock

    assert controller_lock.hold_controller_lock(runtime)
    try:
        yield
    finally:
        controller_lock.release_controller_lock(runtime)
