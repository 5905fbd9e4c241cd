"""Turning laneway's JSON-able results into text for people."""

from __future__ import annotations

import json
import re
from typing import Any

from laneway.controller import advice
from laneway.controller.codes import RefusalCode
from laneway.controller.status_model import (
    Closeout,
    RunningAttempt,
    StatusReport,
    held_gpus_words,
    seams_words,
)

_CONTROL_CHARS = re.compile(
    r"\x1b\[[0-9;?]*[A-Za-z]|\x1b\][^\x07\x1b]*(?:\x07|\x1b\\)|[\x00-\x08\x0b-\x1f\x7f]"
)
"""Whole CSI and OSC escape sequences first, then any other control character (not \\n
or \\t): each becomes one "?"."""


def clean(text: Any) -> str:
    """Neutralise terminal escapes and carriage returns that came from job output."""
    return _CONTROL_CHARS.sub("?", str(text))


def as_json(data: Any) -> str:
    if isinstance(data, StatusReport):
        data = data.as_dict()
    return json.dumps(data, indent=2, sort_keys=False, default=str)


def table(headers: list[str], rows: list[list[Any]]) -> str:
    cells = [[clean("" if v is None else v) for v in row] for row in rows]
    widths = [len(h) for h in headers]
    for row in cells:
        for i, value in enumerate(row):
            widths[i] = max(widths[i], len(value))
    lines = ["  ".join(h.ljust(w) for h, w in zip(headers, widths, strict=True)).rstrip()]
    lines += [
        "  ".join(v.ljust(w) for v, w in zip(row, widths, strict=True)).rstrip() for row in cells
    ]
    return "\n".join(lines)


def duration(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    seconds = int(seconds)
    hours, rest = divmod(seconds, 3600)
    minutes, secs = divmod(rest, 60)
    if hours:
        return f"{hours} h {minutes:02d} m"
    if minutes:
        return f"{minutes} m {secs:02d} s"
    return f"{secs} s"


def status_text(status: StatusReport) -> str:
    run = status.run
    out = [
        f"run {run.id} ({run.name}) — {run.state}; started {run.created_at}"
        + (f", finished {run.finished_at}" if run.finished_at else "")
    ]
    said = controller_line(status)
    if said:
        out.append(clean(said))
    step = advice.report_step(status)
    if step is not None:
        out.append(clean(f"next step: {step.line()}"))
    if status.unknown:
        out.append("")
        out.append(f"UNKNOWN OUTCOMES — dispatch halted until reconciled ({len(status.unknown)}):")
        for u in status.unknown:
            out.append(f"  attempt {u.attempt_id} {u.item}.{u.stage}: {clean(u.reason)}")
            out.append(f"    evidence: {u.evidence}")
            conclusive = u.conclusive
            if conclusive:
                out.append(
                    f"    CONCLUSIVE: settles as {conclusive['outcome']} — "
                    f"{clean(conclusive['words'])}"
                )
                out.append(f"    settle:   {conclusive['settle']}")
            else:
                out.append(f"    resolve:  {u.reconcile}")
    if status.controls:
        out.append("")
        out.append("controls:")
        for c in status.controls:
            where = c.scope + (f" {c.lane}" if c.lane else "")
            out.append(f"  {c.kind} ({where}) by {c.set_by} at {c.set_at}: {clean(c.reason)}")
    states = [
        "waiting",
        "ready",
        "running",
        "unknown",
        "succeeded",
        "failed",
        "skipped",
        "cancelled",
    ]
    out.append("")
    rows = [[stage, *(by.get(s, 0) or "" for s in states)] for stage, by in status.jobs.items()]
    rows.append(["total", *(status.totals.get(s, 0) or "" for s in states)])
    out.append(table(["stage", *states], rows))
    if status.reused:
        taken = ", ".join(f"{stage} {count}" for stage, count in status.reused.items())
        out.append(
            f"reused from earlier runs (succeeded, not run again): {taken} "
            "(see the v_reused_jobs view)"
        )
    for waiting in status.retry_backoff:
        out.append(
            f"retry backoff: job {waiting.job_id} ({waiting.item}.{waiting.stage}) "
            f"retry_after {waiting.retry_after}"
        )
    classes = sorted({o for by in status.outcomes.values() for o in by})
    if classes:
        out.append("")
        out.append("attempt outcomes:")
        out.append(
            table(
                ["stage", *classes],
                [[s, *(by.get(c, "") for c in classes)] for s, by in status.outcomes.items()],
            )
        )
    if status.running:
        out.append("")
        out.append("running:")
        out.append(
            table(
                ["attempt", "item", "stage", "lane", "node", "pid", "elapsed", "timeout", "state"],
                [
                    [
                        r.attempt_id,
                        r.item,
                        r.stage,
                        r.lane,
                        r.node,
                        r.pid,
                        duration(r.elapsed_seconds),
                        duration(r.timeout_seconds),
                        clean(attempt_state_words(r)),
                    ]
                    for r in status.running
                ],
            )
        )
        out += [  # the devices each holds: what its job sees in CUDA_VISIBLE_DEVICES
            clean(f"  attempt {r.attempt_id} holds {held_gpus_words(r.gpus)}")
            for r in status.running
            if r.gpus
        ]
    out += workers_text(status)
    out.append("")
    out.append("lanes:")
    lane_rows = []
    unserved = {entry.node for entry in status.no_worker}
    for lane in status.lanes:
        step = advice.lane_step(lane, status)
        if lane.running:
            state = f"{lane.running} running"
            doubts = unverified_words(status, lane.lane)
            if doubts:
                state += f" (UNVERIFIED: {doubts})"
            elif lane.node in unserved:
                state += " (no live worker on its node)"
        elif step.code == advice.DONE:
            state = "done"
        elif lane.reason:
            state = f"idle {duration(lane.idle_seconds)}: {clean(lane.reason.words)}"
        else:
            state = f"idle {duration(lane.idle_seconds)}"
        lane_rows.append(
            [
                lane.lane,
                lane.node,
                lane.ready,
                lane.waiting,
                lane.done,
                lane.last_start or "-",
                state,
                clean(advice.action_words(step) or "-"),
            ]
        )
    headers = ["lane", "node", "ready", "waiting", "done", "last start", "now", "what to do"]
    out.append(table(headers, lane_rows))
    out += placement_lines(
        [(p.stage, p.nodes, p.words, p.runs_on, p.no_live_worker) for p in status.placement]
    )
    t = status.throughput
    out.append("")
    out.append(f"throughput: {t.settled_attempts} settled attempts, {t.per_hour}/hour")
    out.append(f"closeout: {closeout_words(status.closeout)}")
    if status.recent_events:
        out.append("")
        out.append("recent events:")
        for e in status.recent_events:
            target = f"job {e.job_id}" if e.job_id else ""
            target += f" attempt {e.attempt_id}" if e.attempt_id else ""
            detail = ", ".join(f"{k}={v}" for k, v in e.detail.items() if v is not None)
            out.append(clean(f"  #{e.id} {e.at} {e.kind} {target} {detail}".rstrip()))
    return "\n".join(out)


def controller_line(status: StatusReport) -> str | None:
    """The controller in one line (``StatusReport.controller``): ``controller: running
    (pid N)``; ``controller: GONE — ...`` (or ``STOPPED``) only while the run's next step
    is ``no_controller`` (it has work it could do); a stopped or gone controller beside a
    run that needs a person first as a plain fact; or ``unknown`` and why. None when the
    report does not say (JSON written before it did)."""
    controller = status.controller
    if controller is None:
        return None
    if controller.state == "running":
        return f"controller: running (pid {controller.pid})"
    if controller.state in ("gone", "stopped"):
        if status.run.finished:
            return "controller: none running (the run is finished)"
        step = advice.report_step(status)
        if step is not None and step.code == advice.NO_CONTROLLER:
            return f"controller: {controller.state.upper()} — {controller.words}"
        # A fact, not an alarm: the run needs a person first (the next step says what).
        return f"controller: {controller.words} (none is needed before the next step is taken)"
    return f"controller: {controller.words}"


def attempt_state_words(attempt: RunningAttempt) -> str:
    """An in-flight attempt's state as every view shows it: ``running`` / ``intent``
    while its worker is live, else ``unverified: worker w-1 stale for 12 s``."""
    if attempt.verified:
        return attempt.state
    return f"unverified: {attempt.unverified_because}"


def unverified_words(status: StatusReport, lane: str) -> str | None:
    """Why the lane's in-flight attempts are not known to run, if any is not: each
    distinct reason once (``worker w-1 stale for 12 s``)."""
    because = [r.unverified_because for r in status.running if r.lane == lane and not r.verified]
    found = list(dict.fromkeys(b for b in because if b))
    return "; ".join(found) if found else None


def workers_text(status: StatusReport) -> list[str]:
    """The workers section: each worker of the run's nodes (active ones, the last few
    stopped or lost), then every node no live worker serves, with the command that
    starts one."""
    out = ["", "workers:"]
    if status.workers:
        out.append(
            table(
                ["node", "worker", "pid", "host", "heartbeat", "slots", "state"],
                [
                    [
                        w.node,
                        w.worker_id,
                        w.pid,
                        w.host,
                        f"{duration(max(0.0, w.heartbeat_age_seconds))} ago",
                        w.slots,
                        w.liveness_words(),
                    ]
                    for w in status.workers
                ],
            )
        )
        out += [
            f"  {w.worker_id} seams: {words}"
            for w in status.workers
            if (words := seams_words(w.seams))
        ]
    if status.nodes:
        out += ["", "nodes:"]
        out.append(
            table(
                ["node", "live workers", "last heartbeat", "free memory", "floor", "running"],
                [
                    [
                        n.node,
                        n.live_workers,
                        "never"
                        if n.heartbeat_age_seconds is None
                        else f"{duration(max(0.0, n.heartbeat_age_seconds))} ago",
                        "-" if n.mem_available_mib is None else f"{n.mem_available_mib:.0f} MiB",
                        f"{n.memory_floor_mib} MiB" if n.memory_floor_mib is not None else "-",
                        f"{n.running}/{n.max_jobs}",
                    ]
                    for n in status.nodes
                ],
            )
        )
        for n in status.nodes:
            out += [clean(line) for line in gpu_lines(n.node, n.gpus)]
    held = advice.run_concern(status) is not None
    for entry in status.no_worker:
        out.append(
            clean(
                f"  node {entry.node}: no live worker (none is needed before the run's next "
                "step is taken)"
                if held
                else f"  node {entry.node}: no live worker — start one: {entry.start}"
            )
        )
    return out if len(out) > 2 else []


def gpu_lines(node: str, gpus: list[dict[str, Any]]) -> list[str]:
    """One line per device of ``node``: its use (ours and others'), and whether the
    figures are described (``--gpu-description``) or measured."""
    lines = []
    for d in gpus:
        how = f"described by {d['described']}" if d.get("described") else "measured"
        name = f" ({d['uuid']})" if d.get("uuid") else ""
        lines.append(
            f"  {node} GPU {d.get('index')}{name}: {d.get('used_mib', 0):.0f} of "
            f"{d.get('total_mib', 0):.0f} MiB used (ours {d.get('ours_mib', 0):.0f}, others "
            f"{d.get('baseline_mib', 0):.0f}) — {how}"
        )
    return lines


def placement_lines(
    stages: list[tuple[str, list[str] | None, str, list[str], list[str]]],
) -> list[str]:
    """Where each stage runs (its name, its ``nodes``, their words, the nodes it runs on
    and those no live worker serves), when any stage names its ``nodes`` (else every
    stage runs on its lane's node and nothing is said); a node no live worker serves is
    named."""
    if not any(nodes for _name, nodes, _words, _runs_on, _unserved in stages):
        return []
    out = ["", "stages run on:"]
    for name, nodes, placed, runs_on, unserved in stages:
        words = f"  {name}: {placed}"
        if not nodes:
            words += f" ({', '.join(runs_on)})"
        for node in unserved:
            words += f"; no live worker on node {node}"
        out.append(clean(words))
    return out


def closeout_words(closeout: Closeout) -> str:
    """``none``, ``pending (N steps)``, ``running step K of N (NAME)``, ``finished (N
    steps)`` or ``failed: NAME (STATE, exit C), ...``."""
    state, count = closeout.state, closeout.step_count
    steps = f"{count} step{'s' if count != 1 else ''}"
    if state == "none":
        return "none"
    if state == "pending":
        return f"pending ({steps}; they run when the run finishes or is stopped)"
    if state == "finished":
        return f"finished ({steps} succeeded)"
    failed = []
    for step in closeout.steps:
        if step.name in closeout.failed_steps:
            code = "" if step.exit_code is None else f", exit {step.exit_code}"
            failed.append(f"{step.name} ({step.state}{code})")
    if state == "running":
        words = f"running step {closeout.step} of {count} ({closeout.current})"
        return words + (f"; failed so far: {', '.join(failed)}" if failed else "")
    return clean(f"failed: {', '.join(failed)} (of {steps})")


def explain_text(report: dict[str, Any]) -> str:
    out = [
        f"job {report['job_id']} ({report['item']}.{report['stage']}, lane {report['lane']}, "
        f"run {report['run_id']}): {report['state']}"
        + (f" — {clean(report['state_reason'])}" if report["state_reason"] else "")
    ]
    step = report.get("next_step")
    if step and step.get("command"):
        out.append(clean(f"next step: {step['words']}: {step['command']}"))
    worker = report.get("worker") or {}
    held = report.get("run_concern") is not None  # the run needs a person first
    unserved = (
        not held
        and not worker.get("live", True)
        and report["state"] in ("waiting", "ready", "running")
    )
    if unserved:
        out.append(
            clean(
                f"no worker is running on node {worker['node']}: nothing will claim or settle "
                f"its jobs; start one: {worker['start']}"
            )
        )
    others = [b for b in report["blocked_by"] if b["code"] != RefusalCode.NO_WORKER]
    if others:
        out.append("also blocked by:" if unserved else "blocked by:")
        out += [f"  {clean(b['words'])}" for b in others]
    elif report["state"] == "ready":
        out.append(
            "nothing else blocks it: a worker on its node can start it"
            if unserved
            else "nothing blocks it: the next claim on its node can start it"
        )
    chose = report.get("selection")
    if chose:
        yields = ", ".join(
            f"{group} {'not measured' if y is None else f'{y:g}'}"
            for group, y in sorted(chose["yields"].items())
        )
        out.append(
            clean(
                f"chosen by the run's selection: group {chose['group']} ({chose['why']}; "
                f"{chose['by']} per {chose['per']}: {yields or 'nothing measured'})"
            )
        )
    behind = report.get("waits_behind")
    if behind and behind["count"]:
        shown = ", ".join(f"{j['job']} (priority {j['priority']})" for j in behind["jobs"])
        more = behind["count"] - len(behind["jobs"])
        out.append(
            clean(
                f"priority {behind['priority']}: waits behind {behind['count']} ready job(s) of "
                f"higher priority: {shown}" + (f" and {more} more" if more > 0 else "")
            )
        )
    out += _placement_lines(report)
    out += _settled_lines(report)
    arithmetic = report.get("arithmetic")
    if arithmetic:
        a = arithmetic
        source = (
            f"max(configured {a['configured_mib']}, peak {a['measured_peak_mib']} x "
            f"{a['memory_margin']})"
            if a["learn_memory"] and a["measured_peak_mib"] is not None
            else f"configured {a['configured_mib']}"
        )
        if a["free_mib"] is None:
            out.append(f"memory on node {a['node']}: free unknown (no worker has reported yet)")
        else:
            out.append(
                f"memory on node {a['node']}: free {a['free_mib']} - unreleased "
                f"{a['unreleased_mib']} - reservation {a['reservation_mib']} ({source}) - floor "
                f"{a['floor_mib']} = {a['headroom_after_mib']} MiB"
            )
        out.append(f"jobs on node: {a['running_on_node']} of max {a['max_jobs']}")
    attempt = report.get("attempt")
    if attempt:
        out.append(
            f"attempt {attempt['attempt_id']}: {attempt['state']}, pid {attempt['pid']}"
            + (f" — {clean(attempt['reason'])}" if attempt["reason"] else "")
        )
        if attempt.get("gpus"):
            out.append(clean(f"  holds {held_gpus_words(attempt['gpus'])}"))
    return "\n".join(out)


def _placement_lines(report: dict[str, Any]) -> list[str]:
    """Where the job's stage runs and, per node, why it is not taking the job."""
    place = report.get("placement")
    if not place:
        return []
    where = place["words"] if place["nodes"] else f"{place['words']} ({place['lane_node']})"
    out = [f"runs on: {where}"]
    for entry in place["per_node"]:
        if entry["why_not"] and (place["nodes"] or not entry["runs_it"]):
            reasons = "; ".join(b["words"] for b in entry["why_not"])
            out.append(clean(f"  node {entry['node']}: {reasons}"))
    return out


def _settled_lines(report: dict[str, Any]) -> list[str]:
    """A failed, cancelled or skipped job's last attempt, the end of its stderr, and the
    retry command."""
    out: list[str] = []
    attempt = report.get("last_attempt")
    if attempt:
        ended = []
        if attempt["exit_code"] is not None:
            ended.append(f"exit code {attempt['exit_code']}")
        if attempt["exit_signal"] is not None:
            name = f" ({attempt['signal_name']})" if attempt["signal_name"] else ""
            ended.append(f"signal {attempt['exit_signal']}{name}")
        out.append(
            clean(
                f"attempt {attempt['attempt_id']} (the job's attempt {attempt['number']}): "
                f"{attempt['outcome'] or attempt['state']}"
                + (f", {', '.join(ended)}" if ended else ", no exit code recorded")
                + (f" — {attempt['reason']}" if attempt["reason"] else "")
            )
        )
        out.append(clean(f"  directory: {attempt['attempt_dir']}"))
        tail = attempt["stderr_tail"]
        if tail is None:
            out.append(clean(f"  stderr.log: {attempt['stderr_unreadable']}"))
        elif not tail:
            out.append("  stderr.log: empty")
        else:
            out.append(f"  last {len(tail)} line(s) of stderr.log:")
            out += [clean(f"    {line}") for line in tail]
    elif "last_attempt" in report:
        out.append("no attempt was made")
    retry = report.get("retry")
    if retry and retry.get("sources_changed"):
        files = ", ".join(retry["sources_changed"])
        out.append(
            clean(
                f"a retry cannot work: the run's frozen sources changed ({files}), so its "
                f"first claim would halt the run; start a new run, which reuses what "
                f"succeeded: {retry['command']}"
            )
        )
    elif retry:
        which = "" if retry["job_id"] == report["job_id"] else " (the failed job it depends on)"
        out.append(clean(f"retry{which}: {retry['command']}"))
    return out


def report_text(report: dict[str, Any]) -> str:
    # Only `laneway report` needs these (`status` does not import them).
    from laneway.cli import artifacts_text, oom_text, spend_text
    from laneway.controller.report_window import window_text

    run = report["run"]
    out = [
        clean(
            f"run {run['id']} ({run['name']}) — {run['state']}; {window_text(report)}, "
            f"window {duration(report['window_seconds'])}"
        )
    ]
    step = report.get("next_step")
    if step:
        out.append(
            clean(
                f"next step: {step['words']}" + (f": {step['command']}" if step["command"] else "")
            )
        )
    rows = []
    for name, lane in report["lanes"].items():
        wait = lane["queue_wait_seconds"] or {}
        rows.append(
            [
                name,
                lane["node"],
                lane["attempts"],
                lane["throughput_per_hour"],
                f"{lane['all_idle_share']:.1%}",
                wait.get("p50", "-"),
                ", ".join(f"{k} {v}" for k, v in lane["failures_by_class"].items()) or "-",
            ]
        )
    out.append(
        table(["lane", "node", "attempts", "per hour", "all idle", "wait p50 s", "failures"], rows)
    )
    for name, lane in report["lanes"].items():
        for stage, p in lane["stage_duration_seconds"].items():
            if p:
                out.append(
                    f"  lane {name} {stage}: p50 {p['p50']} s, p90 {p['p90']} s, max {p['max']} s"
                )
        for gap in lane["idle_periods"]:
            reasons = "; ".join(gap["reasons"]) or "no recorded refusal"
            out.append(
                clean(
                    f"  lane {name} idle {duration(gap['seconds'])} from "
                    f"+{gap['start']:.0f} s: {reasons}"
                )
            )
    out += spend_text.usage_lines(report.get("usage"))
    reused = report.get("reused") or {}
    if reused.get("total"):
        stages = ", ".join(f"{stage} {n}" for stage, n in reused["by_stage"].items())
        runs = ", ".join(f"run {r}: {n}" for r, n in reused["from_runs"].items())
        out.append(
            f"reused from earlier runs (linked, not run): {reused['total']} jobs; "
            f"per stage: {stages}; from {runs}"
        )
    out += selection_lines(report.get("selection"))
    out += oom_text.low_water_lines(report.get("node_memory"))
    out += oom_text.oom_lines(report.get("oom_kills"))
    out += artifacts_text.traffic_lines(report.get("artifacts"))
    out.append(f"HTML timeline: {report['html']}")
    return "\n".join(out)


def selection_lines(selection: dict[str, Any] | None) -> list[str]:
    """A run that selects by yield: each group's admissions (per tenth of the window)
    beside its yield."""
    if not selection:
        return []
    lines = [
        clean(
            f"selection by {selection['by']} per {selection['per']} (explore "
            f"{selection['explore']:g}; {selection['explored']} admission(s) explored):"
        )
    ]
    for group in selection["groups"]:
        measured = "not measured" if group["yield"] is None else f"yield {group['yield']:g}"
        lines.append(
            clean(
                f"  {group['group']}: {group['admitted']} admitted, {measured}; per tenth of "
                f"the window: {' '.join(str(n) for n in group['over_time'])}"
            )
        )
    return lines
