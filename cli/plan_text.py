"""`laneway dry-run`'s plan as text: its stages, where they run, their retry policies,
the closeout steps, the artifacts handed on, capacity and the first admission decisions
(``plan_text``)."""

from __future__ import annotations

import shlex
from typing import Any

from laneway.cli.render import clean, duration, placement_lines, table


def artifact_plan_lines(artifacts: dict[str, Any] | None) -> list[str]:
    """Dry-run: the artifact store and the stages that hand files on (none: nothing)."""
    if not artifacts or not artifacts["handoffs"]:
        return []
    store = artifacts["store"] or "default: artifacts/ under each worker's runtime dir"
    out = ["", f"artifacts: store {store}"]
    for handoff in artifacts["handoffs"]:
        out.append(f"  {handoff['from']} -> {handoff['to']}: {', '.join(handoff['outputs'])}")
    out += [f"  warning: {warning}" for warning in artifacts["warnings"]]
    return out


def retry_words(retry: dict[str, Any]) -> str:
    """A stage's retry policy (``RetryPolicy`` as a dict) in words, for ``dry-run``."""
    attempts, on = retry["max_attempts"], retry["on"]
    if attempts <= 1 or not on:
        if attempts > 1:
            return f"no automatic retry (max_attempts {attempts}, but retry.on names no outcome)"
        return "no automatic retry (max_attempts 1): a failed job waits for `laneway retry`"
    words = f"up to {attempts} attempts, retried on {' or '.join(on)}"
    if retry["backoff_seconds"] <= 0:
        return words + ", at once"
    words += f"; the first retry waits {duration(retry['backoff_seconds'])}"
    if retry["backoff_multiplier"] != 1 and attempts > 2:
        words += f", x{retry['backoff_multiplier']:g} each time"
    return words + f", at most {duration(retry['backoff_max_seconds'])}"


def plan_retry_lines(stages: list[dict[str, Any]]) -> list[str]:
    """``dry-run``'s retry policy per stage."""
    return ["", "retry:", *(f"  {s['name']}: {retry_words(s['retry'])}" for s in stages)]


def plan_closeout_lines(steps: list[dict[str, Any]]) -> list[str]:
    """``dry-run``'s closeout steps, in order, with their timeouts."""
    if not steps:
        return ["", "closeout: none"]
    out = ["", "closeout (once the run finishes, or is stopped and drained), in order:"]
    for step in steps:
        where = f", cwd {clean(step['cwd'])}" if step.get("cwd") else ""
        out.append(
            f"  {step['name']}: {clean(shlex.join(step['argv']))} "
            f"(timeout {duration(step['timeout_seconds'])}{where})"
        )
    return out


def plan_text(plan: dict[str, Any]) -> str:
    items = plan["items"]
    out = [
        f"pipeline {plan['pipeline']} (config sha256 {plan['config_sha256'][:12]}…)",
        f"items: {items['taken']} taken"
        + (
            f", {items['deferred_by_batch_cap']} deferred by batch_cap"
            if items["deferred_by_batch_cap"]
            else ""
        )
        + f"; jobs: {plan['jobs_total']}",
        "",
    ]
    lanes = sorted({lane for by in plan["jobs_per_stage_and_lane"].values() for lane in by})
    stages = {s["name"]: s for s in plan["stages"]}
    rows = []
    for stage, by in plan["jobs_per_stage_and_lane"].items():
        s = stages[stage]
        rows.append(
            [
                stage,
                ",".join(s["needs"]) or "-",
                *(by[lane] for lane in lanes),
                duration(s["timeout_seconds"]),
                s["memory_mib"],
                s["cap"] if s["cap"] is not None else "-",
            ]
        )
    out.append(
        table(
            ["stage", "needs", *(f"lane {lane}" for lane in lanes), "timeout", "mem MiB", "cap"],
            rows,
        )
    )
    out += placement_lines(
        [
            (
                stage["name"],
                stage.get("nodes"),
                stage["placement" if "placement" in stage else "words"],
                stage["runs_on"],
                stage.get("no_live_worker") or [],
            )
            for stage in plan["stages"]
        ]
    )
    out += plan_retry_lines(plan["stages"])
    out += plan_closeout_lines(plan.get("closeout") or [])
    out += artifact_plan_lines(plan.get("artifacts"))
    out.append("")
    out.append("capacity:")
    for node in plan["capacity"]:
        out.append(
            f"  node {node['node']}: max_jobs {node['max_jobs']}, "
            f"free {node['mem_available_mib']} MiB - floor {node['memory_floor_mib']} MiB"
            f" = headroom {node['headroom_mib']} MiB"
        )
    out.append("")
    out.append("first admission decisions:")
    for d in plan["first_decisions"]:
        if d["verdict"] == "dispatch":
            out.append(f"  dispatch {d['item']}.{d['stage']} (lane {d['lane']}, node {d['node']})")
        else:
            out.append(f"  lane {d['lane']} {d['stage'] or ''}: refused — {d['words']}")
    return "\n".join(out)


def reuse_plan_lines(plan: Any) -> list[str]:
    """``laneway plan`` (a ``run_plan.RunPlan``) in words: one line per stage, what
    each paid stage's jobs cost, then the spend."""
    from laneway.controller import usage

    lines = [f"plan of a new run of {plan.pipeline}:"]
    width = max(len(stage.stage) for stage in plan.stages)
    for stage in plan.stages:
        parts = []
        if stage.reuse:
            sources = ", ".join(f"run {run}" for run in sorted(stage.reuse_from))
            despite = "; ".join(
                f"{n} despite {words}: --reuse-despite" for words, n in stage.despite.items()
            )
            parts.append(f"reuse {stage.reuse} (from {sources}{'; ' + despite if despite else ''})")
        if stage.run:
            why = "; ".join(f"{n} {reason}" for reason, n in stage.as_dict()["why"].items())
            parts.append(f"run {stage.run}{' paid' if stage.paid else ''} ({why})")
        lines.append(f"  {stage.stage:<{width}}  {', '.join(parts) or 'no jobs'}")
    for stage in plan.stages:
        if stage.paid and stage.run:
            lines.append(f"  {stage.stage}: {cost_words(stage)}")
    if plan.expected:
        spend = ", ".join(f"{key} {amount:g}" for key, amount in plan.expected.items())
        lines.append(f"expected spend of what runs (expected_usage): {spend}")
    lines += usage.budget_plan_lines(plan.budgets)
    lines += usage.limit_plan_lines(plan.limits)
    return lines


def cost_words(stage: Any) -> str:
    """What a paid stage's jobs to run would cost (a ``run_plan.StagePlan``), or that no
    cost is known."""
    if not stage.cost:
        return (
            f"{stage.run} job(s), no cost known (no expected_usage, and no earlier attempt "
            "reported usage)"
        )
    spend = stage.spend()
    return f"{stage.run} job(s), expected spend " + ", ".join(
        f"{key} {spend[key]:g} ({known['per_job']:g} per job: {known['from']})"
        for key, known in stage.cost.items()
    )


def paid_rerun_words(plan: Any) -> str:
    """Why ``run --new`` / ``start-pipeline --new`` asks (or refuses without a
    terminal): each paid stage that would run again, how many jobs, why (which files
    changed) and what it would spend."""
    parts = []
    for stage in plan.paid_reruns:
        why = "; ".join(f"{n} {reason}" for reason, n in stage.as_dict()["why"].items())
        parts.append(f"{stage.stage}: {stage.reruns} ran before ({why}); {cost_words(stage)}")
    return "this new run would pay again for work that ran before: " + " | ".join(parts)
