"""N no-op jobs (`true`) on 2 slots: laneway beside xargs, task-spooler and GNU parallel.

    .venv/bin/python bench/bench_peers.py
    (options: --sizes 1000,10000  --reps 3  --project DIR)

(peers: `bash bench/setup_peers.sh` first; a missing one prints "not installed".)

For each size N and each repetition, in one invocation and interleaved, it runs:

- laneway: `laneway run CONFIG --runtime-dir DIR --json` on a generated TOML config (one
  node max_jobs=2, memory_floor_mib=0, one lane, one stage argv=["true"], N items), a
  fresh runtime dir per repetition. Started as the console script does (`from laneway.cli.main
  import main`) under the checkout's Python, wrapped so that it reports its own and its
  children's rusage: the CPU split "laneway process" (controller + worker service in
  one process, imports and migration included) vs "supervisors + jobs". The ledger is
  read after the run: every job succeeded, exactly one attempt each. A second laneway
  row gives jobs/s over the ledger's span (first intent to last settle), without the
  process start and migration.
- xargs: `seq N | xargs -P2 -n1 true`;
- task-spooler: own TS_SOCKET and TMPDIR per repetition, `tsp -S 2`, N `tsp -n true`
  enqueued by a shell loop, then `tsp -l` polled (every 10 ms) until all N are finished;
  the server is killed (-K) and reaped (this process is a child subreaper) so its CPU,
  and its jobs', count. The polls' own CPU is subtracted;
- GNU parallel: `seq N | parallel -j2 --joblog LOG true`; the joblog is checked.

Per tool: jobs/s (median and min-max over reps), CPU seconds per job (children's
user+sys from getrusage(RUSAGE_CHILDREN) deltas: this process is a child subreaper, so
orphans and detached servers count), both as ratios vs laneway, and the load average
(1 min) when each rep began: wall time on a shared machine follows the load, CPU per
job much less.
No assertions: numbers to compare.
"""

from __future__ import annotations

import json
import os
import resource
import shutil
import sqlite3
import subprocess
import sys
import tempfile
import time
from datetime import datetime
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common as common

SLOTS = 2

WRAPPER = r"""
import json, os, resource, sys
out = os.environ.pop("LANEWAY_BENCH_RUSAGE")
sys.argv = ["laneway", *sys.argv[1:]]
try:
    from laneway.cli.main import main
    main()
finally:
    me = resource.getrusage(resource.RUSAGE_SELF)
    kids = resource.getrusage(resource.RUSAGE_CHILDREN)
    with open(out, "w") as f:
        json.dump({"self": me.ru_utime + me.ru_stime,
                   "children": kids.ru_utime + kids.ru_stime}, f)
"""


def children_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def write_config(directory: Path, n: int) -> Path:
    lines = [
        'name = "bench-peers"',
        "",
        "[[nodes]]",
        'name = "n1"',
        "memory_floor_mib = 0",
        f"max_jobs = {SLOTS}",
        "",
        "[[lanes]]",
        'name = "a"',
        'node = "n1"',
        "",
        "[[stages]]",
        'name = "noop"',
        'argv = ["true"]',
        "timeout_seconds = 60",
        "",
    ]
    for i in range(n):
        lines += ["[[items]]", f'key = "i{i}"', 'lane = "a"']
    path = directory / "pipeline.toml"
    path.write_text("\n".join(lines) + "\n")
    return path


def _ts(text: str) -> float:
    return datetime.fromisoformat(text).timestamp()


def run_laneway(project: Path, n: int, root: Path) -> dict:
    work = root / "laneway"
    work.mkdir()
    config = write_config(work, n)
    runtime = work / "runtime"
    usage_file = work / "rusage.json"
    env = common.project_env(project, {"LANEWAY_BENCH_RUSAGE": str(usage_file)})
    argv = [common.project_python(project), "-c", WRAPPER, "run", str(config)]
    argv += ["--runtime-dir", str(runtime), "--json"]
    cpu0 = children_cpu()
    started = time.perf_counter()
    proc = subprocess.run(argv, env=env, cwd=str(project), capture_output=True, text=True)
    wall = time.perf_counter() - started
    common.reap_orphans()
    cpu = children_cpu() - cpu0
    result: dict = {"wall": wall, "cpu": cpu, "ok": proc.returncode == 0}
    try:
        split = json.loads(usage_file.read_text())
        result["self"], result["children"] = split["self"], split["children"]
    except (OSError, ValueError, KeyError):
        pass
    try:
        with sqlite3.connect(f"file:{runtime / 'ledger.sqlite3'}?mode=ro", uri=True) as db:
            succeeded = db.execute("select count(*) from jobs where state='succeeded'").fetchone()
            attempts = db.execute(
                "select count(*), count(distinct job_id) from attempts"
            ).fetchone()
            span = db.execute("select min(intent_at), max(settled_at) from attempts").fetchone()
        result["check"] = f"{succeeded[0]} ok, {attempts[0] - attempts[1]} dup"
        result["ok"] = result["ok"] and succeeded[0] == n and attempts[0] == n
        if span[0] and span[1]:
            result["span"] = _ts(span[1]) - _ts(span[0])
    except sqlite3.Error as exc:
        result["ok"] = False
        result["check"] = f"ledger: {exc}"
    if proc.returncode != 0:
        last = (proc.stderr.strip().splitlines() or [""])[-1]
        result["check"] = f"exit {proc.returncode}: {last[-100:]}"
    return result


def run_xargs(n: int, root: Path) -> dict:
    if not shutil.which("xargs"):
        return {"missing": True}
    cpu0 = children_cpu()
    started = time.perf_counter()
    proc = subprocess.run(
        ["sh", "-c", f"seq {n} | xargs -P{SLOTS} -n1 true"], capture_output=True, text=True
    )
    wall = time.perf_counter() - started
    return {"wall": wall, "cpu": children_cpu() - cpu0, "ok": proc.returncode == 0}


def run_parallel(n: int, root: Path) -> dict:
    if not shutil.which("parallel"):
        return {"missing": True}
    log = root / "parallel.joblog"
    env = dict(os.environ, HOME=str(root))  # parallel keeps state in ~/.parallel
    cpu0 = children_cpu()
    started = time.perf_counter()
    proc = subprocess.run(
        ["sh", "-c", f"seq {n} | parallel --will-cite -j{SLOTS} --joblog {log} true"],
        capture_output=True,
        text=True,
        env=env,
    )
    wall = time.perf_counter() - started
    cpu = children_cpu() - cpu0
    try:
        rows = log.read_text().splitlines()[1:]
        good = sum(1 for row in rows if row.split("\t")[6] == "0")
    except (OSError, IndexError):
        rows, good = [], 0
    return {
        "wall": wall,
        "cpu": cpu,
        "ok": proc.returncode == 0 and good == n == len(rows),
        "check": f"{good} ok of {len(rows)}",
    }


def run_tsp(tsp: str | None, n: int, root: Path) -> dict:
    if tsp is None:
        return {"missing": True}
    tmp = root / "tsp"
    tmp.mkdir()
    env = dict(
        os.environ,
        TS_SOCKET=str(tmp / "socket"),
        TMPDIR=str(tmp),
        TS_SLOTS=str(SLOTS),
        TS_MAXFINISHED=str(n + 10),
        TS_MAXCONN=str(max(1000, n + 10)),
    )
    poll_cpu = 0.0
    cpu0 = children_cpu()
    started = time.perf_counter()
    subprocess.run([tsp, "-S", str(SLOTS)], env=env, capture_output=True, check=False)
    subprocess.run(
        ["sh", "-c", f'i=0; while [ $i -lt {n} ]; do "$0" -n true; i=$((i+1)); done', tsp],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        check=False,
    )
    finished = failed = 0
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        before = children_cpu()
        listing = subprocess.run([tsp, "-l"], env=env, capture_output=True, text=True)
        poll_cpu += children_cpu() - before
        rows = listing.stdout.splitlines()[1:]
        pending = [r for r in rows if " running " in r or " queued " in r]
        finished = sum(1 for r in rows if " finished " in r)
        if not pending and finished >= n:
            failed = sum(1 for r in rows if " finished " in r and r.split()[3] != "0")
            break
        time.sleep(0.01)
    wall = time.perf_counter() - started
    subprocess.run([tsp, "-K"], env=env, capture_output=True, check=False)
    time.sleep(0.05)
    common.reap_orphans()
    cpu = children_cpu() - cpu0 - poll_cpu
    return {
        "wall": wall,
        "cpu": cpu,
        "ok": finished == n and failed == 0,
        "check": f"{finished - failed} ok of {finished}",
    }


def main() -> None:
    parser = common.parser(__doc__)
    parser.add_argument(
        "--sizes",
        type=common.int_list,
        default=[1000, 10000],
        help="N per row (default 1000,10000)",
    )
    args = parser.parse_args()
    project = args.project.resolve()
    common.become_subreaper()
    tsp = common.find_tsp()
    tools = ["laneway", "xargs -P2", "task-spooler", "GNU parallel"]
    print(f"project: {project}; slots: {SLOTS}; reps: {args.reps}; tsp: {tsp or '-'}")
    for n in args.sizes:
        samples: dict[str, list[dict]] = {tool: [] for tool in tools}
        for _ in range(args.reps):
            root = Path(tempfile.mkdtemp(prefix="laneway-bench-peers-"))
            try:
                for tool in tools:
                    sub = root / tool.split()[0].replace("-", "")
                    sub.mkdir()
                    load = os.getloadavg()[0]
                    if tool == "laneway":
                        sample = run_laneway(project, n, sub)
                    elif tool.startswith("xargs"):
                        sample = run_xargs(n, sub)
                    elif tool == "task-spooler":
                        sample = run_tsp(tsp, n, sub)
                    else:
                        sample = run_parallel(n, sub)
                    sample["load"] = load
                    samples[tool].append(sample)
            finally:
                shutil.rmtree(root, ignore_errors=True)
        print_size(n, samples)


def print_size(n: int, samples: dict[str, list[dict]]) -> None:
    def rates(rows: list[dict], key: str = "wall") -> list[float]:
        return [n / r[key] for r in rows if r.get(key)]

    def cpus(rows: list[dict], key: str = "cpu") -> list[float]:
        return [r[key] / n * 1000 for r in rows if key in r]

    lane = samples["laneway"]
    lane_rate = common.stats(rates(lane))[0] if rates(lane) else None
    lane_cpu = common.stats(cpus(lane))[0] if cpus(lane) else None
    headers = [
        "tool",
        "jobs/s",
        "CPU ms/job",
        "rate vs laneway",
        "CPU vs laneway",
        "load (1 min)",
        "check",
    ]
    rows = []
    for tool, runs in samples.items():
        if any(r.get("missing") for r in runs):
            rows.append([tool, common.NOT_INSTALLED, "", "", "", ""])
            continue
        rate, cpu = rates(runs), cpus(runs)
        checks = sorted({r.get("check", "exit 0" if r["ok"] else "FAILED") for r in runs})
        bad = sum(1 for r in runs if not r["ok"])
        rows.append(
            [
                tool,
                common.fmt(rate),
                common.fmt(cpu, 2),
                f"{common.stats(rate)[0] / lane_rate:.2f}x" if lane_rate and rate else "-",
                f"{common.stats(cpu)[0] / lane_cpu:.2f}x" if lane_cpu and cpu else "-",
                _loads(runs),
                "; ".join(checks) + (f" ({bad} rep(s) FAILED)" if bad else ""),
            ]
        )
        if tool == "laneway":
            span = rates(runs, "span")
            rows.append(
                [
                    "  laneway, ledger span",
                    common.fmt(span),
                    "",
                    "",
                    "",
                    "",
                    "first intent..last settle",
                ]
            )
            rows.append(
                ["  laneway process", "", common.fmt(cpus(runs, "self"), 2), "", "", "", ""]
            )
            rows.append(
                ["  supervisors + jobs", "", common.fmt(cpus(runs, "children"), 2), "", "", "", ""]
            )
    print()
    print(f"N = {n} no-op jobs, {SLOTS} slots (median (min-max) over reps)")
    print(common.table(headers, rows))


def _loads(runs: list[dict]) -> str:
    """The load average (1 min) when each rep of a tool began: min-max."""
    loads = [r["load"] for r in runs if "load" in r]
    return f"{min(loads):.1f}-{max(loads):.1f}" if loads else "-"


if __name__ == "__main__":
    main()
