"""Costs that must not grow with the backlog: claim, an idle controller tick, status and
explain on ledgers of 1k, 100k (and, opt-in, 1M) jobs; then the idle cost of a running
controller and worker.

    .venv/bin/python bench/bench_scale.py
    (options: --sizes 1000,100000  --reps 3  --idle-seconds 20  --backlog 0.02  --project DIR)
    .venv/bin/python bench/bench_scale.py --sizes 1000000     # the 1M ledger, opt-in

Each ledger (in $TMPDIR) is one run created with `ledger.create_run` from a small config
(node n1 max_jobs=4, lane a, stages s1 -> s2 where s2 needs s1, 8 items: 8 jobs ready,
8 waiting), then bulk-filled with SQLAlchemy Core executemany up to SIZE jobs: extra
items of two jobs each, most done (both jobs succeeded, one settled attempt each), the
last --backlog share (default 0.02) not started (s1 ready, s2 waiting: a waiting job
only stays waiting while its need is not terminal), and one event per bulk job. The
extra items are not in the run's frozen config, so they are put after the config's
items: claims take the config's (ready jobs are taken in item order).

Per size it measures, as median (min-max) over --reps, time and SQL statements (a
`before_cursor_execute` listener on every Engine, BEGIN included):

- `ledger.claim_jobs` for 2 free slots, in a transaction rolled back afterwards (so it
  repeats on the same ledger; the commit's fsync is not included);
- `Controller(engine).tick()` when nothing changed (after one warm-up tick that writes
  the status snapshot);
- `laneway status --runtime-dir DIR --json`, `laneway status --runtime-dir DIR` (text),
  `laneway explain JOB --runtime-dir DIR` (JOB: a ready job) and `laneway --help` as
  subprocesses: wall time, and the child's CPU time (user + system, from
  `resource.getrusage(RUSAGE_CHILDREN)` before and after), beside the floor: `python3 -c`
  with the sqlite3 module running `select count(*) from jobs`. The 1-minute load average
  (/proc/loadavg) is printed beside each size's figures;
- `status_report` in this process over the read-only ledger (`readonly.ReadOnlyLedger`,
  what `laneway status` reads through): the queries and the report without start-up.

The children run with a bytecode cache (PYTHONPYCACHEPREFIX in the bench's temp dir,
PYTHONDONTWRITEBYTECODE unset) after one untimed warm-up run of each command, as an
installed laneway runs (pip writes .pyc files); otherwise, where PYTHONDONTWRITEBYTECODE
is set, every laneway module would be compiled from source on each start (about 100 ms
of `status`). `--cold-bytecode` measures with the environment as it is.

Then the idle cost: on a small ledger whose run `laneway run` finished, it starts
`laneway controller --runtime-dir DIR` and `laneway worker --node n1 --runtime-dir DIR
--slots 2`, waits 5 s, and reads their CPU time (/proc/PID/stat utime+stime, children
included) over --idle-seconds split into --reps windows: % of one core, and RSS in MiB.
They are stopped with SIGTERM, then SIGKILL. No assertions: numbers to compare.
"""

from __future__ import annotations

import resource
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common as common

CONFIG_ITEMS = 8
CHUNK_ITEMS = 25_000
BULK_WORKER = "bench-bulk-worker"


class Counter:
    def __init__(self) -> None:
        self.count = 0

    def __call__(self, *args, **kwargs) -> None:
        self.count += 1


def small_config(items: int):
    stages = [
        {"name": "s1", "argv": ["true"], "timeout_seconds": 60},
        {"name": "s2", "argv": ["true"], "timeout_seconds": 60, "needs": ["s1"]},
    ]
    return common.one_lane_config(
        "bench-scale", stages, (f"c{n}" for n in range(items)), max_jobs=4
    )


def only_columns(table, rows: list[dict]) -> list[dict]:
    """Drop keys the table no longer has (the schema may change under the bench)."""
    names = set(table.c.keys())
    if rows and set(rows[0]) <= names:
        return rows
    return [{k: v for k, v in row.items() if k in names} for row in rows]


def build(runtime: Path, size: int, backlog_share: float) -> dict:
    """A ledger of ~``size`` jobs; returns what the measurements need."""
    from sqlalchemy import insert, select

    from laneway.controller.clock import SystemClock
    from laneway.controller.models import Attempt, Event, Item, Job, Worker

    started = time.perf_counter()
    now = SystemClock().now()
    engine, _, run_id = common.open_with_run(runtime, small_config(CONFIG_ITEMS), now)
    extra_items = max(0, (size - 2 * CONFIG_ITEMS) // 2)
    backlog = round(extra_items * backlog_share)
    done_items = extra_items - backlog
    notes: list[str] = []
    earlier = now - timedelta(hours=1)
    with engine.begin() as conn:
        conn.execute(
            insert(Worker.__table__),
            only_columns(
                Worker.__table__,
                [common.stopped_worker_row(BULK_WORKER, earlier)],
            ),
        )
        with_attempts = True
        for first in range(0, extra_items, CHUNK_ITEMS):
            last = min(extra_items, first + CHUNK_ITEMS)
            positions = range(CONFIG_ITEMS + first, CONFIG_ITEMS + last)
            conn.execute(
                insert(Item.__table__),
                only_columns(Item.__table__, common.bulk_item_rows(run_id, positions)),
            )
            ids = conn.execute(
                select(Item.id, Item.position).where(
                    Item.run_id == run_id,
                    Item.position >= positions[0],
                    Item.position <= positions[-1],
                )
            ).all()
            jobs = []
            for item_id, position in ids:
                done = position - CONFIG_ITEMS < done_items
                for stage_position, stage in enumerate(("s1", "s2")):
                    state = "succeeded" if done else ("ready" if stage == "s1" else "waiting")
                    jobs.append(
                        {
                            "run_id": run_id,
                            "item_id": item_id,
                            "stage": stage,
                            "stage_position": stage_position,
                            "lane": "a",
                            "state": state,
                            "fence": 1 if done else 0,
                            "attempt_count": 1 if done else 0,
                            "created_at": earlier,
                            "updated_at": earlier,
                            "finished_at": earlier if done else None,
                        }
                    )
            conn.execute(insert(Job.__table__), only_columns(Job.__table__, jobs))
            job_rows = conn.execute(
                select(Job.id, Job.state, Job.stage, Job.lane).where(
                    # min/max, not first/last: the item query has no ORDER BY (SQLite may
                    # walk the (run_id, key) index, in key order)
                    Job.item_id >= min(item_id for item_id, _ in ids),
                    Job.item_id <= max(item_id for item_id, _ in ids),
                    Job.run_id == run_id,
                )
            ).all()
            if with_attempts:
                attempts = [
                    # The claim copies the job's stage and lane onto the attempt (0015).
                    common.settled_attempt_row(
                        run_id, job_id, runtime, BULK_WORKER, earlier, stage=stage, lane=lane
                    )
                    for job_id, state, stage, lane in job_rows
                    if state == "succeeded"
                ]
                if attempts:
                    try:
                        with conn.begin_nested():
                            conn.execute(
                                insert(Attempt.__table__), only_columns(Attempt.__table__, attempts)
                            )
                    except Exception as exc:  # the schema moved: go on without attempts
                        with_attempts = False
                        notes.append(f"no bulk attempts ({type(exc).__name__})")
            conn.execute(
                insert(Event.__table__),
                only_columns(
                    Event.__table__,
                    [
                        {
                            "at": earlier,
                            "run_id": run_id,
                            "job_id": job_id,
                            "attempt_id": None,
                            "kind": f"job_{state}",
                            "actor": "bench",
                            "detail": {},
                        }
                        for job_id, state, _stage, _lane in job_rows
                    ],
                ),
            )
        explain_job = conn.execute(
            select(Job.id)
            .join(Item, Item.id == Job.item_id)
            .where(Job.run_id == run_id, Item.key == "c0", Job.stage == "s1")
        ).scalar_one()
    return {
        "engine": engine,
        "run_id": run_id,
        "explain_job": explain_job,
        "build_s": time.perf_counter() - started,
        "backlog": backlog,
        "notes": notes,
    }


def measure_claim(engine, counter: Counter) -> tuple[float, int, int]:
    elapsed, statements, claims = common.rolled_back_claim(engine, counter)
    return elapsed, statements, len(claims)


def measure_tick(controller, counter: Counter) -> tuple[float, int, int]:
    counter.count = 0
    started = time.perf_counter()
    report = controller.tick()
    elapsed = time.perf_counter() - started
    changed = (report.promoted or 0) + len(report.closed or []) + len(report.lost or [])
    return elapsed, counter.count, changed


def timed_run(argv: list[str], env: dict, cwd: str) -> tuple[float, int, float]:
    """Wall seconds, exit code and the child's CPU seconds (user + system)."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    started = time.perf_counter()
    proc = subprocess.run(argv, env=env, cwd=cwd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    elapsed = time.perf_counter() - started
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return elapsed, proc.returncode, cpu


def load_average() -> str:
    try:
        return Path("/proc/loadavg").read_text().split()[0]
    except OSError:
        return "?"


def measure_report(runtime: Path, reps: int) -> list[float]:
    """Seconds of ``status_report`` over the read-only ledger, in this process (after one
    untimed run)."""
    from laneway.controller import readonly
    from laneway.controller.status import status_report

    times = []
    for _ in range(reps + 1):
        with readonly.ReadOnlyLedger(runtime) as source, source.snapshot():
            started = time.perf_counter()
            status_report(source, None, now=source.now())
            times.append(time.perf_counter() - started)
    return times[1:]


def cli_env(env: dict, root: Path, cold_bytecode: bool) -> dict:
    """The children's environment: with a bytecode cache under ``root`` unless
    ``cold_bytecode`` (then as it is)."""
    if cold_bytecode:
        return env
    env = {k: v for k, v in env.items() if k != "PYTHONDONTWRITEBYTECODE"}
    env["PYTHONPYCACHEPREFIX"] = str(root / "pycache")
    return env


def measure_size(
    project: Path,
    root: Path,
    size: int,
    reps: int,
    backlog_share: float,
    cold_bytecode: bool = False,
) -> list:
    from sqlalchemy import event
    from sqlalchemy.engine import Engine

    from laneway.controller.daemon import Controller

    runtime = root / f"ledger-{size}"
    info = build(runtime, size, backlog_share)
    engine = info["engine"]
    counter = Counter()
    event.listen(Engine, "before_cursor_execute", counter)
    rows = []
    try:
        measure_claim(engine, counter)  # warm-up: config parse, statement caches
        claims = [measure_claim(engine, counter) for _ in range(reps)]
        controller = Controller(engine)
        controller.tick()  # warm-up: writes the status snapshot
        ticks = [measure_tick(controller, counter) for _ in range(reps)]
    finally:
        event.remove(Engine, "before_cursor_execute", counter)
    engine.dispose()
    report_times = measure_report(runtime, reps)
    prefix, env, cwd = common.laneway_cli(project)
    env = cli_env(env, root, cold_bytecode)
    if not cold_bytecode:  # warm-up: the bytecode cache is written, not timed
        for args in (
            ["status", "--runtime-dir", str(runtime), "--json"],
            ["status", "--runtime-dir", str(runtime)],
            ["--help"],
            ["explain", str(info["explain_job"]), "--runtime-dir", str(runtime)],
        ):
            timed_run([*prefix, *args], env, cwd)
    load_before = load_average()
    status = [
        timed_run([*prefix, "status", "--runtime-dir", str(runtime), "--json"], env, cwd)
        for _ in range(reps)
    ]
    status_text = [
        timed_run([*prefix, "status", "--runtime-dir", str(runtime)], env, cwd) for _ in range(reps)
    ]
    help_runs = [timed_run([*prefix, "--help"], env, cwd) for _ in range(reps)]
    explain = [
        timed_run(
            [*prefix, "explain", str(info["explain_job"]), "--runtime-dir", str(runtime)], env, cwd
        )
        for _ in range(reps)
    ]
    floor_code = (
        "import sqlite3,sys; c=sqlite3.connect(f'file:{sys.argv[1]}?mode=ro', uri=True); "
        "print(c.execute('select count(*) from jobs').fetchone()[0])"
    )
    python3 = real_python3()
    floor = [
        timed_run([python3, "-c", floor_code, str(runtime / "ledger.sqlite3")], env, cwd)
        for _ in range(reps)
    ]
    note = "; ".join(info["notes"])
    load = f"load {load_before} -> {load_average()}"

    def check_rc(runs):
        bad = [run[1] for run in runs if run[1] != 0]
        return f"exit {bad[0]} in {len(bad)} rep(s)" if bad else "ok"

    def cpu(runs):
        return "CPU " + common.fmt([run[2] * 1000 for run in runs], 0) + " ms"

    rows.append(
        [
            str(size),
            "claim_jobs, 2 slots (rolled back)",
            common.fmt([c[0] * 1000 for c in claims], 2),
            common.fmt([c[1] for c in claims], 0),
            f"claimed {claims[0][2]}" + (f"; {note}" if note else ""),
        ]
    )
    rows.append(
        [
            "",
            "Controller.tick(), nothing changed",
            common.fmt([t[0] * 1000 for t in ticks], 2),
            common.fmt([t[1] for t in ticks], 0),
            "changed nothing" if not any(t[2] for t in ticks) else "CHANGED something",
        ]
    )
    rows.append(
        [
            "",
            "status_report() in process (read-only)",
            common.fmt([t * 1000 for t in report_times], 1),
            "",
            "the queries and the report, no start-up",
        ]
    )
    for label, runs in (
        ("laneway status --json", status),
        ("laneway status (text)", status_text),
        ("laneway --help", help_runs),
    ):
        rows.append(
            [
                "",
                label,
                common.fmt([s[0] * 1000 for s in runs], 0),
                "",
                f"{check_rc(runs)}; {cpu(runs)}; {load}",
            ]
        )
    rows.append(
        [
            "",
            f"laneway explain {info['explain_job']}",
            common.fmt([s[0] * 1000 for s in explain], 0),
            "",
            f"{check_rc(explain)}; {cpu(explain)}",
        ]
    )
    rows.append(
        [
            "",
            "floor: python3 sqlite3 count(*)",
            common.fmt([s[0] * 1000 for s in floor], 0),
            "",
            f"{check_rc(floor)}; {cpu(floor)}",
        ]
    )
    print(
        f"  built {size} jobs ({info['backlog']} items not started) in {info['build_s']:.1f} s",
        flush=True,
    )
    shutil.rmtree(runtime, ignore_errors=True)
    return rows


def real_python3() -> str:
    """python3's real interpreter (not a pyenv shim, which alone costs ~150 ms)."""
    found = shutil.which("python3")
    if not found:
        return sys.executable
    try:
        out = subprocess.run(
            [found, "-c", "import sys; print(sys.executable)"],
            capture_output=True,
            text=True,
            timeout=30,
            check=True,
        )
        return out.stdout.strip() or found
    except (OSError, subprocess.SubprocessError):
        return found


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def idle_cost(project: Path, root: Path, idle_seconds: float, windows: int) -> list:
    runtime = root / "idle"
    runtime.mkdir()
    config = runtime / "pipeline.toml"
    items = "".join(f'[[items]]\nkey = "i{n}"\nlane = "a"\n' for n in range(10))
    config.write_text(
        'name = "bench-idle"\n[[nodes]]\nname = "n1"\nmemory_floor_mib = 0\nmax_jobs = 2\n'
        '[[lanes]]\nname = "a"\nnode = "n1"\n'
        '[[stages]]\nname = "noop"\nargv = ["true"]\ntimeout_seconds = 60\n' + items
    )
    prefix, env, cwd = common.laneway_cli(project)
    ledger_dir = runtime / "runtime"
    run = subprocess.run(
        [*prefix, "run", str(config), "--runtime-dir", str(ledger_dir), "--quiet"],
        env=env,
        cwd=cwd,
        capture_output=True,
        text=True,
    )
    if run.returncode != 0:
        last = (run.stderr.strip().splitlines() or [""])[-1]
        return [["laneway run (setup)", f"FAILED exit {run.returncode}: {last[-80:]}", ""]]
    commands = {
        "laneway controller": [*prefix, "controller", "--runtime-dir", str(ledger_dir)],
        "laneway worker --slots 2": [
            *prefix,
            "worker",
            "--node",
            "n1",
            "--runtime-dir",
            str(ledger_dir),
            "--slots",
            "2",
        ],
    }
    procs = {}
    try:
        for name, argv in commands.items():
            log = open(runtime / f"{name.split()[1]}.log", "wb")
            procs[name] = subprocess.Popen(
                argv, env=env, cwd=cwd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
            )
        time.sleep(5)
        window = idle_seconds / windows
        usage: dict[str, list[float]] = {name: [] for name in procs}
        rss: dict[str, float] = {}
        for _ in range(windows):
            before = {name: common.proc_stat(p.pid) for name, p in procs.items()}
            started = time.monotonic()
            time.sleep(window)
            elapsed = time.monotonic() - started
            for name, proc in procs.items():
                after = common.proc_stat(proc.pid)
                if before[name] and after and proc.poll() is None:
                    cpu = (after[0] + after[1]) - (before[name][0] + before[name][1])
                    usage[name].append(cpu / elapsed * 100)
                    rss[name] = after[2]
        rows = []
        for name, proc in procs.items():
            if proc.poll() is not None:
                rows.append([name, f"exited early (rc {proc.returncode})", ""])
            else:
                rows.append(
                    [name, common.fmt(usage[name], 2), f"{rss.get(name, float('nan')):.1f}"]
                )
        return rows
    finally:
        for proc in procs.values():
            stop(proc)


def main() -> None:
    parser = common.parser(__doc__)
    parser.add_argument(
        "--sizes",
        type=common.int_list,
        default=[1000, 100_000],
        help="ledger sizes in jobs (default 1000,100000; add 1000000 to opt in to 1M)",
    )
    parser.add_argument(
        "--backlog", type=float, default=0.02, help="share of bulk items not started"
    )
    parser.add_argument("--idle-seconds", type=float, default=20.0)
    parser.add_argument("--no-idle", action="store_true", help="skip the idle-cost part")
    parser.add_argument(
        "--cold-bytecode",
        action="store_true",
        help="run the CLI children without a bytecode cache where PYTHONDONTWRITEBYTECODE "
        "is set (default: a cache in the bench's temp dir, written by a warm-up run)",
    )
    args = parser.parse_args()
    project = common.use_project_and_say(args.project)
    print(
        f"reps: {args.reps}; backlog share: {args.backlog}; CLI bytecode: "
        + ("as the environment says (--cold-bytecode)" if args.cold_bytecode else "cached")
    )
    root = Path(tempfile.mkdtemp(prefix="laneway-bench-scale-"))
    try:
        rows = []
        for size in args.sizes:
            rows += measure_size(project, root, size, args.reps, args.backlog, args.cold_bytecode)
        print()
        print("per ledger size: median (min-max) over reps")
        print(common.table(["jobs", "operation", "ms", "SQL statements", "note"], rows, left=2))
        if not args.no_idle:
            idle = idle_cost(project, root, args.idle_seconds, max(1, args.reps))
            print()
            print(
                f"idle cost over {args.idle_seconds:g} s in {max(1, args.reps)} window(s), "
                "after 5 s settling, on a finished ledger"
            )
            print(common.table(["process", "% of one core", "RSS MiB"], idle))
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
