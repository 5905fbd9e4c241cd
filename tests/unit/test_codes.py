"""controller/codes.py is the one vocabulary of why work waits and what comes next.

Every refusal admission can emit is a ``RefusalCode`` member (one snapshot per member
that admission emits, so a new member without a case fails here, and a code yielded as
bare text fails the type check); ``refusal_words.describe`` words every member from the
detail its emitter gives; advice's step codes are members; and no product module names a
code as bare text where it builds or compares one."""

from __future__ import annotations

import ast
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from laneway.controller import admission, advice, refusal_words
from laneway.controller.admission import (
    Candidate,
    ControlView,
    DeviceView,
    Holder,
    NodeView,
    RateWindow,
    Snapshot,
)
from laneway.controller.codes import (
    CONTROL_CODES,
    CONTROL_KINDS,
    RefusalCode,
    StepCode,
    refusal_code,
    step_code,
)
from laneway.controller.states import ControlKind
from laneway.controller.status_nodes import no_worker_reason

pytestmark = pytest.mark.no_ledger

ROOT = Path(__file__).resolve().parents[2]
RUN = 1

NOT_ADMISSIONS = {
    RefusalCode.NO_WORKER: "status, the report and explain derive it from the workers table",
    RefusalCode.RETRY_BACKOFF: "explain says it of a ready job waiting out its backoff",
    RefusalCode.BATCH_CAP: "nothing emits it today; advice words a lane that says so",
}
"""Members admission never emits, each with who does."""


def _node(**kwargs: Any) -> NodeView:
    fields: dict[str, Any] = {
        "name": "n1",
        "max_jobs": 4,
        "memory_floor_mib": 1024,
        "mem_available_mib": 64_000,
        "reserved_mib": 0,
        "running": 0,
    }
    return NodeView(**(fields | kwargs))


def _snapshot(job: Candidate | None = None, **kwargs: Any) -> Snapshot:
    fields: dict[str, Any] = {"node": _node(), "free_slots": 4}
    candidates = [] if job is None else [job]
    return Snapshot(candidates=candidates, **(fields | kwargs))


def _job(**kwargs: Any) -> Candidate:
    return Candidate(job_id=10, run_id=RUN, lane="a", stage="solve", **kwargs)


def _control(kind: ControlKind) -> ControlView:
    return ControlView(kind, "global", None, None, f"{kind} by op")


def _gpu_node(*holders: Holder) -> NodeView:
    return _node(devices=(DeviceView(0, 8000, 0, "GPU-0", holders),))


CASES: dict[RefusalCode, Callable[[], Snapshot]] = {
    RefusalCode.OTHER_NODE: lambda: _snapshot(_job(nodes=("n2",))),
    RefusalCode.HALTED: lambda: _snapshot(_job(), controls=[_control(ControlKind.HALT)]),
    RefusalCode.UNKNOWN_OUTCOME: lambda: _snapshot(_job(), unknown_runs={RUN: 2}),
    RefusalCode.PAUSED: lambda: _snapshot(_job(), controls=[_control(ControlKind.PAUSE)]),
    RefusalCode.STOPPED: lambda: _snapshot(_job(), controls=[_control(ControlKind.STOP)]),
    RefusalCode.BUDGET: lambda: _snapshot(
        _job(expected_usage={"cost_usd": 2.0}, expected_from={"cost_usd": "p90 of 3"}),
        budgets={(RUN, None): {"cost_usd": 10.0}},
        spend={(RUN, None, "cost_usd"): (7.0, 1.5)},
    ),
    RefusalCode.RATE_LIMIT: lambda: _snapshot(
        _job(limits=("provider",)),
        rates={(RUN, "provider"): RateWindow("provider", 2.0, 5, 5, frees_in_seconds=0.8)},
    ),
    RefusalCode.SECRET_MISSING: lambda: _snapshot(
        _job(), missing_secrets={(RUN, "solve"): ["API_KEY"]}
    ),
    RefusalCode.MAX_JOBS: lambda: _snapshot(_job(), node=_node(max_jobs=2, running=2)),
    RefusalCode.SLOTS_FULL: lambda: _snapshot(_job(), free_slots=0),
    RefusalCode.LANE_CAP: lambda: _snapshot(
        _job(),
        lane_caps={(RUN, "a"): {"solve": 1}},
        running_lane_stage=Counter({(RUN, "a", "solve"): 1}),
    ),
    RefusalCode.STAGE_CAP: lambda: _snapshot(
        _job(), stage_caps={(RUN, "solve"): 3}, running_stage=Counter({(RUN, "solve"): 3})
    ),
    RefusalCode.GPU_CAPACITY: lambda: _snapshot(_job(gpu_mib=512)),
    RefusalCode.GPU_BUSY: lambda: _snapshot(_job(gpus=1), node=_gpu_node(Holder(True))),
    RefusalCode.GPU_MEMORY: lambda: _snapshot(
        _job(gpu_mib=512), node=_gpu_node(Holder(False, None))
    ),
    RefusalCode.MEMORY_FLOOR: lambda: _snapshot(
        _job(memory_mib=4096), node=_node(mem_available_mib=5000)
    ),
    RefusalCode.NEEDS_PENDING: lambda: _snapshot(None, waiting_lanes={(RUN, "a")}),
}
"""One snapshot per code admission emits, in which admission refuses with that code."""


def _admitted(code: RefusalCode) -> admission.Refusal:
    [refusal] = admission.admit(CASES[code]()).refusals
    return refusal


def test_every_member_admission_emits_has_its_case():
    assert set(CASES) | set(NOT_ADMISSIONS) == set(RefusalCode), (
        "a RefusalCode member with neither a snapshot here nor a line in NOT_ADMISSIONS"
    )
    assert not set(CASES) & set(NOT_ADMISSIONS)


@pytest.mark.parametrize("code", list(CASES))
def test_every_refusal_admission_emits_is_a_member(code: RefusalCode):
    refusal = _admitted(code)
    assert type(refusal.code) is RefusalCode  # not text that happens to match
    assert refusal.code is code
    snap = CASES[code]()
    if snap.candidates:  # explain lists the same reason with the same type
        reasons = admission.explain(snap, snap.candidates[0])
        assert [type(c) for c, _ in reasons] == [RefusalCode] * len(reasons)
        assert reasons[0][0] is code


BARE = {
    RefusalCode.SLOTS_FULL: "its detail (no free slot) says nothing the code does not",
    RefusalCode.BATCH_CAP: "nothing emits it, so no detail says more",
}
"""Members worded as their bare code, each with why."""


def _detail(code: RefusalCode) -> dict[str, Any]:
    """The detail the member's emitter gives it."""
    if code is RefusalCode.BATCH_CAP:
        return {}
    if code is RefusalCode.NO_WORKER:
        return no_worker_reason("n1", "/rt", None, stage="solve", nodes=["n1", "n2"]).detail
    return _admitted(code).detail


@pytest.mark.parametrize("code", [c for c in RefusalCode if c is not RefusalCode.RETRY_BACKOFF])
def test_refusal_words_describes_every_member(code: RefusalCode):
    detail = _detail(code)
    words = refusal_words.describe(code, detail)
    assert words.startswith(code.value)
    # The words are the same whether the code is the member or the text a ledger read back.
    assert refusal_words.describe(code.value, detail) == words
    if code not in BARE:  # a detail's figures and names are worded, not dropped
        assert words != code.value, f"{code}: its detail {detail} is not worded"


def test_a_code_read_back_becomes_its_member_and_an_unknown_one_stays_text():
    assert type(refusal_code("memory_floor")) is RefusalCode
    assert step_code("no_controller") is StepCode.NO_CONTROLLER
    assert step_code("budget") is RefusalCode.BUDGET
    assert refusal_code("batch_cap") == "batch_cap"
    assert type(step_code("a_code_of_an_older_ledger")) is str


def test_controls_and_their_codes_map_both_ways():
    assert set(CONTROL_CODES) == set(ControlKind)
    assert {CONTROL_KINDS[code] for code in CONTROL_CODES.values()} == set(ControlKind)


def test_advices_step_codes_are_members():
    for name in ("DONE", "RUNNING", "NO_CONTROLLER"):
        assert type(getattr(advice, name)) is StepCode
    grouped = (advice.OPERATOR_FIRST, advice.NEW_RUN_CODES, advice.HALTING, advice.RUN_ORDER)
    for codes in grouped:
        assert all(type(code) in (StepCode, RefusalCode) for code in codes)
    assert all(type(code) is RefusalCode for code in advice.WAITS)
    assert not {c.value for c in StepCode} & {c.value for c in RefusalCode}


# -- no code as bare text -------------------------------------------------------------

BUILDERS = {
    "NextStep": 0,
    "Reason": 0,
    "describe": 0,
    "_blocker": 0,
    "held": 0,
    "_control_step": 0,
    "Refusal": 3,
}
"""Calls that take a code: the position of their code argument (or ``code=``)."""
CODES = {c.value for c in RefusalCode} | {c.value for c in StepCode}


def _is_code(node: ast.expr) -> bool:
    """``code``, ``x.code``, ``x["code"]``: an expression that holds a code."""
    if isinstance(node, ast.Name):
        return node.id == "code"
    if isinstance(node, ast.Attribute):
        return node.attr == "code"
    if isinstance(node, ast.Subscript):
        key = node.slice
        return isinstance(key, ast.Constant) and key.value == "code"
    return False


def _texts(node: ast.expr) -> list[str]:
    """The string constants a comparison names: one, or those of a tuple, list or set."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return [node.value]
    if isinstance(node, ast.Tuple | ast.List | ast.Set):
        return [t for element in node.elts for t in _texts(element)]
    return []


def bare_codes(source: str) -> list[tuple[int, str]]:
    """(line, text) of every code named as bare text where one is built or compared."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Compare):
            sides = [node.left, *node.comparators]
            if any(_is_code(side) for side in sides):
                found += [(node.lineno, t) for side in sides for t in _texts(side)]
        elif isinstance(node, ast.Call):
            func = node.func
            name = func.id if isinstance(func, ast.Name) else getattr(func, "attr", "")
            if name in BUILDERS:
                at = BUILDERS[name]
                args = [
                    *node.args[at : at + 1],
                    *(k.value for k in node.keywords if k.arg == "code"),
                ]
                found += [(node.lineno, t) for arg in args for t in _texts(arg)]
        elif isinstance(node, ast.Yield | ast.Return) and isinstance(node.value, ast.Tuple):
            first = node.value.elts[0] if node.value.elts else None
            if first is not None:
                found += [(node.lineno, t) for t in _texts(first) if t in CODES]
    return [(line, text) for line, text in found if text in CODES or text == ""]


EXCEPTIONS: dict[tuple[str, str], str] = {
    ("controller/ledger/claim.py", "budget"): (
        "the claim's one comparison of a refusal's code (does a budget hold the run); "
        "the ledger's modules are being moved by another change, which takes the member"
    ),
    ("controller/ledger/claim.py", ""): "a dispatch recorded in a refusal's shape",
}
"""(module, text) pairs still named as bare text, each with its reason."""


def test_no_product_module_names_a_code_as_bare_text():
    offenders = []
    for room in ("controller", "workers", "cli"):
        for path in sorted((ROOT / room).rglob("*.py")):
            name = path.relative_to(ROOT).as_posix()
            for line, text in bare_codes(path.read_text(encoding="utf-8")):
                if (name, text) not in EXCEPTIONS:
                    offenders.append(f"{name}:{line}: {text!r}")
    assert offenders == [], "use the RefusalCode / StepCode member:\n" + "\n".join(offenders)


def test_the_bare_code_check_finds_what_it_looks_for():
    planted = (
        "if step.code == 'budget': pass\n"
        "if reason['code'] in ('halted', 'paused'): pass\n"
        "NextStep('done', 'w', None)\n"
        "Reason(code='no_worker', stage=None)\n"
        "admission.Refusal(1, 'a', None, 'paused', {})\n"
        "def f():\n    yield 'lane_cap', {}\n"
        "if kind == 'halt': pass\n"  # a control's kind: no code
    )
    assert [text for _, text in bare_codes(planted)] == [
        "budget",
        "halted",
        "paused",
        "done",
        "no_worker",
        "paused",
        "lane_cap",
    ]
