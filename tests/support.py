"""Shared test helpers: bounded waiting (no fixed sleeps), configs, clocks."""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable
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
    from laneway.controller import db, ledger

    with db.transaction(factory) as session:
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
    from laneway.controller import db, ledger

    with db.transaction(factory) as session:
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
    session: Any,
    claim: Any,
    worker: str,
    now: Any,
    *,
    boot_id: str,
    supervisor_pid: int,
    supervisor_start_time: int | None = 1,
) -> None:
    """In ``session``: ``claim``'s supervisor recorded as spawned (intent -> running) on
    boot ``boot_id`` as ``supervisor_pid`` started at ``supervisor_start_time``; no child."""
    from laneway.controller import ledger

    ledger.record_spawn(
        session,
        claim.attempt_id,
        fence=claim.fence,
        actor=worker,
        now=now,
        boot_id=boot_id,
        supervisor_pid=supervisor_pid,
        supervisor_start_time=supervisor_start_time,
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
        (claim,) = ledger.claim_jobs(
            session,
            worker_id=worker,
            node="n1",
            free_slots=slots,
            mem_available_mib=mem,
            now=clock.now(),
            **kwargs,
        )
        if spawn is not None:
            boot_id, pid, start = spawn
            record_spawn(
                session,
                claim,
                worker,
                clock.now(),
                boot_id=boot_id,
                supervisor_pid=pid,
                supervisor_start_time=start,
            )
        if settle is not None:
            ledger.settle_attempt(
                session,
                claim.attempt_id,
                fence=claim.fence,
                outcome=settle,
                actor=worker,
                now=clock.now(),
            )
        if unknown is not None:
            ledger.mark_unknown(
                session, claim.attempt_id, reason=unknown, actor="t", now=clock.now()
            )
    return claim
