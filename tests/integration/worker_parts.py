"""Arrangements for the tests of the worker's parts (``workers.recovery``,
``workers.spawning``, ``workers.finishing``): a worker that only hosts its parts, and
an attempt claimed on n1."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from laneway.controller import db, identity, ledger
from laneway.workers.gpu import FakeGpu
from laneway.workers.service import WorkerService
from tests.support import claim_on_n1, record_spawn

PLENTY = (64_000.0, 128_000.0)


def host(engine: Any, worker_id: str, clock: Any, **kwargs: Any) -> WorkerService:
    """A worker that is not started (nothing registered, nothing recovered): the test
    drives one of its parts directly, as ``worker_id``."""
    service = WorkerService(
        engine,
        node="n1",
        slots=4,
        clock=clock,
        memory_probe=lambda: PLENTY,
        gpu=FakeGpu(),
        launch=False,
        **kwargs,
    )
    service.worker_id = worker_id
    return service


def claimed(
    factory: Any,
    worker: str,
    clock: Any,
    *,
    slots: int = 1,
    supervisor: tuple[int, int | None] | None = None,
    exits: list[dict[str, Any]] | None = None,
) -> list[ledger.Claim]:
    """Claims on n1 with their directories made. ``supervisor``: each one's identity
    recorded on this boot (running); ``exits``: each one's exit.json, in order."""
    claims = claim_on_n1(factory, worker, clock, slots=slots)
    for claim, exit_record in zip(claims, exits or [None] * len(claims), strict=True):
        Path(claim.attempt_dir).mkdir(parents=True)
        if exit_record is not None:
            (Path(claim.attempt_dir) / "exit.json").write_text(json.dumps(exit_record))
        if supervisor is None:
            continue
        with db.transaction(factory) as session:
            record_spawn(session, claim, worker, clock.now(), (identity.boot_id(), *supervisor))
    return claims
