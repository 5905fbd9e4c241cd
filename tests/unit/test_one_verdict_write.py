"""One write for every verdict (``ledger.settle_judged``): the worker's settle, its
restart recovery, the controller's lease expiry and both reconciles write what was
decided through it, so "a success's stored outputs are recorded in the settle's
transaction" is kept in one place, not by each caller remembering ``record_artifacts``.

Two halves: a structural check over the product's source (the writes ``settle_judged``
owns are called from nowhere else, and each of the four paths calls it), with a
planted-violation self-test; and the function's own behaviour on a real ledger (both
backends): outputs recorded with a settle and with a reconcile, in the caller's
transaction, and none for an attempt marked unknown.
"""

from __future__ import annotations

import ast
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import select

from laneway.controller import db, ledger
from laneway.controller.attempt import Judged
from laneway.controller.models import Artifact, Attempt
from laneway.controller.outcome import Verdict
from laneway.controller.states import AttemptState, JobState, Outcome
from tests.support import claim_on_n1, make_config, mark_unknown_one

ROOT = Path(__file__).resolve().parents[2]
PRODUCT = ("controller", "workers", "cli")

OWNED = {"record_artifacts", "settle_from_verdict", "reconcile_attempt", "record_spawn_from_exit"}
"""The writes of a verdict that only ``settle_judged`` may call."""
OWNER = ("controller/ledger/judged.py", "settle_judged")
DEFINED_IN = {
    "record_artifacts": "controller/ledger/artifacts.py",
    "settle_from_verdict": "controller/ledger/settle.py",
    "record_spawn_from_exit": "controller/ledger/settle.py",
    "reconcile_attempt": "controller/ledger/operator.py",
}

CALLERS = {
    ("controller/daemon.py", "_settle_from_exit_record"): "the controller's lease expiry",
    ("workers/recovery.py", "recover_one"): "a restarted worker settling an orphan",
    ("workers/finishing.py", "settle"): "the worker's settle",
    ("controller/reconcile.py", "settle_from_evidence"): "reconcile --from-evidence",
    ("controller/reconcile.py", "reconcile_by_hand"): "reconcile ATTEMPT --as",
}
"""Each path that writes a verdict: its file and function."""


def _called_name(call: ast.Call) -> str | None:
    func = call.func
    if isinstance(func, ast.Name):
        return func.id
    if isinstance(func, ast.Attribute):
        return func.attr
    return None


def bypasses(path: str, source: str) -> list[str]:
    """Where ``source`` (the module at ``path``) calls or imports a write ``OWNED``
    outside ``settle_judged``; ``path:line name``, one per finding."""
    found: list[str] = []

    def visit(node: ast.AST, function: str | None) -> None:
        for child in ast.iter_child_nodes(node):
            inner = function
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                inner = child.name if function is None else function
            if isinstance(child, ast.Call):
                name = _called_name(child)
                if name in OWNED and (path, inner) != OWNER:
                    found.append(f"{path}:{child.lineno} calls {name}")
            if isinstance(child, ast.ImportFrom):
                for alias in child.names:
                    if alias.name in OWNED and path not in (
                        OWNER[0],
                        "controller/ledger/__init__.py",
                    ):
                        found.append(f"{path}:{child.lineno} imports {alias.name}")
            visit(child, inner)

    visit(ast.parse(source), None)
    return found


def product_modules() -> list[tuple[str, str]]:
    return [
        (str(file.relative_to(ROOT)), file.read_text(encoding="utf-8"))
        for room in PRODUCT
        for file in sorted((ROOT / room).rglob("*.py"))
    ]


@pytest.mark.no_ledger
def test_only_settle_judged_writes_a_verdict():
    assert len(product_modules()) > 50
    found = [hit for path, source in product_modules() for hit in bypasses(path, source)]
    assert found == [], (
        "a verdict written past ledger.settle_judged (it owns unknown-or-settle, the late "
        f"identity and a success's outputs): {found}"
    )


@pytest.mark.no_ledger
def test_each_owned_write_exists_and_settle_judged_calls_it():
    """The check above names real functions: each is defined where it says, and
    ``settle_judged`` calls every one (a renamed write would make the check vacuous)."""
    for name, path in DEFINED_IN.items():
        tree = ast.parse((ROOT / path).read_text(encoding="utf-8"))
        assert any(isinstance(node, ast.FunctionDef) and node.name == name for node in tree.body), (
            f"{path} no longer defines {name}"
        )
    owner = ast.parse((ROOT / OWNER[0]).read_text(encoding="utf-8"))
    (function,) = [
        node
        for node in owner.body
        if isinstance(node, ast.FunctionDef)
        and node.name == OWNER[1]
        and not node.decorator_list  # the implementation, not an overload
    ]
    called = {_called_name(node) for node in ast.walk(function) if isinstance(node, ast.Call)}
    assert OWNED <= called, f"settle_judged no longer calls {sorted(OWNED - called)}"


@pytest.mark.no_ledger
@pytest.mark.parametrize(("path", "function"), sorted(CALLERS))
def test_each_path_that_writes_a_verdict_calls_settle_judged(path: str, function: str):
    tree = ast.parse((ROOT / path).read_text(encoding="utf-8"))
    (found,) = [
        node
        for node in ast.walk(tree)
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and node.name == function
    ]
    called = {_called_name(node) for node in ast.walk(found) if isinstance(node, ast.Call)}
    what = CALLERS[(path, function)]
    assert "settle_judged" in called, f"{what} ({path}::{function}) no longer calls settle_judged"


@pytest.mark.no_ledger
def test_the_check_finds_a_planted_bypass():
    planted = (
        "from laneway.controller import ledger\n"
        "from laneway.controller.ledger.artifacts import record_artifacts as keep\n"
        "def settle(session, judged):\n"
        "    ledger.settle_from_verdict(session, 1, fence=1, verdict=judged.verdict)\n"
        "    keep(session, 1, judged.stored, node='n1', now=None)\n"
        "    ledger.record_artifacts(session, 1, judged.stored, node='n1', now=None)\n"
    )
    assert bypasses("workers/finishing.py", planted) == [
        "workers/finishing.py:2 imports record_artifacts",
        "workers/finishing.py:4 calls settle_from_verdict",
        "workers/finishing.py:6 calls record_artifacts",
    ]
    # The same calls inside the owner's own function are its job, not a bypass.
    owner = (
        "def settle_judged(session, judged):\n"
        "    record_artifacts(session, 1, [], node='n', now=None)\n"
    )
    assert bypasses(OWNER[0], owner) == []
    assert bypasses("controller/daemon.py", owner) == [
        "controller/daemon.py:2 calls record_artifacts"
    ]


STORED = [{"name": "out.txt", "sha256": "ab" * 32, "size_bytes": 3, "location": "file:///x"}]


def _artifacts(factory: Any, attempt_id: int) -> list[tuple[str, str]]:
    with factory() as session:
        rows = session.execute(
            select(Artifact.name, Artifact.node).where(Artifact.attempt_id == attempt_id)
        )
        return [tuple(row) for row in rows]


def _attempt(factory: Any, attempt_id: int) -> Attempt:
    with factory() as session:
        found = session.get(Attempt, attempt_id)
        assert found is not None
        return found


def _claimed(make_run: Any, register_worker: Any, factory: Any, clock: Any) -> Any:
    make_run(make_config())
    (claimed,) = claim_on_n1(factory, register_worker(), clock)
    return claimed


def test_a_settled_success_has_its_outputs_recorded_in_the_same_transaction(
    factory: Any, make_run: Any, register_worker: Any, clock: Any
):
    claimed = _claimed(make_run, register_worker, factory, clock)
    judged = Judged(Verdict(Outcome.SUCCEEDED, "exit 0"), {"exit_code": 0}, None, STORED)
    how = ledger.Fenced(claimed.fence)
    # Rolled back after the write: neither the settle nor its outputs remain.
    with pytest.raises(RuntimeError), db.transaction(factory) as session:
        ledger.settle_judged(
            session, claimed.attempt_id, judged, how, actor="w", now=clock.now(), node="n1"
        )
        raise RuntimeError("the transaction ends before its commit")
    assert _attempt(factory, claimed.attempt_id).state is not AttemptState.SETTLED
    assert _artifacts(factory, claimed.attempt_id) == []
    with db.transaction(factory) as session:
        state = ledger.settle_judged(
            session, claimed.attempt_id, judged, how, actor="w", now=clock.now(), node="n1"
        )
    assert state is JobState.SUCCEEDED
    settled = _attempt(factory, claimed.attempt_id)
    assert (settled.state, settled.outcome, settled.exit_code) == (
        AttemptState.SETTLED,
        Outcome.SUCCEEDED,
        0,
    )
    assert _artifacts(factory, claimed.attempt_id) == [("out.txt", "n1")]


def test_an_unestablished_outcome_marks_unknown_and_records_nothing(
    factory: Any, make_run: Any, register_worker: Any, clock: Any
):
    claimed = _claimed(make_run, register_worker, factory, clock)
    judged = Judged(Verdict(None, "no exit.json"))
    with db.transaction(factory) as session:
        state = ledger.settle_judged(
            session,
            claimed.attempt_id,
            judged,
            ledger.Fenced(claimed.fence),
            actor="w",
            now=clock.now(),
            node="n1",
        )
    assert state is None
    unknown = _attempt(factory, claimed.attempt_id)
    assert (unknown.state, unknown.state_reason) == (AttemptState.UNKNOWN, "no exit.json")
    assert _artifacts(factory, claimed.attempt_id) == []


def test_a_late_identity_is_recorded_from_the_exit_record_before_the_settle(
    factory: Any, make_run: Any, register_worker: Any, clock: Any
):
    claimed = _claimed(make_run, register_worker, factory, clock)
    record = {"exit_code": 0, "supervisor_pid": 4242, "boot_id": "boot", "child_pid": 4243}
    judged = Judged(Verdict(Outcome.SUCCEEDED, "exit 0"), record, None, STORED)
    with db.transaction(factory) as session:
        ledger.settle_judged(
            session,
            claimed.attempt_id,
            judged,
            ledger.Fenced(claimed.fence, identity_from_exit=True),
            actor="w",
            now=clock.now(),
            node="n1",
        )
    settled = _attempt(factory, claimed.attempt_id)
    assert (settled.state, settled.supervisor_pid, settled.child_pid) == (
        AttemptState.SETTLED,
        4242,
        4243,
    )
    assert _artifacts(factory, claimed.attempt_id) == [("out.txt", "n1")]


def test_a_reconciled_success_has_its_outputs_recorded_with_the_reconcile(
    factory: Any, make_run: Any, register_worker: Any, clock: Any
):
    claimed = _claimed(make_run, register_worker, factory, clock)
    mark_unknown_one(factory, claimed, clock, "lost", fence=claimed.fence)
    judged = Judged(Verdict(Outcome.SUCCEEDED, "it ran"), result=None, stored=STORED)
    with db.transaction(factory) as session:
        state = ledger.settle_judged(
            session,
            claimed.attempt_id,
            judged,
            ledger.Reconciled("succeeded", reason="it ran", exit_code=0),
            actor="op",
            now=clock.now(),
            node="n1",
        )
    assert state is JobState.SUCCEEDED
    settled = _attempt(factory, claimed.attempt_id)
    assert (settled.outcome, settled.exit_code) == (Outcome.SUCCEEDED, 0)
    assert settled.state_reason == "reconciled by op: it ran"
    assert _artifacts(factory, claimed.attempt_id) == [("out.txt", "n1")]
