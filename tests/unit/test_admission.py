"""controller/admission.py: table tests over hand-built snapshots."""

from __future__ import annotations

import itertools
from collections import Counter
from dataclasses import replace
from typing import Any

import pytest

from laneway.controller.admission import (
    Admission,
    Candidate,
    ControlView,
    DeviceView,
    GroupView,
    Holder,
    NodeView,
    Refusal,
    SelectionView,
    Snapshot,
    admit,
    explain,
    order_by_yield,
    runs_on,
)
from laneway.controller.refusal_words import describe, placement_words

RUN = 1

ORDER = [
    "other_node",
    "halted",
    "unknown_outcome",
    "paused",
    "stopped",
    "budget",
    "secret_missing",
    "max_jobs",
    "slots_full",
    "lane_cap",
    "stage_cap",
    "gpu_capacity",
    "memory_floor",
]


def node(
    *,
    max_jobs: int = 4,
    floor: int = 1024,
    available: float | None = 64_000,
    reserved: float = 0,
    running: int = 0,
    has_gpu: bool = False,
    gpu_running: int = 0,
    gpu_peaks: tuple[float | None, ...] | None = None,
    gpu_total: float = 0,
    gpu_fraction: float = 1.0,
    gpu_baseline: float = 0,
) -> NodeView:
    return NodeView(
        name="n1",
        max_jobs=max_jobs,
        memory_floor_mib=floor,
        mem_available_mib=available,
        reserved_mib=reserved,
        running=running,
        has_gpu=has_gpu,
        gpu_running_peaks=gpu_peaks if gpu_peaks is not None else (None,) * gpu_running,
        gpu_total_mib=gpu_total,
        gpu_fraction=gpu_fraction,
        gpu_baseline_mib=gpu_baseline,
    )


def job(
    job_id: int,
    *,
    run_id: int = RUN,
    lane: str = "a",
    stage: str = "solve",
    memory_mib: int = 0,
    gpu_mib: int = 0,
    gpu_peak: float | None = None,
) -> Candidate:
    return Candidate(job_id, run_id, lane, stage, memory_mib, gpu_mib, gpu_peak)


def snapshot(*candidates: Candidate, free_slots: int = 4, **kwargs: Any) -> Snapshot:
    node_view = kwargs.pop("node", None) or node()
    return Snapshot(node=node_view, free_slots=free_slots, candidates=list(candidates), **kwargs)


def control(kind: str, scope: str = "global", run_id: int | None = None, lane: str | None = None):
    return ControlView(kind=kind, scope=scope, run_id=run_id, lane=lane, reason=f"{kind} by op")


def codes(admission: Admission) -> list[str]:
    return [r.code for r in admission.refusals]


def started(admission: Admission) -> list[int]:
    return [c.job_id for c in admission.starts]


# -- one snapshot per reason ------------------------------------------------------


def conditions_snapshot(active: set[str]) -> Snapshot:
    """A single-candidate snapshot in which exactly the ``active`` reasons apply."""
    controls = []
    if "halted" in active:
        controls.append(control("halt"))
    if "paused" in active:
        controls.append(control("pause"))
    if "stopped" in active:
        controls.append(control("stop"))
    candidate = job(
        10,
        memory_mib=4096 if "memory_floor" in active else 0,
        gpu_mib=512 if "gpu_capacity" in active else 0,
    )
    candidate = replace(
        candidate,
        expected_usage={"cost_usd": 2.0},
        expected_from={"cost_usd": "p90 of 3"},
        nodes=("n2",) if "other_node" in active else ("n1", "n2"),
    )
    return Snapshot(
        node=node(
            max_jobs=2,
            running=2 if "max_jobs" in active else 0,
            has_gpu=False,
            available=5000,
            floor=1024,
        ),
        free_slots=0 if "slots_full" in active else 2,
        candidates=[candidate],
        lane_caps={(RUN, "a"): {"solve": 1}},
        stage_caps={(RUN, "solve"): 3},
        running_lane_stage=Counter({(RUN, "a", "solve"): 1 if "lane_cap" in active else 0}),
        running_stage=Counter({(RUN, "solve"): 3 if "stage_cap" in active else 0}),
        controls=controls,
        unknown_runs={RUN: 2} if "unknown_outcome" in active else {},
        budgets={(RUN, None): {"cost_usd": 10.0}},
        spend={(RUN, None, "cost_usd"): (7.0, 1.5 if "budget" in active else 0.0)},
        missing_secrets={(RUN, "solve"): ["API_KEY"]} if "secret_missing" in active else {},
    )


EXPECTED_DETAIL: dict[str, dict[str, Any]] = {
    "other_node": {"node": "n1", "nodes": ["n2"]},
    "halted": {"scope": "global", "reason": "halt by op"},
    "unknown_outcome": {"unknown_attempts": 2},
    "paused": {"scope": "global", "reason": "pause by op"},
    "stopped": {"scope": "global", "reason": "stop by op"},
    "budget": {
        "scope": "run",
        "stage": "solve",
        "key": "cost_usd",
        "spent": 7.0,
        "reserved": 1.5,
        "expected": 2.0,
        "expected_from": "p90 of 3",
        "budget": 10.0,
    },
    "secret_missing": {"node": "n1", "variables": ["API_KEY"]},
    "max_jobs": {"running": 2, "max_jobs": 2},
    "slots_full": {"slots": 0},
    "lane_cap": {"running": 1, "cap": 1},
    "stage_cap": {"running": 3, "cap": 3},
    "gpu_capacity": {"why": "node has no GPU configured"},
    "memory_floor": {
        "available_mib": 5000,
        "reserved_mib": 0,
        "stage_mib": 4096,
        "floor_mib": 1024,
    },
}


def test_nothing_applies_admits() -> None:
    result = admit(conditions_snapshot(set()))
    assert started(result) == [10]
    assert result.refusals == []


@pytest.mark.parametrize("code", ORDER)
def test_each_reason_alone(code: str) -> None:
    result = admit(conditions_snapshot({code}))
    assert result.starts == []
    assert result.refusals == [Refusal(RUN, "a", "solve", code, EXPECTED_DETAIL[code], 10)]


@pytest.mark.parametrize(
    ("first", "second"),
    list(itertools.combinations(ORDER, 2)),
    ids=lambda code: code,
)
def test_priority_between_two_reasons(first: str, second: str) -> None:
    assert codes(admit(conditions_snapshot({first, second}))) == [first]


@pytest.mark.parametrize("skip", range(len(ORDER)))
def test_priority_with_all_later_reasons(skip: int) -> None:
    active = set(ORDER[skip:])
    assert codes(admit(conditions_snapshot(active))) == [ORDER[skip]]


def test_unknown_count_of_zero_does_not_refuse() -> None:
    result = admit(snapshot(job(1), unknown_runs={RUN: 0}))
    assert started(result) == [1]


def test_unknown_outcome_in_another_run_does_not_refuse() -> None:
    result = admit(snapshot(job(1, run_id=1), job(2, run_id=2), unknown_runs={2: 1}))
    assert started(result) == [1]
    assert [(r.run_id, r.code) for r in result.refusals] == [(2, "unknown_outcome")]


# -- GPU -------------------------------------------------------------------------


def test_gpu_stage_on_node_without_gpu() -> None:
    result = admit(snapshot(job(1, gpu_mib=100), node=node(has_gpu=False)))
    assert result.starts == []
    assert result.refusals[0].code == "gpu_capacity"
    assert result.refusals[0].detail == {"why": "node has no GPU configured"}


def test_first_gpu_attempt_runs_alone() -> None:
    result = admit(snapshot(job(1, gpu_mib=100), node=node(has_gpu=True)))
    assert started(result) == [1]
    assert result.refusals == []


def test_second_gpu_attempt_refused_when_one_already_runs_on_the_node() -> None:
    result = admit(snapshot(job(1, gpu_mib=100), node=node(has_gpu=True, gpu_running=1)))
    assert result.starts == []
    [refusal] = result.refusals
    assert refusal.code == "gpu_memory"
    assert "no measured GPU peak" in refusal.detail["why"]


def test_gpu_attempts_of_the_stage_elsewhere_do_not_block_this_node() -> None:
    result = admit(
        snapshot(
            job(1, gpu_mib=100),
            node=node(has_gpu=True, gpu_running=0),
            running_stage=Counter({(RUN, "solve"): 1}),
        )
    )
    assert started(result) == [1]


def test_two_gpu_candidates_in_one_call_only_one_starts() -> None:
    result = admit(snapshot(job(1, gpu_mib=100), job(2, gpu_mib=100), node=node(has_gpu=True)))
    assert started(result) == [1]
    assert result.refusals[0].code == "gpu_memory"


def test_second_gpu_attempt_refused_within_the_same_call() -> None:
    result = admit(
        snapshot(job(1, gpu_mib=100), job(2, gpu_mib=100, lane="b"), node=node(has_gpu=True))
    )
    assert started(result) == [1]
    assert [(r.job_id, r.code) for r in result.refusals] == [(2, "gpu_memory")]
    assert "no measured GPU peak" in result.refusals[0].detail["why"]


def test_cpu_stage_ignores_gpu_rules() -> None:
    result = admit(
        snapshot(job(1), node=node(has_gpu=False), running_stage=Counter({(RUN, "solve"): 5}))
    )
    assert started(result) == [1]


# -- memory floor ----------------------------------------------------------------


def test_memory_floor_equality_admits() -> None:
    # 4096 - 1024 - 2048 == 1024 == floor
    snap = snapshot(job(1, memory_mib=2048), node=node(available=4096, reserved=1024, floor=1024))
    result = admit(snap)
    assert started(result) == [1]
    assert result.refusals == []


def test_memory_floor_one_mib_less_refuses() -> None:
    snap = snapshot(job(1, memory_mib=2048), node=node(available=4095, reserved=1024, floor=1024))
    result = admit(snap)
    assert result.starts == []
    assert result.refusals == [
        Refusal(
            RUN,
            "a",
            "solve",
            "memory_floor",
            {"available_mib": 4095, "reserved_mib": 1024, "stage_mib": 2048, "floor_mib": 1024},
            1,
        )
    ]


def test_memory_floor_fraction_below_refuses() -> None:
    snap = snapshot(job(1, memory_mib=2048), node=node(available=4095.5, reserved=1024))
    assert codes(admit(snap)) == ["memory_floor"]


def test_memory_floor_without_sample_refuses() -> None:
    result = admit(snapshot(job(1), node=node(available=None, floor=0)))
    assert result.starts == []
    [refusal] = result.refusals
    assert refusal.code == "memory_floor"
    assert refusal.detail == {"why": "no memory sample from this node yet"}
    assert refusal.words() == "memory_floor — no memory sample from this node yet"


def test_memory_reservations_of_this_call_count() -> None:
    snap = snapshot(
        job(1, memory_mib=2000),
        job(2, memory_mib=2000, stage="judge"),
        job(3, memory_mib=0, stage="post"),
        node=node(available=5000, reserved=0, floor=1000),
    )
    result = admit(snap)
    # job 2: 5000 - 2000 - 2000 = 1000 == floor admits; job 3: 5000 - 4000 - 0 = 1000 admits.
    assert started(result) == [1, 2, 3]
    snap = snapshot(
        job(1, memory_mib=2000),
        job(2, memory_mib=2001, stage="judge"),
        node=node(available=5000, reserved=0, floor=1000),
    )
    result = admit(snap)
    assert started(result) == [1]
    assert result.refusals[0].detail["reserved_mib"] == 2000
    assert result.refusals[0].detail["stage_mib"] == 2001


# -- caps counted including this call's admissions ------------------------------


def test_lane_cap_counts_jobs_admitted_in_this_call() -> None:
    snap = snapshot(job(1), job(2), job(3, lane="b"), lane_caps={(RUN, "a"): {"solve": 1}})
    result = admit(snap)
    assert started(result) == [1, 3]
    assert result.refusals == [Refusal(RUN, "a", "solve", "lane_cap", {"running": 1, "cap": 1}, 2)]


def test_lane_cap_counts_already_running() -> None:
    snap = snapshot(
        job(1),
        lane_caps={(RUN, "a"): {"solve": 2}},
        running_lane_stage=Counter({(RUN, "a", "solve"): 2}),
    )
    assert codes(admit(snap)) == ["lane_cap"]


def test_lane_cap_of_zero_refuses_everything() -> None:
    snap = snapshot(job(1), lane_caps={(RUN, "a"): {"solve": 0}})
    assert codes(admit(snap)) == ["lane_cap"]


def test_lane_cap_is_per_stage_and_per_run() -> None:
    snap = snapshot(
        job(1),
        job(2, stage="judge"),
        job(3, run_id=2),
        lane_caps={(RUN, "a"): {"solve": 0}},
    )
    result = admit(snap)
    assert started(result) == [2, 3]


def test_stage_cap_counts_across_lanes_in_this_call() -> None:
    snap = snapshot(
        job(1, lane="a"),
        job(2, lane="b"),
        job(3, lane="c"),
        stage_caps={(RUN, "solve"): 2},
    )
    result = admit(snap)
    assert started(result) == [1, 2]
    assert result.refusals == [Refusal(RUN, "c", "solve", "stage_cap", {"running": 2, "cap": 2}, 3)]


def test_stage_cap_none_means_unlimited() -> None:
    snap = snapshot(*(job(i, lane=f"l{i}") for i in range(4)), stage_caps={(RUN, "solve"): None})
    assert started(admit(snap)) == [0, 1, 2, 3]


def test_max_jobs_counts_jobs_admitted_in_this_call() -> None:
    snap = snapshot(
        job(1, stage="s1"),
        job(2, stage="s2"),
        job(3, stage="s3"),
        node=node(max_jobs=3, running=1),
        free_slots=10,
    )
    result = admit(snap)
    assert started(result) == [1, 2]
    assert result.refusals == [
        Refusal(RUN, "a", "s3", "max_jobs", {"running": 3, "max_jobs": 3}, 3)
    ]


def test_slots_count_jobs_admitted_in_this_call() -> None:
    snap = snapshot(job(1, stage="s1"), job(2, stage="s2"), free_slots=1)
    result = admit(snap)
    assert started(result) == [1]
    assert result.refusals == [Refusal(RUN, "a", "s2", "slots_full", {"slots": 1}, 2)]


def test_starts_keep_candidate_order() -> None:
    snap = snapshot(job(7, lane="b"), job(3, lane="a"), job(5, lane="c"))
    assert started(admit(snap)) == [7, 3, 5]


def test_admit_does_not_mutate_snapshot_counters() -> None:
    running_lane_stage: Counter[tuple[int, str, str]] = Counter()
    running_stage: Counter[tuple[int, str]] = Counter()
    snap = snapshot(job(1), running_lane_stage=running_lane_stage, running_stage=running_stage)
    admit(snap)
    assert running_lane_stage == Counter()
    assert running_stage == Counter()
    assert snap.node.running == 0


# -- control scopes --------------------------------------------------------------

SCOPE_CASES = [
    # control, (run, lane) -> covered
    (control("halt"), {(1, "a"): True, (1, "b"): True, (2, "a"): True}),
    (control("halt", "run", run_id=1), {(1, "a"): True, (1, "b"): True, (2, "a"): False}),
    (
        control("halt", "lane", run_id=1, lane="a"),
        {(1, "a"): True, (1, "b"): False, (2, "a"): False},
    ),
]


@pytest.mark.parametrize(("view", "expected"), SCOPE_CASES, ids=["global", "run", "lane"])
def test_control_covers(view: ControlView, expected: dict[tuple[int, str], bool]) -> None:
    assert {key: view.covers(*key) for key in expected} == expected


@pytest.mark.parametrize("kind", ["halt", "pause", "stop"])
@pytest.mark.parametrize(("scope_index"), range(len(SCOPE_CASES)))
def test_control_scope_through_admit(kind: str, scope_index: int) -> None:
    template, expected = SCOPE_CASES[scope_index]
    view = control(kind, template.scope, template.run_id, template.lane)
    candidates = [job(i, run_id=r, lane=lane) for i, (r, lane) in enumerate(expected)]
    result = admit(snapshot(*candidates, controls=[view]))
    code = {"halt": "halted", "pause": "paused", "stop": "stopped"}[kind]
    refused = {(r.run_id, r.lane) for r in result.refusals if r.code == code}
    assert refused == {key for key, covered in expected.items() if covered}
    assert {(c.run_id, c.lane) for c in result.starts} == {
        key for key, covered in expected.items() if not covered
    }
    for refusal in result.refusals:
        assert refusal.detail == {"scope": template.scope, "reason": f"{kind} by op"}


def test_narrow_halt_beats_wide_pause() -> None:
    controls = [control("pause"), control("halt", "lane", run_id=RUN, lane="a")]
    result = admit(snapshot(job(1, lane="a"), job(2, lane="b"), controls=controls))
    assert [(r.lane, r.code) for r in result.refusals] == [("a", "halted"), ("b", "paused")]


# -- deduplication ---------------------------------------------------------------


def test_one_refusal_per_run_lane_stage() -> None:
    snap = snapshot(
        job(1),
        job(2),
        job(3),
        job(4, stage="judge"),
        job(5, lane="b"),
        job(6, run_id=2),
        job(7, run_id=2),
        controls=[control("pause")],
    )
    result = admit(snap)
    assert result.starts == []
    assert [(r.run_id, r.lane, r.stage, r.job_id) for r in result.refusals] == [
        (1, "a", "solve", 1),
        (1, "a", "judge", 4),
        (1, "b", "solve", 5),
        (2, "a", "solve", 6),
    ]


def test_dedup_keeps_the_first_candidates_reason() -> None:
    snap = snapshot(
        job(1, memory_mib=10_000),
        job(2, memory_mib=0),
        job(3, memory_mib=10_000),
        node=node(available=5000, floor=1000),
        lane_caps={(RUN, "a"): {"solve": 1}},
    )
    result = admit(snap)
    assert started(result) == [2]
    assert [(r.job_id, r.code) for r in result.refusals] == [(1, "memory_floor")]


# -- needs_pending ---------------------------------------------------------------


def test_needs_pending_for_lane_without_candidates() -> None:
    snap = snapshot(job(1, lane="a"), waiting_lanes={(RUN, "c"), (RUN, "a"), (RUN, "b")})
    result = admit(snap)
    assert started(result) == [1]
    assert result.refusals == [
        Refusal(RUN, "b", None, "needs_pending", {}),
        Refusal(RUN, "c", None, "needs_pending", {}),
    ]


def test_needs_pending_not_reported_for_lane_with_refused_candidates() -> None:
    snap = snapshot(job(1, lane="a"), free_slots=0, waiting_lanes={(RUN, "a")})
    assert codes(admit(snap)) == ["slots_full"]


def test_needs_pending_distinguishes_runs() -> None:
    snap = snapshot(job(1, run_id=1, lane="a"), waiting_lanes={(1, "a"), (2, "a")})
    result = admit(snap)
    assert [(r.run_id, r.lane, r.code) for r in result.refusals] == [(2, "a", "needs_pending")]


def test_empty_snapshot_has_no_decisions() -> None:
    result = admit(snapshot())
    assert result.starts == [] and result.refusals == []


# -- describe ------------------------------------------------------------------


def test_describe_memory_floor_names_the_numbers() -> None:
    text = describe(
        "memory_floor",
        {"available_mib": 900, "reserved_mib": 300, "stage_mib": 2048, "floor_mib": 1024},
    )
    assert text == "memory_floor — free 900 MiB - unreleased 300 - stage 2048 < floor 1024"


def test_refusal_words_from_admit_carry_memory_numbers() -> None:
    snap = snapshot(job(1, memory_mib=2048), node=node(available=900.4, reserved=300, floor=1024))
    [refusal] = admit(snap).refusals
    words = refusal.words()
    for number in ("900", "300", "2048", "1024"):
        assert number in words
    assert words.startswith("memory_floor")


@pytest.mark.parametrize(
    ("code", "detail", "text"),
    [
        ("lane_cap", {"running": 1, "cap": 1}, "lane_cap — 1 running, cap 1"),
        ("stage_cap", {"running": 2, "cap": 2}, "stage_cap — 2 running, cap 2"),
        ("max_jobs", {"running": 4, "max_jobs": 4}, "max_jobs — 4 running, node max_jobs 4"),
        ("halted", {"scope": "run", "reason": "bad data"}, "halted (run) — bad data"),
        ("paused", {"scope": "lane", "reason": "breaker"}, "paused (lane) — breaker"),
        ("stopped", {"scope": "global", "reason": "drain"}, "stopped (global) — drain"),
        (
            "unknown_outcome",
            {"unknown_attempts": 2},
            "unknown_outcome — 2 attempt(s) await `laneway reconcile`",
        ),
        ("needs_pending", {}, "needs_pending — waiting for earlier stages to finish"),
        (
            "gpu_capacity",
            {"why": "node has no GPU configured"},
            "gpu_capacity — node has no GPU configured",
        ),
        ("slots_full", {"slots": 0}, "slots_full"),
        (
            "other_node",
            {"node": "a", "nodes": ["b", "c"]},
            "other_node — node a does not run this stage; it runs on b, c",
        ),
        (
            "no_worker",
            {"node": "b", "start": "laneway worker --node b", "stage": "s", "nodes": ["b"]},
            "no_worker — no live worker on node b (stage s runs on b); "
            "start one: laneway worker --node b",
        ),
    ],
)
def test_describe(code: str, detail: dict[str, Any], text: str) -> None:
    assert describe(code, detail) == text


# The GPU k-rule: baseline + k * peak <= fraction * total (boundary: equality admits).
@pytest.mark.parametrize(
    ("running_peaks", "peak", "baseline", "admitted"),
    [
        ((), None, 0, True),  # the first GPU attempt runs alone, measured or not
        ((None,), 1000.0, 0, False),  # a running attempt without a measured peak
        ((1000.0,), None, 0, False),  # this stage has no measured peak
        ((1000.0,), 1000.0, 5200, True),  # 5200 + 2*1000 = 7200 = 0.9 * 8000
        ((1000.0,), 1000.0, 5201, False),  # one MiB over
        ((1000.0, 1000.0), 1000.0, 4200, True),  # k = 3: 4200 + 3000 = 7200
        ((1000.0, 1000.0), 1000.0, 4201, False),
    ],
)
def test_gpu_k_rule(running_peaks, peak, baseline, admitted) -> None:
    gpu_node = node(
        has_gpu=True,
        gpu_peaks=running_peaks,
        gpu_total=8000,
        gpu_fraction=0.9,
        gpu_baseline=baseline,
    )
    result = admit(snapshot(job(1, gpu_mib=100, gpu_peak=peak), node=gpu_node))
    assert (started(result) == [1]) is admitted
    if not admitted:
        assert result.refusals[0].code == "gpu_memory"


def test_gpu_refusal_states_the_arithmetic() -> None:
    gpu_node = node(
        has_gpu=True, gpu_peaks=(1000.0,), gpu_total=8000, gpu_fraction=0.9, gpu_baseline=6000
    )
    result = admit(snapshot(job(1, gpu_mib=100, gpu_peak=1000.0), node=gpu_node))
    why = result.refusals[0].detail["why"]
    assert "baseline 6000 + running peaks 1000 + peak 1000 = 8000 MiB > 0.9 x 8000" in why


def test_explain_lists_every_blocking_reason() -> None:
    busy = node(max_jobs=1, running=1, available=900, floor=1024, has_gpu=False)
    snap = snapshot(
        job(1, memory_mib=2048, gpu_mib=10), node=busy, free_slots=0, controls=[control("pause")]
    )
    codes = [code for code, _ in explain(snap, snap.candidates[0])]
    assert codes == ["paused", "max_jobs", "slots_full", "gpu_capacity", "memory_floor"]


# -- budget ----------------------------------------------------------------------


def budgeted(*candidates: Candidate, spent: float = 0.0, reserved: float = 0.0, **kw: Any):
    return snapshot(
        *candidates,
        budgets={(RUN, None): {"cost_usd": 10.0}, (RUN, "judge"): {"calls": 3.0}},
        spend={(RUN, None, "cost_usd"): (spent, reserved)},
        **kw,
    )


def costing(job_id: int, cost: float, stage: str = "solve", **usage: float) -> Candidate:
    return replace(
        job(job_id, stage=stage),
        expected_usage={"cost_usd": cost, **usage},
        expected_from={"cost_usd": "expected_usage"},
    )


def test_budget_counts_what_this_admission_starts() -> None:
    # 3 + 3 + 3 = 9 fits in 10; a fourth would make 12.
    result = admit(budgeted(*(costing(i, 3.0) for i in range(1, 6)), free_slots=5))
    assert started(result) == [1, 2, 3]
    assert codes(result) == ["budget"]
    assert result.refusals[0].detail["reserved"] == 9.0


def test_budget_equality_admits_and_a_reached_budget_refuses_even_free_attempts() -> None:
    assert started(admit(budgeted(costing(1, 4.0), spent=6.0))) == [1]
    refused = admit(budgeted(costing(1, 0.0), spent=6.0, reserved=4.0))
    assert codes(refused) == ["budget"]
    assert refused.refusals[0].words() == (
        "budget (run) — cost_usd: spent 6 + reserved 4 = 10 reaches budget 10"
    )


def test_reserved_by_running_and_unknown_attempts_counts() -> None:
    result = admit(budgeted(costing(1, 2.0), spent=5.0, reserved=3.5))
    assert codes(result) == ["budget"]
    assert result.refusals[0].words() == (
        "budget (run) — cost_usd: spent 5 + reserved 3.5 + expected 2 (expected_usage) "
        "= 10.5 > budget 10"
    )


def test_stage_budget_refuses_its_stage_only() -> None:
    result = admit(
        budgeted(
            costing(1, 0.0, stage="judge", calls=2.0),
            costing(2, 0.0, stage="judge", calls=2.0),
            costing(3, 1.0),
        )
    )
    assert started(result) == [1, 3]
    assert [(r.stage, r.code, r.detail["scope"]) for r in result.refusals] == [
        ("judge", "budget", "stage")
    ]


def test_no_budget_no_refusal_whatever_the_spend() -> None:
    result = admit(snapshot(costing(1, 1e9), spend={(RUN, None, "cost_usd"): (1e9, 0.0)}))
    assert started(result) == [1]


def test_explain_lists_budget_with_other_reasons() -> None:
    snap = budgeted(costing(1, 20.0), free_slots=0)
    assert [code for code, _ in explain(snap, snap.candidates[0])] == ["budget", "slots_full"]


# -- placement: a stage's ``nodes`` ----------------------------------------------


def test_runs_on_is_the_stage_nodes_else_the_lane_node() -> None:
    assert runs_on(["b", "c"], "a") == ("b", "c")
    assert runs_on(None, "a") == ("a",)
    assert runs_on([], "a") == ("a",)
    assert placement_words(["b", "c"]) == "b, c"
    assert placement_words(None) == "lane's node"


def test_a_job_placed_on_other_nodes_is_never_started_here() -> None:
    elsewhere = replace(job(1), nodes=("n2",))
    here = replace(job(2, lane="b"), nodes=("n1",))
    result = admit(snapshot(elsewhere, here))
    assert started(result) == [2]
    assert result.refusals == [
        Refusal(RUN, "a", "solve", "other_node", {"node": "n1", "nodes": ["n2"]}, 1)
    ]


def test_a_job_placed_elsewhere_takes_no_slot_and_no_memory() -> None:
    # The refused job comes first; the one after it still gets the only slot and memory.
    elsewhere = replace(job(1, memory_mib=60_000), nodes=("n2",))
    here = replace(job(2, memory_mib=60_000, lane="b"), nodes=("n1",))
    result = admit(snapshot(elsewhere, here, free_slots=1, node=node(available=62_000)))
    assert started(result) == [2]


def test_the_lane_cap_counts_the_lanes_jobs_running_on_other_nodes() -> None:
    # Lane a's cap for solve is 1 and one of its jobs already runs (on another node):
    # this node may run the stage but must not start a second.
    placed = replace(job(1), nodes=("n1",))
    result = admit(
        snapshot(
            placed,
            lane_caps={(RUN, "a"): {"solve": 1}},
            running_lane_stage=Counter({(RUN, "a", "solve"): 1}),
        )
    )
    assert started(result) == [] and codes(result) == ["lane_cap"]


def test_explain_names_other_node_first() -> None:
    snap = snapshot(replace(job(1), nodes=("n2",)), free_slots=0)
    assert [code for code, _ in explain(snap, snap.candidates[0])] == ["other_node", "slots_full"]


# -- GPUs as devices ---------------------------------------------------------------


def four_gpus(*holders: tuple[Holder, ...], total: float = 80_000, baseline: float = 0):
    """A node with four devices of ``total`` MiB; ``holders[i]``: who holds device i."""
    held = list(holders) + [()] * (4 - len(holders))
    devices = tuple(DeviceView(i, total, baseline, f"GPU-{i}", tuple(held[i])) for i in range(4))
    return replace(node(has_gpu=True, gpu_fraction=0.9, max_jobs=16), devices=devices)


def gpu_job(job_id: int, *, gpus: int = 0, gpu_mib: int = 0, peak: float | None = None):
    return replace(job(job_id, gpu_mib=gpu_mib, gpu_peak=peak), gpus=gpus)


def test_whole_gpus_go_to_distinct_devices_and_the_fifth_waits_naming_them() -> None:
    result = admit(
        snapshot(*(gpu_job(n, gpus=1) for n in range(1, 9)), free_slots=8, node=four_gpus())
    )
    assert started(result) == [1, 2, 3, 4]
    assert [tuple(d.index for d in result.devices[n]) for n in (1, 2, 3, 4)] == [
        (0,),
        (1,),
        (2,),
        (3,),
    ]
    (refusal,) = result.refusals
    assert (refusal.job_id, refusal.code) == (5, "gpu_busy")
    assert refusal.detail["devices"] == {f"GPU {i}": "held by 1 attempt(s)" for i in range(4)}
    assert "asks for 1 whole GPU(s); 0 of 4 free" in refusal.words()


def test_a_two_gpu_job_takes_two_free_devices_and_skips_a_shared_one() -> None:
    shared = (Holder(False, 1000.0),)
    result = admit(snapshot(gpu_job(1, gpus=2), node=four_gpus(shared)))
    assert [d.index for d in result.devices[1]] == [1, 2]
    too_many = admit(snapshot(gpu_job(1, gpus=5), node=four_gpus()))
    assert too_many.refusals[0].code == "gpu_capacity"
    assert too_many.refusals[0].detail == {"why": "the stage asks for 5 GPU(s); node has 4"}


def test_shares_spread_over_free_devices_before_they_share_one() -> None:
    result = admit(
        snapshot(
            *(gpu_job(n, gpu_mib=100, peak=1000.0) for n in range(1, 7)),
            free_slots=6,
            node=four_gpus(),
        )
    )
    given = [result.devices[n][0].index for n in started(result)]
    assert given == [0, 1, 2, 3, 0, 1]  # measured: the fifth and sixth share


def test_the_sharing_rule_holds_per_device_with_its_arithmetic() -> None:
    # Device 0: one measured holder and a big baseline; devices 1-3: held whole.
    whole = (Holder(True),)
    gpu_node = four_gpus((Holder(False, 30_000.0),), whole, whole, whole, baseline=0)
    gpu_node = replace(
        gpu_node,
        devices=(replace(gpu_node.devices[0], baseline_mib=20_000), *gpu_node.devices[1:]),
    )
    fits = admit(snapshot(gpu_job(1, gpu_mib=100, peak=22_000.0), node=gpu_node))
    assert [d.index for d in fits.devices[1]] == [0]  # 20000 + 30000 + 22000 = 72000 = 0.9 x 80000
    over = admit(snapshot(gpu_job(1, gpu_mib=100, peak=22_001.0), node=gpu_node))
    (refusal,) = over.refusals
    assert refusal.code == "gpu_memory"
    assert refusal.detail["devices"]["GPU 0"] == (
        "baseline 20000 + running peaks 30000 + peak 22001 = 72001 MiB > 0.9 x 80000 = 72000 MiB"
    )
    assert refusal.detail["devices"]["GPU 1"] == "held whole by another attempt"
    unmeasured = admit(snapshot(gpu_job(1, gpu_mib=100, peak=None), node=gpu_node))
    assert "no measured GPU peak yet" in unmeasured.refusals[0].detail["devices"]["GPU 0"]
    busy = admit(snapshot(gpu_job(1, gpu_mib=100), node=four_gpus(whole, whole, whole, whole)))
    assert busy.refusals[0].code == "gpu_busy"


# -- choosing by yield ----------------------------------------------------------------


def grouped(job_id: int, group: str) -> Candidate:
    return replace(job(job_id), group=group)


def test_nothing_measured_explores_every_group_in_turn() -> None:
    view = SelectionView("useful", "cost", 0.1)
    ordered = order_by_yield([grouped(n, "AB"[n % 2]) for n in range(4)], view)
    assert [c.group for c, _ in ordered] == ["A", "B", "A", "B"]
    assert {why["why"] for _, why in ordered} == {"explore"}


@pytest.mark.parametrize("explore", [0.0, 0.25, 0.5])
def test_the_best_group_gets_all_but_the_explored_share(explore: float) -> None:
    view = SelectionView(
        "useful",
        "cost",
        explore,
        {"A": GroupView(1, 1, 100.0, 1.0), "B": GroupView(1, 1, 10.0, 1.0)},
    )
    candidates = [grouped(n, "A") for n in range(40)] + [grouped(100 + n, "B") for n in range(40)]
    ordered = order_by_yield(candidates, view)[:40]
    others = sum(1 for c, _ in ordered if c.group == "B")
    # Counting the two admissions already made: B's share stays within one admission
    # of ``explore``.
    assert abs((others + 1) / 42 - explore) <= 1 / 42
    assert all(why["best"] == "A" for _, why in ordered)


def test_an_unmeasured_group_is_explored_before_a_measured_one() -> None:
    view = SelectionView(
        "useful",
        "cost",
        0.5,
        {"A": GroupView(3, 3, 30.0, 3.0), "B": GroupView(1, 1, 1.0, 1.0)},
    )
    ordered = order_by_yield([grouped(1, "A"), grouped(2, "B"), grouped(3, "C")], view)
    assert [(c.group, why["why"]) for c, why in ordered][:1] == [("C", "explore")]
