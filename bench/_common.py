"""Shared helpers of the bench/ scripts (not a benchmark itself).

Stdlib only, so it can be imported before laneway's code is put on sys.path:

- ``--project DIR`` / ``--reps N`` arguments and ``use_project`` (sys.path[0] = DIR);
- how to run laneway's CLI from a checkout (``laneway_cli``) and its Python
  (``project_python``);
- median and min-max formatting, plain-text tables;
- the peers' binaries (task-spooler, GNU parallel, huey's venv);
- CPU accounting: child-subreaper, reaping orphans, /proc/PID/stat.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import shutil
import statistics
import sys
import time
from collections.abc import Sequence
from pathlib import Path

BENCH_DIR = Path(__file__).resolve().parent
REPO_ROOT = BENCH_DIR.parent
PEERS_PYTHON = BENCH_DIR / ".venv-peers" / "bin" / "python"
NOT_INSTALLED = "not installed (run bench/setup_peers.sh)"
CLK_TCK = os.sysconf("SC_CLK_TCK")
PAGE = os.sysconf("SC_PAGE_SIZE")


# ------------------------------------------------------------------ arguments


def parser(doc: str) -> argparse.ArgumentParser:
    """An argument parser whose --help prints the module docstring."""
    result = argparse.ArgumentParser(
        description=doc, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    result.add_argument(
        "--project",
        type=Path,
        default=REPO_ROOT,
        help="the laneway checkout to measure (default: this repository, %(default)s)",
    )
    result.add_argument("--reps", type=int, default=3, help="repetitions (default %(default)s)")
    return result


def int_list(text: str) -> list[int]:
    return [int(part) for part in text.split(",") if part.strip()]


def use_project(project: Path) -> Path:
    """Make ``project`` the ``laneway`` package, so ``import laneway.controller`` loads
    its code (a checkout is the ``laneway`` namespace; see pyproject's package-dir)."""
    project = project.resolve()
    if not (project / "controller").is_dir():
        raise SystemExit(f"--project {project}: no controller/ package there")
    loaded = sys.modules.get("laneway.controller")
    if loaded is not None and Path(loaded.__path__[0]).resolve() != project / "controller":
        raise SystemExit(f"--project {project}: laneway was already loaded from elsewhere")
    package = type(sys)("laneway")
    package.__path__ = [str(project)]
    sys.modules["laneway"] = package
    sys.path.insert(0, str(project))  # the bench's own imports of ``tests``
    return project


def use_project_and_say(project: Path) -> Path:
    """``use_project``, then print which checkout's code is measured and where its
    controller was loaded from."""
    project = use_project(project)
    from laneway import controller

    print(f"project: {project} (controller from {Path(controller.__file__).parent})")
    return project


def project_python(project: Path) -> str:
    """The Python that runs ``project``'s code: its own venv's, else ours."""
    own = project / ".venv" / "bin" / "python"
    return str(own) if own.exists() else sys.executable


def project_env(project: Path, extra: dict[str, str] | None = None) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(project) + (
        os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else ""
    )
    env.update(extra or {})
    return env


def laneway_cli(project: Path) -> tuple[list[str], dict[str, str], str]:
    """(argv prefix, env, cwd) to run ``laneway`` of ``project``: its venv's console
    script, else ``python -m laneway`` where this interpreter's laneway is ``project``
    (a ``laneway`` found through another install would measure the wrong code)."""
    script = project / ".venv" / "bin" / "laneway"
    env = project_env(project)
    if script.exists():
        return [str(script)], env, str(project)
    if project != REPO_ROOT.resolve():
        raise SystemExit(f"--project {project}: no .venv/bin/laneway there (run make there)")
    return [sys.executable, "-m", "laneway"], env, str(project)


# --------------------------------------------------------------------- numbers


def stats(values: Sequence[float]) -> tuple[float, float, float]:
    return statistics.median(values), min(values), max(values)


def fmt(values: Sequence[float] | None, digits: int = 1, width: int = 0) -> str:
    """``median (min-max)``, or ``-`` for no values."""
    if not values:
        return "-".rjust(width)
    median, low, high = stats(values)
    if len(values) == 1:
        text = f"{median:.{digits}f}"
    else:
        text = f"{median:.{digits}f} ({low:.{digits}f}-{high:.{digits}f})"
    return text.rjust(width)


def percentile(sorted_values: Sequence[float], p: float) -> float:
    """Nearest-rank percentile of already sorted values."""
    if not sorted_values:
        return float("nan")
    rank = max(1, min(len(sorted_values), round(p / 100 * len(sorted_values) + 0.5)))
    return sorted_values[rank - 1]


def table(headers: Sequence[str], rows: Sequence[Sequence[str]], left: int = 1) -> str:
    """Plain-text table: the first ``left`` columns left-aligned, the rest right-aligned."""
    widths = [len(h) for h in headers]
    for row in rows:
        for i, cell in enumerate(row):
            widths[i] = max(widths[i], len(cell))
    lines = []
    for n, row in enumerate([headers, *rows]):
        cells = [
            cell.ljust(widths[i]) if i < left else cell.rjust(widths[i])
            for i, cell in enumerate(row)
        ]
        lines.append("  ".join(cells).rstrip())
        if n == 0:
            lines.append("  ".join("-" * w for w in widths))
    return "\n".join(lines)


# ----------------------------------------------------------------------- peers


def find_tsp() -> str | None:
    """task-spooler's binary: ``tsp`` (Debian) or ``ts`` (not moreutils' ts)."""
    found = shutil.which("tsp")
    if found:
        return found
    found = shutil.which("ts")
    if found:
        import subprocess

        try:
            out = subprocess.run(
                [found, "-h"], capture_output=True, text=True, timeout=5, check=False
            )
        except (OSError, subprocess.TimeoutExpired):
            return None
        if "TS_SOCKET" in out.stdout + out.stderr:
            return found
    return None


def peers_python() -> str | None:
    return str(PEERS_PYTHON) if PEERS_PYTHON.exists() else None


# ------------------------------------------------------------------------- CPU


def become_subreaper() -> bool:
    """Orphaned descendants (a daemonised task-spooler server) get re-parented to us,
    so reaping them adds their CPU to RUSAGE_CHILDREN."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return bool(libc.prctl(36, 1, 0, 0, 0) == 0)  # PR_SET_CHILD_SUBREAPER
    except (OSError, AttributeError):
        return False


def reap_orphans() -> int:
    """Reap every exited child (call only when no subprocess.Popen is outstanding)."""
    reaped = 0
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return reaped
        if pid == 0:
            return reaped
        reaped += 1


def machine_ticks() -> tuple[int, int] | None:
    """(busy, total) clock ticks of every CPU of the machine since boot, from the first
    line of /proc/stat (idle and iowait are not busy); None without /proc."""
    try:
        with open("/proc/stat") as f:
            fields = [int(v) for v in f.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)
    return sum(fields) - idle, sum(fields)


def machine_busy(before: tuple[int, int] | None, after: tuple[int, int] | None) -> float:
    """The share of the machine's CPU time (all cores) that was busy between two
    ``machine_ticks``: whatever ran, the benchmark's processes, a database server and
    any other work alike; NaN without /proc."""
    if before is None or after is None or after[1] == before[1]:
        return float("nan")
    return (after[0] - before[0]) / (after[1] - before[1])


def proc_stat(pid: int) -> tuple[float, float, float] | None:
    """(own CPU seconds, waited-children CPU seconds, RSS MiB) from /proc/PID/stat."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = text[text.rindex(")") + 2 :].split()
    # fields[0] is field 3 (state): utime=14, stime=15, cutime=16, cstime=17, rss=24
    utime, stime, cutime, cstime = (int(fields[i - 3]) for i in (14, 15, 16, 17))
    rss_pages = int(fields[24 - 3])
    return (
        (utime + stime) / CLK_TCK,
        (cutime + cstime) / CLK_TCK,
        rss_pages * PAGE / (1 << 20),
    )


def rolled_back_claim(engine, counter) -> tuple[float, int, list]:
    """One ``ledger.claim_jobs`` for 2 free slots on node n1 by a bench worker, in a
    transaction rolled back afterwards (so it repeats on the same ledger; the commit's
    fsync is not included): (seconds, SQL statements ``counter.count`` saw, claims)."""
    from laneway.controller import db, ledger
    from laneway.controller.clock import SystemClock

    clock = SystemClock()
    session = db.session_factory(engine)()
    try:
        session.begin()
        worker = ledger.register_worker(
            session,
            node="n1",
            host="bench",
            pid=os.getpid(),
            boot_id="bench",
            process_start_time=None,
            slots=2,
            now=clock.now(),
        )
        counter.count = 0
        started = time.perf_counter()
        claims = ledger.claim_jobs(
            session,
            worker_id=worker,
            node="n1",
            free_slots=2,
            mem_available_mib=64_000,
            now=clock.now(),
        )
        return time.perf_counter() - started, counter.count, claims
    finally:
        session.rollback()
        session.close()


# ---------------------------------------------------------------------- ledger

NOOP_STAGE = {"name": "noop", "argv": ["true"], "timeout_seconds": 60}
"""A stage that runs `true`."""


def one_lane_config(name: str, stages: list, keys, *, max_jobs: int):
    """A parsed config named ``name``: node n1 (no memory floor, ``max_jobs``), lane a on
    it, ``stages``, and one item on lane a per key of ``keys``."""
    from laneway.controller.config import parse_config

    return parse_config(
        {
            "name": name,
            "nodes": [{"name": "n1", "memory_floor_mib": 0, "max_jobs": max_jobs}],
            "lanes": [{"name": "a", "node": "n1"}],
            "stages": stages,
            "items": [{"key": key, "lane": "a"} for key in keys],
        },
        Path.cwd(),
    )


def create_run(factory, config, runtime: Path | str, now=None) -> int:
    """One run of ``config`` (runtime dir ``runtime``, no sources), created by actor
    "bench" in its own transaction at ``now`` (default: the system clock's); its id."""
    from laneway.controller import db, ledger
    from laneway.controller.clock import SystemClock

    with db.transaction(factory) as session:
        run = ledger.create_run(
            session,
            config,
            runtime_dir=str(runtime),
            source_hashes={},
            actor="bench",
            now=SystemClock().now() if now is None else now,
        )
        return int(run.id)


def open_with_run(runtime: Path | str, config, now=None) -> tuple:
    """The ledger of ``runtime`` opened (made and migrated if new) with one run of
    ``config`` in it (``create_run``): (engine, session factory, run id)."""
    from laneway.controller import db, ledger_open

    engine = ledger_open.open_ledger(runtime)
    factory = db.session_factory(engine)
    return engine, factory, create_run(factory, config, runtime, now)


def register_worker(factory, now, *, slots: int, host: str = "h", pid: int = 1) -> str:
    """A worker on node n1 (boot "b", no start time) registered in its own transaction;
    its id."""
    from laneway.controller import db, ledger

    with db.transaction(factory) as session:
        return str(
            ledger.register_worker(
                session,
                node="n1",
                host=host,
                pid=pid,
                boot_id="b",
                process_start_time=None,
                slots=slots,
                now=now,
            )
        )


def kernel_round(factory, worker: str, clock, slots: int) -> int:
    """One round of a worker that starts no processes, as the kernel's commits would
    have it: claim up to ``slots`` on n1 (one transaction), record every claim's spawn
    (supervisor 1, child 2, boot "b"; one transaction), settle each succeeded with exit
    code 0 (a transaction each). Returns how many it claimed (0: nothing was ready)."""
    from laneway.controller import db, ledger
    from laneway.controller.states import Outcome

    with db.transaction(factory) as session:
        claims = ledger.claim_jobs(
            session,
            worker_id=worker,
            node="n1",
            free_slots=slots,
            mem_available_mib=64_000,
            now=clock.now(),
        )
    if not claims:
        return 0
    with db.transaction(factory) as session:
        for claim in claims:
            ledger.record_spawn(
                session,
                claim.attempt_id,
                fence=claim.fence,
                actor=worker,
                now=clock.now(),
                boot_id="b",
                supervisor_pid=1,
                supervisor_start_time=1,
                child_pid=2,
                child_start_time=2,
            )
    for claim in claims:
        with db.transaction(factory) as session:
            ledger.settle_attempt(
                session,
                claim.attempt_id,
                fence=claim.fence,
                outcome=Outcome.SUCCEEDED,
                actor=worker,
                now=clock.now(),
                exit_code=0,
            )
    return len(claims)


def stopped_worker_row(worker_id: str, at) -> dict:
    """A ``workers`` row for bulk-inserted history: a worker on n1 that stopped at ``at``."""
    return {
        "id": worker_id,
        "node": "n1",
        "host": "bench",
        "pid": 1,
        "boot_id": "bench",
        "process_start_time": None,
        "slots": 2,
        "state": "stopped",
        "started_at": at,
        "heartbeat_at": at,
        "stopped_at": at,
    }


def bulk_item_rows(run_id: int, positions) -> list[dict]:
    """``items`` rows for bulk-inserted history: item ``b{position}`` on lane a, for each
    of ``positions``."""
    return [
        {"run_id": run_id, "key": f"b{p}", "lane": "a", "position": p, "fields": {}}
        for p in positions
    ]


def settled_attempt_row(
    run_id: int, job_id: int, runtime: Path | str, worker_id: str, when, **extra
) -> dict:
    """An ``attempts`` row for bulk-inserted history: attempt 1 of ``job_id``, by
    ``worker_id`` on n1, settled succeeded (exit code 0) at ``when``; ``extra``
    overrides any column."""
    return {
        "job_id": job_id,
        "run_id": run_id,
        "number": 1,
        "idempotency_key": f"lw-{run_id}-{job_id}-1-bulk",
        "state": "settled",
        "outcome": "succeeded",
        "fence": 1,
        "worker_id": worker_id,
        "node": "n1",
        "argv_hash": "0" * 64,
        "attempt_dir": f"{runtime}/runs/{run_id}/bulk/{job_id}",
        "intent_at": when,
        "started_at": when,
        "settled_at": when,
        "exit_code": 0,
        "diagnostics": [],
        **extra,
    }
