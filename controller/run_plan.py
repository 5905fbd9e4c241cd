"""``laneway plan``: what a new run of a config would reuse and run, why, and what it
would spend, read from the ledger before anything is created.

The decision is ``create_run``'s own (``ledger.reuse_candidates``, ``gone_outputs``,
``ledger.takeovers``), so the plan and the run cannot disagree. For each job that would
run, the reason: its stage opts out or ``--rerun`` names it; an output of the earlier
attempt is gone from the store; what it needs runs again; or, comparing its reuse key's
parts (``reuse.key_body``) with those of the newest earlier job of the same pipeline,
item and stage, which file, field or definition changed; "never run" when there is none.
The expected spend is each stage's jobs to run times its ``expected_usage``
(``usage.budget_plan``), against every budget.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

from sqlalchemy import Engine, text
from sqlalchemy.orm import Session

from laneway.controller import db, ledger, reuse, usage
from laneway.controller import reuse_despite as reuse_despite_module
from laneway.controller.config import ItemConfig, PipelineConfig, config_from_frozen
from laneway.controller.pipeline import gone_outputs

CHUNK = 500
NEVER_RUN = "new: never run"
"""The reason of a job no earlier run of the pipeline had: running it is not a re-run."""


@dataclass
class StagePlan:
    """One stage of the plan: jobs reused (by the run they come from) and jobs to run,
    counted by why."""

    stage: str
    reuse: int = 0
    reuse_from: dict[int, int] = field(default_factory=dict)
    run: int = 0
    why: dict[str, int] = field(default_factory=dict)
    paid: bool = False
    """Its attempts report usage (``expected_usage`` set, or earlier attempts did)."""
    despite: dict[str, int] = field(default_factory=dict)
    """Of ``reuse``: taken over by ``--reuse-despite`` although this changed -> count."""
    cost: dict[str, dict[str, Any]] = field(default_factory=dict)
    """Usage key -> {"per_job", "from"}: what one job costs, measured (the p90 of the
    newest values earlier attempts of the pipeline reported) or its ``expected_usage``."""

    @property
    def reruns(self) -> int:
        """Jobs to run that ran (or were created) before: all but the never-run ones."""
        return self.run - self.why.get(NEVER_RUN, 0)

    def spend(self) -> dict[str, float]:
        """Usage key -> the expected spend of the jobs to run (``run`` x ``cost``)."""
        return {key: self.run * known["per_job"] for key, known in sorted(self.cost.items())}

    def as_dict(self) -> dict[str, Any]:
        return {
            "stage": self.stage,
            "reuse": self.reuse,
            "reuse_from": {str(run): n for run, n in sorted(self.reuse_from.items())},
            "reuse_despite": dict(sorted(self.despite.items())),
            "run": self.run,
            "reruns": self.reruns,
            "why": dict(sorted(self.why.items(), key=lambda kv: (-kv[1], kv[0]))),
            "paid": self.paid,
            "cost_per_job": self.cost,
            "expected_spend": self.spend(),
        }


@dataclass
class RunPlan:
    pipeline: str
    stages: list[StagePlan]
    budgets: list[dict[str, Any]]
    expected: dict[str, float]
    """Usage key -> the run's expected spend (jobs to run x expected_usage)."""
    limits: list[dict[str, Any]] = field(default_factory=list)
    """``usage.limit_plan`` of the jobs to run: the least time its rate limits allow."""
    reuse_despite: list[str] = field(default_factory=list)
    """The stages ``--reuse-despite`` names."""

    @property
    def paid_reruns(self) -> list[StagePlan]:
        """The paid stages with jobs that ran before and would run (and pay) again."""
        return [stage for stage in self.stages if stage.paid and stage.reruns]

    @property
    def reruns_paid_work(self) -> bool:
        return bool(self.paid_reruns)

    def as_dict(self) -> dict[str, Any]:
        return {
            "pipeline": self.pipeline,
            "stages": [stage.as_dict() for stage in self.stages],
            "expected": self.expected,
            "budgets": self.budgets,
            "limits": self.limits,
            "reuse_despite": self.reuse_despite,
            "reruns_paid_work": self.reruns_paid_work,
        }


def build_plan(
    engine: Engine | None,
    config: PipelineConfig,
    hashes: dict[str, str],
    rerun: list[str],
    reuse_despite: list[str] | None = None,
) -> RunPlan:
    """The plan of a new run of ``config`` (``hashes``: its preflight's) on ``engine``'s
    ledger (None: no ledger yet, so every job is new); reads only. ``reuse_despite``:
    as ``pipeline.start_run``'s."""
    if engine is None:
        found_plan = _all_new(config)
        found_plan.reuse_despite = sorted(set(reuse_despite or []))
        return found_plan
    chosen = frozenset(rerun)
    despite = reuse_despite_module.read(engine, config, hashes, reuse_despite or [])
    distrust = gone_outputs(engine, config, hashes, rerun, despite)
    items = config.items[: config.batch_cap] if config.batch_cap else config.items
    plans = {stage.name: StagePlan(stage.name) for stage in config.stages}
    with db.one_read(engine) as session:
        keys, found = ledger.reuse_candidates(session, config, hashes, rerun, despite)
        earlier = {k: f for k, f in found.items() if f.attempt_id not in distrust}
        handed = ledger.hand_offs(session, [f.attempt_id for f in earlier.values()])
        decided = ledger.takeovers(config, keys, earlier, handed, rerun, despite)
        unmatched = [
            (item.key, stage.name)
            for position, item in enumerate(items)
            for stage in config.stages
            if stage.name not in decided[position] and keys[position][stage.name] not in found
        ]
        previous = _previous_bodies(session, config, unmatched)
        measured = _measured_costs(session, config)
    bodies = {item.key: reuse.item_key_bodies(config, item, hashes) for item in items}
    for position, item in enumerate(items):
        taken = decided[position]
        for stage in config.stages:
            plan = plans[stage.name]
            if stage.name in taken:
                plan.reuse += 1
                run_id = taken[stage.name].run_id
                plan.reuse_from[run_id] = plan.reuse_from.get(run_id, 0) + 1
                if keys[position][stage.name] not in earlier:
                    words = despite.changed[position][stage.name]
                    plan.despite[words] = plan.despite.get(words, 0) + 1
                continue
            plan.run += 1
            why = _why(
                stage.name,
                stage.reuse,
                chosen,
                found.get(keys[position][stage.name]),
                distrust,
                [need for need in stage.needs if need not in taken],
                previous.get((item.key, stage.name)),
                bodies[item.key][stage.name],
            )
            plan.why[why] = plan.why.get(why, 0) + 1
    for stage in config.stages:
        plans[stage.name].paid = bool(stage.expected_usage) or stage.name in measured
        plans[stage.name].cost = _cost(stage.expected_usage, measured.get(stage.name, {}))
    to_run = {name: plan.run for name, plan in plans.items()}
    expected: dict[str, float] = {}
    for stage in config.stages:
        for key, amount in stage.expected_usage.items():
            expected[key] = expected.get(key, 0.0) + to_run[stage.name] * amount
    return RunPlan(
        pipeline=config.name,
        stages=[plans[stage.name] for stage in config.stages],
        budgets=usage.budget_plan(config, to_run),
        expected=dict(sorted(expected.items())),
        limits=usage.limit_plan(config, to_run),
        reuse_despite=list(despite.stages),
    )


def _all_new(config: PipelineConfig) -> RunPlan:
    count = len(config.items[: config.batch_cap] if config.batch_cap else config.items)
    stages = [
        StagePlan(
            s.name,
            run=count,
            why={NEVER_RUN: count} if count else {},
            paid=bool(s.expected_usage),
            cost=_cost(s.expected_usage, {}),
        )
        for s in config.stages
    ]
    to_run = {s.stage: s.run for s in stages}
    expected: dict[str, float] = {}
    for stage in config.stages:
        for key, amount in stage.expected_usage.items():
            expected[key] = expected.get(key, 0.0) + count * amount
    return RunPlan(
        config.name,
        stages,
        usage.budget_plan(config, to_run),
        expected,
        usage.limit_plan(config, to_run),
    )


def _why(
    stage: str,
    allowed: bool,
    rerun: frozenset[str],
    found: Any,
    distrust: dict[int, str],
    needs_running: list[str],
    before: dict[str, Any] | None,
    now: dict[str, Any],
) -> str:
    """Why one job runs, in a few words (counted per stage)."""
    if not allowed:
        return "reuse = false"
    if "all" in rerun or stage in rerun:
        return "--rerun"
    if found is not None and found.attempt_id in distrust:
        return "an output of its earlier attempt is gone from the store"
    if found is None and before is None:
        return NEVER_RUN
    if needs_running:
        return f"{', '.join(needs_running)} runs again"
    if found is not None or before is None:
        return "its inputs differ from what the earlier attempt read"
    return what_changed(before, now)


def what_changed(before: dict[str, Any], now: dict[str, Any]) -> str:
    """What differs between two ``reuse.key_body``s, in words: the first of the stage's
    definition, the item, a file, what it needs."""
    if before.get("version") != now.get("version"):
        return "the reuse key's rule changed"
    if before["stage"] != now["stage"]:
        parts = sorted(
            k
            for k in set(before["stage"]) | set(now["stage"])
            if before["stage"].get(k) != now["stage"].get(k)
        )
        return f"stage {', '.join(parts)} changed"
    if before["item"] != now["item"]:
        return "item fields changed"
    changed = [
        os.path.basename(path)
        for path in sorted(set(before["sources"]) | set(now["sources"]))
        if before["sources"].get(path) != now["sources"].get(path)
    ]
    if changed:
        return f"{', '.join(changed)} changed"
    needs = [n for n in sorted(now["needs"]) if before["needs"].get(n) != now["needs"].get(n)]
    if needs:
        return f"{', '.join(needs)} runs again"
    return "no earlier success (it failed or never ran)"


def _previous_bodies(
    session: Session, config: PipelineConfig, wanted: list[tuple[str, str]]
) -> dict[tuple[str, str], dict[str, Any]]:
    """(item key, stage) -> the key body of the newest earlier job of the same pipeline,
    item and stage, from its run's frozen config and source hashes."""
    newest: dict[tuple[str, str], tuple[int, int]] = {}
    keys = sorted({item for item, _ in wanted})
    for start in range(0, len(keys), CHUNK):
        chunk = keys[start : start + CHUNK]
        names = ", ".join(f":k{i}" for i in range(len(chunk)))
        rows = session.execute(
            text(
                "SELECT i.key, j.stage, j.run_id, i.id FROM jobs j "
                "JOIN items i ON i.id = j.item_id JOIN runs r ON r.id = j.run_id "
                f"WHERE r.name = :name AND i.key IN ({names}) ORDER BY j.id DESC"
            ),
            {"name": config.name, **{f"k{i}": k for i, k in enumerate(chunk)}},
        ).all()
        for item_key, stage, run_id, item_id in rows:
            newest.setdefault((item_key, stage), (run_id, item_id))
    bodies: dict[tuple[str, str], dict[str, Any]] = {}
    runs: dict[int, tuple[PipelineConfig, dict[str, str]] | None] = {}
    for pair in wanted:
        if pair not in newest:
            continue
        run_id, item_id = newest[pair]
        if run_id not in runs:
            frozen, hashes = session.execute(
                text("SELECT config_json, source_hashes FROM runs WHERE id = :id"), {"id": run_id}
            ).one()
            try:
                runs[run_id] = (config_from_frozen(frozen), _json(hashes))
            except ValueError:
                runs[run_id] = None
        known = runs[run_id]
        if known is None:
            continue
        key, lane, fields = session.execute(
            text("SELECT key, lane, fields FROM items WHERE id = :id"), {"id": item_id}
        ).one()
        item = ItemConfig.model_validate({**_json(fields), "key": key, "lane": lane})
        old_bodies = reuse.item_key_bodies(known[0], item, known[1])
        if pair[1] in old_bodies:
            bodies[pair] = old_bodies[pair[1]]
    return bodies


def _measured_costs(
    session: Session, config: PipelineConfig
) -> dict[str, dict[str, tuple[float, int]]]:
    """Stage -> usage key -> (the p90 of the newest ``usage.P90_WINDOW`` values the
    pipeline's earlier attempts of the stage reported, how many), for the stages of
    ``config`` whose earlier attempts (same pipeline) reported usage."""
    pairs = session.execute(
        text(
            "SELECT DISTINCT u.stage, u.key FROM attempt_usage u "
            "JOIN runs r ON r.id = u.run_id WHERE r.name = :name"
        ),
        {"name": config.name},
    ).all()
    names = {stage.name for stage in config.stages}
    found: dict[str, dict[str, tuple[float, int]]] = {}
    for stage, key in pairs:
        if stage not in names:
            continue
        values = session.execute(
            text(
                "SELECT u.value FROM attempt_usage u JOIN runs r ON r.id = u.run_id "
                "WHERE r.name = :name AND u.stage = :stage AND u.key = :key "
                "ORDER BY u.attempt_id DESC LIMIT :window"
            ),
            {"name": config.name, "stage": stage, "key": key, "window": usage.P90_WINDOW},
        ).scalars()
        listed = [float(value) for value in values]
        measured = usage.p90(listed)
        if measured is not None:
            found.setdefault(stage, {})[key] = (measured, len(listed))
    return found


def _cost(
    expected_usage: dict[str, float], measured: dict[str, tuple[float, int]]
) -> dict[str, dict[str, Any]]:
    """Usage key -> what one job of a stage costs: measured where earlier attempts
    reported the key, else its ``expected_usage``."""
    cost: dict[str, dict[str, Any]] = {
        key: {"per_job": float(amount), "from": "expected_usage"}
        for key, amount in expected_usage.items()
    }
    for key, (value, count) in measured.items():
        cost[key] = {"per_job": value, "from": f"p90 of {count} earlier attempt(s)"}
    return dict(sorted(cost.items()))


def _json(value: Any) -> dict[str, Any]:
    if isinstance(value, dict):
        return value
    import json

    loaded = json.loads(value) if value else {}
    return loaded if isinstance(loaded, dict) else {}
