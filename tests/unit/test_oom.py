"""workers.oom: finding the memory cgroup's oom_kill counter, reading it, and the rule
that names an attempt OOM-killed; controller.oom: the evidence line round trip."""

from __future__ import annotations

from pathlib import Path

from laneway.controller import oom
from laneway.workers.oom import OomCounter, locate, name_oom

V2_CGROUP = "0::/workers/w1\n"
V1_CGROUP = "5:cpu:/\n4:memory:/box/w1\n0::/\n"


def mountinfo(tmp_path: Path) -> str:
    return (
        f"31 23 0:28 / {tmp_path} rw - tmpfs tmpfs rw\n"
        f"35 31 0:32 / {tmp_path / 'memory'} rw - cgroup cgroup rw,memory\n"
        f"41 31 0:38 / {tmp_path / 'unified'} rw - cgroup2 cgroup2 rw\n"
    )


def test_locate_prefers_cgroup_v2_memory_events(tmp_path):
    events = tmp_path / "unified" / "workers" / "w1" / "memory.events"
    events.parent.mkdir(parents=True)
    events.write_text("oom 2\noom_kill 2\n")
    assert locate(V2_CGROUP, mountinfo(tmp_path)) == events
    assert OomCounter(events).read() == 2


def test_locate_falls_back_to_cgroup_v1_then_to_nothing(tmp_path):
    control = tmp_path / "memory" / "box" / "w1" / "memory.oom_control"
    control.parent.mkdir(parents=True)
    control.write_text("oom_kill_disable 0\nunder_oom 0\noom_kill 7\n")
    # The v2 hierarchy is there but has no memory.events for us (no memory controller).
    assert locate(V1_CGROUP + V2_CGROUP, mountinfo(tmp_path)) == control
    assert OomCounter(locate(V1_CGROUP, mountinfo(tmp_path))).read() == 7
    assert locate(V2_CGROUP, mountinfo(tmp_path)) is None
    assert locate("", "") is None


def test_a_missing_or_odd_counter_reads_as_unknown(tmp_path):
    assert OomCounter(None).read() is None
    assert OomCounter(tmp_path / "gone").read() is None
    odd = tmp_path / "memory.events"
    odd.write_text("oom_kill many\n")
    assert OomCounter(odd).read() is None
    proc = tmp_path / "proc"
    proc.mkdir()  # no cgroup, no mountinfo: no counter, no error
    assert OomCounter.of_this_process(str(proc)).path is None


NUMBERS = {"mem_available_mib": 5000.0, "memory_floor_mib": 1024, "peak_rss_mib": 812.25}


def test_only_a_sigkill_laneway_did_not_send_is_named():
    rose = {"kills_at_start": 1, "kills_now": 2, **NUMBERS}
    assert name_oom({"signal": 9}, **rose) == oom.evidence("cgroup", **NUMBERS)
    for laneways_own in ({"timed_out": True}, {"stopped": True}):
        assert name_oom({"signal": 9, **laneways_own}, **rose) is None
    assert name_oom({"signal": 15}, **rose) is None
    assert name_oom({"exit_code": 137}, **rose) is None
    assert name_oom(None, **rose) is None


def test_without_a_rise_free_memory_under_the_floor_names_it():
    same = {"kills_at_start": 2, "kills_now": 2}
    assert name_oom({"signal": 9}, **same, **NUMBERS) is None
    short = NUMBERS | {"mem_available_mib": 1000.0}
    found = name_oom({"signal": 9}, kills_at_start=None, kills_now=None, **short)
    assert found == oom.evidence("free_memory", **short)
    unknown = NUMBERS | {"mem_available_mib": None}
    assert name_oom({"signal": 9}, kills_at_start=None, kills_now=None, **unknown) is None


def test_the_evidence_line_round_trips():
    found = oom.evidence("cgroup", **NUMBERS)
    assert found["peak_rss_mib"] == round(812.25, 1)
    line = oom.diagnostic(found)
    assert line.startswith("oom_killed {")
    assert oom.from_diagnostics(["result.json is not valid JSON", line]) == found
    assert oom.from_diagnostics(["oom_killed not json", "other"]) is None
    assert oom.from_diagnostics(None) is None
